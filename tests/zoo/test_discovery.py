"""Discovery by structure on the public packages' ViTs: the layout found by tracing (class
tokens under any name, a PE that is a plain tensor attribute), vit-pytorch's attention found
by what its forward computes, and maps that equal the modules' own softmax."""


import pytest
import torch
import zoo

import structinit
from structinit.adapters.traced import TracedAdapter


def test_torchvision_class_token_is_found_by_tracing():
    model = zoo.build(zoo.BY_NAME["tv_vit_b_32"])
    found = structinit.find_position_embedding(model)
    assert (found.source, found.pos_embed_name, found.grid, found.num_prefix_tokens) == (
        "traced", "encoder.pos_embedding", (7, 7), 1)
    assert [n for n, _ in found.prefix_tokens] == ["class_token"]


def test_open_clip_class_embedding_of_shape_d_is_a_prefix_token():
    model = zoo.build(zoo.BY_NAME["openclip_ViT-S-32"])
    found = structinit.find_position_embedding(model)
    assert (found.pos_embed_name, found.grid, found.num_prefix_tokens) == ("positional_embedding", (7, 7), 1)
    assert [n for n, _ in found.prefix_tokens] == ["class_embedding"]


def test_simple_vit_plain_tensor_pe_is_found_and_written():
    model = zoo.build(zoo.BY_NAME["vitpytorch_SimpleViT"])
    found = structinit.find_position_embedding(model)
    assert found.pos_embed is model.pos_embedding and found.num_prefix_tokens == 0 and found.grid == (8, 8)
    structinit.init_(model, "impulse", seed=0)  # pe_scale=1 writes the sin-cos table into it
    torch.testing.assert_close(model.pos_embedding, structinit.sincos_2d((8, 8), 96))


def test_unnamed_pe_and_class_token_are_found_by_tracing():
    model = zoo.build(zoo.BY_NAME["torch_TransformerEncoder_ViT"])  # `positions`, `cls`: no known name
    found = structinit.find_position_embedding(model)
    assert (found.source, found.pos_embed_name, found.num_prefix_tokens, found.grid) == ("traced", "positions", 1,
                                                                                         (8, 8))


@pytest.mark.parametrize("name", ["vitpytorch_ViT", "vitpytorch_SimpleViT"])
def test_vit_pytorch_attention_is_adapted_without_register_adapter(name):
    layers = structinit.find_attention_layers(zoo.build(zoo.BY_NAME[name]))
    assert len(layers) == 4 and all(isinstance(ad, TracedAdapter) for _, ad in layers)
    assert {(ad.num_heads, ad.head_dim, ad.dim) for _, ad in layers} == {(3, 32, 96)}
    # its LayerNorm inside: the tokens are read where the fused projection takes them, after it
    assert all(ad.input_module is ad.module.to_qkv for _, ad in layers)


def test_lsa_is_read_with_its_learned_temperature_and_masked_diagonal_and_a_variant_that_differs_is_not():
    from vit_pytorch.vit_for_small_dataset import LSA

    from structinit.adapters.provenance import trace_attention
    from structinit.adapters.provenance_record import TraceError
    from structinit.adapters.provenance_tokens import tokens_of_call

    lsa = LSA(96, heads=3, dim_head=32)
    with torch.no_grad():
        lsa.temperature.fill_(0.7)  # not the r^−½ it starts at: the scale must be read from it
    x = torch.randn(2, 17, 96, generator=torch.Generator().manual_seed(0))
    ad = trace_attention(lsa, (x,), {})
    assert ad.masks_self and (ad.num_heads, ad.head_dim) == (3, 32)
    assert ad.scale == pytest.approx(float(torch.tensor(0.7).exp()))

    class LSAWithAReLU(LSA):  # the same weights, but a ReLU on the logits: a different forward
        def forward(self, x):
            x = self.norm(x)
            q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
            attn = self.attend((q @ k.transpose(-1, -2) * self.temperature.exp()).relu())
            return self.to_out((attn @ v).transpose(1, 2).flatten(2))

    # Its map is no softmax of q kᵀ·scale: the adapter's recomputation differs from the module's own
    # softmax, so the survey that judges every traced layer on its own maps refuses it.
    relu = LSAWithAReLU(96, heads=3, dim_head=32)
    own = []
    relu.attend.register_forward_hook(lambda m, a, out: own.append(out.detach()))
    try:
        traced = trace_attention(relu, (x,), {})
    except TraceError:
        return
    own.clear()
    with torch.no_grad():
        relu(x)
        ours = traced.attention_probs(tokens_of_call(traced, (x,), {}))
    assert not torch.allclose(ours, own[0], atol=1e-4)


