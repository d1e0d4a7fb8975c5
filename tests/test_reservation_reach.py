"""Where a residual reservation cannot keep position readable, the check after an impulse write
says so from the model's own forward on a probe image: ``reserve='auto'`` warns and names the
layers, ``reserve='residual'`` refuses with the model untouched. A U-Net's long skip is the case
here: a projection of two joined streams replaces the stream, so the position directions the
reservation keeps free of content in the first blocks do not reach the block after the join. A
last block that reads the patches alone carries no position at all, and a position embedding
behind a gate at 0 none in the first: both are refused outright, with or without a reservation."""

import warnings

import pytest
import torch
from torch import nn

import structinit
from attention_modules import Patchify, SepAttention
from rejection import check_rejected
from structinit.adapters.token_order import PositionReach

UNKEPT = "does not keep position readable in every layer"
UNREACHED = r"layer 'blocks\.2\.attn' .*the position embedding its impulse is designed on, 'pos_embed', does not reach"


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), SepAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SkipJoinViT(nn.Module):
    """Three pre-norm blocks on an 8×8 grid (16×16 images, patch 2, a learned PE); with ``join``,
    the last reads a projection of the first block's output joined with the second's."""

    def __init__(self, dim=32, heads=2, join=True, gate=1.0, last="stream", last_gate=0.0):
        super().__init__()
        self.gate = nn.Parameter(torch.tensor(gate))  # how much of the position embedding the tokens take
        self.last_gate = nn.Parameter(torch.tensor(last_gate))  # how much the last block's patches take ('gated')
        self.last = last  # what the last block reads: the stream, or the patches alone (a branch without position)
        self.patch_embed = Patchify((16, 16), 2, dim)
        self.pos_embed = nn.Parameter(torch.randn(1, 64, dim, generator=torch.Generator().manual_seed(0)) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(3))
        self.join = nn.Linear(2 * dim, dim) if join else None

    def forward(self, images):
        patches = self.patch_embed(images)
        skip = x = self.blocks[0](patches + self.gate * self.pos_embed)
        x = self.blocks[1](x)
        x = x if self.join is None else self.join(torch.cat([skip, x], -1))
        last = {"patches": patches, "gated": patches + self.last_gate * self.pos_embed}.get(self.last, x)
        return self.blocks[2](last).mean(1)


