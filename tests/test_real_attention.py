"""Never silently wrong: every attention layer is checked against what the model itself
computes (its own softmax, scaled_dot_product_attention or nn.MultiheadAttention), before an
init writes and after. Each test breaks one assumption the adapters make and expects a refusal
that names the layer and what differs, with the model bit-identical, or a skip that says so."""

import warnings

import pytest
import torch
from attention_styles import STYLES, RawLinearAttention
from broken_attention import ConvPositionViT, PooledViT, ReorderedViT, micro_vit_with, micro_vit_with_sibling_output
from styled_vit import StyledViT
from torch import nn

import structinit
from rejection import check_rejected
from structinit.adapters.observe import observe
from structinit.adapters.registry import adapter_for
from structinit.adapters.survey import attention_survey
from structinit.schemes.checks import diagonal_strength

REFUSED = {  # kind → (impulse's words, mimetic's words or None where mimetic sets the layer)
    "roll_heads": ("heads are mixed before the softmax", None),
    "linear": ("forms no softmax", "forms no softmax"),
    "extra_bias": ("logit term that does not depend on content", None),
    "rotary": ("rotated by position", None),
}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_impulse_refuses_each_broken_assumption_and_writes_nothing(kind):
    model = micro_vit_with(kind)
    words, _ = REFUSED[kind]
    check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   rf"impulse cannot set the attention of layer 'blocks\.0\.attn' \(Variant\): .*{words}")


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_mimetic_refuses_what_it_cannot_read_and_sets_the_rest(kind):
    model = micro_vit_with(kind)
    _, words = REFUSED[kind]
    if words is not None:  # refused before the write, or found after it and undone: bit-identical either way
        check_rejected(model, lambda m: structinit.init_(m, "mimetic", seed=0), ValueError, words)
        return
    structinit.init_(model, "mimetic", seed=0)  # a transform on top of the projections is the model's own
    wq, _, wk, _ = structinit.find_attention_layers(model)[0][1].read_qk()
    product = wq[0] @ wk[0].T
    assert product.diagonal().mean() > 5 * product.fill_diagonal_(0).abs().mean()


def test_a_named_layer_whose_adapter_misreads_its_layout_is_read_by_the_trace_and_written():
    # timm's name for a fused qkv, laid out per head ([q1 k1 v1 q2 k2 v2 …]): the name adapter's
    # q kᵀ differs from the model's, so the trace reads the layer, and both schemes write through it.
    from structinit.adapters.provenance import TracedAdapter

    layers = structinit.find_attention_layers(micro_vit_with("per_head_packed"))
    assert all(isinstance(ad, TracedAdapter) for _, ad in layers)
    model = micro_vit_with("per_head_packed")
    structinit.init_(model, "impulse", seed=0)
    assert bool((structinit.impulse_fidelity(model)["hit"] == 1.0).all())  # the model's own maps
    model = micro_vit_with("per_head_packed")
    structinit.init_(model, "mimetic", seed=0)
    layers = structinit.find_attention_layers(model)
    inputs = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    calls, _ = observe(model, inputs, [(ad.module, ad.input_module, ad) for _, ad in layers])
    for _, ad in layers:
        logits = next(m.logits for m in calls[ad.module].maps if m.logits is not None)
        assert bool((diagonal_strength(logits) > 1.0).all())  # q kᵀ ≈ αZ + βI in its own softmax's input


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
@pytest.mark.parametrize("kind", ["talking_heads", "mix_after", "mix_params", "conv_heads"])
def test_talking_heads_start_as_plain_heads_and_say_so(kind, scheme):
    # Mixers a scheme can set (Linear(h, h), 1×1 Conv2d(h, h) or (h, h) Parameters, before or after the softmax)
    # are set to the identity with the rest of the write, said in a warning and recorded; the
    # check after the write (each head's own map in the model's forward) then passes.
    model = micro_vit_with(kind)
    with pytest.warns(UserWarning, match=r"talking-heads mixers of 2 layer\(s\) to the identity \(blocks\.0\.attn\."):
        structinit.init_(model, scheme, seed=0)
    h = model.blocks[0].attn.num_heads
    for block in model.blocks:
        mixers = [t.reshape(h, h) for n, t in block.attn.named_parameters() if t.shape in ((h, h), (h, h, 1, 1))]
        assert mixers and all(torch.equal(t, torch.eye(h)) for t in mixers)
        assert all(torch.equal(t, torch.zeros(h)) for n, t in block.attn.named_parameters() if n.endswith("bias")
                   and t.shape == (h,))
    record = structinit.get_record(model, "init")
    assert record["layers"] == ["blocks.0.attn", "blocks.1.attn"] and record["head_mixers"][0].startswith("blocks.0")


