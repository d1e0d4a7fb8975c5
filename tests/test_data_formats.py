"""MNIST / Fashion-MNIST (IDX), SVHN (.mat) and ImageFolder loaders: files written here in the
official formats round-trip exactly; truncated or malformed files fail naming the file."""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch
from PIL import Image

from structinit.data import DATASET_STATS, DatasetFormatError, DatasetNotFoundError, channel_stats, load_dataset

SHARED = Path(__file__).resolve().parents[2] / "shared/datasets"


def idx_bytes(array, magic):
    return struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_mnist(folder, n=5, split="train", gz=True, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, n, dtype=np.uint8)
    prefix = "train" if split == "train" else "t10k"
    folder.mkdir(parents=True, exist_ok=True)
    for stem, blob in ((f"{prefix}-images-idx3-ubyte", idx_bytes(images, 2051)),
                       (f"{prefix}-labels-idx1-ubyte", idx_bytes(labels, 2049))):  # fmt: skip
        if gz:
            (folder / f"{stem}.gz").write_bytes(gzip.compress(blob))
        else:
            (folder / stem).write_bytes(blob)
    return images, labels


# ---------------------------------------------------------------------------------------------
# MNIST / Fashion-MNIST
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_idx_round_trip(tmp_path, gz):
    images, labels = write_mnist(tmp_path / "mnist", gz=gz)
    test_images, _ = write_mnist(tmp_path / "mnist", n=3, split="test", gz=gz, seed=1)
    ds = load_dataset("mnist", tmp_path)
    assert ds.images.shape == (5, 1, 28, 28) and ds.images.dtype == torch.uint8
    assert np.array_equal(ds.images[:, 0].numpy(), images) and ds.labels.tolist() == labels.tolist()
    assert ds.classes == [str(i) for i in range(10)] and ds.mean == (0.1307,)
    test = load_dataset("mnist", tmp_path / "mnist", split="test")  # the folder itself works too
    assert np.array_equal(test.images[:, 0].numpy(), test_images)


def test_fashion_mnist_classes(tmp_path):
    write_mnist(tmp_path / "fashion-mnist")
    ds = load_dataset("fashion_mnist", tmp_path)
    assert ds.classes[0] == "T-shirt/top" and ds.classes[9] == "Ankle boot" and ds.name == "fashion_mnist"
    assert ds.std == (0.3530,)


def test_idx_truncated_and_wrong_magic(tmp_path):
    folder = tmp_path / "mnist"
    write_mnist(folder, gz=False)
    images = folder / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-20])
    message = r"expected 5×28×28 = 3920 bytes of pixels after the header, found 3900"
    with pytest.raises(DatasetFormatError, match=message):
        load_dataset("mnist", tmp_path)
    images.write_bytes((folder / "train-labels-idx1-ubyte").read_bytes())
    with pytest.raises(DatasetFormatError, match="train-images-idx3-ubyte: IDX magic number is 2049, expected 2051"):
        load_dataset("mnist", tmp_path)


def test_idx_truncated_gzip_and_count_mismatch(tmp_path):
    folder = tmp_path / "mnist"
    write_mnist(folder)
    gz = folder / "train-images-idx3-ubyte.gz"
    gz.write_bytes(gz.read_bytes()[:-30])
    with pytest.raises(DatasetFormatError, match=r"train-images-idx3-ubyte\.gz: the gzip stream is truncated"):
        load_dataset("mnist", tmp_path)
    write_mnist(tmp_path / "other", n=4)
    (tmp_path / "other/train-labels-idx1-ubyte.gz").replace(folder / "train-labels-idx1-ubyte.gz")
    write_mnist(tmp_path / "again")
    (tmp_path / "again/train-images-idx3-ubyte.gz").replace(gz)
    with pytest.raises(DatasetFormatError, match=r"4 labels but .* has 5 images"):
        load_dataset("mnist", tmp_path)


