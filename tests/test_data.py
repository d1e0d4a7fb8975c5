"""ArrayDataset, CIFAR-10/100 (python pickles, folder or .tar.gz), the bundled digits and the
registry: exact round-trips, errors that name the file, and pickles that cannot run code."""

import os
import pickle
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from structinit.data import (
    DATASET_STATS,
    ArrayDataset,
    DatasetFormatError,
    DatasetNotFoundError,
    channel_stats,
    load_dataset,
)
from structinit.data.digits import digits_arrays, digits_split_indices

SHARED = Path(__file__).resolve().parents[2] / "shared/datasets"
CIFAR_NAMES = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]


# ---------------------------------------------------------------------------------------------
# writers for the official formats
# ---------------------------------------------------------------------------------------------


def cifar_batch(n, seed, label_keys=(b"labels",), num_classes=10, protocol=2):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    batch = {b"batch_label": b"batch %d" % seed, b"data": data}  # no b'filenames', like the local copy
    for key in label_keys:
        batch[key] = [int(v) for v in rng.integers(0, num_classes, n)]
    return batch


def write_cifar10(parent, sizes=(3, 3, 3, 3, 2), test_size=4, protocol=2):
    """cifar-10-batches-py/ under parent; returns {file name: batch dict}."""
    folder = parent / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {f"data_batch_{i + 1}": cifar_batch(n, i, protocol=protocol) for i, n in enumerate(sizes)}
    batches["test_batch"] = cifar_batch(test_size, 99)
    for name, batch in batches.items():
        (folder / name).write_bytes(pickle.dumps(batch, protocol=protocol))
    meta = {b"num_cases_per_batch": 3, b"label_names": CIFAR_NAMES, b"num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=protocol))
    return batches


def tar_folder(folder, archive):
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    return archive


# ---------------------------------------------------------------------------------------------
# ArrayDataset
# ---------------------------------------------------------------------------------------------


def tiny(n=6, c=3, num_classes=3):
    images = torch.arange(n * c * 4, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(n, c, 2, 2)
    labels = torch.arange(n) % num_classes
    return ArrayDataset(images, labels, [f"c{i}" for i in range(num_classes)], "tiny", (0.5,) * c, (0.25,) * c)


def test_array_dataset_basics_and_subset():
    ds = tiny()
    assert len(ds) == 6 and ds.num_classes == 3 and ds.image_shape == (3, 2, 2)
    sub = ds.subset(torch.tensor([4, 1]))
    assert torch.equal(sub.images, ds.images[[4, 1]]) and sub.labels.tolist() == [1, 1]
    assert sub.mean == ds.mean and sub.classes == ds.classes
    mask = ds.subset(ds.labels == 2)
    assert mask.labels.tolist() == [2, 2]
    with pytest.raises(IndexError, match="index 6 out of range for 6 images"):
        ds.subset(torch.tensor([0, 6]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"images": torch.zeros(2, 3, 2, 2)}, "expected a uint8 tensor"),
        ({"images": torch.zeros(2, 2, 2, dtype=torch.uint8)}, "expected a uint8 tensor"),
        ({"labels": torch.tensor([0, 1], dtype=torch.int32)}, "expected an int64 tensor"),
        ({"labels": torch.tensor([0, 1, 2])}, "2 images but 3 labels"),
        ({"labels": torch.tensor([0, 10])}, r"labels out of range: found 10, expected 0\.\.9"),
        ({"labels": torch.tensor([-1, 0])}, "labels out of range: found -1"),
        ({"mean": (0.5,)}, "expected 3 .one per channel"),
    ],
)
def test_array_dataset_rejects(change, message):
    kw = dict(images=torch.zeros(2, 3, 2, 2, dtype=torch.uint8), labels=torch.tensor([0, 1]),
              classes=[str(i) for i in range(10)], name="t", mean=(0.5,) * 3, std=(0.2,) * 3)  # fmt: skip
    with pytest.raises(DatasetFormatError, match=message):
        ArrayDataset(**{**kw, **change})


