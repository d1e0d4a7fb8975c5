"""ConvMixer as published: shapes, parameter counts, residual placement, activation before BN,
channels_last; the conv schemes' dispatch of 'impulse', freezing and reproducibility.

CPU size: one forward/backward/AdamW step of convmixer_cpu_128_6 on a batch of 128 32×32 images
took 0.73 s on one thread (1.39 s without channels_last), i.e. ≈ 12 min for 25 epochs of 5,000
images on one core, ≈ 6–7 min on 2 cores."""


import pytest
import torch
from torch import nn

import structinit
from structinit.models import ConvMixer, convmixer_num_params


def tiny(**kw):
    return structinit.create_model("convmixer_256_8", **{"dim": 16, "depth": 2, **kw})


@pytest.mark.parametrize("name, published", [("convmixer_1536_20", 51.63e6), ("convmixer_768_32", 21.11e6),
                                             ("convmixer_1024_20_ks9_p14", 24.38e6), ("convmixer_256_8", 0.594e6)])
def test_parameter_counts_match_the_formula_and_the_table(name, published):
    with torch.device("meta"):
        model = structinit.create_model(name)
    n = sum(p.numel() for p in model.parameters())
    assert n == convmixer_num_params(model.embed_dim, model.depth, model.kernel_size, model.patch_size,
                                     model.num_classes)
    assert abs(n - published) < 0.005e6


def test_k9_p1_cifar_count():
    assert round(convmixer_num_params(256, 8, 9, 1, 10) / 1e6, 3) == 0.707


def test_shapes_and_img_size_is_accepted():
    model = structinit.create_model("convmixer_cpu_128_6", img_size=32, in_chans=1, num_classes=7)
    x = torch.randn(2, 1, 32, 32)
    assert model(x).shape == (2, 7) and model.forward_features(x).shape == (2, 128, 16, 16)
    assert [n for n, _ in structinit.find_depthwise_convs(model)] == [f"blocks.{i}.dw" for i in range(6)]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_even_kernel_keeps_the_resolution():
    assert tiny(kernel_size=4).forward_features(torch.randn(1, 3, 8, 8)).shape == (1, 16, 4, 4)


def test_channels_last_matches_contiguous():
    a, b = tiny(), tiny(channels_last=False)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 16, 16)
    assert a.blocks[0].dw.weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(a(x), b(x), rtol=1e-4, atol=1e-5)


def test_residual_wraps_only_the_depthwise_branch():
    block = tiny().blocks[0].eval()
    with torch.no_grad():
        block.dw_norm.weight.zero_()
        block.dw_norm.bias.zero_()
    z = torch.randn(2, 16, 4, 4)
    torch.testing.assert_close(block(z), block.pw_norm(block.pw_act(block.pw(z))))


def test_activation_comes_before_batch_norm():
    model = tiny()
    order = [n for n, _ in model.named_children()][:3]
    assert order == ["stem", "stem_act", "stem_norm"]
    block = model.blocks[0]
    assert [n for n, _ in block.named_children()] == ["dw", "dw_act", "dw_norm", "pw", "pw_act", "pw_norm"]
    assert isinstance(block.dw_act, nn.GELU) and isinstance(block.dw_norm, nn.BatchNorm2d)
    assert isinstance(structinit.create_model("convmixer_768_32", dim=8, depth=1).blocks[0].dw_act, nn.ReLU)


def test_bad_model_argument_names_it():
    with pytest.raises(ValueError, match=r"kernel_size=0"):
        ConvMixer(8, 1, 0, 2, 10)


def test_impulse_dispatches_by_the_layers_the_model_has():
    cm = tiny()
    # a name that also initialises attention says, in the model's record, when it takes another
    # target (the model has no attention), and which layers
    structinit.init_(cm, "impulse", seed=0)
    assert structinit.get_record(cm, "init") == {
        "scheme": "impulse", "target": "conv", "layers": ["blocks.0.dw", "blocks.1.dw"],
        "why": "ConvMixer has no attention; its conv layers are initialised"}
    chosen = tiny()
    structinit.init_(chosen, "impulse", seed=0, target="conv")
    assert structinit.get_record(chosen, "init") is None  # asked for by name: nothing to say
    w = cm.blocks[0].dw.weight
    assert torch.equal((w != 0).flatten(1).sum(1), torch.ones(16, dtype=torch.long))
    vit = structinit.create_model("vit_micro_patch2_16")
    structinit.init_(vit, "impulse", seed=0)
    assert structinit.get_record(vit.blocks[0].attn)["solver"] == "analytic"
    assert structinit.impulse_init_.__name__ == "impulse_init_"
    from structinit.schemes.registry import get_scheme

    assert get_scheme("impulse", target="conv") is structinit.conv_impulse_init_
    assert get_scheme("impulse") is structinit.impulse_init_


