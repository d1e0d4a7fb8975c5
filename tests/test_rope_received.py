"""RoPE that turns with rows and columns at once (mixed, 1-D), rotations read from the tables a
model hands its layers, and the pre-norm channel that carries the impulse when q or k has no
learned bias. The models here are written as timm, Hugging Face and vit-pytorch write theirs
(the zoo tests run those packages' own models)."""

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import structinit
from real_images import digit_images
from rejection import check_rejected
from structinit.adapters.prenorm import input_norms
from structinit.adapters.rotary import Rotary, received_rotary, rotary_from_tables
from structinit.adapters.survey import attention_survey
from structinit.analysis.capture import attention_maps
from structinit.functional.rope import rope_impulse_terms_2d, rope_logits
from structinit.functional.targets import kernel_offsets, target_index


def worst_query(logits, offset, grid):
    """(every in-grid target is its query's argmax, the least mass on a target)."""
    t = target_index(grid, offset)
    rows = torch.nonzero(t >= 0).squeeze(1)
    probs = torch.softmax(logits, -1)
    top = bool((probs[rows].argmax(-1) == t[rows]).all())
    return top, float(probs[rows, t[rows]].min())


def mixed_bands(bands=8, theta=10.0, angle=0.7):
    """timm's mixed RoPE of one head: magnitudes θ^(−4i/r) along a direction and its normal."""
    mag = theta ** (-torch.arange(bands, dtype=torch.float64) / bands)
    u = torch.tensor([math.sin(angle), math.cos(angle)], dtype=torch.float64)
    v = torch.tensor([math.cos(angle), -math.sin(angle)], dtype=torch.float64)
    return torch.cat([mag[:, None] * u, mag[:, None] * v])


@settings(max_examples=12, deadline=None)
@given(h=st.integers(2, 10), w=st.integers(2, 10), angle=st.floats(0, 2 * math.pi), mass=st.floats(0.3, 0.95),
       data=st.data())
def test_bands_on_both_axes_put_the_target_mass_on_every_target(h, w, angle, mass, data):
    offset = data.draw(st.sampled_from([o for o in kernel_offsets(3) if abs(o[0]) < h and abs(o[1]) < w]))
    freqs = mixed_bands(angle=angle)
    try:
        amplitudes, phases = rope_impulse_terms_2d(freqs, offset, (h, w), mass)
    except ValueError as err:  # these frequencies cannot single the target out: said, not half-done
        assert "no unique peak" in str(err) or "not reachable" in str(err)
        return
    assert torch.allclose(phases, (freqs @ torch.tensor(offset, dtype=torch.float64)) * (amplitudes > 0))
    top, least = worst_query(rope_logits(freqs, None, amplitudes, phases, (h, w)), offset, (h, w))
    assert top and least == pytest.approx(mass, abs=1e-6)


def test_one_d_rope_over_the_flattened_grid_wraps_but_no_query_sees_the_wrap():
    """θ = ω·(y·w + x): offsets (dy, dx) and (dy + 1, dx − w) get the same logit for every band;
    a query whose target is on the grid never has both on the grid."""
    w = 6
    omega = 10000 ** (-torch.arange(16, dtype=torch.float64) / 16)
    freqs = torch.stack([w * omega, omega], 1)
    for offset in [(0, 1), (1, -1), (-1, 1)]:
        amplitudes, phases = rope_impulse_terms_2d(freqs, offset, (6, w), 0.9)
        top, least = worst_query(rope_logits(freqs, None, amplitudes, phases, (6, w)), offset, (6, w))
        assert top and least >= 0.9 - 1e-6


def test_frequencies_too_slow_on_both_axes_are_refused():
    with pytest.raises(ValueError, match=r"target_mass=0.95: not reachable at offset \(1, 1\) on a 8×8 grid: "
                                         r"the fastest rotary frequencies \(ω_y, ω_x\) = \(0.0001, 0\)"):
        rope_impulse_terms_2d(torch.tensor([[1e-4, 0.0], [0.0, 1e-4]]), (1, 1), (8, 8))


