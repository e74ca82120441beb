"""Load a scoring model by name (cached named model), local folder (any Hugging Face causal LM) or hub id."""

from __future__ import annotations

import json
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from halwatch.errors import ModelError
from halwatch.files import replaced
from halwatch.models import registry

log = logging.getLogger("halwatch")


DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_device(device: str = "auto") -> str:
    """``auto``: the first CUDA GPU, else Apple's MPS, else the CPU; ``cpu``, ``cuda``, ``cuda:N`` and ``mps`` are
    checked against what this machine has."""
    import torch

    device = (device or "auto").strip().lower()
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda:0"
        mps = getattr(torch.backends, "mps", None)
        return "mps" if mps is not None and mps.is_available() else "cpu"
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and (kind != "cuda" or not index.isdigit())):
        raise ModelError(f"unknown device {device!r}: choose auto, cpu, cuda, cuda:N or mps")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ModelError(f"device {device!r}: this machine has no CUDA GPU that torch can use "
                             f"(torch {torch.__version__}); use --device cpu or auto")
        n = int(index or 0)
        if n >= torch.cuda.device_count():
            raise ModelError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
        return f"cuda:{n}"
    if kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ModelError("device 'mps': Apple's MPS backend is not available here; use --device cpu or auto")
    return kind


def cpu_computes_bfloat16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether the CPU has bfloat16 instructions (x86's AVX-512 BF16 or AMX BF16 among Linux's ``/proc/cpuinfo``
    flags). False where that cannot be read (other systems), and on CPUs without them, where torch would convert
    every product and bfloat16 gains nothing."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return False
    flags = {flag for line in text.splitlines() if line.startswith("flags") for flag in line.partition(":")[2].split()}
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def chosen_dtype(dtype: str) -> str:
    """The precision asked for, checked: ``auto`` is ``$HALWATCH_DTYPE`` where that is set (what a process on
    another machine, a Ray actor, must be told), else stays ``auto`` for :func:`resolve_dtype`."""
    dtype = (dtype or "auto").strip().lower()
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}: choose {', '.join(DTYPES)}")
    if dtype != "auto":
        return dtype
    chosen = os.environ.get("HALWATCH_DTYPE", "auto").strip().lower() or "auto"
    if chosen not in DTYPES:
        raise ModelError(f"HALWATCH_DTYPE={chosen!r}: choose {', '.join(DTYPES[1:])} (or unset it for auto)")
    return chosen


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto`` (:func:`chosen_dtype`: ``$HALWATCH_DTYPE`` where it is set): bfloat16 on a GPU that supports it
    (else float16), float16 on MPS, bfloat16 on a CPU that computes it natively (:func:`cpu_computes_bfloat16`:
    2-2.7x faster than float32 there, docs/scale.md) and float32 on other CPUs."""
    import torch

    dtype = chosen_dtype(dtype)
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if device == "mps":
        return "float16"
    return "bfloat16" if cpu_computes_bfloat16() else "float32"


@dataclass
class ScoringModel:
    """A causal LM and its tokenizer, with a stable identity (name + weights hash) for caches and artifacts, on
    ``device`` in ``dtype`` (:func:`resolve_dtype` picks it unless asked)."""

    name: str
    path: str
    weights_hash: str
    model: object
    tokenizer: object

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @cached_property
    def n_layers(self) -> int:
        """Layers of the language model (the text part of a composite config, as in Fuyu's)."""
        return int(self.model.config.get_text_config().num_hidden_layers)

    @cached_property
    def n_heads(self) -> int:
        return int(self.model.config.get_text_config().num_attention_heads)

    @cached_property
    def _heads(self) -> tuple[tuple[int, int], ...]:
        return tuple((layer, head) for layer in range(self.n_layers) for head in range(self.n_heads))

    def all_heads(self) -> tuple[tuple[int, int], ...]:
        """Every ``(layer, head)``, layer by layer (one tuple, made once: callers compare it per answer)."""
        return self._heads


def _folder_hash(folder: Path) -> str:
    """sha256 over the weight and config files of a local model folder, memoised by (path, size, mtime)."""
    files = sorted(
        p for p in folder.iterdir() if p.is_file() and p.suffix in {".safetensors", ".bin", ".json", ".gguf"}
    )
    stamp = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    memo_path = registry.home() / "folder-hashes.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    key = str(folder.resolve())
    if memo.get(key, {}).get("stamp") == stamp:
        return memo[key]["sha256"]
    import hashlib

    digest = hashlib.sha256()
    for p in files:
        digest.update(p.name.encode())
        digest.update(registry.sha256_file(p).encode())
    value = digest.hexdigest()
    memo[key] = {"stamp": stamp, "sha256": value}
    with replaced(memo_path) as f:
        f.write(json.dumps(memo))
    return value


#: The models this process has loaded, while something still holds them: loading the same weights again onto the
#: same device in the same precision (a command run inside a process that already scores with the model, a
#: watchdog's LLM client beside its scorer) shares the loaded one instead of reading the weights again (about 3 s
#: for SmolLM2 on a CPU). Sharing is safe: passes never change the weights, and what one pass captures is held in a
#: context variable of its own thread (:mod:`halwatch.models.forward`).
_LOADED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_LOADING = threading.Lock()


def _from_folder(folder: Path, name: str, weights_hash: str, device: str, dtype: str) -> ScoringModel:
    key = (str(folder.resolve()), name, weights_hash, device, dtype)
    with _LOADING:
        held = _LOADED.get(key)
        if held is None or held.dtype != dtype or held.device.type != device.partition(":")[0]:  # moved since
            held = _LOADED[key] = _read_folder(folder, name, weights_hash, device, dtype)
    return held


def _read_folder(folder: Path, name: str, weights_hash: str, device: str, dtype: str) -> ScoringModel:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device)
    except Exception as exc:  # transformers raises many kinds; the user needs the reason in one line
        raise ModelError(f"cannot load a causal LM from {folder}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelError(f"{name}: halwatch needs a fast tokenizer (character offsets); {folder} has none")
    model.eval()
    return ScoringModel(name=name, path=str(folder), weights_hash=weights_hash, model=model, tokenizer=tokenizer)


def share_device(model: ScoringModel, share: float) -> None:
    """Hold this process to ``share`` of its GPU's memory (0 < share < 1: several processes on one GPU, as
    ``--ray-gpus 0.25`` or ``halwatch bench speed --processes 4`` run them), so that none takes what the others
    need; the attention capture sizes its buffers to the share. Nothing on a CPU, or with a share of 1 or more."""
    import torch

    if 0 < share < 1 and model.device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(share, model.device)


def load_model(name_or_path: str = registry.DEFAULT_MODEL, pull_missing: bool = True, device: str = "auto",
               dtype: str = "auto") -> ScoringModel:
    """Load a scoring model.

    ``name_or_path`` is a registered name (``smollm2-135m``, ...: pulled into the cache on first use when
    ``pull_missing``), a local folder holding a Hugging Face causal LM, or a hub id where a hub is reachable.
    ``device``: ``auto`` (a GPU where there is one, else the CPU), ``cpu``, ``cuda[:N]`` or ``mps``; ``dtype``:
    ``float32``, ``bfloat16``, ``float16`` or ``auto`` (:func:`resolve_dtype`).
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if name_or_path in registry.MODELS:
        if not registry.is_pulled(name_or_path):
            if not pull_missing:
                raise ModelError(f"{name_or_path} is not in the cache: run `halwatch models pull {name_or_path}`")
            registry.pull(name_or_path, log=lambda msg: log.warning("%s", msg))
        folder = registry.model_dir(name_or_path)
        manifest = json.loads((folder / registry.MANIFEST).read_text())
        return _from_folder(folder, name_or_path, manifest["weights_sha256"], device, dtype)
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ModelError(f"{folder} is a folder but holds no config.json: not a Hugging Face model folder")
        return _from_folder(folder, str(folder.resolve()), _folder_hash(folder), device, dtype)
    if folder.suffix or os.sep in name_or_path and not name_or_path.count("/") == 1:
        raise ModelError(f"unknown model {name_or_path!r}: no such folder, and not a registered name "
                         f"({', '.join(registry.MODELS)})")
    try:  # a hub id such as "org/model", resolved by transformers (works only where a hub or its cache is reachable)
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(name_or_path))
    except Exception as exc:
        raise ModelError(
            f"unknown model {name_or_path!r}: not a registered name ({', '.join(registry.MODELS)}), "
            f"not a local folder, and not loadable from the Hugging Face hub ({type(exc).__name__})"
        ) from exc
    return _from_folder(snapshot, name_or_path, _folder_hash(snapshot), device, dtype)