def test_a_model_with_both_gets_its_attention_initialised_and_is_told_so():
    class Both(nn.Module):  # a conv model and a ViT side by side on the same images
        def __init__(self):
            super().__init__()
            self.conv, self.vit = tiny(), structinit.create_model("vit_micro_patch2_16")

        def forward(self, images):
            return self.conv(images) + self.vit(images)

    both = Both()
    dw = both.conv.blocks[0].dw.weight.detach().clone()
    with pytest.warns(UserWarning, match=r"attention is initialised and the conv layers are left as they are "
                                         r"\(pass target='conv'"):
        structinit.init_(both, "impulse", seed=0)
    assert torch.equal(both.conv.blocks[0].dw.weight, dw) and structinit.get_record(both.vit.blocks[0].attn)
    structinit.init_(both, "impulse", target="conv", seed=0)
    assert (both.conv.blocks[0].dw.weight != 0).flatten(1).sum(1).eq(1).all()
    with pytest.raises(ValueError, match=r"target='ssm'"):
        structinit.init_(both, "impulse", target="ssm", seed=0)


@pytest.mark.parametrize("scheme", ["impulse", "box", "gaussian", "random", "softmax", "covariance"])
def test_frozen_filters_do_not_change_and_have_no_optimizer_state(scheme):
    from structinit.harness.run.optim import param_groups

    model = tiny()
    structinit.init_(model, scheme, seed=0, frozen=True)
    convs = structinit.find_depthwise_convs(model)
    before = [c.weight.detach().clone() for _, c in convs]
    opt = torch.optim.AdamW(param_groups(model, 0.05), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(4, 3, 8, 8)), torch.tensor([0, 1, 2, 3])).backward()
        opt.step()
    for (_, c), b in zip(convs, before):
        assert torch.equal(c.weight.detach(), b)
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    assert frozen and not frozen & {id(p) for p in opt.state}
    structinit.init_(model, scheme, seed=0)  # frozen=False makes them trainable again
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("scheme", ["impulse", "box", "gaussian", "random", "softmax", "covariance"])
def test_same_seed_same_weights(scheme):
    a, b = tiny(), tiny()
    b.load_state_dict(a.state_dict())  # only the depthwise weights are written
    structinit.init_(a, scheme, seed=5)
    structinit.init_(b, scheme, generator=torch.Generator().manual_seed(5))
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), k


def test_train_a_convmixer_with_frozen_impulse_filters(tmp_path):
    """End to end through the harness: the run's init is the conv impulse scheme (dispatched by
    module kind), the frozen filters leave training unchanged, and the run resumes as finished."""
    from structinit.harness.finished import load_run, models_of
    from structinit.harness.recipes import recipe
    from structinit.harness.run.checkpoint import load_weights
    from structinit.harness.tasks import train

    cfg = recipe("digits", model="convmixer_cpu_128_6", model_kwargs={"dim": 16, "depth": 2}, epochs=1,
                 train_size=128, init="impulse", init_options={"frozen": True}, out_dir=str(tmp_path / "run"))
    result = train(cfg, progress=False)
    assert 0.0 <= result["final"]["test_acc"] <= 1.0
    initial, _ = models_of(load_run(tmp_path / "run"), (1, 8, 8), 10)
    trained, _ = load_weights(tmp_path / "run" / "model.safetensors")
    for i in range(2):
        w = trained[f"blocks.{i}.dw.weight"]
        assert torch.equal(w, initial.blocks[i].dw.weight.detach())  # frozen: not trained
        assert ((w == 0) | (w == 1)).all() and (w.flatten(1).sum(1) == 1).all()  # one-hot impulses
