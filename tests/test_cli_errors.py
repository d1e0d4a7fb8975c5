"""The command line fails like a tool: an error in what the user typed is one line on stderr,
``structinit <command>: error: …``, that names the flag and the fix, with exit status 2;
``--debug`` shows the traceback; bugs keep theirs. The run folder's own rules (its lock,
temporaries, modes) are in test_run_folder.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from structinit.harness.cli.main import main
from structinit.harness.cli.messages import exit_code, to_flags
from structinit.harness.errors import NonFiniteLossError, user_input
from structinit.harness.run import folder as runfolder
from structinit.harness.specs import parse_seeds

ROOT = Path(__file__).resolve().parents[1]
# The fastest real run: 64 digits images, one batch, one epoch.
COMMON = ["--recipe", "digits", "--epochs", "1", "--train-size", "64", "--no-progress"]
FAST = [*COMMON, "--init", "pytorch"]  # train's flags; compare's --init adds a spec


def error_line(capsys, command: str = "train") -> str:
    """The error the last call printed: one line on stderr (two at most), in the tool's format."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 2 and "Traceback" not in err, err
    assert lines[0].startswith(f"structinit {command}: error: "), err
    return lines[0]


def train_fails(capsys, *args: str) -> str:
    assert main(["train", *args]) == 2
    return error_line(capsys)


# ----------------------------------------------------------------------------- data
def test_unknown_dataset(tmp_path, capsys):
    line = train_fails(capsys, *FAST, "--dataset", "nope", "--out", str(tmp_path / "run"))
    assert "--dataset" in line and "'nope'" in line and "cifar10" in line  # the flag, the value, the choices
    assert not (tmp_path / "run").exists()  # checked before anything was written


def test_missing_data_dir_without_download_names_the_flags(tmp_path, capsys):
    line = train_fails(capsys, *FAST, "--dataset", "cifar10", "--data-dir", str(tmp_path / "nowhere"),
                       "--out", str(tmp_path / "run"))
    assert f"--data-dir {tmp_path / 'nowhere'} does not exist" in line and "--download" in line
    assert "download=True" not in line and not (tmp_path / "run").exists()


def test_data_dir_without_the_files_names_the_flags(tmp_path, capsys):
    line = train_fails(capsys, *FAST, "--dataset", "cifar10", "--data-dir", str(tmp_path), "--out",
                       str(tmp_path / "run"))
    assert "cifar-10-batches-py not found" in line and "pass --download or --data-dir" in line
    assert "download=True" not in line and "root=" not in line


def test_imagefolder_needs_a_data_dir(tmp_path, capsys):
    line = train_fails(capsys, *FAST, "--dataset", "imagefolder", "--out", str(tmp_path / "run"))
    assert "--data-dir is required" in line


