"""What every library has, and its version written in one place: the package name, the
licence, the changelog, the citation file and the CLI's --version all agree with
``structinit.__version__``."""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import tomllib

import structinit

ROOT = Path(__file__).resolve().parents[1]
VERSION = structinit.__version__


def test_the_version_is_written_once_and_everything_reads_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "structinit.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    cff = (ROOT / "CITATION.cff").read_text()
    assert re.search(rf"^version: {re.escape(VERSION)}$", cff, re.M)
    assert f"version = {{{VERSION}}}" in (ROOT / "docs" / "cite.md").read_text()
    assert re.search(rf"^## {re.escape(VERSION)} ", (ROOT / "CHANGELOG.md").read_text(), re.M)
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        import version as docs_hook  # the docs footer's

        assert docs_hook.package_version() == VERSION
        assert docs_hook.on_config({})["copyright"] == f"structinit {VERSION} · MIT licence"
    finally:
        sys.path.remove(str(ROOT / "docs" / "hooks"))
        sys.modules.pop("version", None)


def test_structinit_version_prints_it():
    done = subprocess.run([sys.executable, "-m", "structinit", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"structinit {VERSION}"


def test_the_package_is_torch_structinit_under_the_mit_licence_and_installed_so():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "torch-structinit"  # "structinit" on the package index is another project
    assert project["license"] == {"text": "MIT"}
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert importlib.metadata.version("torch-structinit") == VERSION  # the environment's install, as set up


def test_it_installs_from_a_git_url(tmp_path):
    """The README's git-URL install, from a clone of this checkout's HEAD, into a folder:
    the package that lands there is this version of structinit, as torch-structinit."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(tmp_path / "clone")], check=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                           "--target", str(tmp_path / "site"), f"git+file://{tmp_path / 'clone'}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / f"torch_structinit-{VERSION}.dist-info").is_dir()
    assert f'__version__ = "{VERSION}"' in (tmp_path / "site" / "structinit" / "__init__.py").read_text()