def test_channel_stats_matches_numpy():
    x = torch.randint(0, 256, (37, 3, 5, 4), dtype=torch.uint8)
    mean, std = channel_stats(x, chunk=8)
    ref = x.numpy().astype(np.float64) / 255
    np.testing.assert_allclose(mean, ref.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(std, ref.std(axis=(0, 2, 3)), rtol=1e-9)


# ---------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar10_folder_round_trip(tmp_path, protocol):
    batches = write_cifar10(tmp_path, protocol=protocol)
    ds = load_dataset("cifar10", tmp_path)
    assert ds.images.shape == (14, 3, 32, 32) and ds.images.dtype == torch.uint8 and ds.labels.dtype == torch.int64
    assert ds.classes == [n.decode() for n in CIFAR_NAMES] and ds.name == "cifar10"
    assert (ds.mean, ds.std) == DATASET_STATS["cifar10"]
    rows = np.concatenate([batches[f"data_batch_{i}"][b"data"] for i in range(1, 6)])
    labels = [v for i in range(1, 6) for v in batches[f"data_batch_{i}"][b"labels"]]
    assert ds.labels.tolist() == labels  # batches 1..5 in order
    img = ds.images[4].numpy()
    assert np.array_equal(img[0].reshape(-1), rows[4, :1024])  # the first 1024 values are red
    assert np.array_equal(img[1].reshape(-1), rows[4, 1024:2048])
    assert img[2, 5, 7] == rows[4, 2048 + 5 * 32 + 7]  # row-major 32×32
    test = load_dataset("cifar10", tmp_path / "cifar-10-batches-py", split="test")
    assert np.array_equal(test.images.reshape(4, -1).numpy(), batches["test_batch"][b"data"])


def test_cifar10_from_archive(tmp_path):
    write_cifar10(tmp_path / "src")
    archive = tar_folder(tmp_path / "src/cifar-10-batches-py", tmp_path / "cifar-10-python.tar.gz")
    ref = load_dataset("cifar10", tmp_path / "src")
    for root in (archive, tmp_path):  # the archive itself, or the folder that holds it
        ds = load_dataset("cifar10", root)
        assert torch.equal(ds.images, ref.images) and torch.equal(ds.labels, ref.labels)
    assert not (tmp_path / "cifar-10-batches-py").exists()  # read in place, nothing extracted


@pytest.mark.parametrize("label", ["fine", "coarse"])
def test_cifar100_labels(tmp_path, label):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    keys = (b"fine_labels", b"coarse_labels")
    train = cifar_batch(6, 1, keys, num_classes=20)
    train[b"fine_labels"] = [99, 0, 5, 42, 17, 3]
    train[b"coarse_labels"] = [np.int64(v) for v in train[b"coarse_labels"]]  # numpy scalars unpickle too
    (folder / "train").write_bytes(pickle.dumps(train, protocol=2))
    (folder / "test").write_bytes(pickle.dumps(cifar_batch(2, 2, keys, num_classes=20), protocol=2))
    meta = {
        b"fine_label_names": [b"f%d" % i for i in range(100)],
        b"coarse_label_names": [b"c%d" % i for i in range(20)],
    }
    (folder / "meta").write_bytes(pickle.dumps(meta, protocol=2))
    ds = load_dataset("cifar100", tmp_path, label=label)
    assert ds.num_classes == (100 if label == "fine" else 20)
    assert ds.labels.tolist() == train[f"{label}_labels".encode()]
    assert np.array_equal(ds.images.reshape(6, -1).numpy(), train[b"data"])
    assert len(load_dataset("cifar100", tmp_path, split="test")) == 2
    with pytest.raises(ValueError, match="label='medium'"):
        load_dataset("cifar100", tmp_path, label="medium")


def test_cifar_missing_folder_and_file(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"cifar-10-batches-py not found: .*data_batch_1.*download"):
        load_dataset("cifar10", tmp_path)
    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py/data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3 not found"):
        load_dataset("cifar10", tmp_path)
    assert len(load_dataset("cifar10", tmp_path, split="test")) == 4  # the test split is complete


def test_cifar_corrupted_and_truncated_pickle(tmp_path):
    write_cifar10(tmp_path)
    path = tmp_path / "cifar-10-batches-py/data_batch_2"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    with pytest.raises(DatasetFormatError, match="data_batch_2"):
        load_dataset("cifar10", tmp_path)
    path.write_bytes(pickle.dumps(cifar_batch(3, 0), protocol=2)[:4000])
    with pytest.raises(DatasetFormatError, match=r"data_batch_2: not a valid pickle .*truncated"):
        load_dataset("cifar10", tmp_path)


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_with_forbidden_global_is_not_executed(tmp_path):
    write_cifar10(tmp_path)
    marker = tmp_path / "pwned"
    payload = pickle.dumps({b"data": _Exploit(marker), b"labels": [0]}, protocol=2)
    assert b"system" in payload  # the payload really names os.system
    (tmp_path / "cifar-10-batches-py/data_batch_1").write_bytes(payload)
    with pytest.raises(DatasetFormatError, match=r"data_batch_1: refusing to load global \w+\.system"):
        load_dataset("cifar10", tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda b: b.update({b"labels": [0, 1, 10]}), r"labels out of range: found 10, expected 0\.\.9"),
        (lambda b: b.update({b"data": b[b"data"][:, :3000]}), r"expected uint8 \(N, 3072\)"),
        (lambda b: b.update({b"data": b[b"data"].astype(np.int16)}), r"int16 .*expected uint8"),
        (lambda b: b.update({b"labels": [0, 1]}), "expected 3 integer labels"),
        (lambda b: b.pop(b"data"), r"no b'data' entry"),
    ],
)
def test_cifar_bad_batch_contents(tmp_path, edit, message):
    write_cifar10(tmp_path)
    batch = cifar_batch(3, 7)
    edit(batch)
    (tmp_path / "cifar-10-batches-py/data_batch_4").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DatasetFormatError, match=message) as info:
        load_dataset("cifar10", tmp_path)
    assert "data_batch_4" in str(info.value)


# ---------------------------------------------------------------------------------------------
# digits (bundled) and registry
# ---------------------------------------------------------------------------------------------


