"""bench/paper_column.py: the paper's CIFAR-10 column read from the GPU runs' metrics."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def paper_column():
    spec = importlib.util.spec_from_file_location("paper_column", ROOT / "bench" / "paper_column.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_a_row_reads_the_exact_images_with_their_error_and_the_last_whole_test(tmp_path, paper_column):
    rows = [{"epoch": 1, "images_per_s": 100.0, "test_first1017_acc": 0.5, "wall_s": 60.0},
            {"epoch": 2, "images_per_s": 300.0, "test_first1017_acc": 0.8, "test_acc": 0.7, "wall_s": 120.0},
            {"epoch": 3, "images_per_s": 500.0, "test_first1017_acc": 0.9, "wall_s": 180.0}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "runs.json").write_text(json.dumps({"runs": {"mimetic": {"metrics": "m.jsonl", "card": "X"}}}))
    table = paper_column.column(tmp_path)
    se = 100 * (0.9 * 0.1 / 1017) ** 0.5
    assert f"| `mimetic` | 3 of 200 | 90.00 ± {se:.2f} | 70.00 (epoch 2) | 91.16 | 400 | 3.0 | X |" in table


def test_at_an_epoch_each_run_reads_that_epochs_row_and_runs_short_of_it_are_named(tmp_path, paper_column):
    rows = [{"epoch": e, "images_per_s": 100.0 * e, "test_first1017_acc": e / 10, "wall_s": 60.0 * e}
            for e in (1, 2, 3)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:1]))
    (tmp_path / "runs.json").write_text(json.dumps({"runs": {"impulse": {"metrics": "a.jsonl", "card": "X"},
                                                             "mimetic": {"metrics": "b.jsonl", "card": "X"}}}))
    table = paper_column.column(tmp_path, epoch=2)
    assert "| `impulse` | 2 of 200 | 20.00 ±" in table and "| 200 | 2.0 | X |" in table
    assert "`mimetic`" not in table and "Not at epoch 2 yet: mimetic" in table
    with pytest.raises(SystemExit):
        paper_column.main(["--data", str(tmp_path), "--epoch", "201"])


def test_the_committed_runs_make_a_column(paper_column):
    table = paper_column.column(paper_column.DEFAULT_DATA)
    assert "| `impulse` |" in table and "91.62" in table


def test_every_column_row_on_the_paper_page_is_what_the_script_prints_from_the_committed_runs(paper_column):
    """The paper page's rows are the script's output, at the run's end or at the epoch the row names."""
    page = (ROOT / "docs" / "paper.md").read_text().splitlines()
    rows = [line for line in page if line.startswith("| `") and " of 200 |" in line]
    assert rows, "the paper page shows no column rows"
    for row in rows:
        epoch = int(row.split("|")[2].split()[0])
        printed = paper_column.column(paper_column.DEFAULT_DATA) + paper_column.column(paper_column.DEFAULT_DATA, epoch)
        assert row in printed.splitlines(), f"docs/paper.md shows a row the committed runs do not give: {row}"


def test_the_saved_throughput_table_prints_without_measuring(capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("gpu_throughput", ROOT / "bench" / "gpu_throughput.py")
        bench = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = bench
        spec.loader.exec_module(bench)
        assert bench.main(["--from", str(ROOT / "docs/results/data/gpu/h100-throughput.json")]) == 0
    finally:
        sys.modules.pop("gpu_throughput", None)
        sys.path.remove(str(ROOT / "bench"))
    out = capsys.readouterr().out
    assert "| ViT-Ti/2 (paper) | 512 | 32×32×3 | compile + pipeline | 9,962 |" in out
