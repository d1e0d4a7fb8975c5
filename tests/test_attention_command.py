"""`structinit attention`: the figures and table it writes for inits and for a run before and
after training, and its one-line errors (exit 2)."""

import pytest

from structinit.harness.cli.main import main
from structinit.harness.recipes import recipe
from structinit.harness.tasks import train

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("att") / "impulse" / "seed0"
    train(recipe("digits", out_dir=str(out), epochs=1, train_size=128, init="impulse"), progress=False)
    return out


def test_inits_on_real_images(tmp_path, capsys):
    out = tmp_path / "figs"
    assert main(["attention", "--model", "vit_cpu_patch2_8", "--init", "impulse,mimetic", "--dataset", "digits",
                 "--out", str(out)]) == 0
    names = sorted(p.name for p in out.glob("*.png"))
    assert names == ["comparison.png", "maps_impulse.png", "maps_mimetic.png", "overlay_impulse.png",
                     "overlay_mimetic.png"]
    table = (out / "attention.md").read_text()
    assert table.count("| impulse |") == 3 and table.count("| mimetic |") == 3  # layers 0, 2, 3 of 4
    assert "| impulse | 0 | 1.000 |" in capsys.readouterr().out


def test_position_only_without_a_dataset(tmp_path):
    out = tmp_path / "pos"
    assert main(["attention", "--model", "vit_cpu_patch2_8", "--init", "impulse", "--layers", "0,-1",
                 "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["maps_impulse.png"]
    rows = [r for r in (out / "attention.md").read_text().splitlines() if r.startswith("| impulse")]
    assert [r.split("|")[2].strip() for r in rows] == ["0", "3"]  # -1 is the last of 4 layers
    assert all("| 1.000 |" in r for r in rows)


def test_a_run_before_and_after_training(trained_run, tmp_path):
    out = tmp_path / "ba"
    assert main(["attention", "--run", str(trained_run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["before_after.png", "overlay_init.png",
                                                          "overlay_trained.png"]
    table = (out / "attention.md").read_text()
    assert table.count("| at init |") == 3 and table.count("| trained |") == 3
    assert "| at init | 0 | 1.000 |" in table  # the rebuilt init is the impulse the run started from


@pytest.mark.parametrize("argv, message", [
    (["--run", "{tmp}"], r"{tmp} has no result.json: it is not a finished run"),
    (["--model", "vit_cpu_patch2_8", "--layers", "9"], r"--layers: layers contains 9, but the model has 4"),
    (["--model", "vit_cpu_patch2_8", "--layers", "x"], r"--layers 'x': expected comma-separated integers"),
    (["--model", "vit_cpu_patch2_8", "--dataset", "digits", "--queries", "99"],
     r"--queries 99: grid token indices must lie in 0 … 15"),
    (["--model", "vit_cpu_patch2_8", "--init", "impulse:nope=1"], r"--init: .*unknown option\(s\) nope"),
    (["--model", "vit_cpu_patch2_8", "--out", "{file}"], r"--out .* is a file, not a folder"),
])
def test_errors_are_one_line_with_exit_2(tmp_path, capsys, argv, message):
    import re

    (tmp_path / "f").write_text("x")
    argv = [a.format(tmp=tmp_path, file=tmp_path / "f") for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "o")]
    assert main(["attention", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("structinit attention: error: ")
    assert re.search(message.replace("{tmp}", re.escape(str(tmp_path))), err), err


def test_swin_windows_position_only(tmp_path):
    """Windowed attention: each map is one window's (16 tokens of a 4×4 window), the table has fidelity."""
    out = tmp_path / "swin"
    assert main(["attention", "--model", "swin_cpu_patch2_32", "--init", "impulse,mimetic", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["comparison.png", "maps_impulse.png", "maps_mimetic.png"]
    rows = [r for r in (out / "attention.md").read_text().splitlines() if r.startswith("| impulse")]
    assert [r.split("|")[2].strip() for r in rows] == ["0", "3", "5"]
    hit, mass = zip(*[(float(r.split("|")[3]), float(r.split("|")[4])) for r in rows])
    # the model's own maps: block 3's shifted windows mask keys, so its target holds more than 0.5
    assert hit == (1.0, 1.0, 1.0) and mass[0] == mass[2] == 0.5 and mass[1] > 0.55


def test_swin_windows_on_images(tmp_path, capsys):
    """With a dataset (CIFAR-10's format, written here): the first window's map of each image,
    and impulse still on target, the tables outweighing the content of real pixels."""
    from test_data import write_cifar10

    write_cifar10(tmp_path / "data")
    out = tmp_path / "swin-cifar"
    assert main(["attention", "--model", "swin_cpu_patch2_32", "--init", "impulse", "--dataset", "cifar10",
                 "--data-dir", str(tmp_path / "data"), "--images", "4", "--layers", "0,-1", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["maps_impulse.png"]  # a window: no overlay on the image
    rows = [r for r in (out / "attention.md").read_text().splitlines() if r.startswith("| impulse")]
    assert [r.split("|")[2].strip() for r in rows] == ["0", "5"]
    assert all("| 1.000 |" in r for r in rows)


def test_mixer_maps_are_drawn_by_magnitude_and_labelled_so(tmp_path, monkeypatch):
    """A token-mixing map is a signed Jacobian (mimetic's αZ + βI has negative entries): drawn
    as |weight| under its own colour-bar label, not as attention probabilities."""
    import matplotlib.axes
    import matplotlib.figure

    labels, shown = [], []
    colorbar, imshow = matplotlib.figure.Figure.colorbar, matplotlib.axes.Axes.imshow
    monkeypatch.setattr(matplotlib.figure.Figure, "colorbar",
                        lambda fig, *a, **kw: labels.append(kw.get("label")) or colorbar(fig, *a, **kw))
    monkeypatch.setattr(matplotlib.axes.Axes, "imshow", lambda ax, x, **kw: shown.append(x) or imshow(ax, x, **kw))
    assert main(["attention", "--model", "mixer_cpu_patch4_32", "--init", "mimetic", "--layers", "0",
                 "--out", str(tmp_path / "mixer")]) == 0
    assert labels == ["|token-mixing weight| (√ scale)"] and shown and all(x.min() >= 0 for x in shown)
    from structinit.analysis.token_mixing import token_mixing_maps
    from structinit.models import create_model
    from structinit.schemes.registry import init_

    assert token_mixing_maps(init_(create_model("mixer_cpu_patch4_32"), "mimetic", seed=0), layers=[0])[0].min() < 0


def test_mixer_token_mixing_maps(tmp_path):
    """A Mixer's token-mixing MLPs are drawn as one-head maps and scored against their taps."""
    out = tmp_path / "mixer"
    assert main(["attention", "--model", "mixer_cpu_patch4_32", "--init", "impulse,timm", "--layers", "0",
                 "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["comparison.png", "maps_impulse.png", "maps_timm.png"]
    table = (out / "attention.md").read_text()
    assert "| impulse | 0 | 1.000 | 1.000 |" in table and "| timm | 0 | – |" in table


def test_a_run_shown_with_dataset_none_is_drawn_on_position_only(trained_run, tmp_path):
    """``--dataset none``, as --help offers it, with a run: its maps on position alone, no overlay."""
    out = tmp_path / "none"
    assert main(["attention", "--run", str(trained_run), "--dataset", "none", "--layers", "0", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["before_after.png"]
    rows = [r for r in (out / "attention.md").read_text().splitlines() if r.startswith("| at init")]
    assert rows and "| 1.000 |" in rows[0]  # the impulse hits its targets on the position-only input


def test_a_comparison_folder_given_as_a_run_is_named_so_with_one_of_its_runs(trained_run, tmp_path, capsys):
    comparison = trained_run.parent.parent  # <compare root>/impulse/seed0: the root holds the runs
    assert main(["attention", "--run", str(comparison), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{comparison} is a comparison's folder" in err, err
    assert f"pass one of its runs, such as {trained_run}" in err


@pytest.mark.parametrize("command", ["attention", "cka"])
def test_a_full_disk_while_the_figures_are_written_is_one_line_and_exit_1(trained_run, tmp_path, capsys, monkeypatch,
                                                                          command):
    import errno

    import matplotlib.figure

    def full(self, fname, *args, **kwargs):  # as a disk that fills while the file is written: no file name
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    out = tmp_path / "figs"
    argv = (["attention", "--run", str(trained_run)] if command == "attention"
            else ["cka", str(trained_run), str(trained_run), "--images", "8"])
    assert main([*argv, "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"structinit {command}: error: {out}/"), err
    assert ".png: could not be written" in err, err  # the file, named
    assert err.endswith("could not be written (No space left on device); free space, or choose another --out")
