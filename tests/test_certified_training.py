"""Certified-robustness training and evaluation in the harness: the hinge loss,
certified accuracy in pixel space (with the normalisation's Lipschitz factor), the final ℓ₂
PGD accuracy, the --loss/--certify flags and the cpu-cifar-lipschitz recipe."""

from __future__ import annotations

import math

import pytest
import torch

from structinit.analysis.certify import certified_accuracy, input_lipschitz, pgd_l2_accuracy, pixel_cert_threshold
from structinit.harness.cli.main import main
from structinit.harness.config import ImageConfig
from structinit.harness.recipes import RECIPES, recipe
from structinit.harness.run.checkpoint import load_checkpoint
from structinit.harness.summary import format_summary, summarise
from structinit.harness.tasks import train
from structinit.harness.tasks.image import PAPER_HINGE_MARGIN, hinge_margin, load_data
from structinit.models import create_model

EPS = 36 / 255
TINY = {"channels": (4, 8), "hidden": 16}  # KWLarge on 8×8 digits, a few thousand parameters


def tiny(tmp_path, **kw) -> ImageConfig:
    return recipe("digits", **{"model": "kwlarge_cpu", "model_kwargs": dict(TINY), "init": "pytorch",
                               "loss": "hinge", "certify_eps": EPS, "epochs": 2, "train_size": 300,
                               "holdout": 200, "lr": 1e-2, "out_dir": str(tmp_path / "run"), **kw})


def rebuilt(cfg: ImageConfig, run_dir) -> tuple[torch.nn.Module, dict]:
    """The trained model of a finished run, and its evaluation data (as the run saw it)."""
    train_ds, evals = load_data(cfg)
    model = create_model(cfg.model, num_classes=10, in_chans=1, img_size=8, **cfg.model_kwargs)
    model.load_state_dict(load_checkpoint(run_dir / "checkpoint.pt")["model"])
    return model.eval(), {"train": train_ds, **evals}