def test_a_data_dir_that_is_a_file_is_named_so(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    line = train_fails(capsys, *FAST, "--dataset", "mnist", "--data-dir", str(tmp_path / "file"),
                       "--out", str(tmp_path / "run"))
    assert f"--data-dir {tmp_path / 'file'} is a file, not a folder, and holds no mnist data" in line, line
    assert line.endswith("set --data-dir to the folder that holds the mnist files")
    assert not (tmp_path / "run").exists()
    from structinit.data import load_dataset
    from structinit.data.datasets import DatasetNotFoundError
    with pytest.raises(DatasetNotFoundError, match=r"root=.* is a file, not a folder"):
        load_dataset("mnist", tmp_path / "file")


def test_a_damaged_archive_is_said_in_one_whole_line_with_the_fix(tmp_path, capsys):
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(bytes(range(256)) * 20)
    line = train_fails(capsys, *FAST, "--dataset", "cifar10", "--data-dir", str(tmp_path), "--out", str(tmp_path / "r"))
    assert "cannot read it as a tar archive" in line and line.endswith("download it again (--download)"), line


def test_a_data_dir_that_is_a_file_but_no_archive_is_named_so_for_cifar_too(tmp_path, capsys):
    # CIFAR reads its archive in place, so a file can be a data_dir; a file that is no archive is not one
    (tmp_path / "data_batch_1").write_bytes(b"\x80\x02}q\x00" + bytes(200))  # a pickle, not an archive
    line = train_fails(capsys, *FAST, "--dataset", "cifar10", "--data-dir", str(tmp_path / "data_batch_1"),
                       "--out", str(tmp_path / "r"))
    assert "data_batch_1 is a file, not a folder" in line and "delete" not in line, line
    assert not (tmp_path / "r").exists()

# ----------------------------------------------------------------------------- init specs
def test_unknown_scheme(tmp_path, capsys):
    line = train_fails(capsys, *FAST, "--init", "bogus", "--out", str(tmp_path / "run"))
    assert "error: --init: unknown scheme 'bogus'; valid names: " in line
    assert {"impulse", "mimetic", "pytorch"} <= set(line.split("valid names: ")[1].split(", "))
    assert not (tmp_path / "run").exists()  # checked before the data loaded and the folder was made


def test_unknown_init_option_names_it_and_the_valid_ones(tmp_path, capsys):
    line = train_fails(capsys, *FAST, "--init", "impulse:target_mas=0.3", "--out", str(tmp_path / "run"))
    assert "--init: " in line and "target_mas" in line and "valid: target_mass" in line


def test_compare_bad_spec_names_the_spec(tmp_path, capsys):
    # lr= is the gd solver's own option here, not --lr
    args = ["compare", *COMMON, "--inits", "pytorch,impulse:solver=gd,lr=-1", "--seeds", "1", "--out",
            str(tmp_path / "cmp")]
    assert main(args) == 2
    line = error_line(capsys, "compare")
    assert "--inits/--init: init spec 'impulse:solver=gd,lr=-1': lr=-1" in line and "--lr" not in line
    assert not (tmp_path / "cmp").exists()


# ----------------------------------------------------------------------------- --set, --seeds
@pytest.mark.parametrize(("item", "message"), [
    ("warmup_epochs", "--set 'warmup_epochs': expected KEY=VALUE"),
    ("warmup_epoch=5", "--set 'warmup_epoch=5': no training option 'warmup_epoch' (did you mean warmup_epochs?)"),
    ("epochs=abc", "--set 'epochs=abc': expected an int, got str"),
    ("grad_clip=True", "--set 'grad_clip=True': expected a finite number or None, got bool"),
    ("betas=(0.9,)", "--set 'betas=(0.9,)': expected a pair of numbers, got tuple"),
    ("seed=3", "--set 'seed=3': seed is set by --seed here; use that flag"),
    # a field's own rule, said about what the user typed, not about the field's flag (--epochs)
    ("epochs=-1", "--set 'epochs=-1': expected a positive whole number"),
    ("loss=foo", "--set 'loss=foo': expected 'ce' (cross-entropy) or 'hinge'"),
    # values that ran to exit 0 with a wrong result: clipping flipped the gradient, an EMA of NaN
    ("grad_clip=-1", "--set 'grad_clip=-1': expected a gradient norm > 0, or None for no clipping"),
    ("ema_decay=2", "--set 'ema_decay=2': expected a number in (0, 1)"),
    ("ema_decay=float('nan')", "--set \"ema_decay=float('nan')\": expected a finite number or None, got str"),
    ("label_smoothing=1.5", "--set 'label_smoothing=1.5': expected a number in [0, 1)"),
    ("betas=(2, 0.9)", "--set 'betas=(2, 0.9)': expected two numbers in [0, 1)"),
    ("weight_decay=-0.1", "--set 'weight_decay=-0.1': expected a finite number ≥ 0"),
])
def test_bad_set(tmp_path, capsys, item, message):
    line = train_fails(capsys, *FAST, "--set", item, "--out", str(tmp_path / "run"))
    assert line.startswith(f"structinit train: error: {message}")


def test_set_values_are_read_as_the_field_types():
    from structinit.harness.cli.flags import check_set_item

    assert check_set_item("train_size=None", {}) == ("train_size", None)  # what --train-size cannot say
    assert check_set_item("warmup-epochs=5", {}) == ("warmup_epochs", 5)
    assert check_set_item("betas=(0.9, 0.99)", {}) == ("betas", (0.9, 0.99))
    assert check_set_item("data_dir=2024", {}) == ("data_dir", "2024")  # a folder named 2024, not a number


def test_bad_seeds(tmp_path, capsys):
    assert main(["compare", *COMMON, "--seeds", "0,x", "--out", str(tmp_path / "cmp")]) == 2
    assert "--seeds '0,x': expected a count" in error_line(capsys, "compare")


def test_seeds_zero_says_how_to_ask_for_seed_zero(tmp_path, capsys):
    # "--seeds 0" reads as a count of none; the error says how to run seed 0 alone
    assert main(["compare", *COMMON, "--seeds", "0", "--out", str(tmp_path / "cmp")]) == 2
    line = error_line(capsys, "compare")
    assert "--seeds '0': expected a count" in line and "seed 0 alone is a count of 1 (--seeds 1)" in line
    assert not (tmp_path / "cmp").exists()  # refused before anything was written
    with pytest.raises(ValueError, match="expected a count") as refused:
        parse_seeds("0,x")
    assert "at least 1" not in str(refused.value)  # the hint is for a count, not for a bad list


def test_bad_value_checked_where_it_is_used_names_the_flag(tmp_path, capsys):
    assert "--precision 'half': expected auto" in train_fails(capsys, *FAST, "--precision", "half", "--out",
                                                                 str(tmp_path / "run"))
    line = train_fails(capsys, *FAST, "--set", "holdout=100000", "--out", str(tmp_path / "run2"))
    assert "--set holdout=100000: expected 0 < holdout <" in line


# ----------------------------------------------------------------------------- checkpoints
def test_malicious_checkpoint_is_refused_without_running_it(tmp_path, capsys):
    out, marker = tmp_path / "run", tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    out.mkdir()
    torch.save({"config": {}, "x": Payload()}, out / "checkpoint.pt")
    line = train_fails(capsys, *FAST, "--resume", "--out", str(out))
    assert f"{out / 'checkpoint.pt'}: not a readable structinit checkpoint" in line
    assert "cannot be loaded safely" in line and "nothing in it was run" in line
    assert "weights_only" not in line and not marker.exists()


def test_a_torch_file_that_is_no_run_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    torch.save({"weights": torch.zeros(2)}, out / "checkpoint.pt")
    line = train_fails(capsys, *FAST, "--resume", "--out", str(out))
    assert f"{out / 'checkpoint.pt'}: not the checkpoint of a structinit run (no config, epoch" in line
    assert "found weights" in line and line.endswith("start the run in another --out")


def test_existing_run_without_resume(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"")
    line = train_fails(capsys, *FAST, "--out", str(out))
    assert "checkpoint.pt exists: pass --resume or choose another --out" in line


# ----------------------------------------------------------------------------- --out
def test_out_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    line = train_fails(capsys, *FAST, "--out", str(tmp_path / "file"))
    assert line.endswith(f"--out {tmp_path / 'file'} is a file, not a folder; choose another --out")
    line = train_fails(capsys, *FAST, "--out", str(tmp_path / "file" / "run"))
    assert f"cannot be created: {tmp_path / 'file'} is a file" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permissions")
def test_out_read_only(tmp_path, capsys):
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o555)
    try:
        line = train_fails(capsys, *FAST, "--out", str(locked / "run"))
        assert f"cannot be created: no permission to write in {locked}; choose another --out" in line
        line = train_fails(capsys, *FAST, "--out", str(locked))
        assert f"--out {locked}: no permission to write in that folder" in line
    finally:
        locked.chmod(0o755)


