"""The impulse scheme: every head's attention map on the position-only pseudo input peaks on
its k×k-kernel target (``structinit.init_(model, "impulse", solver=...)``).

Attention maps are recomputed here from the raw ``attn.qkv`` parameters (not through the
library's adapters) so that a layout bug in the adapters cannot hide a wrong map."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import structinit
from structinit.posembed import sincos_frequencies
from structinit.solvers.analytic import analytic_qk, ridge_readout


# --------------------------------------------------------------------------- helpers
def small_vit(img_size=16, patch_size=2, embed_dim=32, depth=2, num_heads=2, **kw):
    opts = dict(num_classes=10, class_token=False, global_pool="avg", pos_embed="sincos")
    opts.update(kw)
    return structinit.VisionTransformer(img_size=img_size, patch_size=patch_size, embed_dim=embed_dim,
                                        depth=depth, num_heads=num_heads, **opts)


def grid_pe(model) -> torch.Tensor:
    pe = model.pos_embed.detach().reshape(-1, model.embed_dim)
    return pe[pe.shape[0] - model.patch_embed.num_patches:]


def pseudo_input(model) -> torch.Tensor:
    """LayerNorm of the grid rows of the PE: what each layer sees without image content."""
    pe = grid_pe(model).float()
    return F.layer_norm(pe, (pe.shape[-1],), eps=1e-6)


def head_maps(attn, x: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ · scale) per head, (heads, N, N), from the fused qkv Linear itself."""
    n = x.shape[0]
    inner = attn.num_heads * attn.head_dim
    qkv = F.linear(x, attn.qkv.weight, attn.qkv.bias)
    q = qkv[:, :inner].reshape(n, attn.num_heads, attn.head_dim).transpose(0, 1)
    k = qkv[:, inner:2 * inner].reshape(n, attn.num_heads, attn.head_dim).transpose(0, 1)
    return (q @ k.transpose(-1, -2) * attn.scale).softmax(-1)


def hit_and_mass(model, offsets_per_layer=None):
    """(hit, mass) per layer×head, computed independently of structinit.impulse_fidelity."""
    grid = model.patch_embed.grid_size
    x = pseudo_input(model)
    hits, masses = [], []
    for i, blk in enumerate(model.blocks):
        offs = offsets_per_layer[i] if offsets_per_layer else blk.attn.structinit_impulse["offsets"]
        probs = head_maps(blk.attn, x)
        hrow, mrow = [], []
        for h, off in enumerate(offs):
            t = structinit.target_index(grid, off)
            rows = torch.nonzero(t >= 0).squeeze(1)
            hrow.append((probs[h, rows].argmax(-1) == t[rows]).float().mean().item())
            mrow.append(probs[h, rows, t[rows]].mean().item())
        hits.append(hrow)
        masses.append(mrow)
    return torch.tensor(hits), torch.tensor(masses)


def logits_from_factors(z, wq, wk):
    """(heads, N, N) logits (z Wq[h])(z Wk[h])ᵀ."""
    return torch.stack([(z @ wq[h]) @ (z @ wk[h]).T for h in range(wq.shape[0])])


def ln_sincos(grid, dim):
    return F.layer_norm(structinit.sincos_2d(grid, dim, dtype=torch.float64), (dim,), eps=1e-6)


def target_margins(logits, grid, offsets):
    """Per head: min over rows with an in-grid target of (target logit − best other logit)."""
    out = []
    for h, off in enumerate(offsets):
        t = structinit.target_index(grid, off)
        rows = torch.nonzero(t >= 0).squeeze(1)
        row_logits = logits[h, rows].clone()
        on_target = row_logits[torch.arange(len(rows)), t[rows]].clone()
        row_logits[torch.arange(len(rows)), t[rows]] = -float("inf")
        out.append(float((on_target - row_logits.max(-1).values).min()))
    return out


