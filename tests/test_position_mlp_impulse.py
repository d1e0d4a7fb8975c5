"""Impulse through a continuous position bias (an MLP that generates the relative bias table, as
Swin-V2 and timm's relpos-MLP ViTs do), on hand-built attention: the fitted table is the target,
the least-squares residual is reported, the model's own maps hit the offsets with the mass asked
for (W_q = 0 for dot-product attention, a bounded logit scale for cosine attention), and every
refusal leaves the model bit-identical."""

import doctest
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import structinit
import structinit.functional.position_mlp as position_mlp
from rejection import check_rejected
from structinit.adapters.observe import real_maps
from structinit.adapters.position_mlp import find_position_mlp
from structinit.functional.position_mlp import fit_last_layer, position_mlp_features
from structinit.functional.relative import relative_position_index
from structinit.functional.targets import target_index


def log_coords(h: int, w: int) -> torch.Tensor:
    """Swin-V2's (1, 2h − 1, 2w − 1, 2) log-spaced offset coordinates."""
    ys = torch.arange(-(h - 1), h, dtype=torch.float32) / max(h - 1, 1)
    xs = torch.arange(-(w - 1), w, dtype=torch.float32) / max(w - 1, 1)
    table = torch.stack(torch.meshgrid(ys, xs, indexing="ij"), -1)[None] * 8
    return torch.sign(table) * torch.log2(table.abs() + 1) / 3


class CpbAttention(nn.Module):
    """Attention over an h×w grid whose relative bias is ``gain·act(cpb_mlp(coords))[index]``:
    dot-product (identity table) or Swin-V2's cosine attention (16·sigmoid table)."""

    def __init__(self, dim, heads, window, hidden=32, cosine=False, zero_first_bias=False):
        super().__init__()
        self.num_heads, self.window_size, self.cosine = heads, window, cosine
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.cpb_mlp = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, heads, bias=False))
        if zero_first_bias:  # the package inits: features homogeneous in the coordinates
            nn.init.zeros_(self.cpb_mlp[0].bias)
        if cosine:
            self.logit_scale = nn.Parameter(torch.full((heads, 1, 1), math.log(10.0)))
        self.register_buffer("relative_coords_table", log_coords(*window), persistent=False)
        self.register_buffer("relative_position_index", relative_position_index(*window), persistent=False)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        if self.cosine:
            attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
            attn = attn * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        else:
            attn = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
        bias = table[self.relative_position_index.view(-1)].view(n, n, -1).permute(2, 0, 1)
        attn = attn + (16 * torch.sigmoid(bias) if self.cosine else bias)
        return self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


class CpbNet(nn.Module):
    """Patch conv → ``depth`` pre-norm CPB attention blocks over the whole grid → mean → head."""

    def __init__(self, grid=(4, 4), dim=16, heads=2, depth=2, patch=2, **attn):
        super().__init__()
        self.image_size = (grid[0] * patch, grid[1] * patch)
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.attns = nn.ModuleList(CpbAttention(dim, heads, grid, **attn) for _ in range(depth))
        self.head = nn.Linear(dim, 3)

    def forward(self, img):
        x = self.patch_embed(img).flatten(2).transpose(1, 2)
        for norm, attn in zip(self.norms, self.attns):
            x = x + attn(norm(x))
        return self.head(x.mean(1))


