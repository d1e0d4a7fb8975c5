"""Download the official dataset files, verify them (size and md5), and unpack archives safely:
nothing appears under its final name unless it verified (see :func:`fetch` and :func:`safe_extract`)."""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import secrets
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

__all__ = ["SOURCES", "DownloadError", "RemoteFile", "Source", "download", "fetch", "file_md5", "safe_extract"]

log = logging.getLogger(__name__)
_CHUNK = 1 << 20
# A mirror that holds the official file names, for every download: what the command line sets.
MIRROR_ENV = "STRUCTINIT_DATA_MIRROR"
MIRROR_HINT = f"base_url= in Python, or the environment variable {MIRROR_ENV}=<url> for any command"


class DownloadError(OSError):
    """A download failed, or its result did not verify; nothing that looks complete was left behind."""


class UnsafeArchiveError(DownloadError):
    """An archive member would be written outside the destination, or is not a plain file/folder."""


@dataclass(frozen=True)
class RemoteFile:
    """One file of a source: its name, md5, size in bytes (``None`` = unchecked), and for an
    archive the folder it unpacks to (unpacking is skipped while that folder exists)."""

    filename: str
    md5: str
    size: int | None = None
    extract_to: str | None = None


@dataclass(frozen=True)
class Source:
    """Where a dataset's files live: ``base_url + filename``, stored under ``root/subdir``."""

    base_url: str
    files: tuple[RemoteFile, ...]
    subdir: str = ""


# The official distributions. md5 sums are those published with each dataset (and used by
# torchvision.datasets); sizes are the files' Content-Length.
SOURCES: dict[str, Source] = {
    # https://www.cs.toronto.edu/~kriz/cifar.html — "CIFAR-10 python version", md5 on that page
    "cifar10": Source(
        "https://www.cs.toronto.edu/~kriz/",
        (RemoteFile("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a", 170498071, "cifar-10-batches-py"),),
    ),
    # same page, "CIFAR-100 python version"
    "cifar100": Source(
        "https://www.cs.toronto.edu/~kriz/",
        (RemoteFile("cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85", 169001437, "cifar-100-python"),),
    ),
    # http://ufldl.stanford.edu/housenumbers/ — format 2 (cropped digits); md5 as in torchvision.datasets.SVHN
    "svhn": Source(
        "http://ufldl.stanford.edu/housenumbers/",
        (
            RemoteFile("train_32x32.mat", "e26dedcc434d2e4c54c9b2d4a06d8373", 182040794),
            RemoteFile("test_32x32.mat", "eb5a983be6a315427106f1b164d9cef3", 64275384),
        ),
        subdir="svhn",
    ),
    # yann.lecun.com no longer serves the files reliably; this is the mirror torchvision.datasets.MNIST
    # tries first. md5 of the original .gz files (torchvision MNIST.resources).
    "mnist": Source(
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        (
            RemoteFile("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873", 9912422),
            RemoteFile("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432", 28881),
            RemoteFile("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3", 1648877),
            RemoteFile("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c", 4542),
        ),
        subdir="mnist",
    ),
    # https://github.com/zalandoresearch/fashion-mnist README: download links and md5 table
    "fashion_mnist": Source(
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        (
            RemoteFile("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d", 26421880),
            RemoteFile("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe", 29515),
            RemoteFile("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79", 4422102),
            RemoteFile("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310", 5148),
        ),
        subdir="fashion-mnist",
    ),
}


def file_md5(path: str | Path) -> str:
    """Hex md5 of a file, read in 1 MiB chunks."""
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stream(url: str, out: BinaryIO, timeout: float) -> tuple[str, int, int | None]:
    """Copy ``url`` into the open file ``out``; returns (md5, bytes received, Content-Length or None)."""
    request = urllib.request.Request(url, headers={"User-Agent": "structinit"})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise DownloadError(f"HTTP {exc.code} {exc.reason} for {url}") from exc
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        raise DownloadError(
            f"cannot reach {url}: {reason}; check the network, or name a mirror that has the file: {MIRROR_HINT}"
        ) from exc
    h, received = hashlib.md5(usedforsecurity=False), 0
    with response:
        header = response.headers.get("Content-Length")
        length = int(header) if header and header.strip().isdigit() else None
        try:
            while chunk := response.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
                received += len(chunk)
        except (OSError, http.client.HTTPException) as exc:  # IncompleteRead, reset, timeout
            raise DownloadError(
                f"truncated transfer: {url} broke off after {received} of {length or '?'} bytes "
                f"({type(exc).__name__}: {exc}); retry"
            ) from exc
    return h.hexdigest(), received, length


