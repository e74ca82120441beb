"""Training the scoring model's adapter (:mod:`halwatch.models.adapter`) on answers with human span labels, in a
work folder under ``$HALWATCH_HOME/fits`` so that an interrupted fit resumes where it stopped.

1. :func:`capture_inputs`: one frozen pass per training answer, stopped after the last adapted layer, keeps what
   the adapter reads (the response tokens' input to the first adapted layer, the prompt's keys and values of the
   adapted layers), in the scoring model's precision, in chunk files written whole (a chunk is either there or not).
2. :func:`train`: AdamW with a one-cycle learning rate, one answer at a time, gradients summed over ``accumulate``
   answers, binary cross-entropy of each response token against its label (a token is hallucinated when it overlaps
   a human span); answers labelled hallucinated without spans are left out. A checkpoint (the adapter, the optimiser
   and where the epoch stands) is written every ``CHECKPOINT_EVERY`` answers and resumed from.

The recipe (rank 8, alpha 16, two epochs, learning rate 5e-4, eight answers per step, layers 15-20 of SmolLM2's
30) is the one measured on RAGTruth's dev split (docs/results, smollm2-135m-adapter-dev).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from halwatch.files import replaced
from halwatch.models import adapter as adapter_lib
from halwatch.progress import progress

#: Answers per chunk file of captured inputs, and between two checkpoints of a training.
CHUNK = 64
CHECKPOINT_EVERY = 200


class _Stop(Exception):
    """Raised by the hook after the last adapted layer: nothing above it is needed."""


def work_folder(identity: dict, views, settings: dict) -> Path:
    """``$HALWATCH_HOME/fits/adapter-<digest>``: named by the scoring model, the training answers' token ids and
    labels, and the settings, so that a rerun of the same fit finds its inputs and checkpoints."""
    from halwatch.models.registry import home

    h = hashlib.sha256(json.dumps({"identity": identity, "settings": settings,
                                   "version": adapter_lib.ADAPTER_VERSION}, sort_keys=True, default=str).encode())
    for v in views:
        h.update(np.asarray(v.input_ids, dtype=np.int64).tobytes() + bytes([int(v.sample.label or 0)]))
        h.update(np.asarray(v.token_labels(), dtype=np.int8).tobytes() + bytes([v.n_prompt % 251]))
    folder = home() / "fits" / f"adapter-{h.hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _save(obj, path: Path) -> None:
    """``torch.save`` through :func:`halwatch.files.replaced`: a file is whole or absent, and two fits of the same
    answers at once (which write the same values) never share a temporary file."""
    import torch

    with replaced(path, binary=True) as f:
        torch.save(obj, f)


def _inputs_of(scoring_model, view, start: int, depth: int) -> dict:
    """One answer's training inputs, from a pass stopped after layer ``start + depth - 1``."""
    import torch

    model = scoring_model.model  # with halwatch's attention, installed by capture_inputs
    layers = adapter_lib.decoder(model).layers
    got = {}

    def keep_input(_module, args, kwargs):
        got["h"] = kwargs.get("hidden_states", args[0] if args else None)

    def stop(*_args):
        raise _Stop

    hooks = [layers[start].register_forward_pre_hook(keep_input, with_kwargs=True),
             layers[start + depth - 1].register_forward_hook(stop)]
    ids = torch.tensor([view.input_ids], device=scoring_model.device)
    try:
        with torch.inference_mode(), adapter_lib.keeping(range(start, start + depth)) as kept:
            try:
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
            except _Stop:
                pass
            keys, values = kept.prompt(0, view.n_prompt)
    finally:
        for hook in hooks:
            hook.remove()
    order = sorted(keys)
    return {"h": got["h"][0, view.n_prompt:].clone(), "k": torch.stack([keys[i] for i in order]).clone(),
            "v": torch.stack([values[i] for i in order]).clone(), "n_prompt": view.n_prompt,
            "labels": torch.tensor(view.token_labels(), dtype=torch.float32), "use": bool(view.has_token_labels)}