# --------------------------------------------------------------------------- all solvers
SOLVER_CASES = [
    # (id, model factory, solver, options, minimum hit, minimum mean mass)
    ("analytic-micro", lambda: structinit.create_model("vit_micro_patch2_16"), "analytic", {}, 1.0, 0.49),
    ("analytic-cpu", lambda: structinit.create_model("vit_cpu_patch2_8", depth=2), "analytic", {}, 1.0, 0.49),
    ("gd-micro", lambda: structinit.create_model("vit_micro_patch2_16"), "gd", dict(steps=200, lr=1e-2), 0.99, 0.2),
    ("gd-cpu", lambda: structinit.create_model("vit_cpu_patch2_8", depth=2), "gd", dict(steps=200, lr=1e-2),
     0.99, 0.2),
    # closed_form scales a *learned* PE by 18 (2025 code); with the fixed sin-cos PE its maps are
    # nearly uniform (published behaviour), so it is checked on learned-PE models with D ≥ N.
    ("closed_form-cpu-learn", lambda: structinit.create_model("vit_cpu_patch2_8", depth=2, pos_embed="learn"),
     "closed_form", {}, 0.99, 0.9),
    ("closed_form-tiny-learn",
     lambda: structinit.create_model("vit_tiny_patch4_32", depth=2, pos_embed="learn"), "closed_form", {}, 0.99, 0.9),
]


@pytest.mark.parametrize("factory,solver,options,min_hit,min_mass",
                         [c[1:] for c in SOLVER_CASES], ids=[c[0] for c in SOLVER_CASES])
def test_every_solver_peaks_on_the_targets(factory, solver, options, min_hit, min_mass):
    torch.manual_seed(0)
    model = factory()
    structinit.init_(model, "impulse", solver=solver, seed=0, **options)
    n = model.patch_embed.num_patches

    fid = structinit.impulse_fidelity(model)
    hit, mass = hit_and_mass(model)
    assert hit.shape == (len(model.blocks), model.blocks[0].attn.num_heads)
    # the library's diagnostic agrees with the independent recomputation
    torch.testing.assert_close(fid["hit"], hit, atol=1e-6, rtol=0)
    torch.testing.assert_close(fid["mass"], mass, atol=1e-4, rtol=0)
    assert hit.min().item() >= min_hit, hit
    assert mass.mean().item() >= min_mass, mass
    assert mass.mean().item() > 4 / n  # far above chance (1/N)
    for blk in model.blocks:
        assert blk.attn.structinit_impulse["solver"] == solver


@pytest.mark.slow
def test_gd_full_2024_schedule_reaches_the_targets():
    """The 2024 recipe (10,000 Adam steps, lr 1e-4, renorm every 100) on the paper's model:
    the published code reaches ~96 % hit with mass ~0.27."""
    model = structinit.create_model("vit_tiny_patch2_32", depth=2)
    structinit.init_(model, "impulse", solver="gd", seed=0)
    fid = structinit.impulse_fidelity(model)
    assert fid["hit"].min().item() >= 0.9, fid["hit"]
    # the periodic renormalisation caps the logits: the maps stay soft (~0.27 in the paper)
    assert 0.2 < fid["mass"].mean().item() < 0.4, fid["mass"]


# --------------------------------------------------------------------------- analytic solver
@pytest.mark.parametrize("target_mass", [0.3, 0.5, 0.9])
def test_analytic_mass_equals_requested_target_mass(target_mass):
    model = structinit.create_model("vit_micro_patch2_16")
    structinit.init_(model, "impulse", solver="analytic", target_mass=target_mass, seed=3)
    hit, mass = hit_and_mass(model)
    assert hit.min().item() == 1.0
    assert abs(mass.mean().item() - target_mass) < 1e-3, mass
    fid = structinit.impulse_fidelity(model)
    assert abs(fid["mass"].mean().item() - target_mass) < 1e-3