def test_out_not_writable_checked_before_the_data_loads(tmp_path, capsys, monkeypatch):
    """The same check as above, under any user (root included): nothing is loaded first."""
    def load(*args, **kwargs):
        raise AssertionError("the data was loaded before --out was checked")

    monkeypatch.setattr(runfolder, "_writable", lambda folder: False)
    monkeypatch.setattr("structinit.harness.tasks.image.load_data", load)
    monkeypatch.setattr("structinit.harness.tasks.image.load_train_split", load)
    line = train_fails(capsys, *FAST, "--out", str(tmp_path / "run"))
    assert f"--out {tmp_path / 'run'} cannot be created: no permission to write in {tmp_path}" in line
    assert main(["compare", *COMMON, "--out", str(tmp_path / "cmp")]) == 2
    assert "no permission to write" in error_line(capsys, "compare")


# ----------------------------------------------------------------------------- --debug, bugs, exit codes
@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(tmp_path, where):
    args = ["train", "--dataset", "nope", "--out", str(tmp_path / "run")]
    args = ["--debug", *args] if where == "before" else [*args, "--debug"]
    with pytest.raises(ValueError, match="dataset 'nope' is not supported"):
        main(args)


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    """Where an error is raised decides: a ValueError from inside training is a bug."""
    def broken(*args, **kwargs):
        raise ValueError("an internal mistake")

    monkeypatch.setattr("structinit.harness.cli.main.train", broken)
    with pytest.raises(ValueError, match="internal mistake"):
        main(["train", *FAST, "--out", str(tmp_path / "run")])


