"""Position reservation: the subspace q/k read position from is free of content at init, and
bad requests are rejected with the model untouched."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import structinit
from attention_modules import EncoderOnly
from rejection import check_rejected
from structinit.functional.reservation import free_width, position_basis, project_out


def cpu_model(**kw):
    model = structinit.create_model("vit_cpu_patch4_32", **kw)
    structinit.init_(model, "pytorch", seed=0)  # the 2024 setting: everything else at PyTorch defaults
    return model


def smooth_images(n=32, size=32, seed=0):
    """Synthetic content with image-like statistics: spatially correlated, unit variance."""
    x = torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))
    x = F.avg_pool2d(F.pad(x, (2, 2, 2, 2), mode="reflect"), 5, stride=1)
    return (x - x.mean()) / x.std()


def basis_of(model):
    return position_basis(model.pos_embed[0, -model.patch_embed.num_patches:])


def max_in_subspace(weight, basis):
    return float((basis.T @ weight.detach().double().reshape(weight.shape[0], -1)).abs().max())


# --------------------------------------------------------------------------- the maths
def test_position_basis_is_orthonormal_spans_ln_pe_and_is_orthogonal_to_ones():
    pe = structinit.sincos_2d((8, 8), 64, dtype=torch.float64)
    u = position_basis(pe)
    assert u.shape == (64, 15)  # rank h + w − 1
    torch.testing.assert_close(u.T @ u, torch.eye(15, dtype=torch.float64), atol=1e-10, rtol=0)
    z = F.layer_norm(pe, (64,), eps=1e-6)
    torch.testing.assert_close(z @ u @ u.T, z, atol=1e-8, rtol=0)  # every LN(PE) row lies in span(U)
    assert float((u.T @ torch.ones(64, dtype=torch.float64)).abs().max()) < 1e-10
    assert free_width(u) == 64 - 1 - 15


def test_project_out_removes_only_the_subspace():
    u = position_basis(structinit.sincos_2d((4, 4), 32, dtype=torch.float64))
    w = torch.randn(32, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    p = project_out(w, u)
    assert p.shape == w.shape and p.dtype == w.dtype
    assert max_in_subspace(p, u) < 1e-6
    torch.testing.assert_close(project_out(p, u), p)  # idempotent
    rest = (w - p).double().reshape(32, -1)
    torch.testing.assert_close(u @ (u.T @ rest), rest, atol=1e-6, rtol=0)  # what went was in span(U)


# --------------------------------------------------------------------------- reserved at init
@pytest.mark.parametrize("scheme, opts", [
    ("impulse", {}), ("impulse", {"pe_scale": 4.0}), ("impulse", {"value_init": "mimetic"}),
    ("impulse", {"solver": "closed_form"}), ("mimetic", {}),
])
def test_residual_reservation_makes_every_write_orthogonal(scheme, opts):
    model = cpu_model()
    structinit.init_(model, scheme, reserve="residual", seed=0, **opts)
    u = basis_of(model)
    writes = [model.patch_embed.proj]
    for blk in model.blocks:
        writes += [blk.attn.proj, blk.mlp.fc2]
    for m in writes:
        assert max_in_subspace(m.weight, u) < 1e-6, m
        assert max_in_subspace(m.bias, u) < 1e-6, m
    # … so in the forward pass, the residual stream minus the PE never enters the subspace
    seen = []
    hooks = [blk.register_forward_hook(lambda mod, args, out: seen.append(out)) for blk in model.blocks]
    with torch.no_grad():
        model(smooth_images(4))
    for h in hooks:
        h.remove()
    pe = model.pos_embed[0].detach().double()
    for out in seen:
        content = out.double() - pe
        assert float((content @ u).abs().max()) < 1e-4 * float(content.abs().max())


def test_patch_reservation_leaves_the_blocks_alone():
    model = cpu_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    structinit.init_(model, "impulse", reserve="patch", seed=0)
    assert max_in_subspace(model.patch_embed.proj.weight, basis_of(model)) < 1e-6
    for name, value in model.state_dict().items():
        if name.endswith(("attn.proj.weight", "mlp.fc2.weight", "mlp.fc2.bias")):
            assert torch.equal(value, before[name]), name


def test_reservation_with_mimetic_values_projects_the_planned_values():
    """value_init='mimetic' plans V/O first; the reservation projects those, not the old O."""
    plain = cpu_model()
    structinit.init_(plain, "impulse", value_init="mimetic", seed=0)
    reserved = cpu_model()
    structinit.init_(reserved, "impulse", value_init="mimetic", reserve="residual", seed=0)
    u = basis_of(reserved)
    expected = project_out(plain.blocks[0].attn.proj.weight.detach(), u)
    torch.testing.assert_close(reserved.blocks[0].attn.proj.weight.detach(), expected)
    # q/k/v are those of the unreserved init
    torch.testing.assert_close(reserved.blocks[0].attn.qkv.weight, plain.blocks[0].attn.qkv.weight)


# --------------------------------------------------------------------------- fidelity on content
@pytest.mark.parametrize("opts", [
    {}, {"pe_scale": 4.0}, {"target_mass": 0.9}, {"value_init": "mimetic"}, {"kernel_size": 5},
    {"offsets": "enumerated"}, {"per_layer_offsets": True}, {"class_token": True},
])
def test_default_impulse_hits_every_target_on_synthetic_content(opts):
    """The defaults (signed kernel, reserve='auto' = residual) at PE ×1: every head of every
    layer keeps its argmax on the target with image-like content, for every option, and with a
    class token (whose vector leaves the reserved subspace, so its logit is 0 < the target's)."""
    opts = dict(opts)
    kw = {"class_token": True, "global_pool": "token"} if opts.pop("class_token", False) else {}
    model = cpu_model(**kw)
    structinit.init_(model, "impulse", seed=0, **opts)
    hit = structinit.impulse_fidelity(model, smooth_images())["hit"]
    assert bool((hit == 1).all()), hit


def test_what_each_part_of_the_default_contributes_on_synthetic_content():
    """Measured at PE ×1, seed 0 (hit layer 1 / mean): nothing reserved 0.23 / 0.15; patch only
    1.00 / 0.50 (later blocks write into the subspace); the unsigned cosine kernel with every
    write reserved 0.69 / 0.81 (LayerNorm's per-key scale still moves its argmax)."""
    images = smooth_images()
    hits = {}
    for name, opts in {"none": {"reserve": "none"}, "patch": {"reserve": "patch"},
                       "cosine": {"signed": False, "reserve": "residual"}}.items():
        model = cpu_model()
        structinit.init_(model, "impulse", seed=0, **opts)
        s = structinit.fidelity_summary(structinit.impulse_fidelity(model, images))
        hits[name] = (s.hit_first, s.hit_mean)
        assert bool((structinit.impulse_fidelity(model)["hit"] == 1).all())  # position-only: exact
    assert hits["none"][0] < 0.5 and hits["none"][1] < 0.5
    assert hits["patch"][0] == 1.0 and hits["patch"][1] < 0.8
    assert 0.5 < hits["cosine"][0] < 0.95 and hits["cosine"][1] > hits["none"][1] + 0.4


def test_prefix_tokens_leave_the_reserved_subspace():
    model = cpu_model(class_token=True, global_pool="token")
    structinit.init_(model, "impulse", seed=0)
    u = basis_of(model)
    for t in (model.cls_token.reshape(1, -1), model.pos_embed[0, :1]):
        assert float((t.detach().double() @ u).abs().max()) < 1e-6


def test_auto_reservation_warns_and_still_inits_a_model_without_patch_embedding():
    model = EncoderOnly(32)
    pe = structinit.sincos_2d((4, 4), 32)
    with pytest.warns(UserWarning, match=r"reserve='auto' reserves nothing here.*no patch embedding"):
        structinit.init_(model, "impulse", grid=(4, 4), pos_embed=pe, pe_scale=None, seed=0)
    assert structinit.get_record(model.encoder.layers[0].self_attn) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        structinit.init_(model, "impulse", grid=(4, 4), pos_embed=pe, pe_scale=None, reserve="none", seed=0)


def test_published_solvers_reserve_nothing_by_default():
    model = cpu_model()
    before = model.patch_embed.proj.weight.detach().clone()
    structinit.init_(model, "impulse", solver="closed_form", seed=0)
    assert torch.equal(model.patch_embed.proj.weight, before)


# --------------------------------------------------------------------------- bad input
def test_reserve_unknown_mode():
    msg = check_rejected(cpu_model(), lambda m: structinit.init_(m, "impulse", reserve="all", seed=0), ValueError,
                         r"reserve='all'")
    assert all(mode in msg for mode in ("none", "patch", "residual", "auto"))


def test_reserve_when_the_pe_rank_leaves_no_room():
    """8×8 grid, D = 8: LN(sin-cos PE) spans all 7 directions LayerNorm leaves."""
    model = structinit.create_model("vit_micro_patch2_16", embed_dim=8, num_heads=2)
    for scheme in ("impulse", "mimetic"):
        check_rejected(model, lambda m, s=scheme: structinit.init_(m, s, reserve="patch", seed=0), ValueError,
                       r"reserve='patch'.*spans 7 of the 7 directions.*width 8")


def test_reserve_on_a_model_without_patch_embedding():
    pe = structinit.sincos_2d((4, 4), 32)
    check_rejected(EncoderOnly(32), lambda m: structinit.init_(m, "impulse", grid=(4, 4), pos_embed=pe, pe_scale=None,
                                                        reserve="patch", seed=0),
                   ValueError, r"no patch embedding.*reserve='none', or name it patch_embed\.proj")


def test_reserve_finds_an_unnamed_mlp_output_as_the_blocks_last_linear_to_width():
    model = cpu_model()
    model.blocks[1].mlp = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    structinit.init_(model, "impulse", reserve="residual", seed=0)
    pe = model.pos_embed.detach()[0].double()
    basis = position_basis(pe).float()
    assert (basis.T @ model.blocks[1].mlp[2].weight.detach()).abs().max() < 1e-5


class RemixedClassToken(nn.Module):
    """``block`` run after its class token is replaced by a Linear of itself (CrossViT writes the
    fused class token back into a branch so, through ``revert_projs``): a write into the stream
    that no block layout names."""

    def __init__(self, block: nn.Module, dim: int):
        super().__init__()
        self.remix, self.block = nn.Linear(dim, dim), block

    def forward(self, x):
        return self.block(torch.cat([self.remix(x[:, :1]), x[:, 1:]], dim=1))


def test_reserve_finds_a_write_into_the_stream_by_dataflow_and_the_class_token_stays_below_the_targets():
    model = cpu_model(class_token=True, global_pool="token")
    model.blocks[2] = RemixedClassToken(model.blocks[2], 128)
    structinit.init_(model, "impulse", seed=0)  # the default reservation, 'residual'
    basis = position_basis(model.pos_embed.detach()[0, 1:].double()).float()
    remix = model.blocks[2].remix
    assert (basis.T @ remix.weight.detach()).abs().max() < 1e-5 and (basis.T @ remix.bias.detach()).abs().max() < 1e-5
    assert float(structinit.impulse_fidelity(model)["hit"].min()) == 1.0  # the model's own maps, every layer


def test_reserve_on_a_block_without_known_mlp_output():
    model = cpu_model()
    model.blocks[1].mlp = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 64))
    check_rejected(model, lambda m: structinit.init_(m, "impulse", reserve="residual", seed=0), ValueError,
                   r"block 'blocks\.1'.*no MLP output.*reserve='patch'")


