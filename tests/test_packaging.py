"""What every library has, and its version written in one place: the package name, the
licence, the changelog, the citation file and the CLI's --version all agree with
``structinit.__version__``."""

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

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


def test_the_packages_build_and_pass_twine_check_strict(tmp_path):
    """The sdist and the wheel build (offline, with this environment's setuptools) and pass
    ``twine check --strict``; the sdist holds the package, not the tests, which need the whole
    repository (docs, scripts, golden files) and run from a clone."""
    import tarfile

    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    sdist, wheel = sorted(tmp_path.glob("*.tar.gz")), sorted(tmp_path.glob("*.whl"))
    assert len(sdist) == 1 and len(wheel) == 1
    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(sdist[0]), str(wheel[0])],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with tarfile.open(sdist[0]) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    assert "structinit/functional/linalg.py" in names and "structinit_cli.py" in names
    assert not [n for n in names if n.startswith(("tests/", "bench/", "docs/", "scripts/"))]


def test_python_versions_are_those_ci_runs():
    # requires-python and the classifiers say 3.11 and up, and ruff targets 3.11: the tests use
    # tomllib (3.11), and CI runs 3.11.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.11"
    assert "Programming Language :: Python :: 3.11" in project["project"]["classifiers"]
    assert project["tool"]["ruff"]["target-version"] == "py311"
    assert sys.version_info >= (3, 11)


def test_the_citation_file_lists_every_paper_and_no_release_date_before_a_release():
    cff = (ROOT / "CITATION.cff").read_text()
    cite = (ROOT / "docs" / "cite.md").read_text()
    papers = set(re.findall(r"arxiv\.org/abs/(\d{4}\.\d{5})", cite))
    assert len(papers) == 8 and papers == set(re.findall(r'value: "arXiv:(\d{4}\.\d{5})"', cff))
    unreleased = re.search(rf"^## {re.escape(VERSION)} \(unreleased", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert bool(unreleased) != bool(re.search(r"^date-released:", cff, re.M))
