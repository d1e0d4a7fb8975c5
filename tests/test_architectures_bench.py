"""bench/architectures.py: the side-by-side tables read each architecture's own run folders,
and every gain is a difference of the same seed's runs."""

from __future__ import annotations

import json

import pytest
from architectures import (
    collect,
    format_accuracy,
    format_cost,
    format_gains,
    gain_rows,
    parse_runs,
    plot_gains,
    run_cost,
)

from structinit.harness.summary import seed_accuracies


def _write_run(root, init, seed, acc, wall_s=600.0, threads=1, model="vit_cpu_patch4_32"):
    folder = root / init / f"seed{seed}"
    folder.mkdir(parents=True)
    result = {"final": {"holdout_acc": acc, "train_loss": 1.0}, "wall_s": wall_s, "device": {"threads": threads},
              "config": {"model": model, "model_kwargs": {}}}
    (folder / "result.json").write_text(json.dumps(result))


@pytest.fixture
def folders(tmp_path):
    swin, mixer = tmp_path / "swin", tmp_path / "mixer"
    # swin: impulse beats pytorch by 3 and 1 points on seeds 0 and 1 (seed 2 of impulse still training)
    for seed, acc in enumerate((0.50, 0.52, 0.55)):
        _write_run(swin, "pytorch", seed, acc, model="swin_cpu_patch2_32")
    for seed, acc in enumerate((0.53, 0.53)):
        _write_run(swin, "impulse", seed, acc, model="swin_cpu_patch2_32")
    (swin / "impulse" / "seed2").mkdir()  # a run in progress: a folder with no result.json yet
    _write_run(swin, "mimetic", 1, 0.56, model="swin_cpu_patch2_32")
    # mixer: one seed of two inits; pytorch ran on two threads
    _write_run(mixer, "pytorch", 0, 0.40, wall_s=300.0, threads=2, model="mixer_cpu_patch4_32")
    _write_run(mixer, "impulse", 0, 0.38, wall_s=900.0, model="mixer_cpu_patch4_32")
    return {"swin": (swin,), "mixer": (mixer,)}


def test_accuracies_are_read_per_seed_and_runs_in_progress_left_out(folders):
    table = collect(folders)
    assert table["swin"] == {"pytorch": {0: 0.50, 1: 0.52, 2: 0.55}, "impulse": {0: 0.53, 1: 0.53},
                             "mimetic": {1: 0.56}}
    text = format_accuracy(table)
    assert "| impulse | 53.00 ± 0.00 (53.00, 53.00) | 38.00 (38.00) |" in text
    assert "| timm | not run | not run |" in text
    assert text.splitlines()[0] == "| init | swin: acc % (per seed) | mixer: acc % (per seed) |"


def test_gains_pair_the_same_seed(folders):
    text = format_gains(collect(folders))
    # seeds 0 and 1 only: +3 and +1 points (mean 2, std √2); seed 2's pytorch run has no partner
    assert "| impulse − pytorch | 2.00 ± 1.41 (+3.00, +1.00) | -2.00 (-2.00) |" in text
    assert "| mimetic − pytorch | 4.00 (+4.00) | – |" in text  # seed 1: 0.56 − 0.52
    assert "| impulse − mimetic | -3.00 (-3.00) | – |" in text
    assert gain_rows(("pytorch", "impulse")) == [("impulse", "pytorch")]
    assert gain_rows() == [("mimetic", "pytorch"), ("impulse", "pytorch"), ("mimetic", "timm"), ("impulse", "timm"),
                           ("timm", "pytorch"), ("impulse", "mimetic")]


def test_cost_counts_threads_and_builds_the_runs_model(folders):
    cost = run_cost(folders["mixer"])
    assert cost["runs"] == 2 and cost["minutes"] == pytest.approx(10.0)
    assert cost["core_hours"] == pytest.approx((300 * 2 + 900) / 3600)
    from structinit.models import create_model

    params = sum(p.numel() for p in create_model("mixer_cpu_patch4_32", num_classes=10).parameters())
    assert f"| mixer | `mixer_cpu_patch4_32` | {params:,} | 2 | 10.0 | 0.42 |" in format_cost(folders)


def test_bad_folders_are_named(tmp_path):
    with pytest.raises(ValueError, match="NAME=FOLDER"):
        parse_runs(["runs/cpu-cifar-swin"])
    with pytest.raises(FileNotFoundError, match=r"nowhere.*structinit compare --recipe cpu-cifar --model MODEL --out"):
        parse_runs([f"swin={tmp_path / 'nowhere'}"])
    with pytest.raises(FileNotFoundError, match="no such folder"):
        seed_accuracies(tmp_path / "nowhere")
    assert parse_runs([f"swin={tmp_path}"]) == {"swin": (tmp_path,)}
    (tmp_path / "b").mkdir()
    assert parse_runs([f"s={tmp_path / 'b'}+{tmp_path}"]) == {"s": (tmp_path / "b", tmp_path)}
    with pytest.raises(FileNotFoundError, match="nowhere is not a folder"):
        parse_runs([f"s={tmp_path}+{tmp_path / 'nowhere'}"])