class WrappedMHA(nn.Module):
    """``nn.MultiheadAttention`` in a module of its own that holds nothing else."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


def test_the_block_around_an_attention_wrapped_alone_is_the_wrappers_parent():
    """The wrapper holds the attention and nothing else, so the MLP output that writes into the
    same stream is found in the block around the wrapper; the reservation keeps the class token
    below every target."""
    model = cpu_model(class_token=True, global_pool="token")
    for block in model.blocks:
        block.attn = WrappedMHA(128, block.attn.num_heads)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "reserve='auto' reserves nothing here"
        structinit.init_(model, "impulse", seed=0)
    basis = position_basis(model.pos_embed.detach()[0, 1:].double()).float()
    assert max(float((basis.T @ b.mlp.fc2.weight.detach()).abs().max()) for b in model.blocks) < 1e-5
    assert float(structinit.impulse_fidelity(model)["hit"].min()) == 1.0  # the model's own maps, every layer
    # Without it the class token takes the argmax, and the advice says that no reservation was applied.
    model = cpu_model(class_token=True, global_pool="token")
    for block in model.blocks:
        block.attn = WrappedMHA(128, block.attn.num_heads)
    check_rejected(model, lambda m: structinit.init_(m, "impulse", reserve="none", seed=0), ValueError,
                   r"a prefix token \(a class or register token\) took the argmax.*no reservation, which keeps it "
                   r"below, was applied: reserve='residual' or 'patch'")