def test_digits_split_is_disjoint_stratified_and_stable():
    train, test = load_dataset("digits"), load_dataset("digits", split="test")
    assert len(train) + len(test) == 1797 and train.images.shape[1:] == (1, 8, 8)
    assert int(train.images.max()) == 255 and train.images.dtype == torch.uint8
    from sklearn.datasets import load_digits

    reference = load_digits()  # what the bundled file is read to, without importing scikit-learn
    images, labels = digits_arrays()
    assert np.array_equal(images, reference.images) and np.array_equal(labels, reference.target)
    assert images.dtype == labels.dtype == np.int64 and images.shape == (1797, 8, 8)
    tr, te = digits_split_indices(labels, "train"), digits_split_indices(labels, "test")
    assert not set(tr) & set(te) and len(set(tr) | set(te)) == 1797
    assert test.class_counts().tolist() == [round(0.2 * c) for c in np.bincount(labels)]
    again = load_dataset("digits", split="test")
    assert torch.equal(again.images, test.images) and torch.equal(again.labels, test.labels)
    assert test.mean == train.mean


def test_digits_are_read_from_the_bundled_file_without_importing_sklearn_and_else_through_it(monkeypatch):
    import structinit.data.digits as digits

    fast = digits_arrays()
    with monkeypatch.context() as m:  # the bundled file is found and read: scikit-learn is never asked
        m.setattr(digits, "require", lambda *a: pytest.fail("digits_arrays imported scikit-learn"))
        assert all(np.array_equal(a, b) for a, b in zip(digits_arrays(), fast))
    monkeypatch.setattr(digits.importlib.util, "find_spec", lambda name: None)  # a layout it does not know
    assert all(np.array_equal(a, b) for a, b in zip(digits_arrays(), fast))


def test_load_dataset_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="dataset 'imagenet21k' is not supported; expected one of cifar10, cifar100, "
                                         "svhn, mnist, fashion_mnist, imagefolder, digits"):
        load_dataset("imagenet21k")
    with pytest.raises(ValueError, match="split='val'"):
        load_dataset("digits", split="val")
    with pytest.raises(TypeError, match=r"unexpected option.*size"):
        load_dataset("mnist", tmp_path, size=(8, 8))
    with pytest.raises(ValueError, match="root is required"):
        load_dataset("imagefolder")


def test_a_registered_dataset_loads_through_load_dataset(tmp_path):
    from structinit.data import DATASET_LOADERS, DATASETS, DatasetLoader

    assert DATASETS == ("cifar10", "cifar100", "svhn", "mnist", "fashion_mnist", "imagefolder", "digits")
    tiny = ArrayDataset(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([0, 1]), ["a", "b"], "tiny",
                        (0.5,), (0.25,))
    seen = []
    DATASET_LOADERS.register("tiny", DatasetLoader(lambda root, split, flip=False: seen.append((root, split, flip))
                                                   or tiny, frozenset({"flip"})))
    try:
        assert load_dataset("tiny", tmp_path, "test", flip=True) is tiny and seen == [(tmp_path, "test", True)]
        with pytest.raises(TypeError, match=r"load_dataset\('tiny'\): unexpected option\(s\) size; allowed: flip"):
            load_dataset("tiny", tmp_path, size=3)
    finally:
        DATASET_LOADERS.remove("tiny")
    with pytest.raises(ValueError, match="dataset 'tiny' is not supported"):
        load_dataset("tiny", tmp_path)


@pytest.mark.parametrize("split", ["val", "TRAIN", None, ["train"]])
def test_every_loader_checks_the_split_the_same_way(tmp_path, split):
    from structinit.data.cifar import CIFAR10, load_cifar
    from structinit.data.digits import load_digits
    from structinit.data.idx import load_idx_dataset
    from structinit.data.imagefolder import load_image_folder
    from structinit.data.svhn import load_svhn

    # checked before any file is looked for: tmp_path holds none of these datasets
    for load in (lambda: load_cifar(tmp_path, CIFAR10, split), lambda: load_svhn(tmp_path, split),
                 lambda: load_idx_dataset(tmp_path, "mnist", split), lambda: load_image_folder(tmp_path, split),
                 lambda: load_digits(split), lambda: load_dataset("cifar10", tmp_path, split)):
        with pytest.raises(ValueError, match=re.escape(f"split={split!r}: expected 'train' or 'test'")):
            load()


# ---------------------------------------------------------------------------------------------
# the real files beside the project (skipped where absent)
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not (SHARED / "cifar-10-batches-py").is_dir(), reason="shared CIFAR-10 copy absent")
def test_real_cifar10():
    ds = load_dataset("cifar10", SHARED)
    assert ds.images.shape == (50000, 3, 32, 32) and ds.class_counts().tolist() == [5000] * 10
    mean, std = channel_stats(ds.images)
    assert mean == pytest.approx(DATASET_STATS["cifar10"][0], abs=1e-4)
    assert std == pytest.approx(DATASET_STATS["cifar10"][1], abs=1e-4)
    assert len(load_dataset("cifar10", SHARED / "cifar-10-batches-py", split="test")) == 10000