def test_idx_missing(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"train-images-idx3-ubyte\[\.gz\] .*download"):
        load_dataset("mnist", tmp_path)
    write_mnist(tmp_path / "mnist")
    (tmp_path / "mnist/train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte"):
        load_dataset("mnist", tmp_path)


# ---------------------------------------------------------------------------------------------
# SVHN
# ---------------------------------------------------------------------------------------------


def test_svhn_mat_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (32, 32, 3, 4), dtype=np.uint8)
    y = np.array([[10], [1], [9], [10]], dtype=np.uint8)
    scipy.io.savemat(tmp_path / "train_32x32.mat", {"X": x, "y": y})
    ds = load_dataset("svhn", tmp_path)
    assert ds.images.shape == (4, 3, 32, 32) and ds.labels.tolist() == [0, 1, 9, 0]
    assert ds.images[2, 1, 5, 7] == x[5, 7, 1, 2]  # X is (H, W, C, N)
    assert np.array_equal(ds.images[3].numpy(), x[..., 3].transpose(2, 0, 1))
    assert ds.classes == [str(i) for i in range(10)] and ds.mean == DATASET_STATS["svhn"][0]


def test_svhn_errors(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"test_32x32\.mat not found"):
        load_dataset("svhn", tmp_path, split="test")
    path = tmp_path / "svhn/train_32x32.mat"
    path.parent.mkdir()
    x = np.zeros((32, 32, 3, 2), dtype=np.uint8)
    scipy.io.savemat(path, {"X": x, "y": np.array([[11], [1]], dtype=np.uint8)})
    with pytest.raises(DatasetFormatError, match=r"train_32x32.mat: labels out of range: found 11, expected 1\.\.10"):
        load_dataset("svhn", tmp_path)
    scipy.io.savemat(path, {"X": x[:16], "y": np.array([[1], [1]], dtype=np.uint8)})
    with pytest.raises(DatasetFormatError, match=r"X is a uint8 array of shape \(16, 32, 3, 2\)"):
        load_dataset("svhn", tmp_path)
    path.write_bytes(b"MATLAB 5.0 MAT-file" + bytes(50))
    with pytest.raises(DatasetFormatError, match=r"train_32x32\.mat"):
        load_dataset("svhn", tmp_path)


# ---------------------------------------------------------------------------------------------
# ImageFolder
# ---------------------------------------------------------------------------------------------


def write_png(path, array):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def test_image_folder_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {}
    for split in ("train", "test"):
        for cls in ("zebra", "ant"):
            for i in range(2):
                a = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
                arrays[split, cls, i] = a
                write_png(tmp_path / split / cls / f"{i}.png", a)
    (tmp_path / "train/ant/notes.txt").write_text("not an image")  # ignored
    ds = load_dataset("imagefolder", tmp_path)
    assert ds.classes == ["ant", "zebra"] and ds.labels.tolist() == [0, 0, 1, 1]
    assert ds.images.shape == (4, 3, 6, 5)
    assert np.array_equal(ds.images[2].numpy(), arrays["train", "zebra", 0].transpose(2, 0, 1))
    assert ds.mean == pytest.approx(channel_stats(ds.images)[0])
    test = load_dataset("imagefolder", tmp_path, split="test")
    assert np.array_equal(test.images[1].numpy(), arrays["test", "ant", 1].transpose(2, 0, 1))
    assert test.mean == ds.mean  # test split normalised with training statistics


def test_image_folder_grayscale_resize_and_errors(tmp_path):
    write_png(tmp_path / "a/0.png", np.full((4, 4), 7, dtype=np.uint8))
    write_png(tmp_path / "b/0.png", np.full((8, 6), 9, dtype=np.uint8))
    with pytest.raises(DatasetFormatError, match=r"b/0.png: image is 8×6 .*pass size="):
        load_dataset("imagefolder", tmp_path)
    ds = load_dataset("imagefolder", tmp_path, size=(4, 4))
    assert ds.images.shape == (2, 1, 4, 4) and ds.images[1].unique().tolist() == [9]
    with pytest.raises(DatasetNotFoundError, match="no test/"):
        load_dataset("imagefolder", tmp_path, split="test")
    (tmp_path / "b/1.png").write_bytes(b"not a png")
    with pytest.raises(DatasetFormatError, match=r"b/1.png: cannot be read as an image"):
        load_dataset("imagefolder", tmp_path, size=(4, 4))
    (tmp_path / "b/1.png").unlink()
    (tmp_path / "c").mkdir()
    with pytest.raises(DatasetFormatError, match="c: empty class folder"):
        load_dataset("imagefolder", tmp_path, size=(4, 4))
    write_png(tmp_path / "flat/0.png", np.zeros((4, 4), dtype=np.uint8))
    with pytest.raises(DatasetFormatError, match="flat: no class folders"):
        load_dataset("imagefolder", tmp_path / "flat")


