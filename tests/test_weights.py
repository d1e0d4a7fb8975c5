"""Exported weights: model.safetensors (and model_ema.safetensors) at the end of a run, with
the config, init fingerprint and version in the header, loadable by plain safetensors and
into a fresh model with strict=True."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

import structinit
from structinit.harness.recipes import recipe
from structinit.harness.run.checkpoint import load_checkpoint, load_weights, save_weights
from structinit.harness.tasks import train


def test_save_load_round_trip(tmp_path):
    path = tmp_path / "w.safetensors"
    state = {"a.weight": torch.randn(3, 4).t(), "a.bias": torch.arange(3), "flag": torch.tensor([True])}
    save_weights(path, state, {"note": "x"})
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # written atomically, no temporary left
    loaded, meta = load_weights(path)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    assert meta == {"format": "pt", "note": "x"}
    with pytest.raises(TypeError, match=r"metadata\['n'\] is not a string"):
        save_weights(path, state, {"n": 1})


def test_load_weights_names_the_path_and_what_it_expected(tmp_path):
    path = tmp_path / "w.safetensors"
    with pytest.raises(FileNotFoundError, match=r"w\.safetensors: weights file not found; expected a safetensors"):
        load_weights(path)
    save_weights(path, {"x": torch.ones(100)})
    path.write_bytes(path.read_bytes()[:-10])  # truncated
    with pytest.raises(ValueError, match=r"w\.safetensors: not a readable safetensors file \(expected"):
        load_weights(path)
    path.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match=r"w\.safetensors: not a readable safetensors file"):
        load_weights(path)


def test_run_exports_final_weights_and_ema(tmp_path):
    cfg = recipe("digits", out_dir=str(tmp_path / "run"), epochs=1, train_size=None, init="impulse", ema_decay=0.9)
    result = train(cfg, progress=False)
    run = tmp_path / "run"
    final = load_checkpoint(run / "checkpoint.pt")
    weights, meta = load_weights(run / "model.safetensors")
    assert weights.keys() == final["model"].keys()
    assert all(torch.equal(weights[k], final["model"][k]) for k in weights)
    ema, ema_meta = load_weights(run / "model_ema.safetensors")
    assert all(torch.equal(ema[k], final["ema"][k]) for k in ema) and ema_meta == meta
    assert json.loads(meta["config"]) == json.loads(json.dumps(cfg.to_dict()))
    assert meta["init_fingerprint"] == result["init_fingerprint"]
    assert meta["structinit_version"] == structinit.__version__ and meta["format"] == "pt"
    # what timm / Hugging Face do: plain safetensors, then a strict load into a fresh model
    model = structinit.create_model(cfg.model, num_classes=10, in_chans=1, img_size=8)
    model.load_state_dict(safetensors.torch.load_file(run / "model.safetensors"), strict=True)
    assert all(torch.equal(v, final["model"][k]) for k, v in model.state_dict().items())


def test_no_ema_file_without_ema(tmp_path):
    train(recipe("digits", out_dir=str(tmp_path / "run"), epochs=1), progress=False)
    assert (tmp_path / "run/model.safetensors").is_file()
    assert not (tmp_path / "run/model_ema.safetensors").exists()


def test_the_same_weights_make_the_same_bytes_in_every_process(tmp_path):
    # safetensors orders the header's metadata by a hash map seeded per process: without sorting it,
    # two identical exports differ in their bytes. Each process here writes the same weights.
    import subprocess
    import sys

    # With 17 metadata keys, two processes that wrote them in hash-map order would agree about once
    # in 17! tries: three processes are plenty to see an unsorted header.
    extra = ", ".join(f"'k{k:02d}': 'v'" for k in range(12))
    code = ("import sys, torch; from structinit.harness.run.checkpoint import save_weights; "
            "save_weights(sys.argv[1], {'a': torch.arange(6.0), 'b': torch.ones(2, 3)}, "
            "{'config': '{}', 'init_fingerprint': 'f', 'structinit_version': '0', 'seed': '1', " + extra + "})")
    files = []
    for k in range(3):
        files.append(tmp_path / f"w{k}.safetensors")
        subprocess.run([sys.executable, "-c", code, str(files[-1])], check=True, timeout=120)
    assert len({f.read_bytes() for f in files}) == 1
    tensors, metadata = load_weights(files[0])
    assert torch.equal(tensors["a"], torch.arange(6.0)) and metadata["seed"] == "1" and metadata["format"] == "pt"
