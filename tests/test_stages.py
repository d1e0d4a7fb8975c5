"""A later stage with its own position embedding (Visformer's, after a merge; CrossViT's second
branch): impulse traces each stage's embedding from its first layer, designs that stage's heads
on its own grid, and writes its embedding; the layers' own softmax maps on what each stage's
tokens carry show it. A stage whose tokens carry no position of their own is refused by name."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_models import StagedViT

import structinit
from rejection import check_rejected


def _own_hits(model: StagedViT, layer: int) -> torch.Tensor:
    """Per head, the share of grid rows whose argmax in layer ``layer``'s own map is the token at
    its offset, on the block's norm of the position rows its stage adds (the model's PE for the
    first stage, the stage's own for the second); targets off the grid not counted."""
    side = model.side if layer < 2 else model.side // 2
    rows = model.first_rows() if layer < 2 else model.stage_pos[0].flatten(1).T
    with torch.no_grad():
        attn = model.attns[layer]
        attn(model.norms[layer](rows[None]))
        probs = attn.last_probs[0]  # (heads, T, T), as the module computed them
    hits = []
    for h, (dy, dx) in enumerate(attn.structinit_impulse["offsets"]):
        got = [int(probs[h, y * side + x].argmax()) == (y + dy) * side + x + dx
               for y in range(side) for x in range(side) if 0 <= y + dy < side and 0 <= x + dx < side]
        hits.append(sum(got) / len(got))
    return torch.tensor(hits)


def test_each_stage_is_designed_on_its_own_grid_and_embedding():
    torch.manual_seed(0)
    model = StagedViT()
    before = model.stage_pos.detach().clone()
    structinit.init_(model, "impulse", seed=0, reserve="none")
    for layer in range(4):
        assert (_own_hits(model, layer) == 1).all(), layer
    records = [structinit.get_record(a, "impulse") for a in model.attns]
    assert [tuple(r["grid"]) for r in records] == [(8, 8), (8, 8), (4, 4), (4, 4)]
    assert [r.get("pos_embed") for r in records] == [None, None, "stage_pos", "stage_pos"]
    assert not torch.equal(model.stage_pos, before)  # the stage's own embedding written (the solver's PE)
    assert (structinit.impulse_fidelity(model)["hit"] == 1).all()
    # Broken on purpose: a second-stage head's q replaced; its own maps and the fidelity miss
    with torch.no_grad():
        model.attns[2].w_in[:32] = torch.randn(32, 96, generator=torch.Generator().manual_seed(1))
    assert _own_hits(model, 2)[0] < 0.5 and structinit.impulse_fidelity(model)["hit"][2, 0] < 0.5


@pytest.mark.parametrize("states", [None, 224])
def test_a_first_embedding_kept_channels_first_under_no_known_name_is_traced(states):
    """The first stage's PE (1, D, h, w) added to the patch map (TNT's pixel PE), found by the
    trace; also in a model that states an image size it was not built for (TNT's 224 px,
    built at 64): the images its layers were probed with are traced instead."""
    torch.manual_seed(0)
    model = StagedViT(maps_pe=True)
    if states:
        model.img_size = states
    structinit.init_(model, "impulse", seed=0, reserve="none")
    assert all((_own_hits(model, layer) == 1).all() for layer in range(4))


def test_a_later_stage_alone_is_written_through_its_own_embedding():
    torch.manual_seed(0)
    model = StagedViT()
    first = [p.detach().clone() for p in model.attns[0].parameters()]
    structinit.init_(model, "impulse", seed=0, reserve="none", layers=[2, 3])
    assert all(torch.equal(p, q) for p, q in zip(model.attns[0].parameters(), first))
    assert all((_own_hits(model, layer) == 1).all() for layer in (2, 3))


@pytest.mark.parametrize("reserve", ["none", "patch"])
def test_a_reservation_projects_what_feeds_a_later_stage_its_merge(reserve):
    """reserve='patch' projects the patch embedding off the first stage's position subspace, and
    the merge that feeds the second stage off that stage's: on images, each stage's first layer
    then keeps its heads on their targets in the model's own maps; with 'none' content moves them."""
    torch.manual_seed(0)
    model = StagedViT()
    merge = model.merge.weight.detach().clone()
    structinit.init_(model, "impulse", seed=0, reserve=reserve)
    images = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    hit = structinit.impulse_fidelity(model, images)["hit"].mean(1)
    if reserve == "patch":
        assert not torch.equal(model.merge.weight, merge)
        assert hit[0] == 1 and hit[2] == 1, hit
    else:
        assert torch.equal(model.merge.weight, merge) and hit[2] < 0.5, hit


def test_a_later_stage_with_no_position_of_its_own_is_refused_by_its_mechanism():
    torch.manual_seed(0)
    check_rejected(StagedViT(stage_pe=False), lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"2 attention layer\(s\) \(the first 'attns\.2'.*16 tokens of width 96\).*carry no position "
                   r"of their own.*nothing was written")


@settings(max_examples=6, deadline=None)
@given(heads=st.sampled_from([1, 2, 3, 4, 6]), side=st.sampled_from([6, 8, 10]), seed=st.integers(0, 2**16))
def test_every_stage_hits_whatever_its_heads_and_grid(heads, side, seed):
    torch.manual_seed(seed)
    model = StagedViT(heads=heads, side=side)
    structinit.init_(model, "impulse", seed=seed, reserve="none")
    for layer in range(4):
        assert (_own_hits(model, layer) == 1).all(), (layer, heads, side)