class ConvTalkingHeads(RawLinearAttention):
    """Talking heads as 1×1 convolutions whose channels are the heads of the maps, before and after
    the softmax (EfficientFormerV2's ``talking_head1``/``talking_head2``)."""

    def __init__(self, dim, heads):
        super().__init__(dim, heads)
        self.before, self.after = nn.Conv2d(heads, heads, 1), nn.Conv2d(heads, heads, 1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = nn.functional.linear(x, self.w_in, self.b_in).reshape(b, t, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        logits = self.before((q @ k.transpose(-2, -1)) * (d // self.h) ** -0.5)
        probs = self.keep(logits, logits.softmax(-1))
        return nn.functional.linear((self.after(probs) @ v).transpose(1, 2).reshape(b, t, d), self.w_out, self.b_out)


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_talking_heads_as_convolutions_over_the_heads_are_traced_and_set_to_the_identity(monkeypatch, scheme):
    """No adapter names the module: the trace follows its map through the mixing convolutions to
    the values, the verdict sees the heads mixed, and the scheme sets the mixers to the identity;
    its check after the write, on the module's own maps, then passes."""
    monkeypatch.setitem(STYLES, "conv-talking-heads", ConvTalkingHeads)
    torch.manual_seed(0)
    model = StyledViT("conv-talking-heads")
    assert adapter_for(model.attns[0]) is None
    with pytest.warns(UserWarning, match=r"talking-heads mixers of 2 layer\(s\) to the identity"):
        structinit.init_(model, scheme, seed=0, **({"reserve": "none"} if scheme == "impulse" else {}))
    eye = torch.eye(3)[:, :, None, None]
    for attn in model.attns:
        assert torch.equal(attn.before.weight, eye) and torch.equal(attn.after.weight, eye)
        assert not attn.before.bias.any() and not attn.after.bias.any()


def test_qk_norm_is_refused_by_impulse_and_kept_by_mimetic():
    model = micro_vit_with("qk_norm")
    check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"layer 'blocks\.0\.attn' \(Variant\): q and k are normalised")
    structinit.init_(model, "mimetic", seed=0)


def test_a_change_the_probe_cannot_see_at_init_is_caught_after_the_write_and_undone():
    """Logits that flip sign beyond ±3 agree with the adapter at init (they are small), so the
    probe before the write passes; the impulse's large negative logits flip, the check after the
    write sees the model's own maps miss, and every written tensor is restored."""
    model = micro_vit_with("flip_large")
    assert {v.kind for v in attention_survey(model).verdicts} == {"self"}
    check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"after the write, head 0 of layer 'blocks\.0\.attn'.*the write was undone")


def test_a_pooling_head_is_left_alone_and_listed():
    model = PooledViT()
    pool = {k: v.clone() for k, v in model.pool.state_dict().items()}
    survey = attention_survey(model)
    assert [n for n, _ in survey.skipped()] == ["pool"] and "1 query over 64 tokens" in survey.skipped()[0][1]
    with pytest.warns(UserWarning, match=r"left alone: pool \(cross-attention of 1 query over 64 tokens"):
        structinit.init_(model, "impulse", seed=0)
    assert all(torch.equal(v, model.pool.state_dict()[k]) for k, v in pool.items())
    assert [n for n, _ in structinit.find_attention_layers(model)] == ["vit.blocks.0.attn", "vit.blocks.1.attn"]
    assert structinit.get_record(model, "init")["skipped"] == [("pool", survey.skipped()[0][1])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        structinit.init_(model, "mimetic", seed=0, layers=[0, 1])  # the blocks alone: nothing to say
    assert [n for n, _ in structinit.find_attention_layers(model, pooling=True)][-1] == "pool"


def test_an_unknown_attention_beside_depthwise_convs_is_named_not_replaced_by_the_conv_init():
    model = ConvPositionViT()
    check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"attention that no adapter understands: attn \(UnknownAttention: a 64×64 softmax map; "
                   r"parameter 'to_qk.weight' does not lay its heads out as evenly strided blocks\)")
    structinit.init_(model, "impulse", target="conv", seed=0)  # asked for by name: the convs alone


def test_impulse_fidelity_reads_the_models_own_maps():
    """On real tokens the score comes from the maps the model computes: for talking heads set by
    hand with the mixing made the identity, it equals the plain model's; mixing the heads again
    changes the model's maps, and the score follows them, not the adapter's recomputation."""
    plain, mixed = micro_vit_with(None), micro_vit_with("talking_heads")
    structinit.init_(plain, "impulse", seed=0)
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    for block, variant in zip(plain.blocks, mixed.blocks):
        variant.attn.qkv.load_state_dict(block.attn.qkv.state_dict())
        for lin in (variant.attn.proj_l, variant.attn.proj_w):
            lin.weight.data.copy_(torch.eye(2))
            lin.bias.data.zero_()
        variant.attn.structinit_impulse = block.attn.structinit_impulse
        variant.attn.proj.load_state_dict(block.attn.proj.state_dict())
    mixed.load_state_dict({k: v for k, v in plain.state_dict().items() if "attn" not in k}, strict=False)
    same = structinit.impulse_fidelity(mixed, images)["hit"]
    torch.testing.assert_close(same, structinit.impulse_fidelity(plain, images)["hit"])
    for block in mixed.blocks:
        block.attn.proj_l.weight.data.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))  # swap the heads' logits
    swapped = structinit.impulse_fidelity(mixed, images)["hit"]
    assert swapped[0].max() < 0.5 < same[0].min()