def test_analytic_sharpness_grows_with_target_mass():
    norms, masses = [], []
    for tm in (0.2, 0.6):
        model = structinit.create_model("vit_micro_patch2_16")
        structinit.init_(model, "impulse", target_mass=tm, offsets=[(0, 1), (1, -1)], seed=0)
        norms.append(model.blocks[0].attn.qkv.weight[:32].norm().item())
        masses.append(hit_and_mass(model)[1].mean().item())
    assert norms[1] > norms[0]  # sharper maps need larger q/k weights
    assert masses[1] > masses[0] + 0.3


def test_analytic_argmax_is_target_index_for_every_row():
    model = structinit.create_model("vit_micro_patch2_16")
    structinit.init_(model, "impulse", solver="analytic", seed=11)
    grid = model.patch_embed.grid_size
    x = pseudo_input(model)
    for blk in model.blocks:
        offs = blk.attn.structinit_impulse["offsets"]
        probs = head_maps(blk.attn, x)
        for h, off in enumerate(offs):
            t = structinit.target_index(grid, off)
            for row in range(grid[0] * grid[1]):
                if t[row] >= 0:
                    assert int(probs[h, row].argmax()) == int(t[row]), (h, off, row)


@pytest.mark.parametrize("solver", ["analytic", "gd", "closed_form"])
def test_explicit_offsets_are_honoured_and_recorded(solver):
    offsets = [(1, 1), (0, -1), (-1, 0), (1, 0)]
    model = structinit.create_model("vit_cpu_patch2_8", depth=2, pos_embed="learn")
    opts = dict(steps=200, lr=1e-2) if solver == "gd" else {}
    structinit.init_(model, "impulse", solver=solver, offsets=offsets, seed=0, **opts)
    for blk in model.blocks:
        rec = blk.attn.structinit_impulse
        assert [tuple(o) for o in rec["offsets"]] == offsets
        assert tuple(rec["grid"]) == (4, 4) and rec["num_prefix_tokens"] == 0
    hit, _ = hit_and_mass(model, [offsets] * len(model.blocks))
    assert hit.min().item() >= 0.99


def test_explicit_offsets_change_the_maps():
    """The map follows the requested offsets: swapping them swaps which token wins."""
    a = structinit.create_model("vit_micro_patch2_16")
    b = structinit.create_model("vit_micro_patch2_16")
    structinit.init_(a, "impulse", offsets=[(0, 1), (-1, -1)], seed=0)
    structinit.init_(b, "impulse", offsets=[(-1, -1), (0, 1)], seed=0)
    x = pseudo_input(a)
    pa, pb = head_maps(a.blocks[0].attn, x), head_maps(b.blocks[0].attn, x)
    torch.testing.assert_close(pa[0], pb[1], atol=1e-5, rtol=0)
    assert not torch.allclose(pa[0], pb[0], atol=1e-2)


def test_enumerated_offsets_order():
    model = structinit.create_model("vit_cpu_patch2_8", depth=2)
    structinit.init_(model, "impulse", solver="analytic", offsets="enumerated", seed=0)
    expected = [(0, 0), (-1, 0), (0, 1), (0, -1)]  # centre, up, right, left
    for blk in model.blocks:
        assert [tuple(o) for o in blk.attn.structinit_impulse["offsets"]] == expected
    assert hit_and_mass(model)[0].min().item() == 1.0
    # closed_form enumerates by default
    model = structinit.create_model("vit_cpu_patch2_8", depth=2, pos_embed="learn")
    structinit.init_(model, "impulse", solver="closed_form", seed=0)
    assert [tuple(o) for o in model.blocks[0].attn.structinit_impulse["offsets"]] == expected


