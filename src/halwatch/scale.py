"""Scale-out on Ray: score a data set larger than one machine with Ray Data.

Records go through ``Dataset.map_batches`` with a callable class: each actor loads the scoring model and the
detector once (:class:`ScoreActor`), then scores batches of records, each answer's failure caught and returned with
its id. :func:`score_records` writes the results as the same JSONL that ``halwatch score --input`` writes, in the
input's order, one line as each result arrives, so that an interrupted run keeps what it finished; run again, it
skips the ids already in the output (a half-written last line is dropped). :func:`score_dataset` is the lazy form
for a Ray Dataset a user already has. :class:`SignalActor` computes signals instead of verdicts, for the benchmark
harness (``halwatch bench --ray``), which caches them on the driver as its own pass would.

Ray is an optional extra (``pip install -e .[ray]``); nothing here imports it before it is used.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import sys
from pathlib import Path

import numpy as np

from halwatch.errors import HalwatchError, InputError

log = logging.getLogger("halwatch")


def _ray():
    try:
        import ray
    except ImportError:
        raise HalwatchError("Ray is not installed: pip install -e '.[ray]' (or pip install 'ray[data]')") from None
    return ray


def connect(address: str | None = None, num_cpus: int | None = None, timeout: float = 30):
    """Join the Ray cluster at ``address`` (``host:port``, ``auto``, ``ray://...``), or start a local one when
    there is none, listening on the loopback address only; a session already connected is kept. An address where
    nothing answers within ``timeout`` seconds is an error at once (Ray itself would retry for minutes)."""
    local = address in (None, "", "local")
    if local and "ray" not in sys.modules:
        # Ray's single-machine mode: every server of a local cluster binds 127.0.0.1 (read when ray is imported)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = _ray()
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # results come back in the input's order
    context.enable_progress_bars = context.print_on_execution_start = False  # halwatch shows its own progress
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    if ray.is_initialized():
        return ray
    options = {"log_to_driver": False, "configure_logging": False}
    if local:
        ray.init(num_cpus=num_cpus, include_dashboard=False, **options)
    else:
        _check_reachable(address, timeout)
        try:
            ray.init(address=address, **options)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise HalwatchError(f"cannot join the Ray cluster at {address}: {exc}") from None
    return ray


def _check_reachable(address: str, timeout: float) -> None:
    """Raise at once when nothing accepts a connection at ``address`` (``host:port`` or ``ray://host[:port]``;
    ``auto`` is left to Ray) within ``timeout`` seconds."""
    import socket

    if address == "auto":
        return
    where = address.split("://", 1)[1] if "://" in address else address
    host, _, port = where.rstrip("/").rpartition(":")
    if not host:
        host, port = where.rstrip("/"), ("10001" if address.startswith("ray://") else "6379")
    if not port.isdigit():
        raise InputError(f"--ray: {address!r} is not an address (host:port, auto or ray://host:port)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise HalwatchError(f"cannot join the Ray cluster at {address}: nothing answers there "
                            f"({exc.strerror or type(exc).__name__}, after at most {timeout:g} s); is the head node "
                            f"started (ray start --head) and is the address right?") from None


def check_resources(ray, actors: int, cpus: float, gpus: float) -> None:
    """Raise when the cluster cannot place ``actors`` actors of ``cpus`` CPUs and ``gpus`` GPUs each (Ray would wait
    for them forever): one line naming what is missing."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive", True)]
    fits = 0
    for res in nodes:
        by_cpu = int(res.get("CPU", 0) // cpus) if cpus > 0 else actors
        by_gpu = int(res.get("GPU", 0) // gpus) if gpus > 0 else actors
        fits += min(by_cpu, by_gpu)
    if fits >= actors:
        return
    total_gpus, total_cpus = sum(r.get("GPU", 0) for r in nodes), sum(r.get("CPU", 0) for r in nodes)
    if gpus > 0 and total_gpus < gpus:
        raise HalwatchError(f"the Ray cluster has {total_gpus:g} GPUs and each actor asks for {gpus:g} (--device cuda "
                            f"asks for one per actor): add GPU nodes, or score on CPUs (--device cpu)")
    raise HalwatchError(f"the Ray cluster ({len(nodes)} nodes, {total_cpus:g} CPUs, {total_gpus:g} GPUs) can place "
                        f"{fits} of the {actors} actors asked for ({cpus:g} CPUs and {gpus:g} GPUs each): lower "
                        f"--ray-actors, --ray-cpus or --ray-gpus")


def _plain(value):
    """A column value of a Ray batch as the JSON value it came from (None and NaN for a missing field)."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def batch_records(batch: dict) -> list[dict]:
    """The records of a Ray batch (columns of numpy arrays): a ``record`` column of JSON texts (how
    :func:`score_records` sends them), or one column per field of the JSONL format (a user's own Dataset)."""
    if "record" in batch:
        return [json.loads(text) for text in batch["record"]]
    names = list(batch)
    n = len(batch[names[0]]) if names else 0
    rows = []
    for i in range(n):
        row = {name: _plain(batch[name][i]) for name in names}
        rows.append({k: v for k, v in row.items() if v is not None})
    return rows


def _actor_threads(threads: int | None) -> None:
    """An actor's torch threads: its CPUs."""
    import torch

    if threads:
        torch.set_num_threads(int(threads))


class ScoreActor:
    """Scores a batch of records through the one scoring path (:class:`~halwatch.pipeline.Pipeline`, the model
    loaded once per actor, no disk cache): columns ``id``, ``result`` (the JSON of the verdict, as ``halwatch
    score`` writes it; empty on failure) and ``error`` (empty on success)."""

    def __init__(self, detector: str | dict, scorer_options: dict | None = None, threads: int | None = None,
                 gpu_share: float = 0, evidence: str | None = None):
        from halwatch.detectors import load_detector
        from halwatch.models.loader import share_device
        from halwatch.pipeline import Pipeline

        _actor_threads(threads)
        self.pipeline = Pipeline(load_detector(detector, **{**(scorer_options or {}), "cache": None}))
        share_device(self.pipeline.scorer.model, gpu_share)  # load it now; a fraction of a GPU: its memory
        self.evidence = evidence


    def __call__(self, batch: dict) -> dict:
        records = batch_records(batch)
        ids = [str(r.get("id", "")) if isinstance(r, dict) else "" for r in records]
        results, errors = [""] * len(records), [""] * len(records)
        samples, views, slots = [], [], []
        from halwatch.data.jsonl import sample_from_record

        parsed = []
        for i, record in enumerate(records):
            try:
                parsed.append((i, sample_from_record(record, f"record {ids[i] or i}")))
            except InputError as exc:
                errors[i] = str(exc)
        found = self.pipeline.encode([sample for _, sample in parsed], keep_errors=True)
        for (i, sample), sample_views in zip(parsed, found):
            if isinstance(sample_views, InputError):
                errors[i] = str(sample_views)
            else:
                views.append(sample_views)
                samples.append(sample)
                slots.append(i)
        if slots:
            everything = list(range(len(slots)))
            try:
                self._score(everything, samples, views, slots, results)
            except Exception:  # noqa: BLE001 - one at a time, so that only the failing records fail
                for j in everything:
                    try:
                        self._score([j], samples, views, slots, results)
                    except Exception as exc:  # noqa: BLE001 - reported with the record's id
                        errors[slots[j]] = f"record {ids[slots[j]]}: {type(exc).__name__}: {exc}"
        return {"id": np.array(ids, dtype=object), "result": np.array(results, dtype=object),
                "error": np.array(errors, dtype=object)}

    def _score(self, chunk, samples, views, slots, results) -> None:
        for j, result in zip(chunk, self.pipeline.score([views[j] for j in chunk], evidence=self.evidence)):
            results[slots[j]] = json.dumps(result.to_dict(), ensure_ascii=False)


class SignalActor:
    """Computes the signals of a batch of records for ``request`` (from the driver's scorer, whose options it
    loads the model with once, no disk cache): columns ``id`` and ``signals`` (the arrays, as bytes of an
    ``.npz``)."""

    def __init__(self, request, scorer_options: dict | None = None, threads: int | None = None,
                 gpu_share: float = 0):
        from halwatch.models.loader import share_device
        from halwatch.scorer import Scorer

        _actor_threads(threads)
        self.scorer = Scorer.from_options(cache=None, **(scorer_options or {}))
        share_device(self.scorer.model, gpu_share)
        self.request = request

    def __call__(self, batch: dict) -> dict:
        from halwatch.cache import write_signals
        from halwatch.data.jsonl import sample_from_record

        records = batch_records(batch)
        samples = [sample_from_record(r, f"record {r.get('id')}") for r in records]
        out = []
        for sig in self.scorer.signals(samples, self.request):
            buffer = io.BytesIO()
            write_signals(buffer, sig)
            out.append(buffer.getvalue())
        return {"id": np.array([str(r["id"]) for r in records], dtype=object), "signals": np.array(out, dtype=object)}


def _map(dataset, actor: type, constructor: dict, actors: int, cpus: float, gpus: float, batch_size: int):
    """``dataset.map_batches`` through a pool of ``actors`` actors of class ``actor``, each built once with
    ``constructor``, as many torch threads as it has CPUs and, given a fraction of a GPU, that share of its
    memory."""
    ray = _ray()
    if actors < 1:
        raise InputError(f"--ray-actors must be at least 1, got {actors}")
    constructor = {**constructor, "threads": max(1, int(cpus)), "gpu_share": gpus}
    return dataset.map_batches(actor, fn_constructor_kwargs=constructor,
                               compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=cpus, num_gpus=gpus,
                               batch_size=batch_size, batch_format="numpy")


def _items(records: list[dict]) -> list[dict]:
    """Rows of a Ray Dataset carrying records as JSON texts (their fields vary, so no columns of their own)."""
    return [{"id": str(r["id"]), "record": json.dumps(r, ensure_ascii=False)} for r in records]


def score_dataset(dataset, detector: str | dict = "default", scorer_options: dict | None = None, actors: int = 1,
                  cpus_per_actor: float = 1, gpus_per_actor: float = 0, batch_size: int = 8,
                  evidence: str | None = None):
    """A Ray Dataset of records (one column per JSONL field, or a ``record`` column of JSON texts) -> a lazy
    Dataset with columns ``id``, ``result`` (JSON text of the verdict) and ``error``, scored by ``actors`` actors
    that each load the scoring model and ``detector`` once (``evidence``: as :meth:`Pipeline.score`)."""
    return _map(dataset, ScoreActor, {"detector": detector, "scorer_options": scorer_options, "evidence": evidence},
                actors, cpus_per_actor, gpus_per_actor, batch_size)


def finished_ids(path: Path) -> set[str]:
    """Ids already in an output file; a last line cut short by an interruption is removed from the file."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    good_end, done = 0, set()
    for line in data.splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            break
        if not line.endswith(b"\n"):
            break
        done.add(str(record["id"]))
        good_end += len(line)
    if good_end < len(data):
        log.warning("%s: dropped a half-written last line (%d bytes) of an interrupted run", path,
                    len(data) - good_end)
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return done


def score_records(records: list[dict], output: str | Path, detector: str | dict = "default",
                  scorer_options: dict | None = None, address: str | None = None, actors: int = 1,
                  cpus_per_actor: float = 1, gpus_per_actor: float = 0, batch_size: int = 8,
                  progress: bool = True, timeout: float = 30, evidence: str | None = None) -> dict:
    """Score ``records`` (dicts of the JSONL format, each with an ``id``) on Ray and append each verdict to
    ``output`` in the records' order as it arrives; records whose id is already there are skipped. Returns
    ``{"scored", "skipped", "failed": [{"id", "error"}]}``; failed records are not written (a rerun retries
    them). ``evidence``: as :meth:`halwatch.pipeline.Pipeline.score`."""
    from halwatch.progress import progress as progress_bar

    output = Path(output)
    ids = [str(r.get("id")) for r in records]
    if len(set(ids)) != len(ids) or "None" in ids:
        raise InputError("every record needs an id of its own to score on Ray (the output is resumed by id)")
    done = finished_ids(output)
    todo = [r for r in records if str(r["id"]) not in done]
    stats = {"scored": 0, "skipped": len(records) - len(todo), "failed": []}
    if not todo:
        return stats
    ray = connect(address, timeout=timeout)
    check_resources(ray, actors, cpus_per_actor, gpus_per_actor)
    if scorer_options:  # this process's $HALWATCH_DTYPE reaches the actors; a plain `auto` resolves on each node
        from halwatch.models.loader import chosen_dtype

        scorer_options = {**scorer_options, "dtype": chosen_dtype(scorer_options.get("dtype", "auto"))}
    dataset = ray.data.from_items(_items(todo))
    scored = score_dataset(dataset, detector, scorer_options, actors, cpus_per_actor, gpus_per_actor, batch_size,
                           evidence)
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "a", encoding="utf-8") as f, progress_bar(total=len(todo), disable=not progress,
                                                               desc="ray score", unit="answer") as bar:
        for batch in scored.iter_batches(batch_size=None, batch_format="numpy"):
            for rid, result, error in zip(batch["id"], batch["result"], batch["error"]):
                if error:
                    stats["failed"].append({"id": str(rid), "error": str(error)})
                else:
                    f.write(result + "\n")
                    stats["scored"] += 1
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch["id"]))
    return stats


def ray_signals(scorer, samples, request, address: str | None = None, actors: int = 1, cpus_per_actor: float = 1,
                gpus_per_actor: float = 0, batch_size: int = 8, timeout: float = 30):
    """The signals of ``samples`` for ``request``, computed by Ray actors that load ``scorer``'s model (a
    registered name or a folder every node can read) with its input mode and token cap. In the samples' order."""
    from halwatch.cache import read_signals
    from halwatch.data.jsonl import sample_record
    from halwatch.models import registry

    ray = connect(address, timeout=timeout)
    check_resources(ray, actors, cpus_per_actor, gpus_per_actor)
    rows = _items([{**sample_record(sample), "id": str(i)} for i, sample in enumerate(samples)])
    model = scorer.model.name if scorer.model.name in registry.MODELS else scorer.model.path
    # the driver's precision, not its option: the driver caches these signals under its own key, so an actor whose
    # machine would pick another precision for "auto" (a CPU with or without bfloat16) must not
    options = {"model": model, "input_mode": scorer.input_mode, "max_tokens": scorer.max_tokens,
               "device": scorer.device, "dtype": scorer.model.dtype, "batch_size": None}
    out = _map(ray.data.from_items(rows), SignalActor, {"request": request, "scorer_options": options}, actors,
               cpus_per_actor, gpus_per_actor, batch_size)
    signals: list = [None] * len(samples)
    for batch in out.iter_batches(batch_size=None, batch_format="numpy"):
        for rid, blob in zip(batch["id"], batch["signals"]):
            signals[int(rid)] = read_signals(io.BytesIO(blob))
    return signals

