"""bench/sweep.py's own logic on models built here (the registries it sweeps need the zoo venv):
each outcome it can report, its table and summary, and a sweep that resumes from its file."""

import json

import sweep
import torch
from attention_styles import StyledViT
from test_traced_attention import VNormed
from torch import nn


def _refused():
    model = StyledViT("raw-linear")
    model.attns[1] = VNormed(48, 3)
    return model


def test_each_outcome_is_told_apart_on_the_models_own_maps():
    written = sweep.run_one("styled", "here", lambda: StyledViT("einsum"))
    assert [(r.scheme, r.outcome) for r in written] == [("impulse", "written"), ("mimetic", "written")]
    assert all(r.own_map is not None and r.own_map >= 0.95 for r in written[:1])
    refused = sweep.run_one("qk-normed", "here", _refused)
    assert {r.outcome for r in refused} == {"refused"} and "more than a projection" in refused[0].reason
    none = sweep.run_one("mlp", "here", lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10)))
    assert {r.outcome for r in none} == {"no-attention"}
    text = sweep.table(written + refused + none)
    assert text.splitlines()[-1] == ("sweep: 2/4 as expected, 0 silent, 0 tracebacks "
                                     "(0 written with no map of 3 or more keys to check)")


def test_a_write_whose_own_maps_miss_is_silent(monkeypatch):
    monkeypatch.setattr(sweep, "own_map", lambda model, scheme: 0.4)  # as if the maps showed too little of the write
    assert {r.outcome for r in sweep.run_one("styled", "here", lambda: StyledViT("einsum"))} == {"silent"}


def test_smallest_picks_the_smallest_sounding_name():
    assert sweep.smallest(["vit_base_patch16_224", "vit_tiny_patch16_224", "vit_small_patch16_224"]) == \
        "vit_tiny_patch16_224"


def test_a_saved_sweep_is_printed_again_and_not_rerun(tmp_path, capsys):
    rows = sweep.run_one("styled", "here", lambda: StyledViT("einsum"))
    path = tmp_path / "sweep.json"
    sweep._save(str(path), rows)
    assert sweep.main(["--from", str(path)]) == 0
    assert "| styled | here | impulse | written | 1.00 |  |" in capsys.readouterr().out
    assert [r["outcome"] for r in json.loads(path.read_text())["rows"]] == ["written", "written"]
    torch.testing.assert_close(torch.tensor(rows[0].own_map), torch.tensor(1.0))


def test_the_summary_counts_each_scheme_per_package_from_the_saved_rows(tmp_path, capsys):
    rows = [sweep.Row("a", "here", "impulse", "written", 1.0), sweep.Row("a", "here", "mimetic", "expected"),
            sweep.Row("b", "here", "impulse", "refused"), sweep.Row("b", "here", "mimetic", "unverified"),
            sweep.Row("c", "here", "impulse", "no-attention"), sweep.Row("c", "here", "mimetic", "no-attention")]
    path = tmp_path / "sweep.json"
    sweep._save(str(path), rows)
    assert sweep.main(["--from", str(path), "--summary"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "| here | 2 | 1 (1 written, 0 refused for the mechanism) | 1 (0 written, 1 refused for the mechanism) "
        "| 0 | 0 | 1 |")
