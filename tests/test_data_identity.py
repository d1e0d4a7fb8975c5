"""A dataset known by what its files hold: the official files, a copy with the official labels
in the official order (said in one line, and recorded by the run), another known file under
the asked-for name (refused, naming it), or files of no published copy (loaded as they are).

The registries of published sums are patched with this test's own small files: the real
datasets are not the tests' to depend on."""

from __future__ import annotations

import hashlib
import json
import pickle
import warnings

import numpy as np
import pytest
from test_data import write_cifar10

from structinit.data import identity, load_dataset
from structinit.data.datasets import DatasetFormatError
from structinit.data.identity import COPY, OFFICIAL, UNKNOWN, identify, labels_md5


def _md5(path) -> str:
    return hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()


def test_the_published_sums_are_the_official_files_and_label_sequences():
    # each file of each dataset once, and CIFAR-10's six label sequences (read from the official files)
    assert len(set(identity.OFFICIAL_FILES.values())) == len(identity.OFFICIAL_FILES) == 11
    assert {f for d, f in identity.OFFICIAL_LABELS.values() if d == "CIFAR-10"} == {
        *(f"data_batch_{i}" for i in range(1, 6)), "test_batch"}
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in [*identity.OFFICIAL_FILES, *identity.OFFICIAL_LABELS])


def test_identify_tells_official_copy_other_and_unknown(monkeypatch):
    labels = np.array([3, 1, 4, 1, 5], dtype=np.int64)
    monkeypatch.setitem(identity.OFFICIAL_FILES, "f" * 32, ("CIFAR-10", "test_batch"))
    monkeypatch.setitem(identity.OFFICIAL_LABELS, labels_md5(labels), ("CIFAR-10", "test_batch"))
    assert identify("p", "f" * 32, labels, "CIFAR-10", "test_batch") == OFFICIAL
    assert identify("p", "0" * 32, labels, "CIFAR-10", "test_batch") == COPY  # other bytes, the same labels
    assert identify("p", None, labels[::-1].copy(), "CIFAR-10", "test_batch") == UNKNOWN  # another order
    with pytest.raises(DatasetFormatError, match=r"p: this is CIFAR-10's test_batch \(by its labels, in the official "
                                                 r"order\), and CIFAR-10's data_batch_1 was asked for"):
        identify("p", None, labels, "CIFAR-10", "data_batch_1")
    with pytest.raises(DatasetFormatError, match=r"this is CIFAR-10's test_batch \(by the official file\)"):
        identify("p", "f" * 32, labels, "CIFAR-100", "test")


def test_a_copy_of_cifar10_is_loaded_said_once_and_recorded(tmp_path, monkeypatch):
    batches = write_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    for name, batch in batches.items():  # this test's files stand for the official ones
        monkeypatch.setitem(identity.OFFICIAL_LABELS, labels_md5(np.asarray(batch[b"labels"])), ("CIFAR-10", name))
    monkeypatch.setitem(identity.OFFICIAL_FILES, _md5(folder / "data_batch_1"), ("CIFAR-10", "data_batch_1"))
    # the test batch re-encoded: other pixels, the same labels in the same order (and no filenames key)
    test = batches["test_batch"]
    test[b"data"] = (test[b"data"].astype(np.int64) + 3).clip(0, 255).astype(np.uint8)
    (folder / "test_batch").write_bytes(pickle.dumps(test, protocol=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = load_dataset("cifar10", tmp_path, "test")
    assert ds.source.startswith("CIFAR-10 test: a copy of the official files (test_batch: the official labels")
    assert len(caught) == 1 and str(caught[0].message).startswith(f"{folder}: CIFAR-10 test: a copy")
    assert "\n" not in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # data_batch_1 is official, the others copies: said once, for the split
        with pytest.warns(UserWarning, match="data_batch_2, data_batch_3, data_batch_4, data_batch_5: the official"):
            train = load_dataset("cifar10", tmp_path, "train")
    assert "data_batch_1" not in train.source.split("(")[1].split(":")[0]


def test_a_known_file_under_another_name_is_refused_naming_it(tmp_path, monkeypatch):
    batches = write_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    monkeypatch.setitem(identity.OFFICIAL_FILES, _md5(folder / "data_batch_2"), ("CIFAR-10", "data_batch_2"))
    (folder / "test_batch").write_bytes((folder / "data_batch_2").read_bytes())  # a train batch in the test's place
    with pytest.raises(DatasetFormatError, match=r"test_batch: this is CIFAR-10's data_batch_2 \(by the official "
                                                 r"file\), and CIFAR-10's test_batch was asked for"):
        load_dataset("cifar10", tmp_path, "test")
    del batches


def test_files_of_no_published_copy_load_as_they_are(tmp_path):
    write_cifar10(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = load_dataset("cifar10", tmp_path, "test")
    assert ds.source == "CIFAR-10 test: files that are no published copy (test_batch)"
    assert ds.subset([0, 1]).source == ds.source


def test_a_run_records_which_copy_it_read(tmp_path):
    from structinit.harness.recipes import recipe
    from structinit.harness.tasks import train

    out = tmp_path / "run"
    write_cifar10(tmp_path / "data", sizes=(40, 40, 40, 40, 40), test_size=16)
    cfg = recipe("digits", dataset="cifar10", data_dir=str(tmp_path / "data"), model="vit_cpu_patch4_32",
                 epochs=1, batch_size=32, train_size=None, out_dir=str(out), augment="none")
    result = train(cfg, progress=False)
    recorded = json.loads((out / "result.json").read_text())["data"]
    assert recorded == result["data"] == {
        "train": "CIFAR-10 train: files that are no published copy (data_batch_1, data_batch_2, data_batch_3, "
                 "data_batch_4, data_batch_5)",
        "test": "CIFAR-10 test: files that are no published copy (test_batch)"}


def test_mnist_says_whether_its_label_file_is_the_official_one(tmp_path, monkeypatch):
    from test_data_formats import write_mnist

    from structinit.data import idx

    images, labels = write_mnist(tmp_path / "mnist", n=8, split="test")
    assert load_dataset("mnist", tmp_path, "test").source == "MNIST test: files that are no published copy"
    content = idx.struct.pack(">II", idx.LABELS_MAGIC, len(labels)) + labels.tobytes()
    official_labels = hashlib.md5(content, usedforsecurity=False).hexdigest()
    monkeypatch.setitem(idx.KNOWN_LABELS, official_labels, ("mnist", "test"))
    assert load_dataset("mnist", tmp_path, "test").source == ("MNIST test: the official label file, images that are "
                                                               "no published copy")
    pixels = idx.struct.pack(">IIII", idx.IMAGES_MAGIC, len(images), 28, 28) + images.tobytes()
    monkeypatch.setitem(idx.KNOWN_IMAGES, hashlib.md5(pixels, usedforsecurity=False).hexdigest(), ("mnist", "test"))
    assert load_dataset("mnist", tmp_path, "test").source == "MNIST test: the official files"
    monkeypatch.delitem(idx.KNOWN_LABELS, official_labels)  # the images alone tell what the folder holds
    with pytest.raises(DatasetFormatError, match=r"t10k-images-idx3-ubyte.gz: these are MNIST's test images "
                                                 r"\(the official file\), and Fashion-MNIST test was asked for"):
        load_dataset("fashion_mnist", tmp_path / "mnist", "test")
