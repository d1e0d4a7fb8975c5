"""Downloads against a local HTTP server: verified files only, nothing half-written left behind,
archives that would write outside their folder refused."""

import gzip
import hashlib
import io
import os
import pickle
import struct
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from structinit.data import SOURCES, DownloadError, RemoteFile, Source, download, load_dataset
from structinit.data.download import UnsafeArchiveError, fetch, safe_extract


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.server.hits.append(self.path)
        route = self.server.routes.get(self.path)
        if route is None:
            self.send_error(404, "Not Found")
            return
        body, length = route
        self.send_response(200)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def _httpd():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def server(_httpd):
    """(base_url, routes, hits): routes maps '/name' -> (body, Content-Length or None)."""
    _httpd.routes, _httpd.hits = {}, []
    return f"http://127.0.0.1:{_httpd.server_address[1]}/", _httpd.routes, _httpd.hits


def md5(data):
    return hashlib.md5(data).hexdigest()


def tar_bytes(members):
    """A .tar.gz from (TarInfo, bytes or None) pairs."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, None if data is None else io.BytesIO(data))
    return buf.getvalue()


def file_info(name):
    return tarfile.TarInfo(name)


def cifar_archive(n=2):
    rng = np.random.default_rng(0)
    members = [(tarfile.TarInfo("cifar-10-batches-py"), None)]
    members[0][0].type = tarfile.DIRTYPE
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": [1] * n}
        members.append((file_info(f"cifar-10-batches-py/{name}"), pickle.dumps(batch, protocol=2)))
    meta = {b"label_names": [b"c%d" % i for i in range(10)]}
    members.append((file_info("cifar-10-batches-py/batches.meta"), pickle.dumps(meta, protocol=2)))
    return tar_bytes(members)


def leftovers(folder):
    return sorted(p.name for p in folder.rglob("*")) if folder.exists() else []


def one_file_source(base_url, name, body, extract_to=None, size="auto"):
    size = len(body) if size == "auto" else size
    return Source(base_url, (RemoteFile(name, md5(body), size, extract_to),))


def serve_cifar_archive(server, monkeypatch) -> list[str]:
    """Serve a small CIFAR-10 archive as the cifar10 source; returns the server's hit list."""
    base, routes, hits = server
    body = cifar_archive()
    routes["/cifar-10-python.tar.gz"] = (body, None)
    source = one_file_source(base, "cifar-10-python.tar.gz", body, "cifar-10-batches-py")
    monkeypatch.setitem(SOURCES, "cifar10", source)
    return hits


def test_archive_download_extract_load_and_skip(server, tmp_path, monkeypatch):
    hits = serve_cifar_archive(server, monkeypatch)
    root = tmp_path / "data"
    ds = load_dataset("cifar10", root, download=True)
    assert ds.images.shape == (10, 3, 32, 32) and ds.classes[3] == "c3"
    assert (root / "cifar-10-batches-py/data_batch_5").is_file()
    assert not [p for p in leftovers(root) if p.startswith(".")]  # no .part file, no staging folder
    assert hits == ["/cifar-10-python.tar.gz"]
    download("cifar10", root)  # verified archive and its folder exist: nothing fetched
    assert len(hits) == 1
    assert torch.equal(load_dataset("cifar10", root, download=True).images, ds.images)
    assert len(hits) == 1


def test_downloaded_archive_mode_follows_the_umask(server, tmp_path, monkeypatch):
    serve_cifar_archive(server, monkeypatch)
    old = os.umask(0o022)
    try:
        download("cifar10", tmp_path)
    finally:
        os.umask(old)
    assert (tmp_path / "cifar-10-python.tar.gz").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("name", ["cifar-10-batches-py", "cifar-10-python.tar.gz"])
