"""One survey per init: what an init reads from the model is found once, by as few forwards as
the facts need, and nothing of it outlives the init."""

from __future__ import annotations

import collections

import pytest
import torch
from broken_attention import ReorderedViT, micro_vit_with

import structinit
from structinit.adapters import registry as adapter_registry
from structinit.adapters.logit_transforms import POSITION_BIAS
from structinit.adapters.survey import ModelSurvey
from structinit.adapters.token_order import token_order


def _count_forwards(model: torch.nn.Module) -> list[int]:
    calls = [0]

    def hook(module, args):
        calls[0] += 1

    model.register_forward_pre_hook(hook)
    return calls


@pytest.mark.parametrize("name,scheme,most", [
    ("vit_cpu_patch4_32", "impulse", 3),       # the survey's probe, the token order, the check after the write
    ("vit_cpu_patch4_32", "mimetic", 2),       # the survey's probe, the check after the write
    ("vit_cpu_patch4_32", "timm", 0),          # a whole-model scheme asks the survey nothing
    ("convit_cpu_patch4_32", "impulse", 3),
    ("convmixer_cpu_128_6", "conv_impulse", 0),
    ("convmixer_cpu_128_6", "impulse", 0),     # its graph, traced without running it, proves it has no attention
])
def test_an_init_runs_the_model_forward_no_more_than_its_facts_need(name, scheme, most):
    model = structinit.create_model(name)
    calls = _count_forwards(model)
    if scheme == "conv_impulse":
        structinit.conv_impulse_init_(model, seed=0)
    else:
        structinit.init_(model, scheme, seed=0)
    assert calls[0] <= most, calls[0]


def _probe_batches(model: torch.nn.Module) -> list[int]:
    sizes = []
    model.register_forward_pre_hook(lambda m, args: sizes.append(args[0].shape[0]))
    return sizes


def test_plain_self_attention_is_surveyed_on_one_image():
    model = structinit.create_model("vit_cpu_patch4_32")
    sizes = _probe_batches(model)
    survey = ModelSurvey(model)
    assert all(v.kind == "self" and v.checked for v in survey.attention.verdicts)
    assert sizes == [1] and survey.probe.shape[0] == 1


def test_a_layer_refused_on_one_image_is_judged_again_on_two():
    # a logit term that does not depend on content shows as what two images share: one cannot name it
    model = micro_vit_with("extra_bias")
    sizes = _probe_batches(model)
    verdict = ModelSurvey(model).attention.verdict("blocks.0.attn")
    assert sizes == [1, 2] and (verdict.kind, verdict.code) == ("refused", POSITION_BIAS)


def test_each_module_is_looked_up_once_per_init(monkeypatch):
    seen = collections.Counter()
    original = adapter_registry.adapter_for

    def counting(module):
        seen[id(module)] += 1
        return original(module)

    monkeypatch.setattr(adapter_registry, "adapter_for", counting)
    model = structinit.create_model("vit_cpu_patch4_32")
    structinit.init_(model, "impulse", seed=0)
    assert seen and max(seen.values()) == 1, max(seen.values())
    assert all(id(block.attn) in seen for block in model.blocks)  # a claimed module's children need no look


def test_a_survey_finds_each_fact_once_and_keeps_nothing_on_the_model():
    model = structinit.create_model("vit_cpu_patch4_32")
    calls = _count_forwards(model)
    survey = ModelSurvey(model)
    assert calls[0] == 0  # built lazily: nothing read yet
    first = (survey.layers(), survey.position, survey.probe, survey.first_layer_tokens)
    after_first = calls[0]
    again = (survey.layers(), survey.position, survey.probe, survey.first_layer_tokens)
    assert calls[0] == after_first == 1
    assert first[0] == again[0] and all(a is b for a, b in zip(first[1:], again[1:]))
    # A new survey reads the model afresh: a layer replaced since is seen (no cache keyed by the model).
    model.blocks[0].attn = torch.nn.Identity()
    assert len(ModelSurvey(model).layers()) == len(first[0]) - 1