def images(model, n=4, seed=0):
    h, w = model.image_size
    return torch.randn(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def own_maps(model, x):
    """Every attention layer's probabilities as the model's own forward computed them."""
    chosen = structinit.find_attention_layers(model)
    return [m.probs for m in real_maps(model, x, chosen)]


def target_stats(probs, grid, offsets):
    """(every argmax on its target, smallest mass on a target) over the queries whose target is in the grid."""
    hits, low = True, 1.0
    for h, offset in enumerate(offsets):
        t = target_index(grid, offset)
        rows = torch.nonzero(t >= 0).squeeze(1)
        p = probs[:, h, rows]
        hits &= bool((p.argmax(-1) == t[rows]).all())
        low = min(low, float(p.gather(-1, t[rows].expand(p.shape[0], -1)[..., None]).min()))
    return hits, low


def test_docstring_examples_run():
    import structinit.adapters.position_mlp as adapter

    for module in (position_mlp, adapter):
        result = doctest.testmod(module, extraglobs={"torch": torch})
        assert result.attempted > 0 and result.failed == 0


def test_the_exact_fit_is_the_target_table():
    """hidden + 1 ≥ R and [H 1] of full row rank: the fitted column is hi at the offset and lo at every other row."""
    coords = log_coords(3, 3).reshape(-1, 2).double()  # R = 25
    w1, b1 = position_mlp_features(coords, 64, generator=torch.Generator().manual_seed(0))
    hidden = torch.relu(coords @ w1.T + b1)
    assert int(torch.linalg.matrix_rank(torch.cat([hidden, torch.ones(25, 1, dtype=hidden.dtype)], 1))) == 25
    fit = fit_last_layer(hidden, [12, 13], 4.0, -4.0, bias=True)
    z = torch.full((25, 2), -4.0, dtype=torch.float64)
    z[12, 0] = z[13, 1] = 4.0
    torch.testing.assert_close(hidden @ fit.weight.T + fit.bias, z, atol=1e-3, rtol=0)  # to the tiny ridge
    assert float(fit.residual.max()) < 1e-4


def test_least_squares_reports_its_residual():
    """Features that cannot single out a row (homogeneous: b₁ = 0, so the (0, 0) row is all zeros)
    leave a residual, and it is reported."""
    coords = log_coords(3, 3).reshape(-1, 2).double()
    w1 = torch.randn(6, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    hidden = torch.relu(coords @ w1.T)
    fit = fit_last_layer(hidden, [12], 4.0, -4.0, bias=False)
    assert float(fit.residual[0]) > 0.1
    assert float(fit.fitted[12, 0]) == pytest.approx(0.0, abs=1e-9)  # the origin's features are 0


@pytest.mark.parametrize("cosine", [False, True], ids=["dot-product", "cosine"])
def test_the_models_own_maps_hit_every_offset_with_the_mass_asked_for(cosine):
    torch.manual_seed(0)
    model = CpbNet(grid=(4, 4), heads=4, cosine=cosine, zero_first_bias=True).eval()
    offsets = [(0, 0), (-1, 0), (0, 1), (1, -1)]
    structinit.init_(model, "impulse", offsets=offsets, target_mass=0.9, seed=0)
    for attn in model.attns:
        record = structinit.get_record(attn)
        assert record["solver"] == "position-mlp" and record["offsets"] == offsets
        assert record["mass"] >= 0.9 - 1e-6 and record["residual"] < 1e-3
        if cosine:  # the logit scale bounds the content term: s = (Δ − β) / 2 > 0
            assert all(0 < s < 8 for s in record["logit_scale"])
        else:  # q = 0: every logit is the bias
            assert bool((attn.qkv.weight[:16] == 0).all()) and bool((attn.qkv.bias[:16] == 0).all())
            assert bool((attn.qkv.weight[16:32] != 0).any())  # W_k keeps its weights: W_q's gradient is not 0
    for seed in range(2):  # any content
        for probs in own_maps(model, images(model, seed=seed) * 5):
            hit, low = target_stats(probs, (4, 4), offsets)
            assert hit and low >= 0.9 - 1e-4, low
    fid = structinit.fidelity_summary(structinit.impulse_fidelity(model, images(model)))
    assert fid.hit_first == 1.0 and fid.hit_mean == 1.0


def test_the_default_mass_is_the_routes_own():
    model = CpbNet(heads=2).eval()
    structinit.init_(model, "impulse", seed=0)
    assert structinit.get_record(model.attns[0])["mass"] >= 0.95 - 1e-6


def test_a_one_sided_bound_makes_a_narrow_mlp_exact():
    """Hidden width + 1 < R (timm's RelPosMlp: 128 features, 225 rows on an 8×8 grid): the offset's row
    is fitted, the others need only be low, and the maps still hit."""
    model = CpbNet(grid=(5, 5), heads=2, hidden=32).eval()  # R = 81 > 33
    structinit.init_(model, "impulse", offsets=[(0, 1), (1, 0)], seed=0)
    record = structinit.get_record(model.attns[0])
    assert record["mass"] >= 0.95 - 1e-6
    for probs in own_maps(model, images(model)):
        assert target_stats(probs, (5, 5), [(0, 1), (1, 0)])[0]


def test_refusals_leave_the_model_bit_identical():
    model = CpbNet(heads=2, cosine=True).eval()
    check_rejected(model, lambda m: structinit.init_(m, "impulse", target_mass=1 - 1e-9), ValueError,
                   r"layer 'attns.0'.*capped.*lower target_mass.*'mimetic'")
    check_rejected(model, lambda m: structinit.init_(m, "impulse", solver="gd"), ValueError,
                   "an MLP generates")
    check_rejected(model, lambda m: structinit.init_(m, "impulse", pe_scale=2.0), ValueError, "pe_scale")
    check_rejected(model, lambda m: structinit.init_(m, "impulse", offsets=[(0, 4), (0, 0)], kernel_size=9),
                   ValueError, "outside")


def test_an_mlp_whose_features_cannot_peak_is_refused_untouched():
    """A first layer that is not Linear → ReLU (here a Tanh) keeps the model's own features; homogeneous
    ones cannot make a head peak at (0, 0), and impulse says so and writes nothing."""
    model = CpbNet(heads=2, zero_first_bias=True).eval()
    for attn in model.attns:
        attn.cpb_mlp[1] = nn.Tanh()
    check_rejected(model, lambda m: structinit.init_(m, "impulse", offsets=[(0, 0), (0, 0)]), ValueError,
                   r"layer 'attns.0'.*cannot make head 0's bias peak.*residual.*'mimetic'")


def test_discovery_reads_the_table_the_model_adds():
    model = CpbNet(heads=3).eval()
    attn = model.attns[0]
    found = find_position_mlp(attn)
    assert found.grid == (4, 4) and found.num_heads == 3 and found.activation == "identity"
    with torch.no_grad():
        table = attn.cpb_mlp(attn.relative_coords_table).view(-1, 3)
    torch.testing.assert_close(found.table, table)
    survey = structinit.adapters.attention_survey(model)
    assert [v.kind for v in survey.verdicts] == ["self", "self"]
    cosine = CpbNet(heads=3, cosine=True).eval()
    assert [v.kind for v in structinit.adapters.attention_survey(cosine).verdicts] == ["self", "self"]


@settings(max_examples=10, deadline=None)
@given(h=st.integers(2, 5), w=st.integers(2, 5), heads=st.integers(1, 4), hidden=st.sampled_from([16, 32, 96]),
       cosine=st.booleans(), seed=st.integers(0, 3))
def test_every_shape_hits_its_offsets_in_the_models_own_maps(h, w, heads, hidden, cosine, seed):
    torch.manual_seed(seed)
    model = CpbNet(grid=(h, w), dim=8 * heads, heads=heads, depth=1, hidden=hidden, cosine=cosine).eval()
    structinit.init_(model, "impulse", seed=seed)
    record = structinit.get_record(model.attns[0])
    (probs,) = own_maps(model, images(model, seed=seed))
    hit, low = target_stats(probs, (h, w), [tuple(o) for o in record["offsets"]])
    assert hit and low >= record["mass"] - 1e-4
