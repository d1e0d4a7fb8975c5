"""`structinit ablate NAME`: every ablation's variants are valid inits, the table / JSON /
figure it writes, training through `compare` (finished runs reused), and its one-line errors."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from structinit.harness.ablation import ABLATIONS, ablate, variants
from structinit.harness.cli.main import main
from structinit.harness.compare import check_specs
from structinit.harness.recipes import recipe
from structinit.harness.run import folder as runfolder

pytest.importorskip("matplotlib")

# The digits model at patch 1: an 8×8 token grid, so that kernel sizes 5 and 7 fit.
GRID8 = {"model_kwargs": {"patch_size": 1}}
FAST = ["--recipe", "digits", "--images", "16", "--steps", "5", "--repeats", "1", "--no-progress"]


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("structinit ablate: error: "), err
    return lines[0]


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_every_variant_is_a_valid_init_on_the_recipe_model(name, tmp_path):
    found = variants(name, steps=5)
    assert found and len({v.label for v in found}) == len(found) == len({v.key for v in found})
    base = recipe("digits", **GRID8)
    for v in found:
        cfg = dataclasses.replace(base, model_kwargs={**base.model_kwargs, **v.model_kwargs})
        assert check_specs(cfg, [v.spec], [0], tmp_path)[v.spec][0] == "impulse"
    if any("solver=gd" in v.spec for v in found):
        assert all("steps=5" in v.spec for v in found if "solver=gd" in v.spec)


def test_unknown_name_from_the_library():
    with pytest.raises(ValueError, match="ablation 'nope': unknown; valid: pseudo, kernel, heads"):
        ablate("nope", recipe="digits")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    out = tmp_path_factory.mktemp("abl") / "kernel"
    return out, ablate("kernel", recipe="digits", seeds=2, images=32, repeats=1, out=out, **GRID8)


def test_kernel_writes_table_json_and_figure(kernel):
    out, result = kernel
    assert sorted(p.name for p in out.iterdir()) == ["ablation.json", "ablation.md", "ablation.png"]
    saved = json.loads((out / "ablation.json").read_text())
    assert saved["rows"] == result["rows"]  # what the function returns is what it wrote
    assert [r["label"] for r in saved["rows"]] == ["kernel_size=3", "kernel_size=5", "kernel_size=7"]
    assert saved["settings"]["seeds"] == [0, 1] and saved["settings"]["images"] == 32
    assert {"structinit", "torch", "python"} <= set(saved["versions"])
    for row in saved["rows"]:
        for key in ("pe_hit_l1", "pe_hit_mean", "real_hit_l1", "real_hit_mean", "real_mass_l1", "local_mass_l1"):
            assert all(0.0 <= v <= 1.0 for v in row["metrics"][key]["per_seed"]), (row["label"], key)
            assert len(row["metrics"][key]["per_seed"]) == 2
        assert row["metrics"]["pe_hit_l1"]["mean"] == row["metrics"]["pe_hit_mean"]["mean"] == 1.0  # analytic: exact
        assert row["init_s"] > 0 and row["accuracy"] is None
    md = (out / "ablation.md").read_text().splitlines()
    assert md[0].startswith("# Ablation `kernel`")
    assert md[3].startswith("structinit ablate kernel --recipe digits --seeds 2 --images 32")
    assert "model_kwargs={\"patch_size\": 1}" in md[3]
    rows = [line for line in md if line.startswith("| kernel_size=")]
    assert len(rows) == 3 and all(" ± " in r for r in rows)
    assert (out / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_adds_accuracy_and_reuses_finished_runs(tmp_path):
    settings = dict(recipe="digits", images=8, repeats=1, train=True, out=tmp_path / "offsets", epochs=1,
                    train_size=64)
    first = ablate("offsets", **settings)
    results = sorted((tmp_path / "offsets" / "runs").glob("*/*/seed0/result.json"))
    assert len(results) == 2  # runs/<variant>/<init label>/seed0
    stamps = [p.stat().st_mtime_ns for p in results]
    for row in first["rows"]:
        assert 0.0 <= row["accuracy"]["mean"] <= 1.0 and row["accuracy"]["seeds"] == [0]
    second = ablate("offsets", **settings)
    assert [p.stat().st_mtime_ns for p in results] == stamps  # nothing retrained
    assert [r["accuracy"] for r in second["rows"]] == [r["accuracy"] for r in first["rows"]]
    assert "accuracy (%)" in (tmp_path / "offsets" / "ablation.md").read_text()


def test_cli_prints_the_table(tmp_path, capsys):
    out = tmp_path / "sharp"
    assert main(["ablate", "sharpness", *FAST, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for mass in (0.3, 0.5, 0.7, 0.9):
        assert f"| target_mass={mass} | `impulse:target_mass={mass}` |" in printed
    assert f"→ {out}/ablation.md" in printed and (out / "ablation.png").is_file()


def test_unknown_name_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["ablate", "nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and "pseudo" in err and "pe-scale" in err


def test_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["ablate", "offsets", *FAST, "--out", str(tmp_path / "f")]) == 2
    assert f"--out {tmp_path / 'f'} is a file, not a folder" in error_line(capsys)


def test_out_not_writable(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runfolder, "_writable", lambda folder: False)
    assert main(["ablate", "offsets", *FAST, "--out", str(tmp_path / "x")]) == 2
    assert "no permission to write" in error_line(capsys)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args, message", [
    (["kernel"], r"error: ablation 'kernel', variant 'kernel_size=5' \(impulse:kernel_size=5\) does not fit model "
                r"vit_cpu_patch2_8: kernel_size=5 is larger than the token grid 4×4.*; choose another --model"),
    (["offsets", "--images", "0"], r"--images: expected a positive whole number"),
    (["offsets", "--seeds", "x"], r"--seeds 'x': expected a count"),
    (["offsets", "--set", "nope=1"], r"--set 'nope=1': no training option 'nope'"),
])
def test_bad_input_is_one_line(args, message, tmp_path, capsys):
    assert main(["ablate", args[0], *FAST, *args[1:], "--out", str(tmp_path / "o")]) == 2
    line = error_line(capsys)
    assert re.search(message, line), line