def rope_tables(grid, bands, theta=100.0, half=False, start=0.0):
    """timm's axial [sin | cos] table (n, 4·bands): rows' bands then columns', each angle on
    both channels of its pair."""
    h, w = grid
    f = theta ** (-torch.arange(bands, dtype=torch.float64) / bands)
    y, x = torch.meshgrid(torch.arange(h) + start, torch.arange(w) + start, indexing="ij")
    angles = torch.cat([y.flatten()[:, None] * f, x.flatten()[:, None] * f], 1)
    per_channel = angles.repeat(1, 2) if half else angles.repeat_interleave(2, -1)
    return torch.sin(per_channel), torch.cos(per_channel), angles


@pytest.mark.parametrize("half", [False, True])
def test_tables_are_read_as_the_rotation_they_apply(half):
    sin, cos, angles = rope_tables((3, 5), 4, half=half, start=0.5)
    rotary = rotary_from_tables(cos, sin, half, num_prefix_tokens=1)
    assert rotary.grid == (3, 5) and rotary.num_prefix_tokens == 1
    wrapped = torch.remainder(rotary.angles[0] - angles + math.pi, 2 * math.pi) - math.pi  # atan2 wraps
    assert float(wrapped.abs().max()) < 1e-12
    freqs = rotary.frequencies()[0]
    f = 100.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    assert torch.allclose(freqs, torch.cat([torch.stack([f, 0 * f], 1), torch.stack([0 * f, f], 1)]))
    # The layout matters: the other one is no rotation (its two channels turn by other angles).
    assert rotary_from_tables(cos, sin, not half, num_prefix_tokens=1) is None


def test_angles_that_are_not_linear_in_the_position_are_refused():
    _, _, angles = rope_tables((4, 4), 2)
    bent = angles.clone()
    bent[5, 0] += 0.3
    with pytest.raises(ValueError, match="not linear in the grid position"):
        Rotary(bent[None], ((0, 1), (2, 3), (4, 5), (6, 7)), (4, 4)).frequencies()


@pytest.mark.parametrize(("kwargs", "found"), [
    (lambda s, c: {"rope": torch.cat([s, c], -1)}, True),                   # timm
    (lambda s, c: {"position_embeddings": (c, s)}, True),                    # Hugging Face (half layout: no)
    (lambda s, c: {"pos_emb": (s, c)}, True),                                # vit-pytorch
    (lambda s, c: {"rope": torch.cat([s, c], -1)[:, :6]}, False),            # not 2·head_dim wide
    (lambda s, c: {"something_else": s}, False),
])
def test_a_rotation_is_read_from_the_calls_the_packages_make(kwargs, found):
    sin, cos, _ = rope_tables((4, 4), 4)  # interleaved, 16 channels
    module = nn.Module()
    module.num_prefix_tokens = 1
    got = received_rotary(module, (torch.zeros(1, 17, 32),), kwargs(sin, cos), tokens=17, head_dim=16)
    if "position_embeddings" in kwargs(sin, cos):  # Hugging Face's tables are half-split: these are not
        assert got is None
    else:
        assert (got is not None) == found
        if found:
            assert got.grid == (4, 4) and got.num_prefix_tokens == 1


def test_xpos_scaling_is_no_rotation():
    angles = torch.arange(16.0)[None, :, None] * torch.ones(1, 1, 8)
    module = nn.Module()
    assert received_rotary(module, (), {"rotary_pos_emb": (angles, 1.0)}, tokens=16, head_dim=8) is not None
    assert received_rotary(module, (), {"rotary_pos_emb": (angles, torch.ones(1, 16, 8))}, tokens=16,
                           head_dim=8) is None


# -- a ViT that hands each layer its RoPE table, as timm's EVA does ---------------------------------