def test_attention_metrics_read_the_models_own_maps():
    """The same for where heads look: with the talking-heads mixing made the identity the
    metrics are the plain model's; with the heads' logits swapped, each head shows the other's."""
    model = micro_vit_with("talking_heads")
    with pytest.warns(UserWarning, match="talking-heads mixers"):
        structinit.init_(model, "impulse", seed=0, target_mass=0.99, pe_scale=4.0)
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    plain = structinit.attention_metrics(model, images)["distance"]
    swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    for block in model.blocks:  # swap the heads' logits, then their maps back: the layers' outputs are
        block.attn.proj_l.weight.data.copy_(swap)  # unchanged, while each softmax map, what the metrics
        block.attn.proj_w.weight.data.copy_(swap)  # read, is the other head's
    swapped = structinit.attention_metrics(model, images)["distance"]
    torch.testing.assert_close(swapped, plain.flip(-1))


def test_the_probe_sees_every_way_torch_computes_attention():
    """softmax as a function, a method and torch.softmax; scaled_dot_product_attention (flex_attention:
    test_flex_attention); and
    nn.MultiheadAttention, whose fused fast path the probe keeps it off."""
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    calls, _ = observe(SelfAttend(mha), x, [(mha, mha, structinit.MultiheadAttentionAdapter(mha))])
    (found,) = calls[mha].maps
    expected = mha(x, x, x, need_weights=True, average_attn_weights=False)[1]
    torch.testing.assert_close(found.probs, expected)
    model = structinit.create_model("vit_micro_patch2_16")  # timm-style attention: sdpa
    ad = structinit.find_attention_layers(model)[0][1]
    calls, _ = observe(model, torch.randn(1, 3, 16, 16), [(ad.module, ad.input_module, ad)])
    (sdpa,) = calls[ad.module].maps
    assert sdpa.source == "fused" and sdpa.probs.shape == (1, 2, 64, 64)
    torch.testing.assert_close(sdpa.probs, ad.attention_probs(calls[ad.module].x), atol=1e-5, rtol=1e-5)


class SelfAttend(torch.nn.Module):
    def __init__(self, mha):
        super().__init__()
        self.mha = mha

    def forward(self, x):
        return self.mha(x, x, x)[0]


def test_the_probe_leaves_the_callers_random_state_alone():
    model = structinit.create_model("vit_micro_patch2_16")
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    structinit.init_(model, "impulse", seed=0)
    torch.testing.assert_close(torch.rand(3), expected)