@pytest.mark.parametrize("registers", [0, 3])
def test_the_token_order_takes_one_forward_whatever_the_grid(registers):
    model = ReorderedViT(True, registers)
    _, ad = structinit.find_attention_layers(model)[0]
    calls = _count_forwards(model)
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    order = token_order(model, ad, model.vit.pos_embed, 64, images)
    assert calls[0] == 1
    assert order is not None and order.shape == (2, 64 + registers)
    for sample in order:
        assert sorted(sample[sample >= 0].tolist()) == list(range(64)) and int((sample < 0).sum()) == registers
    assert not model.vit.pos_embed.requires_grad or model.vit.pos_embed.grad is None


def test_the_token_order_of_tokens_mixed_before_the_layer_is_unread():
    """A token that mixes rows of the position embedding (a conv stem after the PE) has no one
    grid position: the order is None, not a guess."""
    model = ReorderedViT(False, 0)
    _, ad = structinit.find_attention_layers(model)[0]
    pe = model.vit.pos_embed
    with torch.no_grad():
        mixed = torch.nn.Conv1d(64, 64, 1)  # every token becomes a sum of every row
    handle = ad.input_module.register_forward_pre_hook(lambda m, args: (mixed(args[0]), *args[1:]))
    try:
        order = token_order(model, ad, pe, 64, torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0)))
    finally:
        handle.remove()
    assert order is None


def test_a_model_is_proved_free_of_attention_only_by_a_graph_that_shows_none():
    from structinit.adapters.survey import forms_no_attention

    assert forms_no_attention(structinit.create_model("convmixer_cpu_128_6"))
    assert not forms_no_attention(structinit.create_model("vit_cpu_patch4_32"))  # a softmax in its graph
    encoder = torch.nn.TransformerEncoderLayer(16, 2, batch_first=True)  # a torch.nn leaf holding attention
    assert not forms_no_attention(torch.nn.Sequential(torch.nn.Linear(4, 16), encoder))

    class Branchy(torch.nn.Module):  # Python that branches on a tensor: no graph, no proof
        def forward(self, x):
            return x.relu() if x.sum() > 0 else x
    assert not forms_no_attention(Branchy())