def test_hinge_loss_trains_and_certifies(tmp_path):
    cfg = tiny(tmp_path, epochs=6)
    result = train(cfg, progress=False)
    history, final = result["history"], result["final"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert final["holdout_acc"] > 0.3  # 10 classes: chance is 0.1
    assert 0 <= final["holdout_cert_acc"] <= final["holdout_pgd_acc"] <= final["holdout_acc"]
    assert all("holdout_cert_acc" in row for row in history)  # every evaluation certifies
    assert "holdout_pgd_acc" not in history[0] and "holdout_pgd_acc" in history[-1]  # the final one only

    # the certified accuracy is certified_accuracy at ε in pixel space, with L = 1/min(std)
    model, data = rebuilt(cfg, tmp_path / "run")
    held = data["holdout"]
    mean = torch.tensor(held.mean).view(1, -1, 1, 1)
    std = torch.tensor(held.std).view(1, -1, 1, 1)
    with torch.no_grad():
        logits = model((held.images.float() / 255 - mean) / std)
    assert final["holdout_acc"] == pytest.approx(float((logits.argmax(1) == held.labels).float().mean()))
    by_hand = certified_accuracy(logits, held.labels, EPS, lipschitz=1 / min(held.std))
    assert final["holdout_cert_acc"] == pytest.approx(by_hand)
    assert by_hand < certified_accuracy(logits, held.labels, EPS, lipschitz=1.0) or by_hand == 0


def test_normalisation_factor():
    assert input_lipschitz((0.5, 0.25)) == 4.0
    assert input_lipschitz(torch.tensor([0.2, 0.4]).view(1, -1, 1, 1)) == pytest.approx(5.0)
    assert pixel_cert_threshold(0.1, 1.0, (0.5,)) == pytest.approx(math.sqrt(2) * 0.1 * 2)
    assert hinge_margin(ImageConfig(loss="hinge", certify_eps=0.1), (0.5,)) == pytest.approx(math.sqrt(2) * 0.2)
    assert hinge_margin(ImageConfig(loss="hinge"), (0.5,)) == PAPER_HINGE_MARGIN
    assert hinge_margin(ImageConfig(loss="hinge", hinge_margin=0.3, certify_eps=0.1), (0.5,)) == 0.3


def test_pgd_between_certified_and_clean_for_a_lipschitz_model():
    torch.manual_seed(0)
    model = create_model("kwlarge_cpu", num_classes=10, in_chans=1, img_size=8, **TINY).eval()
    x = torch.rand(64, 1, 8, 8)
    with torch.no_grad():
        logits = model(x)
    y = logits.argmax(1)  # every example right, margins of all sizes
    eps = 0.5 * float(torch.quantile(logits.topk(2).values.diff(dim=1).abs(), 0.5)) / math.sqrt(2)
    cert = certified_accuracy(logits, y, eps)
    pgd = pgd_l2_accuracy(model, x, y, eps, steps=10, seed=0)
    assert 0 < cert <= pgd <= 1.0
    assert pgd_l2_accuracy(model, x, y, eps, steps=10, seed=0) == pgd  # seeded
    # a large radius breaks the non-robust points
    assert pgd_l2_accuracy(model, x, y, 50 * eps, steps=10, clamp=None, seed=0) < pgd


def test_pgd_stays_in_the_ball_and_the_box():
    seen = []

    class Spy(torch.nn.Module):
        def forward(self, z):
            seen.append(z.detach().clone())
            return torch.cat([z.flatten(1).sum(1, keepdim=True), -z.flatten(1).sum(1, keepdim=True)], 1)

    x = torch.rand(8, 3, 4, 4)
    pgd_l2_accuracy(Spy(), x, torch.zeros(8, dtype=torch.long), 0.3, steps=5, seed=1)
    for z in seen:
        assert float((z - x).flatten(1).norm(dim=1).max()) <= 0.3 + 1e-5
        assert float(z.min()) >= 0 and float(z.max()) <= 1


def test_plain_model_gets_pgd_but_no_certificate(tmp_path):
    kwargs = {**TINY, "conv": "plain"}
    result = train(tiny(tmp_path, model_kwargs=kwargs, epochs=1), progress=False)
    assert "holdout_cert_acc" not in result["final"]
    assert result["final"]["holdout_pgd_acc"] <= result["final"]["holdout_acc"]


def test_cli_flags(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--recipe", "digits", "--model", "kwlarge_cpu", "--set", f"model_kwargs={TINY!r}",
            "--init", "pytorch", "--epochs", "1", "--set", "holdout=200", "--loss", "hinge",
            "--certify", "36/255", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    saved = load_checkpoint(out / "checkpoint.pt")["config"]
    assert saved["loss"] == "hinge" and saved["certify_eps"] == pytest.approx(EPS)
    assert "holdout_cert_acc" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--loss", "foo"], "--loss 'foo': expected 'ce'"),
    (["--certify", "-1"], "--certify -1.0: expected an ℓ₂ radius > 0"),
    (["--certify", "0"], "--certify 0.0: expected an ℓ₂ radius > 0"),
    (["--set", "hinge_margin=0.3"], "--set hinge_margin=0.3 applies to --loss 'hinge' only"),
    (["--loss", "hinge", "--set", "hinge_margin=-2"], "--set 'hinge_margin=-2': expected a margin > 0"),
    (["--certify", "36/255", "--precision", "bf16"], "--precision 'bf16' with --certify 0.1412: a certificate"),
    (["--certify", "36/255", "--precision", "fp16"], "--precision 'fp16' with --certify 0.1412: a certificate"),
])
def test_bad_values_exit_2_naming_the_flag(tmp_path, capsys, flags, message):
    assert main(["train", "--recipe", "digits", "--epochs", "1", *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "run").exists()


def test_unparsable_certify_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--certify", "36/0", "--out", str(tmp_path / "run")])
    assert info.value.code == 2
    assert "expected a number or a fraction such as 36/255" in capsys.readouterr().err


def test_recipe_exists_and_builds():
    assert "cpu-cifar-lipschitz" in RECIPES
    cfg = recipe("cpu-cifar-lipschitz", out_dir="unused")
    assert (cfg.model, cfg.loss, cfg.precision, cfg.train_size, cfg.holdout) == ("kwlarge_cpu", "hinge", "fp32",
                                                                                 5000, 10000)
    assert cfg.certify_eps == pytest.approx(EPS)
    model = create_model(cfg.model, num_classes=10, **cfg.model_kwargs)
    assert model.lipschitz_bound == 1.0
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 10)


def _run(seed, acc, cert=None, pgd=None):
    final = {"holdout_acc": acc, "holdout_loss": 1.0}
    if cert is not None:
        final |= {"holdout_cert_acc": cert, "holdout_pgd_acc": pgd}
    return {"final": final, "seed": seed, "wall_s": 60.0}


def test_summary_gets_robustness_columns_only_when_runs_have_them():
    plain = format_summary(summarise({"pytorch": [_run(0, 0.5), _run(1, 0.6)]}))
    assert "certified" not in plain and "PGD" not in plain
    assert plain.splitlines()[0] == "| init | metric | accuracy % (mean ± std) | per seed | minutes per run |"
    table = format_summary(summarise({"pytorch": [_run(0, 0.5, 0.2, 0.3), _run(1, 0.6, 0.3, 0.4)],
                                      "orthogonal": [_run(0, 0.5)]}))
    head, _, row, other = table.splitlines()
    assert "certified % (mean ± std)" in head and "PGD % (mean ± std)" in head
    assert "| 25.00 ± 7.07 | 35.00 ± 7.07 |" in row
    assert "| — | — |" in other


def test_checkpoints_from_before_the_new_fields_still_resume(tmp_path):
    from structinit.harness.run.checkpoint import check_same_config
    from structinit.harness.tasks.image import ImageTask

    now = ImageConfig().to_dict()
    old = {k: v for k, v in now.items() if k not in ImageTask.added_fields}
    check_same_config(old, now, tmp_path / "checkpoint.pt", defaults=ImageTask.added_fields)  # no error
    with pytest.raises(ValueError, match="loss differ"):
        check_same_config(old, {**now, "loss": "hinge"}, tmp_path / "checkpoint.pt", defaults=ImageTask.added_fields)
