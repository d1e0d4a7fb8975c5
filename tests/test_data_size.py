"""bench/data_size.py: every size gets the same optimiser budget, the study resumes, and the
table's gains are the per-seed differences of the runs' own held-out accuracies."""

from __future__ import annotations

import json

import pytest
from data_size import Study, collect, format_by_size, format_trends, plot, report, run_config, run_study

from structinit.harness.summary import paired_gains

DIGITS = Study("digits", (50, 100), {"holdout": 200, "augment": "none"}, recipe="digits")


def test_every_size_gets_the_same_steps_and_warm_up():
    configs = [run_config(DIGITS, size, 8, None, batch=25) for size in DIGITS.sizes]
    steps = [c.epochs * (c.train_size // c.batch_size) for c in configs]
    warmup = [c.warmup_epochs * (c.train_size // c.batch_size) for c in configs]
    assert steps == [8, 8] and warmup == pytest.approx([0.8, 0.8])
    assert all(c.eval_every == c.epochs and c.precision == "fp32" for c in configs)  # one evaluation, at the end
    with pytest.raises(ValueError, match="divide"):
        run_config(DIGITS, 60, 8, None, batch=25)  # 2.4 batches an epoch
    with pytest.raises(ValueError, match="divide"):
        run_config(DIGITS, 75, 8, None, batch=25)  # 8 steps are not whole epochs of 3


def test_the_study_runs_resumes_and_reports(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn = []
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *a, **kw: drawn.append((ax, a, kw))
                        or original(ax, *a, **kw))
    inits, studies, out = ["pytorch", "impulse"], {"digits": DIGITS}, tmp_path / "runs"
    run_study(studies, inits, [0, 1], 8, out, None, batch=25)
    results = sorted(out.glob("digits-*/*/seed*/result.json"))
    assert len(results) == 8 and all(json.loads(p.read_text())["history"][-1]["step"] == 8 for p in results)
    stamps = {p: p.stat().st_mtime_ns for p in results}
    run_study(studies, inits, [0, 1], 8, out, None, batch=25)  # finished runs are reused, not retrained
    assert {p: p.stat().st_mtime_ns for p in results} == stamps

    table = collect(studies, inits, out)
    acc = {(p.parts[-4], p.parts[-3], p.parts[-2]): json.loads(p.read_text())["final"]["holdout_acc"] for p in results}
    for size in DIGITS.sizes:
        by_init = table["digits"][size]
        assert paired_gains(by_init, "impulse") == [acc[(f"digits-{size}", "impulse", f"seed{s}")]
                                             - acc[(f"digits-{size}", "pytorch", f"seed{s}")] for s in (0, 1)]
    text = report(studies, inits, out, tmp_path / "figures")
    assert text.count("| digits |") == 2 + 4 and "s0: " in text and "s1: " in text  # by size, then per init
    finals = [json.loads(p.read_text()) for p in results]
    loss = sum(r["final"]["train_loss"] for r in finals if r["config"]["train_size"] == 50
               and r["config"]["init"] == "impulse") / 2
    row = next(line for line in text.splitlines() if line.startswith("| digits | 50 | impulse |"))
    assert f"| {loss:.3f} | s0: " in row  # the mean final train loss over the two seeds
    hours = sum(r["wall_s"] * r["device"]["threads"] for r in finals) / 3600
    assert f"8 runs finished; their training took {hours:.1f} CPU core-hours" in text
    for name in ("data_size_accuracy", "data_size_gain", "data_size_loss"):
        assert (tmp_path / "figures" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the loss figure: at size 100, impulse's curve is the mean over both seeds of their per-epoch losses
    histories = [r["history"] for r in finals if r["config"]["train_size"] == 100 and r["config"]["init"] == "impulse"]
    curve = next(a for ax, a, kw in drawn
                 if ax.get_title() == "digits, 100 images" and kw.get("label") == "impulse (2)")
    assert list(curve[0]) == [h["step"] for h in histories[0]] == [4, 8]  # 100 images, batch 25: 2 epochs of 4 steps
    assert list(curve[1]) == pytest.approx([(a["train_loss"] + b["train_loss"]) / 2 for a, b in zip(*histories)])
    assert json.loads((out / "data_size.json").read_text())["digits"]["50"]["impulse"]["0"] == table["digits"][50][
        "impulse"][0]


def test_trends_pair_every_difference_by_seed():
    table = {"digits": {
        50: {"pytorch": {0: 0.50, 1: 0.60}, "mimetic": {0: 0.55, 1: 0.62}, "impulse": {0: 0.58, 1: 0.61}},
        100: {"pytorch": {0: 0.70, 1: 0.72}, "mimetic": {0: 0.71, 1: 0.76}, "impulse": {0: 0.71}}}}
    text = format_trends({"digits": DIGITS}, ["pytorch", "mimetic", "impulse"], table)
    rows = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ")[1:] for line in text.splitlines()
            if line.startswith("| ") and "−" in line.split(" | ")[0]}
    # mimetic gains: size 50 → 5, 2 points (mean 3.50, std 2.12); size 100 → 1, 4 (2.50 ± 2.12);
    # per seed largest − smallest: −4, +2 → −1.00 ± 4.24
    assert rows["mimetic − pytorch"] == ["3.50 ± 2.12", "2.50 ± 2.12", "-1.00 ± 4.24"]
    # impulse ran only seed 0 at size 100: that cell and the change use seed 0 alone (8 → 1: −7)
    assert rows["impulse − pytorch"] == ["4.50 ± 4.95", "1.00", "-7.00"]
    assert rows["impulse − mimetic"] == ["1.00 ± 2.83", "0.00", "-3.00"]
    assert format_trends({"digits": DIGITS}, ["pytorch", "impulse"], {}).count("| –") == 3  # nothing run yet


def test_the_gain_figure_names_an_init_below_its_axis(tmp_path, monkeypatch):
    import matplotlib.axes

    notes = []
    original = matplotlib.axes.Axes.text
    monkeypatch.setattr(matplotlib.axes.Axes, "text", lambda ax, x, y, s, **kw: notes.append(s) or original(
        ax, x, y, s, **kw))
    table = {"digits": {50: {"pytorch": {0: 0.90}, "timm": {0: 0.70}, "impulse": {0: 0.93}},
                        100: {"pytorch": {0: 0.91}, "timm": {0: 0.66}, "impulse": {0: 0.95}}}}
    paths = plot({"digits": DIGITS}, ["pytorch", "timm", "impulse"], table, tmp_path)
    assert [p.name for p in paths] == ["data_size_accuracy.png", "data_size_gain.png"]
    assert notes == ["below the axis: timm: -20.0 to -25.0"]  # impulse (+3, +4) stays on the axis


def test_by_size_table_has_a_column_per_init():
    table = {"digits": {50: {"pytorch": {0: 0.50, 1: 0.60}, "impulse": {0: 0.58}}, 100: {}}}
    text = format_by_size({"digits": DIGITS}, ["pytorch", "impulse"], table)
    assert text.splitlines()[0] == "| dataset | images | pytorch | impulse |"
    assert "| digits | 50 | 55.00 ± 7.07 | 58.00 |" in text  # mean of 0.50, 0.60; std 0.0707
    assert "| digits | 100 | – | – |" in text  # nothing finished at that size yet


def test_the_pages_tables_are_rebuilt_from_the_committed_study():
    """docs/results/data-size.md's tables are what --from makes of docs/results/data/data-size.json,
    row for row: 144 runs, per seed."""
    from pathlib import Path

    from data_size import STUDIES, load_report_data, report_from

    root = Path(__file__).resolve().parents[1]
    saved = root / "docs" / "results" / "data" / "data-size.json"
    table, _ = load_report_data(saved)
    assert sum(len(seeds) for by_size in table.values() for by_init in by_size.values()
               for seeds in by_init.values()) == 144
    rows = [r for r in report_from(STUDIES, ["pytorch", "timm", "mimetic", "impulse"], saved).splitlines()
            if r.startswith("| ")]
    page = (root / "docs" / "results" / "data-size.md").read_text().splitlines()
    assert len(rows) > 70 and [r for r in rows if r not in page] == []
