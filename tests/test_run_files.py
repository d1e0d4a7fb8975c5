"""A run's files are its own: a finished run's result.json and exported weights are trusted only
when they are its checkpoint's, and no run is written inside a comparison's folder, nor a
comparison over a run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train import digits

from structinit.harness.compare import compare
from structinit.harness.recipes import recipe
from structinit.harness.tasks import train


@pytest.mark.parametrize("damage", ["weights deleted", "ema weights deleted", "result not json", "result a list",
                                    "result of another seed", "result edited", "weights truncated",
                                    "weights of another seed"])
def test_a_finished_run_missing_its_files_writes_them_again_from_its_checkpoint(tmp_path, capsys, damage):
    """A finished run whose exported weights or result.json are gone, unreadable or another
    run's (copied from another seed, edited by hand, truncated) is not reported as done:
    resuming writes them again from the checkpoint, bit-identical, and trains no step."""
    import dataclasses

    from safetensors.torch import load_file

    cfg = digits(tmp_path, epochs=1, train_size=128, ema_decay=0.9)
    first = train(cfg, progress=False)
    run = Path(cfg.out_dir)
    # copies: load_file maps the file, whose bytes the damage below changes in place
    weights, ema = ({k: v.clone() for k, v in load_file(run / name).items()}
                    for name in ("model.safetensors", "model_ema.safetensors"))
    checkpoint = (run / "checkpoint.pt").stat().st_mtime_ns
    if damage == "weights deleted":
        (run / "model.safetensors").unlink()
    elif damage == "ema weights deleted":
        (run / "model_ema.safetensors").unlink()
    elif damage == "weights truncated":
        data = (run / "model.safetensors").read_bytes()
        (run / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage.endswith("of another seed"):  # the same init, another seed: what a copy between seeds makes
        other = Path(train(dataclasses.replace(cfg, seed=1, out_dir=str(tmp_path / "seed1")), progress=False)
                     ["config"]["out_dir"])
        name = "result.json" if damage.startswith("result") else "model.safetensors"
        (run / name).write_bytes((other / name).read_bytes())
    elif damage == "result edited":
        edited = json.loads((run / "result.json").read_text())
        edited["final"] = {k: 0.999 for k in edited["final"]}
        (run / "result.json").write_text(json.dumps(edited))
    else:
        (run / "result.json").write_text('{"config": {' if damage == "result not json" else "[]")
    capsys.readouterr()
    again = train(cfg, resume=True, progress=False)
    assert "writing them again from" in capsys.readouterr().err
    assert again["final"] == first["final"] and again["history"] == first["history"]
    assert (run / "checkpoint.pt").stat().st_mtime_ns == checkpoint  # nothing trained
    assert json.loads((run / "result.json").read_text())["final"] == first["final"]
    for name, saved in (("model.safetensors", weights), ("model_ema.safetensors", ema)):
        now = load_file(run / name)
        assert all(torch.equal(now[k], saved[k]) for k in saved)
    capsys.readouterr()
    assert train(cfg, resume=True, progress=False)["final"] == first["final"]  # whole again: simply returned
    assert "writing them again" not in capsys.readouterr().err


def test_compare_does_not_count_a_result_copied_from_another_seed(tmp_path, capsys):
    """The case as a user met it: one seed's result.json copied over another's. compare reads
    each run from its checkpoint, so both seeds keep their own scores."""
    base = recipe("digits", epochs=1, train_size=128)
    compare(base, ["impulse"], [0, 1], tmp_path / "cmp", progress=False)
    seed0, seed1 = (tmp_path / "cmp" / "impulse" / f"seed{s}" / "result.json" for s in (0, 1))
    own = json.loads(seed0.read_text())["final"]
    assert own != json.loads(seed1.read_text())["final"]
    seed0.write_text(seed1.read_text())
    capsys.readouterr()
    compare(base, ["impulse"], [0, 1], tmp_path / "cmp", progress=False)
    assert "not this run's; writing them again" in capsys.readouterr().err
    assert json.loads(seed0.read_text())["final"] == own


def test_no_run_inside_a_comparison_and_no_comparison_over_a_run(tmp_path):
    """train --out <a compare folder> would make report show that run alone; compare --out <a
    run folder> would mix the two: both are refused in one line before anything is written."""
    base = recipe("digits", epochs=1, train_size=128)
    compare(base, ["pytorch"], [0], tmp_path / "cmp", progress=False)
    with pytest.raises(ValueError, match=r"is a comparison's folder \(it holds a comparison's summary.json\)"):
        train(recipe("digits", epochs=1, train_size=128, out_dir=str(tmp_path / "cmp")), progress=False)
    assert not (tmp_path / "cmp" / "result.json").exists()
    (tmp_path / "cmp" / "summary.json").unlink()  # a comparison still running has its runs only
    with pytest.raises(ValueError, match=r"comparison's runs \(pytorch/seed…\)"):
        train(recipe("digits", epochs=1, train_size=128, out_dir=str(tmp_path / "cmp")), progress=False)
    run = digits(tmp_path, epochs=1, train_size=128)
    train(run, progress=False)
    with pytest.raises(ValueError, match=r"is a run's folder \(it holds a run's result.json\)"):
        compare(base, ["pytorch"], [0], run.out_dir, progress=False)


def test_a_run_has_an_id_that_its_files_record_and_its_readers_check(tmp_path, capsys):
    """The id is the run's settings, seed, starting weights and data: another folder, the same
    id; another seed or learning rate, another id. attention (through the weights it loads)
    refuses another run's weights from the same init (another lr), and weights whose tensors
    were changed, naming the file."""
    from safetensors.torch import load_file, save_file

    from structinit.harness.cli.main import main
    from structinit.harness.run.checkpoint import load_weights

    runs = {}
    for name, seed, lr in (("a", 0, 1e-3), ("moved", 0, 1e-3), ("b", 0, 2e-3), ("c", 1, 1e-3)):
        cfg = recipe("digits", out_dir=str(tmp_path / name), epochs=1, train_size=64, seed=seed, lr=lr, init="impulse")
        runs[name] = train(cfg, progress=False)
    ids = {name: r["run_id"] for name, r in runs.items()}
    assert ids["a"] == ids["moved"] and len({ids["a"], ids["b"], ids["c"]}) == 3 and len(ids["a"]) == 16
    assert runs["a"]["init_fingerprint"] == runs["b"]["init_fingerprint"]  # the same init: only the id tells them
    for name in runs:
        _, metadata = load_weights(tmp_path / name / "model.safetensors")
        assert metadata["run_id"] == json.loads((tmp_path / name / "result.json").read_text())["run_id"] == ids[name]
    assert main(["attention", "--run", str(tmp_path / "a"), "--dataset", "none", "--out", str(tmp_path / "f")]) == 0
    capsys.readouterr()

    weights = tmp_path / "a" / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes((tmp_path / "b" / "model.safetensors").read_bytes())  # the same init, another lr's run
    assert main(["attention", "--run", str(tmp_path / "a"), "--dataset", "none", "--out", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{weights}: these weights are run {ids['b']}'s, and the folder's result.json is run {ids['a']}'s" in err
    assert len(err.splitlines()) == 1 and "train --resume" in err

    weights.write_bytes(original)
    tensors, metadata = load_file(weights), load_weights(weights)[1]
    name = next(iter(tensors))
    save_file({**tensors, name: tensors[name] + 1}, weights, metadata)  # its header intact, a tensor changed
    assert main(["attention", "--run", str(tmp_path / "a"), "--dataset", "none", "--out", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{weights}: its tensors are not the ones the run finished with" in err, err


def test_a_result_edited_or_copied_from_another_seed_is_refused_by_its_readers(tmp_path):
    from structinit.harness.finished import find_runs, load_run

    base = recipe("digits", epochs=1, train_size=64)
    compare(base, ["pytorch"], 2, tmp_path / "cmp", progress=False)
    seed0, seed1 = (tmp_path / "cmp" / "pytorch" / f"seed{s}" for s in (0, 1))
    assert [r.result["seed"] for r in find_runs(tmp_path / "cmp")] == [0, 1]
    (seed0 / "result.json").write_bytes((seed1 / "result.json").read_bytes())
    with pytest.raises(ValueError, match=r"seed0/result.json: it is seed 1's result, in the folder of seed 0: a copy"):
        find_runs(tmp_path / "cmp")
    result = json.loads((seed1 / "result.json").read_text())
    result["config"]["lr"] = 0.5  # edited: not the run its id names
    (seed1 / "result.json").write_text(json.dumps(result))
    with pytest.raises(ValueError, match=rf"its settings, seed or data are not those of run {result['run_id']}"):
        load_run(seed1)


def test_report_refuses_a_result_from_another_runs_folder_or_with_its_scores_edited(tmp_path, capsys):
    """A result.json whose own settings and id agree is still refused when the weights beside it
    are another run's (a same-seed run with another lr, copied in), or when its scores were
    changed after the run wrote it (its digest)."""
    from structinit.harness.cli.main import main

    base = recipe("digits", epochs=1, train_size=64)
    compare(base, ["pytorch"], 2, tmp_path / "cmp", progress=False)
    other = recipe("digits", epochs=1, train_size=64, lr=5e-3, out_dir=str(tmp_path / "lr"))
    train(other, progress=False)
    seed0 = tmp_path / "cmp" / "pytorch" / "seed0"
    own = (seed0 / "result.json").read_bytes()
    assert main(["report", str(tmp_path / "cmp"), "--out", str(tmp_path / "r0")]) == 0
    capsys.readouterr()

    (seed0 / "result.json").write_bytes((tmp_path / "lr" / "result.json").read_bytes())  # same seed, other lr
    assert main(["report", str(tmp_path / "cmp"), "--out", str(tmp_path / "r1")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.safetensors: these weights are run" in err, err
    assert "structinit train --resume --out <the run's folder>" in err

    result = json.loads(own)
    result["final"] = {**result["final"], "test_acc": 0.999}  # a score edited by hand
    (seed0 / "result.json").write_text(json.dumps(result))
    assert main(["report", str(tmp_path / "cmp"), "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "it is not the file its run wrote (its scores were changed since" in err, err

    (seed0 / "result.json").write_bytes(own)
    (seed0 / "model.safetensors").write_bytes((seed0 / "model.safetensors").read_bytes()[:5000])  # truncated
    assert main(["cka", str(seed0), str(tmp_path / "cmp" / "pytorch" / "seed1"), "--out", str(tmp_path / "k")]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.safetensors: not a readable safetensors file" in err and "--run:" not in err, err
    assert err.endswith(f"`structinit train --resume --out {seed0}` writes it again from the run's checkpoint"), err


def test_no_run_in_a_folder_below_a_comparison_but_its_own_seed_folder(tmp_path):
    """report reads a comparison's runs to three folders down: a run written in any of them but
    the <init>/seed<k> folder of its own seed would be counted as one of the comparison's."""
    compare(recipe("digits", epochs=1, train_size=64), ["pytorch"], [0], tmp_path / "cmp", progress=False)
    for below in ("pytorch", "newrun", "pytorch/extra", "pytorch/seed5"):
        cfg = recipe("digits", epochs=1, train_size=64, seed=0, out_dir=str(tmp_path / "cmp" / below))
        with pytest.raises(ValueError, match=rf"lies inside a comparison: {tmp_path / 'cmp'} is a comparison's"):
            train(cfg, progress=False)
        assert not (tmp_path / "cmp" / below / "checkpoint.pt").exists()
    from structinit.harness.run.folder import inside_comparison

    assert inside_comparison(tmp_path / "cmp" / "mimetic" / "seed3", seed=3) is None  # where compare puts it
    assert inside_comparison(tmp_path / "elsewhere", seed=0) is None