def test_random_offsets_shared_across_layers_unless_per_layer():
    model = structinit.create_model("vit_micro_patch2_16", depth=4)  # 8×8 grid, 2 heads
    structinit.init_(model, "impulse", kernel_size=5, seed=5)
    recs = [tuple(map(tuple, b.attn.structinit_impulse["offsets"])) for b in model.blocks]
    assert len(set(recs)) == 1
    assert all(max(abs(dy), abs(dx)) <= 2 for dy, dx in recs[0])
    structinit.init_(model, "impulse", kernel_size=3, per_layer_offsets=True, seed=5)
    recs = [tuple(map(tuple, b.attn.structinit_impulse["offsets"])) for b in model.blocks]
    assert len(set(recs)) > 1


@pytest.mark.parametrize("kernel_size,offsets", [(5, [(2, -2), (-1, 2)]), (7, [(3, -3), (-2, 3)]), (7, "random")])
def test_larger_kernels(kernel_size, offsets):
    model = structinit.create_model("vit_micro_patch2_16")  # 8×8 grid
    structinit.init_(model, "impulse", kernel_size=kernel_size, offsets=offsets, seed=2)
    rec = model.blocks[0].attn.structinit_impulse["offsets"]
    if offsets != "random":
        assert [tuple(o) for o in rec] == offsets
    assert all(max(abs(dy), abs(dx)) <= kernel_size // 2 for dy, dx in rec)
    hit, mass = hit_and_mass(model)
    assert hit.min().item() == 1.0
    assert abs(mass.mean().item() - 0.5) < 1e-3


def test_offsets_outside_kernel_rejected_and_model_untouched():
    model = structinit.create_model("vit_micro_patch2_16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError):
        structinit.init_(model, "impulse", kernel_size=3, offsets=[(2, 0), (0, 0)], seed=0)
    with pytest.raises(ValueError):
        structinit.init_(model, "impulse", kernel_size=9, seed=0)  # larger than the 8×8 grid
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_layers_option_only_changes_those_layers():
    torch.manual_seed(0)
    model = structinit.create_model("vit_micro_patch2_16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    structinit.init_(model, "impulse", layers=[0], pe_scale=None, seed=0)
    after = model.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == {"blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias"}
    assert hasattr(model.blocks[0].attn, "structinit_impulse")
    assert not hasattr(model.blocks[1].attn, "structinit_impulse")
    fid = structinit.impulse_fidelity(model, layers=[0])
    assert fid["hit"].min().item() == 1.0
    # negative indices select from the end
    model2 = structinit.create_model("vit_micro_patch2_16")
    before2 = {k: v.clone() for k, v in model2.state_dict().items()}
    structinit.init_(model2, "impulse", layers=[-1], pe_scale=None, seed=0)
    assert torch.equal(model2.blocks[0].attn.qkv.weight, before2["blocks.0.attn.qkv.weight"])
    assert not torch.equal(model2.blocks[1].attn.qkv.weight, before2["blocks.1.attn.qkv.weight"])


@pytest.mark.parametrize("solver", ["analytic", "gd", "closed_form"])
def test_qk_biases_zero_value_and_rest_untouched(solver):
    torch.manual_seed(0)
    model = structinit.create_model("vit_cpu_patch2_8", depth=2, pos_embed="learn")
    d = model.embed_dim
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert before["blocks.0.attn.qkv.bias"][: 2 * d].abs().max() > 0  # constructor bias is not zero
    opts = dict(steps=20, lr=1e-2) if solver == "gd" else dict(value_init="keep")
    structinit.init_(model, "impulse", solver=solver, seed=0, **opts)
    after = model.state_dict()
    for i in range(2):
        p = f"blocks.{i}.attn."
        assert torch.count_nonzero(after[p + "qkv.bias"][: 2 * d]) == 0
        # value rows, value bias and the output projection are kept
        assert torch.equal(after[p + "qkv.weight"][2 * d:], before[p + "qkv.weight"][2 * d:])
        assert torch.equal(after[p + "qkv.bias"][2 * d:], before[p + "qkv.bias"][2 * d:])
        assert torch.equal(after[p + "proj.weight"], before[p + "proj.weight"])
        assert torch.equal(after[p + "proj.bias"], before[p + "proj.bias"])
        assert not torch.equal(after[p + "qkv.weight"][:d], before[p + "qkv.weight"][:d])
    untouched = [k for k in after if "attn" not in k and k != "pos_embed"]
    assert untouched
    for k in untouched:
        assert torch.equal(after[k], before[k]), k


def test_pe_scale_writes_scaled_sincos_into_grid_rows():
    torch.manual_seed(0)
    model = small_vit(class_token=True, global_pool="token", pos_embed="learn")
    cls_row = model.pos_embed[0, 0].detach().clone()
    structinit.init_(model, "impulse", pe_scale=2.5, seed=0)
    table = structinit.sincos_2d((8, 8), 32)
    torch.testing.assert_close(model.pos_embed[0, 1:].detach(), 2.5 * table, atol=1e-6, rtol=1e-6)
    assert torch.equal(model.pos_embed[0, 0].detach(), cls_row)  # the class token's row is not on the grid
    assert model.pos_embed.requires_grad  # still learned
    assert hit_and_mass(model)[0].min().item() == 1.0
    # default pe_scale = 4 also on a fixed sin-cos PE
    fixed = structinit.create_model("vit_micro_patch2_16")
    structinit.init_(fixed, "impulse", seed=0)
    torch.testing.assert_close(fixed.pos_embed[0].detach(), 4.0 * table, atol=1e-6, rtol=1e-6)


def test_pe_scale_none_leaves_pos_embed_unchanged():
    fixed = structinit.create_model("vit_micro_patch2_16")
    pe = fixed.pos_embed.detach().clone()
    structinit.init_(fixed, "impulse", pe_scale=None, seed=0)
    assert torch.equal(fixed.pos_embed.detach(), pe)
    assert hit_and_mass(fixed)[0].min().item() == 1.0  # the structure is read out of the fixed table

    # a learned PE that carries the sin-cos structure (plus a little noise) is read, not rewritten
    torch.manual_seed(1)
    learned = small_vit(class_token=True, global_pool="token", pos_embed="learn")
    with torch.no_grad():
        learned.pos_embed[0, 1:] = 3 * structinit.sincos_2d((8, 8), 32) + 0.01 * torch.randn(64, 32)
    pe = learned.pos_embed.detach().clone()
    structinit.init_(learned, "impulse", pe_scale=None, seed=0)
    assert torch.equal(learned.pos_embed.detach(), pe)
    assert torch.isfinite(learned.blocks[0].attn.qkv.weight).all()
    assert hit_and_mass(learned)[0].mean().item() > 0.9


def test_closed_form_scales_learned_pe_by_18_and_leaves_fixed_pe():
    torch.manual_seed(0)
    learned = structinit.create_model("vit_cpu_patch2_8", depth=2, pos_embed="learn")
    pe = learned.pos_embed.detach().clone()
    structinit.init_(learned, "impulse", solver="closed_form", seed=0)
    torch.testing.assert_close(learned.pos_embed.detach(), 18.0 * pe, atol=1e-6, rtol=1e-6)
    fixed = structinit.create_model("vit_cpu_patch2_8", depth=2)
    pe = fixed.pos_embed.detach().clone()
    structinit.init_(fixed, "impulse", solver="closed_form", seed=0)
    assert torch.equal(fixed.pos_embed.detach(), pe)


def vo_composite(attn):
    d = attn.qkv.in_features
    inner = attn.num_heads * attn.head_dim
    wv = attn.qkv.weight[2 * inner:3 * inner].detach().double().T  # (D, inner): x ↦ x Wv
    wo = attn.proj.weight.detach().double().T  # (inner, D)
    return wv @ wo, d


@pytest.mark.parametrize("solver", ["analytic", "gd"])
def test_value_init_mimetic_composes_to_gamma_z_minus_delta_i(solver):
    torch.manual_seed(0)
    model = structinit.create_model("vit_cpu_patch2_8", depth=2)
    opts = dict(steps=20, lr=1e-2) if solver == "gd" else {}
    structinit.init_(model, "impulse", solver=solver, value_init="mimetic", seed=0, **opts)
    composites = []
    for blk in model.blocks:
        c, d = vo_composite(blk.attn)
        composites.append(c)
        # γZ − δI with γ = δ = 0.4, Z_ij ~ U(±√(3/D)): |tr + δD| ≤ γ√(3D), diagonal in −δ ± γ√(3/D)
        assert abs(c.trace().item() + 0.4 * d) <= 0.4 * (3 * d) ** 0.5
        assert abs(c.trace().item() + 0.4 * d) < 0.05 * 0.4 * d
        diag = c.diagonal()
        assert (diag < 0).all()
        assert ((diag + 0.4).abs() <= 0.4 * (3 / d) ** 0.5 + 1e-5).all()
        off = c - torch.diag(diag)
        assert off.abs().max().item() <= 0.4 * (3 / d) ** 0.5 + 1e-5
        # off-diagonal entries have variance γ²/D
        rms = (off.pow(2).sum() / (d * d - d)).sqrt().item()
        assert abs(rms - 0.4 / d**0.5) < 0.1 * 0.4 / d**0.5
        assert torch.count_nonzero(blk.attn.qkv.bias[2 * d:]) == 0
        assert torch.count_nonzero(blk.attn.proj.bias) == 0
    assert not torch.allclose(composites[0], composites[1])  # a fresh draw per layer
    assert hit_and_mass(model)[0].min().item() >= 0.99  # q/k unaffected


def test_value_init_keep_and_invalid_name():
    model = structinit.create_model("vit_micro_patch2_16")
    v_before = model.blocks[0].attn.qkv.weight[64:].detach().clone()
    o_before = model.blocks[0].attn.proj.weight.detach().clone()
    structinit.init_(model, "impulse", value_init="keep", seed=0)
    assert torch.equal(model.blocks[0].attn.qkv.weight[64:], v_before)
    assert torch.equal(model.blocks[0].attn.proj.weight, o_before)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError):
        structinit.init_(model, "impulse", value_init="bogus", seed=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, snapshot[k]), k


# --------------------------------------------------------------------------- the 2-D analytic kernel
@pytest.mark.parametrize("dim,heads,grid,kernel", [(64, 4, (9, 9), 5), (64, 2, (7, 10), 3), (192, 3, (12, 12), 7)])
def test_analytic_kernel_argmax_exactly_at_target(dim, heads, grid, kernel):
    taps = structinit.kernel_offsets(kernel)
    offsets = [taps[(7 * h + 3) % len(taps)] for h in range(heads)]
    z = ln_sincos(grid, dim)
    wq, wk = analytic_qk(z, grid, offsets, dim // heads, sincos_frequencies(dim))
    assert wq.shape == wk.shape == (heads, dim, dim // heads)
    logits = logits_from_factors(z, wq, wk)
    for h, off in enumerate(offsets):
        t = structinit.target_index(grid, off)
        rows = torch.nonzero(t >= 0).squeeze(1)
        assert torch.equal(logits[h, rows].argmax(-1), t[rows]), (h, off)
    assert min(target_margins(logits, grid, offsets)) > 0


def _shift_windows(logits, grid, p1, p2, reach=2):
    """Logits of rows p1 and p2 at the same relative displacements δ, |δ| ≤ reach."""
    w = grid[1]
    a, b = [], []
    for dy in range(-reach, reach + 1):
        for dx in range(-reach, reach + 1):
            a.append(logits[p1[0] * w + p1[1], (p1[0] + dy) * w + p1[1] + dx])
            b.append(logits[p2[0] * w + p2[1], (p2[0] + dy) * w + p2[1] + dx])
    return torch.stack(a), torch.stack(b)


def test_analytic_kernel_is_shift_invariant_on_raw_sincos():
    """Control for the next test: read out of the *raw* sin-cos table the kernel is
    κ(p, p') = f(p' − p) up to the small ridge bias, with a margin ≈ 1 at the target."""
    dim, grid = 64, (10, 10)
    offsets = [(0, 0), (-1, 1), (2, 0), (1, -2)]
    pe = structinit.sincos_2d(grid, dim, dtype=torch.float64)
    wq, wk = analytic_qk(pe, grid, offsets, dim // 4, sincos_frequencies(dim))
    logits = logits_from_factors(pe, wq, wk)
    for h in range(4):
        a, b = _shift_windows(logits[h], grid, (2, 2), (7, 7))
        spread = (a.max() - a.min()).item()
        assert (a - b).abs().max().item() < 0.01 * spread
    assert min(target_margins(logits, grid, offsets)) > 0.9


@pytest.mark.parametrize("dim,heads", [(64, 4), (192, 3)])
def test_analytic_readout_through_layernorm_is_the_ridge_solution(dim, heads):
    """Through LayerNorm no linear readout is exact (each token is divided by its own std), so
    the documented contract is: the readout R = Zᵀ(ZZᵀ + λI)⁻¹ solves the ridge normal equations
    Zᵀ(Z R T − T) + λ R T = 0 for any feature table T, it sums to zero over channels (LayerNorm's
    mean is ignored), and the kernel stays shift-invariant to within the ~±10 % token-scale
    spread (the argmax itself is guaranteed separately by impulse_qk's check)."""
    grid = (10, 10)
    z = ln_sincos(grid, dim)
    readout = ridge_readout(z, ridge=2e-3)
    feats = torch.randn(z.shape[0], 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w = readout @ feats
    lam = 2e-3 * (z @ z.T).diagonal().mean()
    residual = z.T @ (z @ w - feats) + lam * w
    assert residual.abs().max() < 1e-8 * (z.T @ feats).abs().max()
    assert w.sum(0).abs().max() < 1e-9
    offsets = [(0, 0), (-1, 1), (2, 0), (1, -2)][:heads]
    wq, wk = analytic_qk(z, grid, offsets, dim // heads, sincos_frequencies(dim))
    logits = logits_from_factors(z, wq, wk)
    for h in range(heads):
        a, b = _shift_windows(logits[h], grid, (2, 2), (7, 7))
        spread = (a.max() - a.min()).item()
        assert ((a - a.mean()) - (b - b.mean())).abs().max().item() < 0.15 * spread


@pytest.mark.parametrize("dim,heads,side", [(16, 2, 10), (16, 1, 8), (12, 1, 8), (8, 1, 8)])
def test_analytic_small_embed_dim_hits_every_target_or_refuses(dim, heads, side):
    """A width too small for LayerNorm's per-token scale to be absorbed by the kernel margin must
    not silently give a broken structure: either every head's argmax is on its target with the
    position-only pseudo input, or the init raises naming the size, and the model is untouched."""
    model = small_vit(img_size=side, patch_size=1, embed_dim=dim, depth=1, num_heads=heads, num_classes=0)
    taps = structinit.kernel_offsets(3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        structinit.init_(model, "impulse", offsets=taps[-heads:], seed=0)
    except ValueError as err:
        assert f"head_dim={dim // heads}" in str(err) and "misses" in str(err)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        return
    hit, _ = hit_and_mass(model)
    assert hit.min().item() == 1.0, hit


def _dims_heads():
    return st.tuples(st.integers(1, 4), st.integers(2, 16)).map(lambda t: (4 * t[0] * t[1], t[0])).filter(
        lambda t: t[0] // t[1] >= 8 and t[0] <= 64)


# Derandomised (a fixed example set, so the suite is stable) and without shrinking (each example
# runs a solver; the explicit small-width test above pins the known failures deterministically).
NO_SHRINK = dict(deadline=None, derandomize=True, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                 suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])


@settings(max_examples=15, **NO_SHRINK)
@given(dh=_dims_heads(), side=st.integers(3, 10), data=st.data())
def test_property_analytic_model_hits_every_target(dh, side, data):
    dim, heads = dh
    kernel = data.draw(st.sampled_from([k for k in (3, 5, 7) if k <= side]), label="kernel")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    model = small_vit(img_size=side, patch_size=1, embed_dim=dim, depth=1, num_heads=heads, num_classes=0)
    structinit.init_(model, "impulse", kernel_size=kernel, seed=seed)
    hit, mass = hit_and_mass(model)
    assert hit.min().item() == 1.0, (hit, model.blocks[0].attn.structinit_impulse["offsets"])
    assert abs(mass.mean().item() - 0.5) < 1e-3


@settings(max_examples=15, **NO_SHRINK)
@given(dh=_dims_heads(), h=st.integers(3, 10), w=st.integers(3, 10), data=st.data())
def test_property_analytic_kernel_non_square_grids(dh, h, w, data):
    dim, heads = dh
    kernel = data.draw(st.sampled_from([k for k in (3, 5, 7) if k <= min(h, w)]), label="kernel")
    offsets = data.draw(st.lists(st.sampled_from(structinit.kernel_offsets(kernel)), min_size=heads,
                                 max_size=heads), label="offsets")
    z = ln_sincos((h, w), dim)
    wq, wk = analytic_qk(z, (h, w), offsets, dim // heads, sincos_frequencies(dim))
    logits = logits_from_factors(z, wq, wk)
    assert min(target_margins(logits, (h, w), offsets)) > 0


# --------------------------------------------------------------------------- gd pseudo inputs
@pytest.mark.parametrize("pseudo", ["uniform", "gaussian", "pe+uniform", "pe+gaussian"])
def test_gd_pseudo_input_ablations(pseudo):
    base = structinit.create_model("vit_micro_patch2_16")
    structinit.init_(base, "impulse", solver="gd", steps=30, lr=1e-2, pseudo="pe", seed=0)
    model = structinit.create_model("vit_micro_patch2_16")
    before = model.blocks[0].attn.qkv.weight.detach().clone()
    structinit.init_(model, "impulse", solver="gd", steps=30, lr=1e-2, pseudo=pseudo, seed=0)
    w = model.blocks[0].attn.qkv.weight.detach()
    assert torch.isfinite(w).all()
    assert not torch.equal(w[:64], before[:64])
    # the pseudo input matters: same seed and offsets, different fit than with pseudo='pe'
    assert (base.blocks[0].attn.structinit_impulse["offsets"] == model.blocks[0].attn.structinit_impulse["offsets"])
    assert not torch.allclose(w[:64], base.blocks[0].attn.qkv.weight[:64], atol=1e-4)


def test_gd_unknown_pseudo_input_rejected():
    model = structinit.create_model("vit_micro_patch2_16")
    with pytest.raises(ValueError):
        structinit.init_(model, "impulse", solver="gd", steps=2, pseudo="noise", seed=0)


def test_gd_share_solution_copies_one_fit_to_every_layer():
    model = structinit.create_model("vit_micro_patch2_16")
    structinit.init_(model, "impulse", solver="gd", steps=20, lr=1e-2, seed=0)
    assert torch.equal(model.blocks[0].attn.qkv.weight[:64], model.blocks[1].attn.qkv.weight[:64])
    structinit.init_(model, "impulse", solver="gd", steps=20, lr=1e-2, share_solution=False, seed=0)
    assert not torch.equal(model.blocks[0].attn.qkv.weight[:64], model.blocks[1].attn.qkv.weight[:64])