def test_a_column_takes_each_init_from_the_first_folder_that_has_it(folders, tmp_path):
    """A Swin built another way trains mimetic and impulse only; its baselines come from the
    default Swin's folder, and a second folder never overrides the first's init."""
    other = tmp_path / "swin-pytorch-rest"
    _write_run(other, "impulse", 0, 0.60, wall_s=1200.0)
    _write_run(other, "impulse", 1, 0.58, wall_s=1200.0)
    table = collect({"swin-pt": (other, folders["swin"][0])})
    assert table["swin-pt"]["impulse"] == {0: 0.60, 1: 0.58}  # not the default Swin's 0.53s
    assert table["swin-pt"]["pytorch"] == {0: 0.50, 1: 0.52, 2: 0.55} and table["swin-pt"]["mimetic"] == {1: 0.56}
    assert "| impulse − pytorch | 8.00 ± 2.83 (+10.00, +6.00) |" in format_gains(table)
    cost = run_cost((other, folders["swin"][0]))
    assert cost["runs"] == 2 + 3 + 1  # its own impulse runs, the other folder's pytorch and mimetic
    assert cost["minutes"] == pytest.approx((2 * 1200 + 4 * 600) / 6 / 60)
    # beside the default Swin's own column, the joined column pays only for its own runs
    text = format_cost({"swin": folders["swin"], "swin-pt": (other, folders["swin"][0])})
    assert "| swin | `swin_cpu_patch2_32` |" in text and "| 6 | 10.0 | 1.00 |" in text  # 3 + 2 + 1 runs of 600 s
    from structinit.models import create_model

    params = sum(p.numel() for p in create_model("vit_cpu_patch4_32", num_classes=10).parameters())
    assert f"| swin-pt | `vit_cpu_patch4_32` | {params:,} | 2 | 20.0 | 0.67 |" in text  # its two impulse runs


def test_a_summary_json_stands_in_for_a_folder(folders, tmp_path):
    summary = {"pytorch": {"accs": [0.50, 0.60], "seeds": [0, 2], "mean": 0.55},
               "impulse": {"accs": [0.56, 0.61], "seeds": [0, 2]}}
    path = tmp_path / "vit-summary.json"
    path.write_text(json.dumps(summary))
    table = collect({"vit": (path,), **folders})
    assert table["vit"] == {"impulse": {0: 0.56, 2: 0.61}, "pytorch": {0: 0.50, 2: 0.60}}
    assert "| impulse − pytorch | 3.50 ± 3.54 (+6.00, +1.00) | 2.00 ± 1.41" in format_gains(table)
    assert "| vit |" not in format_cost({"vit": (path,), **folders})  # no per-run record to cost
    (tmp_path / "bad.json").write_text(json.dumps({"pytorch": {"accs": [0.5], "seeds": [0, 1]}}))
    with pytest.raises(ValueError, match=r"bad\.json: not a comparison's summary\.json"):
        collect({"vit": (tmp_path / "bad.json",)})
    with pytest.raises(FileNotFoundError, match="no file"):
        parse_runs([f"vit={tmp_path / 'missing.json'}"])


def test_the_figure_draws_the_paired_gains(folders, tmp_path, monkeypatch):
    import matplotlib.axes

    bars = []
    original = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda ax, x, h, **kw: bars.append((kw["label"], list(h)))
                        or original(ax, x, h, **kw))
    path = plot_gains(collect(folders), tmp_path / "gain.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    heights = dict(bars)
    assert heights["impulse"] == pytest.approx([2.0, -2.0])  # swin: +3, +1 paired; mixer: −2
    assert heights["mimetic"] == pytest.approx([4.0])  # only swin has mimetic
    assert "timm" not in heights  # not run anywhere: no bar, no legend entry


@pytest.mark.parametrize("kwargs, message", [
    ("[1]", "--set 'model_kwargs=[1]': expected a dict"),
    ("{x", "--set 'model_kwargs={x': expected a dict"),
    ('{"weight_init": "jax"}', "--model: weight_init='jax': expected 'timm'"),
])
def test_the_pages_compare_names_bad_model_kwargs_before_training(tmp_path, capsys, kwargs, message):
    # the command docs/results/architectures.md trains each column with
    from test_data import write_cifar10

    from structinit.harness.cli.main import main

    write_cifar10(tmp_path / "data")
    argv = ["compare", "--recipe", "cpu-cifar", "--precision", "fp32", "--data-dir", str(tmp_path / "data"),
            "--model", "swin_cpu_patch2_32", "--set", f"model_kwargs={kwargs}", "--out", str(tmp_path / "runs")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("result.json"))


def test_the_pages_tables_are_rebuilt_from_the_committed_per_seed_data():
    """docs/results/architectures.md's accuracy and gain tables are what the command printed
    beside them makes of the per-seed JSON in docs/results/data, row for row."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    data = root / "docs" / "results" / "data"
    swin, rest = data / "cpu-cifar-swin.json", data / "cpu-cifar-swin-pytorch-rest.json"
    folders = parse_runs([f"vit={data / 'cpu-cifar-vit.json'}", f"swin={swin}", f"swin, PyTorch rest={rest}+{swin}",
                          f"mixer={data / 'cpu-cifar-mixer.json'}"])
    inits = ("mimetic", "impulse", "pytorch", "timm")
    table = collect(folders, inits)
    page = (root / "docs" / "results" / "architectures.md").read_text().splitlines()
    for printed in (format_accuracy(table, inits), format_gains(table, inits)):
        rows = [r for r in printed.splitlines() if r.startswith("| ")]
        assert len(rows) > 3 and all(r in page for r in rows), [r for r in rows if r not in page]
