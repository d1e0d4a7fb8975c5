"""The ``structinit`` command before the package is imported: its entry point is
``structinit_cli.main``, a module outside the package, so that Ctrl-C while torch loads ends in
one line and exit status 130 (SIGTERM: 143), not in a traceback or a silent exit."""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import structinit

ROOT = Path(__file__).resolve().parents[1]

# A sitecustomize that makes `import structinit` wait a minute after saying so on stdout: the
# start-up window of a real run (torch loading), made long and observable, so that SIGINT is
# sent exactly while the package is being imported.
SLOW_IMPORT = '''
import sys
import time


class SlowStructinit:
    def find_spec(self, name, path=None, target=None):
        if name == "structinit":
            print("importing structinit", flush=True)
            time.sleep(60)
        return None


sys.meta_path.insert(0, SlowStructinit())
'''


# The same, for `python -m structinit`: the package's own __init__ is running (its first line has set
# the guard) when torch, which it imports, is made to wait.
SLOW_TORCH = SLOW_IMPORT.replace("SlowStructinit", "SlowTorch").replace('"structinit"', '"torch"').replace(
    "importing structinit", "importing torch")


def console_script() -> Path:
    """The ``structinit`` command this environment's install made (beside its python)."""
    script = Path(sys.executable).parent / "structinit"
    assert script.is_file(), f"{script}: no structinit command; install the package (bash scripts/setup.sh)"
    return script


def test_the_command_is_the_launcher_outside_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"] == {"structinit": "structinit_cli:main"}
    assert project["tool"]["setuptools"]["py-modules"] == ["structinit_cli"]
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name="structinit")
    assert entry.value == "structinit_cli:main"  # the environment's install, as set up
    loaded = subprocess.run([sys.executable, "-c", "import sys, structinit_cli; print(sorted(m for m in sys.modules "
                             "if m.split('.')[0] in ('structinit', 'torch')))"],
                            capture_output=True, text=True, cwd=ROOT, check=True)
    assert loaded.stdout.strip() == "[]"  # importing the launcher loads neither the package nor torch
    done = subprocess.run([str(console_script()), "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"structinit {structinit.__version__}"


STOPS = [(signal.SIGINT, 130, "structinit: interrupted while starting; nothing was run"),
         (signal.SIGTERM, 143, "structinit: terminated (SIGTERM) while starting; nothing was run")]


def stopped_while_loading(command: list[str], slow: str, announced: str, signum, tmp_path) -> tuple[int, str]:
    """(exit status, stderr) of ``command`` sent ``signum`` while an import is made to wait by the
    sitecustomize ``slow``, once it prints ``announced``."""
    (tmp_path / "sitecustomize.py").write_text(slow)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    # Started as from a terminal, SIGINT at its default: a job a shell puts in the background without
    # job control inherits SIGINT ignored, and Python then keeps ignoring it (the run would go on).
    proc = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline() == announced, proc.communicate(timeout=60)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.mark.parametrize("signum,code,words", STOPS)
def test_a_stop_while_the_package_imports_is_one_line_and_its_exit_status(tmp_path, signum, code, words):
    got = stopped_while_loading([str(console_script()), "demo"], SLOW_IMPORT, "importing structinit\n", signum,
                                tmp_path)
    assert got == (code, words + "\n")


@pytest.mark.parametrize("signum,code,words", STOPS)
def test_a_stop_while_python_m_structinit_loads_torch_is_one_line_and_its_exit_status(tmp_path, signum, code, words):
    got = stopped_while_loading([sys.executable, "-m", "structinit", "demo"], SLOW_TORCH, "importing torch\n", signum,
                                tmp_path)
    assert got == (code, words + "\n")


def test_only_python_m_structinit_itself_sets_the_guard():
    import structinit_cli

    assert structinit_cli.started_as_module(["python", "-m", "structinit", "train"])
    assert structinit_cli.started_as_module(["python", "-X", "dev", "-mstructinit"])
    assert not structinit_cli.started_as_module(["python", "-m", "pytest", "structinit"])
    assert not structinit_cli.started_as_module(["python", "-m", "structinit.harness.cli.main"])
    assert not structinit_cli.started_as_module(["/usr/bin/structinit", "train"])