def test_download_when_root_names_the_folder_or_the_archive(server, tmp_path, monkeypatch, name):
    base, routes, _ = server
    body = cifar_archive()
    routes["/cifar-10-python.tar.gz"] = (body, None)
    source = one_file_source(base, "cifar-10-python.tar.gz", body, "cifar-10-batches-py")
    monkeypatch.setitem(SOURCES, "cifar10", source)
    assert len(load_dataset("cifar10", tmp_path / name, split="test", download=True)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar-10-batches-py", "cifar-10-python.tar.gz"]


def test_base_url_override_for_idx_files(server, tmp_path, monkeypatch):
    base, routes, hits = server
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (3, 28, 28), dtype=np.uint8), np.array([4, 0, 9], dtype=np.uint8)
    blobs = {
        "train-images-idx3-ubyte.gz": struct.pack(">IIII", 2051, 3, 28, 28) + images.tobytes(),
        "train-labels-idx1-ubyte.gz": struct.pack(">II", 2049, 3) + labels.tobytes(),
    }
    files = []
    for name, raw in blobs.items():
        body = gzip.compress(raw)
        routes[f"/mirror/{name}"] = (body, None)
        files.append(RemoteFile(name, md5(body), len(body)))
    monkeypatch.setitem(SOURCES, "mnist", Source("http://unreachable.invalid/", tuple(files), subdir="mnist"))
    folder = download("mnist", tmp_path, base_url=base + "mirror")
    assert folder == tmp_path / "mnist" and sorted(hits) == sorted(f"/mirror/{n}" for n in blobs)
    ds = load_dataset("mnist", tmp_path)
    assert np.array_equal(ds.images[:, 0].numpy(), images) and ds.labels.tolist() == [4, 0, 9]


def test_corrupted_download_is_not_kept(server, tmp_path):
    base, routes, _ = server
    good = b"the official bytes" * 100
    routes["/f.bin"] = (good[:-1] + b"X", None)  # same length, different content
    with pytest.raises(DownloadError, match=f"md5 is {md5(good[:-1] + b'X')}, expected {md5(good)}"):
        download("x", tmp_path, source=one_file_source(base, "f.bin", good))
    assert leftovers(tmp_path) == []


def test_truncated_transfer_is_not_kept(server, tmp_path):
    base, routes, _ = server
    body = b"0123456789" * 50
    routes["/f.bin"] = (body, len(body) + 100)  # the server promises more than it sends
    with pytest.raises(DownloadError, match=f"truncated transfer: .*{len(body)} of {len(body) + 100}"):
        fetch(base + "f.bin", tmp_path / "f.bin", md5(body), timeout=10)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(("size", "message"), [("auto", "received 250 bytes, expected 500"), (None, "md5 is")])
def test_cut_file_with_the_full_files_checksum(server, tmp_path, size, message):
    base, routes, _ = server
    full = bytes(range(250)) * 2
    routes["/f.bin"] = (full[:250], None)  # consistent Content-Length, but a cut file
    with pytest.raises(DownloadError, match=message):
        download("x", tmp_path, source=one_file_source(base, "f.bin", full, size=size))
    assert leftovers(tmp_path) == []


def test_http_error_names_the_url(server, tmp_path):
    base, _, _ = server
    with pytest.raises(DownloadError, match=rf"HTTP 404 .*{base}missing.bin"):
        download("x", tmp_path, source=one_file_source(base, "missing.bin", b"abc"))
    assert leftovers(tmp_path) == []


def test_existing_corrupted_file_is_reported_not_replaced(server, tmp_path):
    base, routes, hits = server
    routes["/f.bin"] = (b"good", None)
    (tmp_path / "f.bin").write_bytes(b"bad!")
    with pytest.raises(DownloadError, match=r"f\.bin: md5 is .*corrupted or truncated; delete it and retry"):
        download("x", tmp_path, source=one_file_source(base, "f.bin", b"good"))
    assert (tmp_path / "f.bin").read_bytes() == b"bad!" and hits == []