def capture_inputs(scoring_model, views, start: int, depth: int, folder: Path, show: bool = False) -> list[dict]:
    """Every view's training inputs, captured once into ``folder`` (chunks of :data:`CHUNK`) and read back."""
    import torch

    from halwatch.models.forward import check_adapter, ensure_installed

    ensure_installed(scoring_model.model)
    check_adapter(scoring_model.model)  # an architecture the adapter cannot run is refused before any pass
    records: list[dict] = []
    bar = progress(total=len(views), desc="adapter inputs", unit="answer", disable=not show)
    for lo in range(0, len(views), CHUNK):
        path = folder / f"inputs-{lo // CHUNK:05d}.pt"
        if not path.exists():
            _save([_inputs_of(scoring_model, v, start, depth) for v in views[lo:lo + CHUNK]], path)
        records += torch.load(path, weights_only=False)
        bar.update(min(CHUNK, len(views) - lo))
    bar.close()
    return records


def _layer_dict(record: dict, start: int) -> tuple[dict, dict]:
    return ({start + j: record["k"][j] for j in range(len(record["k"]))},
            {start + j: record["v"][j] for j in range(len(record["v"]))})


def train(scoring_model, records: list[dict], use: list[int], settings: dict, checkpoint: Path,
          show: bool = False, desc: str = "adapter") -> dict[str, np.ndarray]:
    """The adapter trained on ``records[use]`` (those with token labels), its tensors rounded to float16 as an
    artifact stores them. Resumes from ``checkpoint`` (``.pt``); the finished tensors are kept beside it
    (``.npz``) and returned at once on a rerun."""
    import torch
    from torch.nn import functional as F

    done = checkpoint.with_suffix(".npz")
    if done.exists():
        with np.load(done) as saved:
            return {k: saved[k] for k in saved.files}
    model = scoring_model.model
    start, depth = settings["start"], settings["depth"]
    torch.manual_seed(settings["seed"])
    adapter = adapter_lib.new_adapter(model, start, depth, settings["rank"], settings["alpha"], settings["seed"])
    adapter.to(scoring_model.device)
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for p in adapter.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=settings["lr"], weight_decay=0.01)
    fit = [i for i in use if records[i]["use"]]
    steps = settings["epochs"] * len(fit) // settings["accumulate"]
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=settings["lr"], total_steps=steps + 1,
                                                   pct_start=0.1)
    epoch, position = 0, 0
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        adapter.load_state_dict(state["adapter"])
        optimiser.load_state_dict(state["optimiser"])
        schedule.load_state_dict(state["schedule"])
        epoch, position = state["epoch"], state["position"]

    def keep() -> None:  # the checkpoint: where the training stands, resumed from by the same call
        _save({"adapter": adapter.state_dict(), "optimiser": optimiser.state_dict(),
               "schedule": schedule.state_dict(), "epoch": epoch, "position": position}, checkpoint)

    bar = progress(total=settings["epochs"] * len(fit), initial=epoch * len(fit) + position, desc=desc,
                   unit="answer", disable=not show)
    while epoch < settings["epochs"]:
        adapter.train()
        order = np.random.default_rng([settings["seed"], epoch]).permutation(fit)
        while position < len(order):
            r = records[order[position]]
            keys, values = _layer_dict(r, start)
            logits = adapter(model, r["h"], keys, values, r["n_prompt"])
            loss = F.binary_cross_entropy_with_logits(logits, r["labels"].to(logits.device))
            (loss / settings["accumulate"]).backward()
            position += 1
            bar.update(1)
            if position % settings["accumulate"] == 0:
                optimiser.step()
                schedule.step()
                optimiser.zero_grad()
            if position % CHECKPOINT_EVERY == 0 and position < len(order):
                keep()
        optimiser.zero_grad()
        epoch, position = epoch + 1, 0
        keep()
    bar.close()
    arrays = {k: v.astype(np.float16).astype(np.float32) for k, v in adapter.arrays().items()}
    with replaced(done, binary=True) as f:
        np.savez(f, **arrays)
    checkpoint.unlink(missing_ok=True)
    return arrays


def logits_of(scoring_model, request: adapter_lib.AdapterRequest, records: list[dict],
              indices) -> dict[int, np.ndarray]:
    """The adapter's token log-odds of ``records[indices]``, from their captured inputs."""
    import torch

    adapter, merged = adapter_lib.loaded(scoring_model.model, request)
    out = {}
    with torch.inference_mode():
        for i in indices:
            keys, values = _layer_dict(records[i], request.start)
            out[int(i)] = adapter(scoring_model.model, records[i]["h"], keys, values, records[i]["n_prompt"],
                                  merged).float().cpu().numpy()
    return out
