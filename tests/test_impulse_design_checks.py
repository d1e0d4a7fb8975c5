"""Impulse's claim, each head's argmax on its target, holds in the model's own forward or the
init is refused: a causal layer cannot attend to a target after its query, and q/k that do not
put a head's argmax on its target are undone, not reported as written."""

import importlib

import pytest
import torch

import structinit
from impulse_helpers import small_vit
from rejection import assert_untouched, check_rejected, snapshot


def _causal_vit():
    model = structinit.create_model("vit_micro_patch2_16", depth=2)
    for block in model.blocks:
        block.attn.causal = True  # each token attends to itself and the tokens before it
    return model


def test_a_causal_layer_is_refused_offsets_after_the_query_and_takes_those_before_it():
    message = check_rejected(_causal_vit(), lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                             r"layer 'blocks\.0\.attn' .* at offset \(\d+, -?\d+\): the layer is causal.*offsets=")
    assert "nothing was written" in message
    model = _causal_vit()
    heads = model.blocks[0].attn.num_heads
    structinit.init_(model, "impulse", seed=0, offsets=[(-1, -1), (-1, 0), (0, -1), (0, 0)][:heads])
    assert bool((structinit.impulse_fidelity(model)["hit"] == 1).all())


def test_q_and_k_that_miss_a_heads_target_are_undone_not_reported_written(monkeypatch):
    """With the causal pre-check out of the way, the solver's q/k for a target after the query
    cannot put the argmax there (the model masks it): the check after the write names the head
    and undoes the write, where it once reported success."""
    impulse = importlib.import_module("structinit.schemes.impulse")

    monkeypatch.setattr(impulse, "_check_causal_targets", lambda placed: None)
    model = _causal_vit()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"put head \d's argmax on its target offset .* in only \d+%.*undone"):
        structinit.init_(model, "impulse", seed=0, offsets=[(1, 1)] * model.blocks[0].attn.num_heads)
    assert_untouched(model, before)


def _solver_with_head0_off(monkeypatch, scale: float) -> None:
    """The analytic solver, with seeded noise of ``scale`` (relative to its norm) added to head 0's
    W_q in the first layer it solves: a write whose head 0 misses its target in some rows."""
    import dataclasses

    from structinit.functional import impulse_solvers

    solve = impulse_solvers.AnalyticSolver.solve

    def off(self, x, grid, layers, generator):
        out = solve(self, x, grid, layers, generator)
        wq = out[0].wq.clone()
        noise = torch.randn(wq[0].shape, generator=torch.Generator().manual_seed(0), dtype=wq.dtype)
        wq[0] += scale * wq[0].norm() / wq[0].numel() ** 0.5 * noise
        out[0] = dataclasses.replace(out[0], wq=wq)
        return out
    monkeypatch.setattr(impulse_solvers.AnalyticSolver, "solve", off)


def test_a_head_under_the_one_bar_is_refused_and_was_accepted_at_the_old_bar(monkeypatch):
    """One bar for a write, MIN_HEAD_HIT (95 % of the grid rows), the one bench/sweep.py calls a
    write below silent: a head whose own map hits its target in 90–95 % of the rows is refused,
    the model left as it was; at the old 90 % bar the same write is accepted."""
    from structinit.schemes import checks

    assert checks.MIN_HEAD_HIT == 0.95

    def own_hit(scale: float) -> float:  # head 0's hit in the model's own maps, with no bar
        with monkeypatch.context() as patch:
            patch.setattr(checks, "MIN_HEAD_HIT", 0.0)
            patch.setattr(checks, "HIT_SLACK", 1.0)
            _solver_with_head0_off(patch, scale)
            torch.manual_seed(0)
            model = small_vit()
            structinit.init_(model, "impulse", seed=0)
            return float(structinit.impulse_fidelity(model)["hit"][0, 0])

    # the smallest noise that takes head 0 under the bar (the rows flip one by one as it grows)
    scale, hit = next((s, h) for s in torch.arange(0.3, 0.8, 0.02).tolist() if (h := own_hit(s)) < 0.95)
    assert 0.9 <= hit < 0.95, hit
    _solver_with_head0_off(monkeypatch, scale)
    torch.manual_seed(0)
    model = small_vit()
    check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   rf"head 0's argmax on its target offset .* in only {hit:.0%} of the grid rows")
    monkeypatch.setattr(checks, "MIN_HEAD_HIT", 0.9)  # the bar the library held before
    structinit.init_(model, "impulse", seed=0)
    assert float(structinit.impulse_fidelity(model)["hit"][0, 0]) == hit


class _LatePosition(torch.nn.Module):
    """A ViT whose position embedding is added after its first block: that block's tokens carry
    no position (a class token, an 8×8 grid, width 32, 2 heads)."""

    def __init__(self, late: bool = True):
        super().__init__()
        from attention_modules import Block, SepAttention

        self.late, self.patch_embed = late, torch.nn.Conv2d(3, 32, 2, 2)
        self.cls_token = torch.nn.Parameter(0.02 * torch.randn(1, 1, 32))
        self.pos_embed = torch.nn.Parameter(0.02 * torch.randn(1, 65, 32))
        self.blocks = torch.nn.ModuleList([Block(SepAttention(32, 2), 32) for _ in range(2)])
        for block in self.blocks:  # an MLP after the attention, which the reservation projects
            block.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1)
        for i, block in enumerate(self.blocks):
            x = block(x + self.pos_embed if i == int(self.late) else x)
            x = x + block.mlp(x)
        return x.mean(1)


def test_a_layer_the_position_embedding_does_not_reach_is_refused_and_the_layers_after_it_are_written():
    """The embedding is found by its name and shape, and every layer receives its 65 tokens, but
    the first block's tokens carry no position: its heads' argmax cannot be on their targets, so
    the write is undone, naming why; the layers after it are written, their heads on their targets
    in the model's own maps. Added before the first block, the same model is written whole."""
    torch.manual_seed(0)
    check_rejected(_LatePosition(), lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"attention layer 'blocks\.0\.attn': the position embedding does not reach the "
                   r"tokens this layer receives .* the write was undone\. Initialise only the layers the position "
                   r"embedding reaches \(layers=\)")
    model = _LatePosition()
    structinit.init_(model, "impulse", seed=0, layers=[1])
    assert bool((structinit.impulse_fidelity(model, layers=[1])["hit"] == 1).all())
    structinit.init_(_LatePosition(late=False), "impulse", seed=0)