def _evil_members(kind):
    ok = (file_info("pkg/ok.txt"), b"fine")
    if kind == "dotdot":
        return [ok, (file_info("../evil"), b"escaped")]
    if kind == "nested-dotdot":
        return [ok, (file_info("pkg/../../evil"), b"escaped")]
    if kind == "absolute":
        return [ok, (file_info("/tmp/structinit-evil-absolute"), b"escaped")]
    info = file_info("pkg/link")
    info.type, info.linkname = {
        "symlink": (tarfile.SYMTYPE, "../../evil"),
        "hardlink": (tarfile.LNKTYPE, "/etc/passwd"),
        "device": (tarfile.CHRTYPE, ""),
    }[kind]
    return [ok, (info, None)]


@pytest.mark.parametrize("kind", ["dotdot", "nested-dotdot", "absolute", "symlink", "hardlink", "device"])
def test_unsafe_archive_members_are_refused(server, tmp_path, kind):
    base, routes, _ = server
    body = tar_bytes(_evil_members(kind))
    routes["/a.tar.gz"] = (body, None)
    root = tmp_path / "data"
    with pytest.raises(UnsafeArchiveError, match="refusing member"):
        download("x", root, source=one_file_source(base, "a.tar.gz", body, extract_to="pkg"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # nothing outside root
    assert leftovers(root) == ["a.tar.gz"]  # the verified archive only: no pkg/, no staging folder


def test_safe_extract_is_all_or_nothing(tmp_path):
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(tar_bytes([(file_info("pkg/a.txt"), b"a"), (file_info("pkg/b.txt"), b"b")]))
    assert safe_extract(archive, tmp_path / "out") == [tmp_path / "out/pkg"]
    assert (tmp_path / "out/pkg/b.txt").read_bytes() == b"b"
    with pytest.raises(DownloadError, match="pkg already exists"):
        safe_extract(archive, tmp_path / "out")
    archive.write_bytes(b"not a tar")
    with pytest.raises(DownloadError, match=r"a\.tar\.gz: cannot unpack it"):
        safe_extract(archive, tmp_path / "out2")
    assert leftovers(tmp_path / "out2") == []


def test_registry_has_every_downloadable_dataset():
    assert set(SOURCES) == {"cifar10", "cifar100", "svhn", "mnist", "fashion_mnist"}
    for source in SOURCES.values():
        assert source.base_url.startswith(("http://", "https://")) and source.base_url.endswith("/")
        for f in source.files:
            assert len(f.md5) == 32 and int(f.md5, 16) >= 0 and f.size > 0
    with pytest.raises(ValueError, match="no source for 'imagenet'"):
        download("imagenet", "unused")


def test_the_mirror_the_error_advises_is_one_the_command_line_can_name(server, tmp_path, monkeypatch):
    # The official host cannot be reached: the error names the mirror setting, and that setting
    # fetches the files from the mirror through `structinit train --download`.
    from structinit.harness.cli.main import main

    hits = serve_cifar_archive(server, monkeypatch)
    base = SOURCES["cifar10"].base_url
    body = server[1]["/cifar-10-python.tar.gz"]
    server[1]["/mirror/cifar-10-python.tar.gz"] = body
    monkeypatch.setitem(SOURCES, "cifar10", Source("http://unreachable.invalid/", SOURCES["cifar10"].files))
    with pytest.raises(DownloadError, match="STRUCTINIT_DATA_MIRROR=<url> for any command"):
        download("cifar10", tmp_path / "a", timeout=5)
    monkeypatch.setenv("STRUCTINIT_DATA_MIRROR", base + "mirror")
    out = tmp_path / "run"
    assert main(["train", "--recipe", "digits", "--dataset", "cifar10", "--data-dir", str(tmp_path / "b"),
                 "--download", "--epochs", "1", "--set", "train_size=None", "--model", "vit_cpu_patch4_32",
                 "--batch-size", "4", "--no-progress", "--out", str(out)]) == 0
    assert hits == ["/mirror/cifar-10-python.tar.gz"] and (out / "result.json").is_file()