@pytest.mark.skipif(not (SHARED / "mnist").is_dir(), reason="shared MNIST copy absent")
def test_real_mnist():
    ds = load_dataset("mnist", SHARED)
    assert ds.images.shape == (60000, 1, 28, 28) and len(load_dataset("mnist", SHARED, split="test")) == 10000
    mean, std = channel_stats(ds.images)
    assert mean[0] == pytest.approx(0.1307, abs=1e-4) and std[0] == pytest.approx(0.3081, abs=1e-4)


@pytest.mark.parametrize("gz", [True, False])
def test_a_label_file_is_known_by_its_content_not_its_name(tmp_path, monkeypatch, gz):
    # MNIST and Fashion-MNIST share their file names. A label file whose content is a known
    # official one (here a stand-in registered as MNIST's train labels) is refused as the other
    # dataset or the other split, named; as itself, or as an unknown file, it loads.
    import hashlib

    from structinit.data import idx

    _, labels = write_mnist(tmp_path / "data", gz=gz)
    official = hashlib.md5(idx_bytes(labels, 2049)).hexdigest()  # the content, whatever the gzip around it
    monkeypatch.setitem(idx.KNOWN_LABELS, official, ("mnist", "train"))
    assert load_dataset("mnist", tmp_path / "data").labels.tolist() == labels.tolist()
    name = "train-labels-idx1-ubyte" + (".gz" if gz else "")
    with pytest.raises(DatasetFormatError, match=rf"{name}: these are MNIST's train labels \(the official file\), "
                                                 "and Fashion-MNIST train was asked for"):
        load_dataset("fashion_mnist", tmp_path / "data")
    for f in (tmp_path / "data").iterdir():  # the same files as the test split
        f.rename(f.with_name(f.name.replace("train", "t10k")))
    with pytest.raises(DatasetFormatError, match=r"these are MNIST's train labels .* MNIST test was asked for"):
        load_dataset("mnist", tmp_path / "data", split="test")
    monkeypatch.delitem(idx.KNOWN_LABELS, official)
    assert len(load_dataset("fashion_mnist", tmp_path / "data", split="test")) == 5  # unknown: not judged


@pytest.mark.skipif(not (SHARED / "mnist").is_dir(), reason="the shared MNIST copy is not on this machine")
def test_the_official_mnist_labels_are_known():
    from structinit.data import idx

    for split, stem in (("train", "train"), ("test", "t10k")):
        path = SHARED / "mnist" / f"{stem}-labels-idx1-ubyte.gz"
        labels = idx.read_idx(path, idx.LABELS_MAGIC, (None,), "labels")
        idx.check_known_labels(path, labels, "mnist", split)  # itself: passes
        with pytest.raises(DatasetFormatError, match=f"these are MNIST's {split} labels"):
            idx.check_known_labels(path, labels, "fashion_mnist", split)
        path = SHARED / "mnist" / f"{stem}-images-idx3-ubyte.gz"  # the images by their published md5 too
        images = idx.read_idx(path, idx.IMAGES_MAGIC, (None, 28, 28), "pixels")
        assert idx.check_known_images(path, images, "mnist", split)
        with pytest.raises(DatasetFormatError, match=f"these are MNIST's {split} images"):
            idx.check_known_images(path, images, "fashion_mnist", split)