def test_exit_codes():
    try:
        with user_input("dataset"):
            raise FileNotFoundError("x")
    except FileNotFoundError as err:
        assert exit_code(err) == 2
    assert exit_code(NonFiniteLossError("diverged")) == 1 and exit_code(ValueError("bug")) is None


def test_from_a_shell(tmp_path):
    """Exit statuses and output as a shell sees them: one line and 2, or a traceback with --debug."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "structinit", "train", "--dataset", "nope", "--out", str(tmp_path / "run")]
    plain = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert plain.returncode == 2 and plain.stdout == ""
    assert plain.stderr.startswith("structinit train: error: --dataset") and len(plain.stderr.splitlines()) == 1
    debug = subprocess.run([*cmd, "--debug"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr


def test_library_phrases_become_flags():
    assert to_flags("pass download=True (--download) or root= the folder that contains them") == (
        "pass --download or --data-dir the folder that contains them")
    assert to_flags("delete it and re-download (download=True)") == "delete it and re-download (--download)"
    assert to_flags("out_dir=/x is a file; choose another out_dir (--out)") == (
        "--out /x is a file; choose another --out")
    assert to_flags("batch_size=100 is not divisible; lower batch_size") == (
        "--batch-size 100 is not divisible; lower --batch-size")
    assert to_flags("warmup_lr=-1: expected") == "--set warmup_lr=-1: expected"
    assert to_flags("lr=-1: expected a number", "init") == "lr=-1: expected a number"  # a scheme's own option


@pytest.mark.parametrize("flag,value,message", [
    ("--ema-decay", "nan", "--ema-decay nan: expected a finite number; NaN and ±inf are not allowed"),
    ("--ema-decay", "1", "--ema-decay 1.0: expected a number in (0, 1)"),
    ("--lr", "1e308", "--lr 1e+308: expected a positive finite number (float32: at most 3.4e38)"),  # overflowed
])
def test_bad_flag_values_that_used_to_train(tmp_path, capsys, flag, value, message):
    line = train_fails(capsys, *FAST, flag, value, "--out", str(tmp_path / "run"))
    assert line.startswith(f"structinit train: error: {message}")
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize("field,value", [("grad_clip", -1.0), ("grad_clip", float("inf")), ("ema_decay", float("nan")),
                                         ("ema_decay", 0.0), ("label_smoothing", -0.1), ("betas", (0.9, 1.0)),
                                         ("eps", 0.0), ("min_lr", float("nan")), ("warmup_epochs", -1.0)])
def test_the_config_refuses_values_that_train_wrong(field, value):
    from structinit.harness.config import ImageConfig, check_config

    with pytest.raises(ValueError, match=rf"^{field}="):
        check_config(ImageConfig(**{field: value}))
    check_config(ImageConfig(grad_clip=None, ema_decay=None))  # None: off, as documented


@pytest.mark.parametrize("argv,message", [
    (["train", "--recipe", "digits", "--out", ""], "argument --out: '' is empty: name a folder"),
    (["compare", "--recipe", "digits", "--out", " "], "argument --out: ' ' is empty: name a folder"),
    (["train", "--recipe", "digits", "--init", "impulse:target_mass=0.3,target_mass=0.5"],
     "--init: init spec 'impulse:target_mass=0.3,target_mass=0.5': option 'target_mass' is given twice"),
])
def test_no_silent_choice(tmp_path, monkeypatch, capsys, argv, message):
    """An empty --out fell back to a default folder, and a repeated option let the last win."""
    from structinit.harness.cli.main import main

    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors exit; the rest return the code
        code = exit_.code
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("argv", "words"), [
    (["--seeds", "1,1"], "--seeds '1,1': seed 1 is given twice"),
    (["--inits", "impulse,mimetic,impulse"], "init spec 'impulse' names the same init as 'impulse'"),
    (["--inits", "impulse:kernel_size=3", "--init", "impulse:kernel_size=3"], "names the same init"),
    (["--seeds", "99999999999999999999999"], "a count is at most 10,000; a seed is a whole number in [0, 2**63)"),
    (["--inits", "impulse,impulse:pe_scale=1.0"], "names the same init as 'impulse' (pe_scale=1.0: its default)"),
    (["--inits", "mimetic:alpha=0.7,mimetic"], "names the same init as 'mimetic:alpha=0.7'"),
    (["--seeds", "0,-1"], "seed -1 is not a whole number in [0, 2**63)"),
])
def test_a_comparison_that_would_count_a_run_twice_or_never_end_is_refused(argv, words, tmp_path, capsys):
    out = tmp_path / "cmp"
    code = main(["compare", "--recipe", "digits", "--epochs", "1", "--no-progress", "--out", str(out), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and words in err, err
    assert not out.exists()


def test_the_compare_api_takes_what_the_command_line_takes(tmp_path):
    from structinit.harness.compare import compare
    from structinit.harness.recipes import recipe

    base = recipe("digits", epochs=1)
    with pytest.raises(ValueError, match="seed 0 is given twice"):
        compare(base, ["pytorch"], [0, 0], tmp_path / "a")
    with pytest.raises(ValueError, match=r"inits=\[\]: expected init specs"):
        compare(base, [], 1, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    summary = compare(base, "pytorch,mimetic", 1, tmp_path / "c", progress=False)  # a string, a count
    assert set(summary) == {"pytorch", "mimetic"} and all(row["seeds"] == [0] for row in summary.values())


def test_train_and_compare_refuse_what_is_not_a_run_config_in_one_line(tmp_path):
    from structinit.harness.compare import compare
    from structinit.harness.tasks import train

    for call, name in ((lambda: train({"recipe": "digits"}), "cfg"),
                       (lambda: compare({"recipe": "digits"}, ["pytorch"], 1, tmp_path / "a"), "base")):
        with pytest.raises(TypeError) as err:
            call()
        message = str(err.value)
        assert message.startswith(f"{name}: expected a run config") and "got dict" in message, message
        assert "structinit.recipe(" in message and "\n" not in message
    assert not (tmp_path / "a").exists()


def test_the_advice_for_a_seed_count_too_large_is_a_list_the_parser_takes():
    from structinit.harness.specs import parse_seeds

    with pytest.raises(ValueError, match=r"to run seed 123456 alone, give a list of one: --seeds 123456, "):
        parse_seeds("123456")
    assert parse_seeds("123456,") == [123456]


def test_a_warning_is_one_line_naming_the_command_not_python_s_source_line(monkeypatch):
    import warnings

    import structinit.harness.cli.main as cli

    shown = []

    def warns(args):  # what Python's warning machinery prints for a warning raised in the command
        shown.append(warnings.formatwarning("a copy of the official files\nsecond line", UserWarning, "x.py", 7,
                                            "    lambda root, split: load_cifar(root)"))
        return 0

    monkeypatch.setattr(cli, "_demo", warns)
    assert main(["demo"]) == 0
    assert shown == ["structinit demo: warning: a copy of the official files second line\n"]
    assert "UserWarning" in warnings.formatwarning("m", UserWarning, "f", 1, "")  # put back after the command