def test_diagonal_strength_reads_identity_logits_and_ignores_row_constants():
    eye = torch.eye(6)[None, None] * 3.0
    strong = diagonal_strength(eye)
    torch.testing.assert_close(diagonal_strength(eye + torch.randn(1, 1, 6, 1)), strong)
    assert strong.item() > 2 and diagonal_strength(torch.zeros(1, 1, 6, 6)).item() == 0


@pytest.mark.parametrize("shuffle,registers", [(True, 0), (False, 3), (True, 3)])
def test_tokens_out_of_grid_order_are_read_in_grid_order(shuffle, registers):
    """An encoder that shuffles its tokens, or appends registers after the grid: the init is
    right by position, and the fidelity of the model's own maps, put back in grid order from the
    token order its forward shows, is exact; scored by sequence index it would be near chance."""
    model = ReorderedViT(shuffle, registers)
    assert structinit.infer_layout(model) == structinit.TokenLayout((8, 8), registers)
    structinit.init_(model, "impulse", seed=0)
    fid = structinit.impulse_fidelity(model, torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2)))
    assert bool((fid["hit"] == 1).all()), fid["hit"]
    from structinit.adapters.probe import probe_inputs
    from structinit.adapters.token_order import is_identity, token_order

    name, ad = structinit.find_attention_layers(model)[0]
    order = token_order(model, ad, model.vit.pos_embed, 64, probe_inputs(model, [(name, ad)]))
    assert order is not None and not is_identity(order)
    assert sorted(order[0][order[0] >= 0].tolist()) == list(range(64)) and int((order[0] < 0).sum()) == registers


def test_an_output_projection_in_a_sibling_module_is_found_and_checked():
    """q/k/v in one module that returns the per-head context, the output projection beside it
    (Hugging Face's Data2Vec, Swin-V2, DPT …): the layer is adapted, its context checked against
    the model's own forward, and both schemes write it, mimetic's W_o into the sibling."""
    model = micro_vit_with_sibling_output()
    (name, ad), _ = structinit.find_attention_layers(model)
    assert name == "blocks.0.attn.attention" and ad.linear_views()["o"][0] is model.blocks[0].attn.output.dense.weight
    assert {v.kind for v in attention_survey(model).verdicts} == {"self"}
    structinit.init_(model, "impulse", seed=0)
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    assert bool((structinit.impulse_fidelity(model, images)["hit"] == 1).all())
    dense = model.blocks[0].attn.output.dense.weight.detach().clone()
    structinit.init_(model, "mimetic", seed=0)
    assert not torch.equal(dense, model.blocks[0].attn.output.dense.weight)


def test_position_only_fidelity_reads_the_maps_the_model_computes_not_the_adapters():
    """Impulse written and checked, then layer 0's forward changed behind the adapter's back (it
    negates its logits): the position-only score follows the model's own softmax and drops,
    while the adapter's recomputation of the same input still says every head hits."""
    torch.manual_seed(0)
    model = structinit.create_model("vit_micro_patch2_16", depth=2)
    structinit.init_(model, "impulse", seed=0)
    assert (structinit.impulse_fidelity(model)["hit"] == 1).all()
    attn = model.blocks[0].attn

    def negated(x):
        q, k, v = attn._qkv(x)
        probs = (-(q @ k.transpose(-2, -1)) * attn.scale).softmax(-1)
        return attn.proj((probs @ v).transpose(1, 2).reshape(x.shape[0], -1, q.shape[1] * q.shape[3]))

    attn.forward = negated
    hit = structinit.impulse_fidelity(model)["hit"]
    assert (hit[0] < 0.1).all() and (hit[1] == 1).all()
    from structinit.adapters.position_input import layer_position_input
    from structinit.functional import target_index

    name, ad = structinit.find_attention_layers(model)[0]
    layout = structinit.analysis.attention_layouts(model, [0])[0]
    designed = ad.attention_probs(*layer_position_input(model, name, ad, layout))[0]  # what the adapter believes
    for h, offset in enumerate(structinit.get_record(attn, "impulse")["offsets"]):
        target = target_index(layout.grid, tuple(offset))
        rows = target >= 0
        assert torch.equal(designed[h].argmax(-1)[rows], target[rows])