def images(n=4):
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def impulse(model, planned=False, **options):
    """The warnings of an impulse init that say the reservation does not keep position readable;
    with ``planned``, the init as ``plan_init(...).commit()``, which must say it too."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if planned:
            structinit.plan_init(model, "impulse", seed=0, **options).commit()
        else:
            structinit.init_(model, "impulse", seed=0, **options)
    return [str(w.message) for w in caught if UNKEPT in str(w.message)]


@pytest.mark.parametrize("planned", [False, True], ids=["init_", "plan_init-commit"])
def test_auto_warns_naming_the_layer_past_the_join_and_the_warning_is_true(planned):
    model = SkipJoinViT().eval()
    said = impulse(model, planned)
    assert len(said) == 1 and "'blocks.2.attn'" in said[0], said
    assert "'blocks.0.attn'" not in said[0] and "'blocks.1.attn'" not in said[0]
    # What it says, in the model's own maps: every head on target with images before the join, not after
    # it; on the position-only input (the papers' setting) every layer still is.
    on_images = structinit.impulse_fidelity(model, images())["hit"]
    assert bool((on_images[:2] >= 0.95).all()) and float(on_images[2].min()) < 0.5, on_images
    assert bool((structinit.impulse_fidelity(model)["hit"] >= 0.95).all())


@pytest.mark.parametrize("reserve", ["auto", "none"])
def test_a_later_branch_without_position_is_refused_naming_it(reserve):
    """The last block reads the patches alone: its tokens carry no position, whatever the write,
    with or without a reservation; refused, naming it, the model untouched, as a first layer the
    embedding does not reach is. The blocks the embedding reaches are written."""
    message = check_rejected(SkipJoinViT(join=False, last="patches").eval(),
                             lambda m: structinit.init_(m, "impulse", seed=0, reserve=reserve), ValueError,
                             UNREACHED)
    assert "blocks.1" not in message and "the write was undone" in message and "layers=" in message
    model = SkipJoinViT(join=False, last="patches").eval()
    assert impulse(model, layers=[0, 1], reserve=reserve) == []
    assert bool((structinit.impulse_fidelity(model, layers=[0, 1])["hit"] >= 0.95).all())


@pytest.mark.parametrize("reserve", ["auto", "none"])
def test_a_later_branch_whose_embedding_is_gated_off_at_init_is_refused(reserve):
    """The last block reads the patches plus the embedding behind its own gate at 0: refused as the
    branch without any is; with the gate open at init it is written."""
    check_rejected(SkipJoinViT(join=False, last="gated").eval(),
                   lambda m: structinit.init_(m, "impulse", seed=0, reserve=reserve), ValueError,
                   UNREACHED)
    model = SkipJoinViT(join=False, last="gated", last_gate=1.0).eval()
    structinit.init_(model, "impulse", seed=0, reserve=reserve)
    assert bool((structinit.impulse_fidelity(model)["hit"] >= 0.95).all())


class ThroughNumPy(SkipJoinViT):
    """The embedding reaches the tokens through a NumPy round trip, where no torch op sees it."""

    def forward(self, images):
        pe = torch.from_numpy(self.pos_embed.detach().numpy().copy())
        x = self.blocks[0](self.patch_embed(images) + pe)
        return self.blocks[2](self.blocks[1](x)).mean(1)


def test_a_path_outside_torch_is_not_taken_for_no_position():
    model = ThroughNumPy(join=False).eval()
    assert impulse(model, reserve="none") == []  # written: moving the embedding moves every layer's tokens
    assert bool((structinit.impulse_fidelity(model)["hit"] >= 0.95).all())


@pytest.mark.parametrize("reserve", ["auto", "none"])
def test_a_position_embedding_gated_off_at_init_is_refused(reserve):
    """A learned gate at 0: the tokens reach the first layer with a zero gradient from the
    embedding and no position; refused as a table added after the layer is, the model untouched."""
    check_rejected(SkipJoinViT(join=False, gate=0.0).eval(),
                   lambda m: structinit.init_(m, "impulse", seed=0, reserve=reserve), ValueError,
                   r"'blocks\.0\.attn': the position embedding does not reach the tokens .* a factor that is 0 at init")


def test_reserve_residual_refuses_it_with_the_model_untouched():
    message = check_rejected(SkipJoinViT().eval(), lambda m: structinit.init_(m, "impulse", seed=0,
                                                                               reserve="residual"),
                             ValueError, "reserve='residual' " + UNKEPT)
    assert "'blocks.2.attn'" in message and "the write was undone" in message and "layers=" in message


@pytest.mark.parametrize("options", [{"layers": [0, 1]}, {"reserve": "none"}],
                         ids=["before-the-join", "no-reservation"])
def test_no_word_where_position_is_kept_or_none_was_promised(options):
    assert impulse(SkipJoinViT().eval(), **options) == []


def test_a_plain_vit_keeps_position_in_every_layer():
    model = SkipJoinViT(join=False).eval()
    assert impulse(model) == []
    assert bool((structinit.impulse_fidelity(model, images())["hit"] >= 0.95).all())


def test_where_the_embedding_flows_through_views_in_place_writes_and_lists():
    pe = torch.randn(4, 3)
    with PositionReach([pe]) as reach:
        a = torch.zeros(4, 3)
        a[1:] = pe.data[1:]  # a view of its .data, written into another tensor
        b = torch.zeros(4, 3).add_(pe)
        c = torch.empty(4, 3)
        torch.mul(pe, 2, out=c)
        d = torch.ones(4, 3) * 2
        e = torch.cat([d, pe.T.T])
        f, g = pe * 0.0, torch.zeros(1) * pe[0]  # products with zeros: a gate at 0
    assert [reach.reaches(t, pe) for t in (a, b, c, d, e, f, g)] == [True, True, True, False, True, False, False]