class _PooledKeys(torch.nn.Module):
    """CvT's attention: q from a depthwise convolution, k and v from a strided one (4× fewer
    tokens), heads folded into the batch: a (B·heads, 64, 16) softmax map over 3-D logits."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.h = heads
        conv = torch.nn.Conv2d
        self.to_q = torch.nn.Sequential(conv(dim, dim, 3, padding=1, groups=dim), conv(dim, dim, 1))
        self.to_kv = torch.nn.Sequential(conv(dim, dim, 3, padding=1, stride=2, groups=dim), conv(dim, 2 * dim, 1))
        self.out = conv(dim, dim, 1)

    def forward(self, x):  # (B, D, H, W)
        b, d, hh, ww = x.shape
        fold = lambda t: t.reshape(b * self.h, d // self.h, -1).transpose(1, 2)  # (B·heads, T, r)
        q, (k, v) = fold(self.to_q(x)), (fold(t) for t in self.to_kv(x).chunk(2, dim=1))
        probs = torch.einsum("bid,bjd->bij", q, k).softmax(-1)
        return self.out(torch.einsum("bij,bjd->bid", probs, v).transpose(1, 2).reshape(b, d, hh, ww))


class _PooledKeysNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.attn, self.head = torch.nn.Conv2d(3, 16, 4, stride=4), _PooledKeys(), torch.nn.Linear(16, 10)

    def forward(self, images):
        x = self.stem(images)
        return self.head((x + self.attn(x)).mean((2, 3)))


def test_attention_over_pooled_keys_is_not_passed_over_for_the_conv_layers_beside_it():
    """A softmax over (B·heads, queries, fewer keys) is no map structinit reads as self-attention
    or as pooling, and no adapter claims it; the model has depthwise convolutions too. 'impulse'
    names the map and the escape (``target='conv'``) instead of initialising the convolutions in
    the attention's place; the model is left bit for bit as it was. Asked for, the convolutions
    are written."""
    from rejection import check_rejected

    torch.manual_seed(0)
    model = _PooledKeysNet()
    check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"has attention that no adapter understands: attn \(_PooledKeys: a 64×16 softmax map over 3-D "
                   r"logits\); nothing was written\..*target='conv'")
    check_rejected(model, lambda m: structinit.init_(m, "mimetic", seed=0), ValueError,
                   r"no attention layer structinit can read in _PooledKeysNet: its forward makes softmax maps that "
                   r"are neither self-attention over its tokens nor pooling by its adapters: attn \(_PooledKeys: a "
                   r"64×16 softmax map")
    before = model.attn.to_q[0].weight.detach().clone()
    structinit.init_(model, "impulse", target="conv", seed=0)
    assert not torch.equal(model.attn.to_q[0].weight, before)


class _SequentialSoftmax(torch.nn.Module):
    """vit-pytorch MaxViT's habit: the softmax inside ``nn.Sequential(nn.Softmax(dim=-1), nn.Dropout(p))``."""

    def __init__(self, dim, heads):
        super().__init__()
        self.h, self.qkv, self.proj = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.attend = torch.nn.Sequential(torch.nn.Softmax(dim=-1), torch.nn.Dropout(0.0))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        self.last_probs = self.attend(q @ k.transpose(-2, -1) * (d // self.h) ** -0.5)
        return self.proj((self.last_probs @ v).transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_a_softmax_kept_in_a_sequential_with_a_dropout_is_its_attention_modules_map(scheme):
    """The map made in the Sequential belongs to the attention module around it (not to the
    Sequential, where no projection is: it was read as a head whose q and k are pooled, and left
    alone); both schemes write the layer, and impulse's heads hit in the module's own maps."""
    from attention_modules import SepViT

    torch.manual_seed(0)
    model = SepViT(attn_cls=_SequentialSoftmax)
    assert [n for n, _ in ModelSurvey(model).layers()] == ["blocks.0.attn", "blocks.1.attn"]
    structinit.init_(model, scheme, seed=0, **({"reserve": "none"} if scheme == "impulse" else {}))
    assert structinit.get_record(model, "init")["layers"] == ["blocks.0.attn", "blocks.1.attn"]
    if scheme == "impulse":
        assert bool((structinit.impulse_fidelity(model)["hit"] == 1).all())


class _BiasedAttention(_SequentialSoftmax):
    """Plain attention that takes an optional additive logit bias (RegionViT's local calls)."""

    def forward(self, x, bias=None):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-2, -1) * (d // self.h) ** -0.5
        self.last_probs = self.attend(logits if bias is None else logits + bias)
        return self.proj((self.last_probs @ v).transpose(1, 2).reshape(b, t, d))


class _CalledTwice(torch.nn.Module):
    """Each block's one attention module called twice per forward: on all 16 tokens, then, with
    ``unlike``, on 2×2 windows with a logit bias (RegionViT's regional-then-local calls); else on
    all tokens again (weights shared, as ALBERT shares them)."""

    def __init__(self, unlike: bool, dim=16, heads=2):
        super().__init__()
        from attention_modules import Patchify

        self.unlike, self.patch_embed = unlike, Patchify((16, 16), 4, dim)
        self.pos_embed = torch.nn.Parameter(structinit.sincos_2d((4, 4), dim)[None])
        self.attn = torch.nn.ModuleList([_BiasedAttention(dim, heads) for _ in range(2)])
        self.bias = torch.nn.Parameter(torch.randn(1, heads, 4, 4))

    def forward(self, images):
        x = self.patch_embed(images) + self.pos_embed
        b, t, d = x.shape
        for attn in self.attn:
            x = x + attn(x)
            if not self.unlike:
                x = x + attn(x)
                continue
            win = x.reshape(b, 2, 2, 2, 2, d).permute(0, 1, 3, 2, 4, 5).reshape(b * 4, 4, d)
            win = win + attn(win, bias=self.bias)
            x = win.reshape(b, 2, 2, 2, 2, d).permute(0, 1, 3, 2, 4, 5).reshape(b, t, d)
        return x.mean(1)


@pytest.mark.parametrize("scheme", ["impulse", "mimetic"])
def test_a_layer_called_on_two_token_layouts_in_one_forward_is_refused_and_one_called_alike_is_written(scheme):
    """A module the forward calls twice, handed other shapes and a bias the second time, is checked
    on one call only: both schemes refuse it, naming the two calls, and leave the model as it was.
    The same module called twice alike (shared weights) is written."""
    from rejection import check_rejected

    options = {"reserve": "none"} if scheme == "impulse" else {}
    torch.manual_seed(0)
    check_rejected(_CalledTwice(unlike=True), lambda m: structinit.init_(m, scheme, seed=0, **options), ValueError,
                   r"layer 'attn.0' .*called 2 times in one forward, and not alike: first with \(\(2, 16, 16\)\), "
                   r"later with \(\(8, 4, 16\), bias=\(1, 2, 4, 4\)\).*nothing was written.*layers=")
    model = _CalledTwice(unlike=False)
    structinit.init_(model, scheme, seed=0, **options)
    assert structinit.get_record(model, "init")["layers"] == ["attn.0", "attn.1"]


class _Attend(torch.nn.Module):
    """The core of the attention, with no parameter: the parent hands it q, k and v (vit-pytorch's
    ``Attend``, x-transformers' too)."""

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


class _HandsQKV(_SequentialSoftmax):
    def __init__(self, dim, heads):
        super().__init__(dim, heads)
        self.attend = _Attend()

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        return self.proj(self.attend(q, k, v).transpose(1, 2).reshape(b, t, d))


class _MemoryKeys(_SequentialSoftmax):
    """Self-attention over its tokens and two learned memory keys and values."""

    def __init__(self, dim, heads):
        super().__init__(dim, heads)
        self.memory = torch.nn.Parameter(torch.randn(2, 2, heads, 1, dim // heads))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        k, v = (torch.cat([m.transpose(0, 1).expand(b, -1, 2, -1), t_], 2) for m, t_ in zip(self.memory, (k, v)))
        probs = (q @ k.transpose(-2, -1) * (d // self.h) ** -0.5).softmax(-1)
        return self.proj((probs @ v).transpose(1, 2).reshape(b, t, d))


def test_a_map_made_in_a_module_without_parameters_is_its_parents():
    """q, k and v handed to a parameter-free module that makes the map: the map is the parent's,
    whose projections make them (it was filed under the child, read as handed queries, and the
    layer left alone as a pooling head). Mimetic writes the layer and checks it in its own maps."""
    from attention_modules import SepViT

    torch.manual_seed(0)
    model = SepViT(attn_cls=_HandsQKV)
    assert [n for n, _ in ModelSurvey(model).layers()] == ["blocks.0.attn", "blocks.1.attn"]
    structinit.init_(model, "mimetic", seed=0)
    assert structinit.get_record(model, "init")["layers"] == ["blocks.0.attn", "blocks.1.attn"]


def test_attention_over_its_tokens_and_a_few_learned_keys_is_named_so_not_a_pooling_head():
    from attention_modules import SepViT
    from rejection import check_rejected

    torch.manual_seed(0)
    check_rejected(SepViT(attn_cls=_MemoryKeys), lambda m: structinit.init_(m, "mimetic", seed=0), ValueError,
                   r"no attention layer found in SepViT \(only layers it leaves alone: blocks\.0\.attn, "
                   r"blocks\.1\.attn, the first as _MemoryKeys: self-attention of 64 tokens over 66 keys, 2 more "
                   r"than its tokens \(learned memory keys, an attention sink")


class _Values(_SequentialSoftmax):
    """Plain attention whose values are one head shared by every query head ('one'), or the
    tokens themselves, no value projection ('tokens')."""

    def __init__(self, dim, heads, values):
        super().__init__(dim, heads)
        self.values, self.v = values, torch.nn.Linear(dim, dim // heads)

    def forward(self, x):
        b, t, d = x.shape
        q, k, _ = self.qkv(x).reshape(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        v = self.v(x)[:, None] if self.values == "one" else x.reshape(b, t, self.h, -1).transpose(1, 2)
        probs = (q @ k.transpose(-2, -1) * (d // self.h) ** -0.5).softmax(-1)
        return self.proj((probs @ v).transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("values,words", [
    ("one", r"its keys and values serve its 2 query heads in different groups \(2 key heads, 1 value head\)"),
    ("tokens", r"no parameter feeds its values: they are made from its tokens with no projection of their own"),
])
def test_values_the_trace_cannot_set_are_named_for_what_they_are(values, words):
    """Values shared by the query heads while the keys are not, and values with no projection:
    each refusal says which (they were called keys and values shared, and no parameter feeding
    'the attention')."""
    from attention_modules import SepViT
    from rejection import check_rejected

    torch.manual_seed(0)
    model = SepViT(attn_cls=lambda dim, heads: _Values(dim, heads, values))
    check_rejected(model, lambda m: structinit.init_(m, "mimetic", seed=0), ValueError,
                   r"blocks\.0\.attn \(_Values: a \d+×\d+ softmax map; " + words)
