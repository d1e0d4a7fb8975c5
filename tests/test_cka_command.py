"""`structinit cka` between two finished runs, and the CKA heat map."""

import json

import pytest
import torch

import structinit
from structinit.harness.cli.main import main
from structinit.harness.recipes import recipe
from structinit.harness.tasks import train

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cka")
    out = []
    for init in ("impulse", "pytorch"):
        path = root / init / "seed0"
        train(recipe("digits", out_dir=str(path), epochs=1, train_size=128, init=init), progress=False)
        out.append(path)
    return out


def test_cka_between_runs_and_of_a_run_with_itself(two_runs, tmp_path, capsys):
    a, b = two_runs
    assert main(["cka", str(a), str(b), "--images", "64", "--batch-size", "16", "--out", str(tmp_path / "ab")]) == 0
    saved = json.loads((tmp_path / "ab" / "cka.json").read_text())
    matrix = torch.tensor(saved["matrix"])
    assert matrix.shape == (4, 4) and saved["labels"] == ["impulse seed 0", "pytorch seed 0"]
    assert bool(((matrix > -0.1) & (matrix <= 1 + 1e-9)).all())
    assert (tmp_path / "ab" / "cka.png").stat().st_size > 0
    assert "linear CKA after training" in capsys.readouterr().out
    assert main(["cka", str(a), str(a), "--images", "64", "--batch-size", "16", "--out", str(tmp_path / "aa")]) == 0
    same = torch.tensor(json.loads((tmp_path / "aa" / "cka.json").read_text())["matrix"])
    torch.testing.assert_close(torch.diagonal(same), torch.ones(4, dtype=same.dtype))


def test_cka_errors_are_one_line(two_runs, tmp_path, capsys):
    assert main(["cka", str(two_runs[0]), str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "has no result.json" in capsys.readouterr().err
    assert main(["cka", *map(str, two_runs), "--batch-size", "2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "batch" in err


def test_cka_figure_writes_values_and_rejects_bad_shapes(tmp_path):
    fig = structinit.cka_figure(torch.tensor([[1.0, 0.5], [0.25, float("nan")]]), label_a="A", label_b="B",
                                path=tmp_path / "c.png")
    assert [t.get_text() for t in fig.axes[0].texts] == ["1.00", "0.50", "0.25", "–"]
    with pytest.raises(ValueError, match=r"matrix has shape \(3,\)"):
        structinit.cka_figure(torch.ones(3), label_a="A", label_b="B")


def test_cka_with_fewer_than_four_images_names_images(two_runs, tmp_path, capsys):
    assert main(["cka", *map(str, two_runs), "--images", "0", "--out", str(tmp_path / "cka")]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1, line
    assert line.endswith("--images 0: CKA needs at least 4 test images (its unbiased estimator needs n > 3); pass "
                         "--images 4 or more"), line


def test_cka_of_runs_on_two_datasets_names_them(two_runs, tmp_path, capsys):
    """Not "the init's code changed", nor a shape error blamed on --batch-size: the datasets."""
    from test_data_formats import write_mnist

    write_mnist(tmp_path / "data" / "mnist", n=64)
    write_mnist(tmp_path / "data" / "mnist", n=16, split="test")
    a, b = two_runs[0], tmp_path / "mnist"
    assert main(["train", "--recipe", "digits", "--epochs", "1", "--train-size", "64", "--no-progress",
                 "--dataset", "mnist", "--data-dir", str(tmp_path / "data"),
                 "--set", 'model_kwargs={"img_size": 28, "patch_size": 7}', "--out", str(b)]) == 0
    capsys.readouterr()
    assert main(["cka", str(a), str(b), "--out", str(tmp_path / "cka")]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1, line
    assert line.endswith(f"{b} trained on mnist, {a} on digits: CKA compares two models on the same images; pass "
                         "two runs of one dataset"), line
