"""The split between the core install (torch, numpy, scipy) and the harness extra: without
the extra, the init API and the harness modules still import, and the first use of a
missing package says which one it is and how to install it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from structinit.utils.optional_imports import HARNESS_INSTALL, require

ROOT = Path(__file__).resolve().parents[1]
EXTRA = ("sklearn", "matplotlib", "PIL", "tqdm", "safetensors")


def test_require_names_the_package_and_the_extra(monkeypatch):
    for module in ("sklearn", "sklearn.datasets"):  # importing them now fails as if they were absent
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=r"the digits dataset needs the scikit-learn package.*"
                                          r'pip install -e "\.\[harness\]" in a clone of structinit'):
        require("sklearn.datasets", "the digits dataset")
    assert require("json", "anything").dumps(1) == "1"
    assert HARNESS_INSTALL == 'pip install -e ".[harness]" in a clone of structinit (the package torch-structinit)'


def test_without_the_extra_only_its_features_fail():
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in EXTRA)
    code = f"""
import sys
{blocked}
import structinit
model = structinit.init_(structinit.create_model("vit_cpu_patch2_8", num_classes=10, in_chans=1, img_size=8),
                         "impulse", seed=0)
import structinit.data, structinit.augment, structinit.harness.tasks.image, structinit.harness.compare
from structinit.harness.run.checkpoint import save_weights
from structinit.harness.compare import plot_curves
from structinit.harness.run.lifecycle import Chunk, _progress
for call in (lambda: structinit.load_dataset("digits"), lambda: _progress(Chunk(1, 0, 1, True), 1, "epoch", True),
             lambda: plot_curves(dict(), "x.png"), lambda: structinit.data.imagefolder._read_image("x.png", None),
             lambda: save_weights("w.safetensors", model.state_dict())):
    try:
        call()
    except ImportError as err:
        print(err)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert [line.split(" needs the ")[1].split()[0] for line in lines] == [
        "scikit-learn", "tqdm", "matplotlib", "pillow", "safetensors"]
    assert all(HARNESS_INSTALL in line for line in lines)


# Each command with arguments it would accept on a full install (what it reads need not exist:
# the missing extra is said first).
COMMANDS = [
    ["train", "--recipe", "digits", "--epochs", "1", "--no-progress"],
    ["compare", "--recipe", "digits", "--inits", "impulse", "--seeds", "1", "--no-progress"],
    ["report", "runs/nothing-here"],
    ["attention", "--model", "vit_cpu_patch2_8", "--dataset", "none"],
    ["cka", "runs/nothing-here", "runs/nothing-here-either"],
    ["ablate", "kernel"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_command_on_a_base_install_names_the_extra_in_one_line(argv, tmp_path):
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in EXTRA)
    code = f"import sys; {blocked}\nfrom structinit.harness.cli.main import main\nsys.exit(main({argv!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    err = proc.stderr.strip()
    assert proc.returncode == 1, (proc.returncode, err[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"structinit {argv[0]} needs the harness extra" in err and HARNESS_INSTALL in err, err
    assert "scikit-learn, matplotlib, pillow, tqdm, safetensors are not installed" in err
    assert not any(tmp_path.iterdir())  # nothing started: no run folder


def test_demo_needs_no_extra():
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in EXTRA)
    code = (f"import sys; {blocked}\nfrom structinit.harness.cli.main import main\n"
            "sys.exit(main(['demo', '--model', 'vit_cpu_patch2_8']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