@pytest.mark.parametrize("name", ["vitpytorch_ViT", "vitpytorch_SimpleViT"])
def test_attention_maps_equal_the_modules_own_softmax(name):
    entry = zoo.BY_NAME[name]
    model = zoo.build(entry)
    structinit.init_(model, "impulse", seed=0)
    images, _ = zoo.real_images(4, entry.image_size)
    maps = structinit.attention_maps(model, images)  # the library's capture (its survey probes the model too)
    real, handles = [], []
    for _, ad in structinit.find_attention_layers(model):
        handles.append(ad.module.attend.register_forward_hook(lambda m, a, out: real.append(out.detach())))
    try:
        with torch.no_grad():
            model.eval()(images)  # then one plain forward: each module's own softmax
    finally:
        for h in handles:
            h.remove()
    assert len(maps) == len(real) == 4
    for ours, theirs in zip(maps, real):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def eva_real_maps(model, images):
    """EVA-02's real attention maps, (B, H, T, T) per layer: softmax(q kᵀ/√r) of the q, k its
    attention hands to scaled_dot_product_attention, i.e. after RoPE."""
    import timm.models.eva as eva

    real, sdpa = [], eva.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        real.append((q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(-1))
        return sdpa(q, k, v, **kw)

    eva.F.scaled_dot_product_attention = spy
    try:
        with torch.no_grad():
            model(images)
    finally:
        eva.F.scaled_dot_product_attention = sdpa
    return real


def real_hit(model, maps) -> float:
    """Layer-1 argmax hit of real maps against the offsets the impulse init recorded."""
    layout, (_, ad) = structinit.infer_layout(model), structinit.find_attention_layers(model)[0]
    p, hits = maps[0].shape[-1] - layout.num_patches, []
    for h, off in enumerate(structinit.get_record(ad.module, "impulse")["offsets"]):
        t = structinit.target_index(layout.grid, off)
        rows = torch.nonzero(t >= 0).squeeze(1)
        hits.append((maps[0][:, h, rows + p].argmax(-1) == t[rows] + p).float().mean().item())
    return sum(hits) / len(hits)


def test_eva02_rope_is_read_from_the_call_and_the_impulse_survives_a_save_and_load():
    """EVA-02 has an absolute PE *and* RoPE on q/k, the RoPE table handed to every block. Its k
    bias is a zero buffer, neither learned nor saved: impulse writes through a pre-norm channel
    instead. The maps EVA hands to scaled_dot_product_attention (spied here, apart from
    structinit's capture) hit the targets, and still do in a fresh model that loads the state
    dict, which a write into the k-bias buffer would not survive."""
    entry = zoo.BY_NAME["timm_eva02_tiny_patch14_224"]
    model = zoo.build(entry)
    structinit.init_(model, "impulse", seed=0)
    record = structinit.get_record(model.blocks[0].attn, "impulse")
    assert record["solver"] == "rotary-norm" and record["norm"] == "blocks.0.norm1"
    assert bool((model.blocks[0].attn.k_bias == 0).all())
    images, _ = zoo.real_images(4, entry.image_size)
    assert real_hit(model, eva_real_maps(model, images)) >= 0.95
    assert structinit.fidelity_summary(structinit.impulse_fidelity(model, images)).hit_first >= 0.95
    reloaded = zoo.build(entry)
    reloaded.load_state_dict(model.state_dict())
    for block, again in zip(model.blocks, reloaded.blocks):
        structinit.set_record(again.attn, "impulse", structinit.get_record(block.attn, "impulse"))
    assert real_hit(reloaded, eva_real_maps(reloaded, images)) >= 0.95


def test_pit_channels_first_position_embedding_is_read_and_its_first_stage_takes_impulse():
    entry = zoo.BY_NAME["timm_pit_ti_224"]
    model = zoo.build(entry)
    found = structinit.find_position_embedding(model)
    assert found.grid == (27, 27) and tuple(found.pos_embed.shape) == (1, 729, 64)
    assert found.pos_embed.data_ptr() == model.pos_embed.data_ptr()  # a view of the (1, D, h, w) parameter
    before = model.pos_embed.detach().clone()
    structinit.init_(model, "impulse", layers=[0, 1], seed=0)  # the stage on the 27×27 grid
    assert model.pos_embed.shape == (1, 64, 27, 27) and not torch.equal(model.pos_embed, before)
    images, _ = zoo.real_images(4, entry.image_size)
    hits = structinit.impulse_fidelity(model, images, layers=[0, 1], batch_size=2)["hit"]
    assert (hits >= 0.95).all(), hits