class RopeAttention(nn.Module):
    """timm's EvaAttention, reduced: fused qkv weight, q and v biases as parameters, k's a zero
    buffer (neither learned nor saved), the table ``rope`` applied after the class token."""

    def __init__(self, dim, num_heads, k_bias_learned=False):
        super().__init__()
        self.num_heads, self.head_dim, self.num_prefix_tokens = num_heads, dim // num_heads, 1
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(dim))
        if k_bias_learned:
            self.k_bias = nn.Parameter(torch.zeros(dim))
        else:
            self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, rope=None):
        b, n, c = x.shape
        qkv = nn.functional.linear(x, self.qkv.weight, torch.cat([self.q_bias, self.k_bias, self.v_bias]))
        q, k, v = qkv.reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        sin, cos = rope.chunk(2, -1)

        def turn(t):
            grid = t[:, :, 1:]
            turned = torch.stack([-grid[..., 1::2], grid[..., ::2]], -1).reshape(grid.shape)
            return torch.cat([t[:, :, :1], grid * cos + turned * sin], 2)

        attn = (turn(q) @ turn(k).transpose(-2, -1) * self.scale).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim, heads, **kw):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), RopeAttention(dim, heads, **kw)
        self.norm2, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                                 nn.Linear(2 * dim, dim))

    def forward(self, x, rope):
        x = x + self.attn(self.norm1(x), rope=rope)
        return x + self.mlp(self.norm2(x))