def test_position_only_fidelity_on_a_model_no_probe_fits_says_it_recomputes():
    """A forward that needs more than tokens (here a mask) cannot be probed with images or with
    tokens: the init is refused until the call is handed over (example_inputs=); fidelity, with
    no input of its own, falls back to the adapters' recomputation of the position-only input,
    and says so in a warning instead of passing it off as the model's own maps."""
    from torch import nn

    class NeedsMask(nn.Module):
        def __init__(self):
            super().__init__()
            vit = structinit.create_model("vit_micro_patch2_16", depth=2)
            self.table, self.blocks = nn.Parameter(vit.pos_embed.detach().clone()[0]), vit.blocks

        def forward(self, x, mask):
            return self.blocks((x + self.table) * mask)

    finder = "test-needs-mask"
    structinit.register_position_finder(finder, lambda m: structinit.Discovery(m.table, "table", grid=(8, 8),
                                                                                 num_prefix_tokens=0)
                                        if isinstance(m, NeedsMask) else None)
    try:
        torch.manual_seed(0)
        model = NeedsMask()
        check_rejected(model, lambda m: structinit.init_(m, "impulse", reserve="none", seed=0), ValueError,
                       r"cannot check its write in NeedsMask's own forward.*example_inputs=")
        call = (torch.randn(2, 64, model.table.shape[-1]), torch.ones(2, 64, 1))
        structinit.init_(model, "impulse", reserve="none", seed=0, example_inputs=call)
        with pytest.warns(UserWarning, match="cannot run NeedsMask's own forward.*the adapters' recomputation"):
            fid = structinit.impulse_fidelity(model)
        assert (fid["hit"] == 1).all()
    finally:
        structinit.unregister_position_finder(finder)


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_a_bfloat16_model_is_initialised_in_its_dtype_and_checked(scheme):
    """bf16 rounds a layer's output to about 1e-2 of it: the checks allow for that (they refused
    every bf16 model, blaming the value path), and still refuse a layer that is really different."""
    torch.manual_seed(0)
    model = structinit.create_model("vit_cpu_patch4_32", depth=2).bfloat16()
    structinit.init_(model, scheme, seed=0)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    if scheme == "impulse":
        images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
        assert (structinit.impulse_fidelity(model, images)["hit"] == 1).all()
    broken = micro_vit_with("roll_heads").bfloat16()
    check_rejected(broken, lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"impulse cannot set the attention of layer 'blocks\.0\.attn'")


def test_diagonal_strength_reads_a_mask_of_finfo_min_as_closed_pairs_like_minus_infinity():
    """Hugging Face fills masked logits with finfo(dtype).min, not −∞: the same closed pairs,
    not a number that overflows the spread into NaN (which no threshold would catch)."""
    from structinit.schemes.checks import diagonal_strength

    logits = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)) + 4 * torch.eye(8)
    above = torch.ones(8, 8, dtype=torch.bool).triu(1)
    with_inf = logits.masked_fill(above, float("-inf"))
    with_min = logits.masked_fill(above, torch.finfo(logits.dtype).min)
    strength = diagonal_strength(with_inf)
    assert torch.isfinite(strength).all() and (strength > 1).all()
    torch.testing.assert_close(diagonal_strength(with_min), strength)


class UnevenHeads(nn.Module):
    """Projections named as Hugging Face names them, 64 wide, and 3 heads: its width does not
    split into its heads, so its own forward fails and nothing can be read from it."""

    def __init__(self, dim=64, heads=3):
        super().__init__()
        self.num_heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(((q @ k.transpose(-2, -1)).softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_heads_that_do_not_split_the_width_are_refused_in_one_line_not_a_traceback(scheme):
    model = nn.Sequential(nn.Conv2d(3, 64, 2, stride=2), nn.Flatten(2), UnevenHeads())
    model[2].register_forward_pre_hook(lambda m, args: (args[0].transpose(1, 2),))
    grid = {"grid": (8, 8)} if scheme == "impulse" else {}
    check_rejected(model, lambda m: structinit.init_(m, scheme, seed=0, **grid), ValueError,
                   r"layer '2' \(UnevenHeads\): its q projection has 64 outputs, which its 3 heads do not split")
