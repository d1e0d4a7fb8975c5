"""Attention figures and training curves: they render to PNG files that decode, share one
colour scale, keep the requested panels, and reject bad input with clear errors."""

import pytest
import torch

import structinit
from structinit.analysis.curves import mean_std_curve

plt = pytest.importorskip("matplotlib.pyplot")


def impulse_model():
    model = structinit.create_model("vit_micro_patch2_16")
    structinit.init_(model, "impulse", seed=0)
    return model


def decoded_size(path):
    image = plt.imread(path)
    return image.shape[0] * image.shape[1]


def test_attention_figure_draws_full_and_zoomed_maps_per_head(tmp_path):
    model = impulse_model()
    maps = structinit.attention_maps(model, torch.randn(2, 3, 16, 16))
    layout = structinit.infer_layout(model)
    fig = structinit.attention_figure([m[0] for m in maps], layout, layer_names=["layer 0", "layer 1"],
                                      zoom=16, path=tmp_path / "a.png")
    heads = maps[0].shape[1]
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 2 * 2 * heads  # layers × heads × (full, zoom)
    assert {ax.images[0].get_array().shape for ax in panels} == {(64, 64), (16, 16)}
    assert len({ax.images[0].norm.vmax for ax in panels}) == 1  # one shared colour scale
    assert decoded_size(tmp_path / "a.png") > 0


def test_comparison_figure_has_one_row_per_init_and_zooms_to_the_grid(tmp_path):
    maps = {}
    for init in ("impulse", "mimetic", "pytorch"):
        model = structinit.create_model("vit_micro_patch2_16")
        structinit.init_(model, init, seed=0)
        maps[init] = structinit.attention_maps(model, torch.randn(1, 3, 16, 16))[0][0]
    layout = structinit.infer_layout(model)
    fig = structinit.comparison_figure(maps, layout, zoom=200, path=tmp_path / "c.png")
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 3 * maps["impulse"].shape[0]
    assert {ax.images[0].get_array().shape for ax in panels} == {(64, 64)}  # zoom clipped to N
    labels = [ax.get_ylabel() for ax in panels if ax.get_ylabel()]
    assert [lab.split("\n")[0] for lab in labels] == ["impulse", "mimetic", "pytorch"]
    assert decoded_size(tmp_path / "c.png") > 0


def test_overlay_figure_and_its_query_check(tmp_path):
    model = impulse_model()
    layout = structinit.infer_layout(model)
    probs = structinit.attention_maps(model, torch.randn(1, 3, 16, 16))[0][0]
    image = torch.rand(3, 16, 16)
    fig = structinit.overlay_figure(image, probs, layout, [0, 63], path=tmp_path / "o.png")
    assert len([ax for ax in fig.axes if ax.images]) == 2 * probs.shape[0]
    with pytest.raises(ValueError, match=r"queries=\[64\]: grid token indices must lie in 0 … 63"):
        structinit.overlay_figure(image, probs, layout, [64])


def test_maps_whose_token_count_is_not_the_layout_are_refused():
    layout = structinit.TokenLayout((8, 8), 1)
    with pytest.raises(ValueError, match=r"received 64 tokens, but the layout has 1 prefix \+ 64 grid"):
        structinit.attention_figure([torch.rand(2, 64, 64)], layout, layer_names=["x"])
    with pytest.raises(ValueError, match=r"layer_names has 2 entries for 1 layers"):
        structinit.attention_figure([torch.rand(2, 65, 65)], layout, layer_names=["x", "y"])
    with pytest.raises(ValueError, match=r"maps_by_init is empty"):
        structinit.comparison_figure({}, layout)


def run(seed, accs, losses):
    history = [{"epoch": e + 1, "train_loss": 1.0} for e in range(len(accs))]
    for row, acc, loss in zip(history, accs, losses):
        if acc is not None:
            row.update(holdout_acc=acc, holdout_loss=loss)
    return {"seed": seed, "history": history}


def test_mean_std_curve_uses_the_epochs_every_seed_evaluated():
    runs = [run(0, [0.1, None, 0.3], [2.0, None, 1.0]), run(1, [0.3, 0.4, 0.5], [1.0, 0.9, 0.8])]
    epochs, mean, std = mean_std_curve(runs, "holdout_acc")
    assert epochs == [1, 3]
    assert mean == pytest.approx([0.2, 0.4])
    assert std == pytest.approx([0.1414213, 0.1414213], rel=1e-5)


def test_curves_figure_draws_accuracy_and_loss_with_bands(tmp_path):
    runs = {"impulse": [run(0, [0.1, 0.3], [2, 1]), run(1, [0.2, 0.4], [1.5, 0.9])],
            "pytorch": [run(0, [0.1, 0.2], [2, 1.2])]}
    fig = structinit.curves_figure(runs, path=tmp_path / "curves.png")
    acc, loss = fig.axes[:2]
    assert acc.get_ylabel().startswith("held-out accuracy") and loss.get_ylabel() == "held-out loss"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["impulse (n=2)", "pytorch (n=1)"]  # below the panels
    assert acc.lines[0].get_ydata().tolist() == pytest.approx([15.0, 35.0])
    assert len(acc.collections) == 1  # a band for the init with two seeds only
    ticks = [t for t in acc.get_xticks() if acc.get_xlim()[0] <= t <= acc.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)  # two epochs: ticks at whole epochs, never 1.2
    assert decoded_size(tmp_path / "curves.png") > 0
    with pytest.raises(ValueError, match=r"runs is empty"):
        structinit.curves_figure({})