def fetch(url: str, dest: str | Path, md5: str, size: int | None = None, timeout: float = 60.0) -> Path:
    """Download ``url`` to ``dest`` unless ``dest`` already exists with the right md5.

    The file is written to a temporary ``.part`` file beside ``dest`` and renamed to ``dest``
    only after its length and md5 match; on any failure the part file is deleted.
    Raises :class:`DownloadError` (HTTP error, truncated transfer, size or md5 mismatch).
    """
    dest = Path(dest)
    if dest.exists():
        found = file_md5(dest)
        if found != md5:
            raise DownloadError(
                f"{dest}: md5 is {found}, expected {md5} — the file is corrupted or truncated; delete it and retry"
            )
        log.info("%s: already downloaded and verified", dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkstemp (always 0600): 0666 less the umask, like any file the user writes.
    part = str(dest.parent / f".{dest.name}.{secrets.token_hex(4)}.part")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        log.info("downloading %s -> %s", url, dest)
        with os.fdopen(fd, "wb") as out:
            found, received, length = _stream(url, out, timeout)
        if length is not None and received != length:
            raise DownloadError(
                f"truncated transfer: received {received} of {length} bytes (Content-Length) from {url}; retry"
            )
        if size is not None and received != size:
            raise DownloadError(
                f"{url}: received {received} bytes, expected {size} — the download is truncated or not the "
                f"official file; nothing was kept, retry or use another mirror ({MIRROR_HINT})"
            )
        if found != md5:
            raise DownloadError(
                f"{url}: md5 is {found}, expected {md5} — the download is corrupted or truncated; "
                f"nothing was kept, retry or use another mirror ({MIRROR_HINT})"
            )
        os.replace(part, dest)
    finally:
        if os.path.exists(part):
            os.unlink(part)
    return dest


def _check_member(member: tarfile.TarInfo, staging: Path, archive: Path) -> None:
    name = member.name
    path = PurePosixPath(name)

    def refuse(why: str) -> UnsafeArchiveError:
        return UnsafeArchiveError(
            f"{archive}: refusing member {name!r} ({why}); nothing was extracted — the archive is corrupted or "
            "not the official one: delete it and retry"
        )

    if not (member.isfile() or member.isdir()):
        kind = "symlink" if member.issym() else "hard link" if member.islnk() else "device or fifo"
        raise refuse(f"a {kind}; only regular files and folders are allowed")
    if not name or path.is_absolute() or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise refuse("an absolute path")
    if ".." in path.parts or "\\" in name:
        raise refuse("a path that leaves the destination")
    target = (staging / name).resolve()
    if not target.is_relative_to(staging.resolve()):
        raise refuse(f"it resolves to {target}, outside {staging}")


def safe_extract(archive: str | Path, dest: str | Path) -> list[Path]:
    """Unpack a tar archive into ``dest``; returns the top-level paths created.

    Every member is checked before anything is written (see :class:`UnsafeArchiveError`), then
    extracted with tarfile's ``"data"`` filter where available into a hidden staging folder,
    and the top-level entries are moved into ``dest`` — all or nothing.
    """
    archive, dest = Path(archive), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=dest, prefix=".extract-"))
    try:
        try:
            with tarfile.open(archive, "r:*") as tar:
                members = tar.getmembers()
                for member in members:
                    _check_member(member, staging, archive)
                # the "data" filter exists from Python 3.11.4 / 3.10.12; without it, the checks above suffice
                extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                tar.extractall(staging, members=members, **extra)
        except (tarfile.TarError, EOFError, zlib.error) as exc:
            raise DownloadError(
                f"{archive}: cannot unpack it ({type(exc).__name__}: {exc}); delete it and retry"
            ) from exc
        entries = sorted(staging.iterdir())
        clash = [dest / e.name for e in entries if (dest / e.name).exists()]
        if clash:
            raise DownloadError(f"{clash[0]} already exists; delete it to unpack {archive} again")
        for entry in entries:
            os.replace(entry, dest / entry.name)
        return [dest / e.name for e in entries]
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def download(
    name: str, root: str | Path, base_url: str | None = None, *, source: Source | None = None, timeout: float = 60.0
) -> Path:
    """Download (and unpack) dataset ``name`` into ``root``; returns the folder the files are in.

    Args:
        name: a key of :data:`SOURCES` ("cifar10", "cifar100", "svhn", "mnist", "fashion_mnist").
        root: the data folder; files go to ``root/<source.subdir>``.
        base_url: replaces the source's host and path (a mirror holding the same file names);
            by default ``$STRUCTINIT_DATA_MIRROR`` where it is set (how the command line names one).
        source: a :class:`Source` to use instead of ``SOURCES[name]``.

    Files that already exist with the right md5 are not downloaded again; an archive is not
    unpacked again while its folder exists.
    """
    if source is None:
        if name not in SOURCES:
            raise ValueError(f"download: no source for {name!r}; expected one of {', '.join(SOURCES)}")
        source = SOURCES[name]
    folder = Path(root).expanduser() / source.subdir
    base = base_url if base_url is not None else os.environ.get(MIRROR_ENV) or source.base_url
    base = base if base.endswith("/") else base + "/"
    for remote in source.files:
        path = fetch(base + remote.filename, folder / remote.filename, remote.md5, remote.size, timeout)
        if remote.extract_to is not None and not (folder / remote.extract_to).exists():
            safe_extract(path, folder)
            if not (folder / remote.extract_to).is_dir():
                raise DownloadError(f"{path}: unpacked, but it did not contain the expected {remote.extract_to}/")
    return folder