class HandedRopeViT(nn.Module):
    """Patch 4 on 32 px, a class token, the rope table built in the forward and handed to every
    block (``mixed``: learned per-head frequencies per layer, as naver's mixed RoPE)."""

    def __init__(self, dim=64, heads=2, depth=2, mixed=False, **kw):
        super().__init__()
        self.img_size, self.patch_size = 32, 4
        self.patch_embed = nn.Conv2d(3, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, **kw) for _ in range(depth))
        self.head = nn.Linear(dim, 10)
        r = dim // heads
        if mixed:  # (depth, heads, r/2, 2): ω = (ω_y, ω_x) per pair
            g = torch.Generator().manual_seed(0)
            mag = 10.0 ** (-torch.arange(r // 4, dtype=torch.float32) / (r // 4))
            turn = torch.rand(depth, heads, 1, generator=g) * 2 * math.pi
            u = torch.stack([torch.sin(turn), torch.cos(turn)], -1) * mag[:, None]
            v = torch.stack([torch.cos(turn), -torch.sin(turn)], -1) * mag[:, None]
            self.freqs = nn.Parameter(torch.cat([u, v], 2))
        else:
            self.freqs = None
            self.register_buffer("axial", 100.0 ** (-torch.arange(r // 4, dtype=torch.float32) / (r // 4)))

    def rope(self, grid, layer):
        h, w = grid
        y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        pos = torch.stack([y.flatten(), x.flatten()], 1).float()
        if self.freqs is not None:
            angles = pos @ self.freqs[layer].transpose(-2, -1)  # (heads, n, r/2)
        else:
            angles = torch.cat([pos[:, :1] * self.axial, pos[:, 1:] * self.axial], 1)
        per_channel = angles.repeat_interleave(2, -1)
        return torch.cat([per_channel.sin(), per_channel.cos()], -1)

    def forward(self, img):
        x = self.patch_embed(img)
        grid = tuple(x.shape[-2:])
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x.flatten(2).transpose(1, 2)], 1)
        for i, block in enumerate(self.blocks):
            x = block(x, self.rope(grid, i))
        return self.head(x[:, 0])


def images(n=8):
    return digit_images(n)


@pytest.mark.parametrize(("options", "solver"), [({}, "rotary-norm"), ({"k_bias_learned": True}, "rotary"),
                                                 ({"mixed": True}, "rotary-norm")])
def test_a_rotation_the_model_hands_its_layers_carries_the_impulse(options, solver):
    torch.manual_seed(0)
    model = HandedRopeViT(**options)
    assert [v.kind for v in attention_survey(model).verdicts] == ["self", "self"]
    structinit.init_(model, "impulse", seed=0, target_mass=0.9)
    maps = attention_maps(model, images(4))  # the model's own softmax, on real images
    for i, (name, ad) in enumerate(structinit.find_attention_layers(model)):
        record = structinit.get_record(ad.module)
        assert record["solver"] == solver
        for h, offset in enumerate(record["offsets"]):
            t = target_index((8, 8), offset) + 1  # after the class token
            rows = torch.nonzero(t > 0).squeeze(1) + 1
            grid_keys = maps[i][:, h, rows, 1:]
            mass = grid_keys.gather(-1, t[rows - 1][None, :, None].expand(len(grid_keys), -1, 1) - 1)[..., 0]
            # target_mass is of the grid keys: the class token, a key that is not turned, takes a little.
            assert float((mass / grid_keys.sum(-1)).min()) >= 0.9 - 1e-4, (name, h)
            # It acts as grid token (0, 0), whose angles are 0: the one query whose target is there ties
            # with it; every other query's argmax is its target.
            tied = rows == (-offset[0]) * 8 + (-offset[1]) + 1
            top = maps[i][:, h, rows].argmax(-1)
            assert bool((top[:, ~tied] == t[rows - 1][~tied]).all()), (name, h)
    if solver == "rotary-norm":  # the pre-norm's last channel is 1 for every token, and q, k read it alone
        for block in model.blocks:
            assert float(block.norm1.weight.detach()[-1]) == 0 and float(block.norm1.bias.detach()[-1]) == 1
            assert bool((block.attn.k_bias == 0).all())  # the buffer is left as the model keeps it


def test_the_pre_norm_is_found_in_the_models_own_forward():
    model = HandedRopeViT()
    chosen = structinit.find_attention_layers(model)
    found = input_norms(model, chosen, images(2))
    assert [f.name for f in found] == ["blocks.0.norm1", "blocks.1.norm1"]
    assert all(f.readers == () for f in found)


def test_a_model_whose_rope_follows_its_input_is_read_on_the_grid_it_is_told():
    torch.manual_seed(0)
    model = HandedRopeViT(k_bias_learned=True)
    del model.img_size  # states no size: the probe guesses one
    structinit.init_(model, "impulse", seed=0, grid=(8, 8))
    fid = structinit.impulse_fidelity(model, images())
    assert float(fid["hit"].mean()) >= 0.95
    other = HandedRopeViT(k_bias_learned=True)  # another grid: the rotation is read on images of that grid
    structinit.init_(other, "impulse", seed=0, grid=(6, 6))
    assert structinit.get_record(other.blocks[0].attn)["grid"] == (6, 6)
    # On 5×5 the class token takes the argmax of one row in 16 of a head (94 %): under the bar, refused
    check_rejected(HandedRopeViT(k_bias_learned=True), lambda m: structinit.init_(m, "impulse", seed=0, grid=(5, 5)),
                   ValueError, r"in only 9\d% of the grid rows .* a prefix token \(a class or register token\) took")


class FixedSizeViT(HandedRopeViT):
    def forward(self, img):
        if img.shape[-1] != 32:
            raise RuntimeError("this model takes 32-pixel images")
        return super().forward(img)


def test_a_grid_the_model_cannot_be_probed_on_is_refused():
    check_rejected(FixedSizeViT(k_bias_learned=True), lambda m: structinit.init_(m, "impulse", seed=0, grid=(5, 5)),
                   ValueError, r"grid=\(5, 5\): the model's rotation depends on its input, and its forward does not "
                               r"take images of \(20, 20\) px")


def test_learned_frequencies_are_read_again_when_the_model_is_initialised_again():
    """The probe that finds the layers is kept per model; a mixed RoPE's angles are weights,
    and move in training: a second init reads them as they are then, and writes what an init
    of a fresh copy writes."""
    torch.manual_seed(0)
    model = HandedRopeViT(mixed=True, k_bias_learned=True)
    structinit.init_(model, "impulse", seed=0)
    structinit.find_attention_layers(model)  # the probe that finds the layers, kept for the model
    with torch.no_grad():
        model.freqs.mul_(1.3)  # as training would move them
    twin = copy.deepcopy(model)  # a new model: nothing kept for it
    structinit.init_(model, "impulse", seed=1)
    structinit.init_(twin, "impulse", seed=1)
    for block, fresh in zip(model.blocks, twin.blocks):
        assert torch.equal(block.attn.q_bias, fresh.attn.q_bias) and torch.equal(block.attn.k_bias, fresh.attn.k_bias)
