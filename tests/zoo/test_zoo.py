"""Every catalogue model (``bench/zoo.py``: ViTs built by timm, torchvision, vit-pytorch,
open_clip, transformers and torch itself) × every attention scheme, with no hints: each init
works and writes the attention, impulse keeps its argmax on real images, and every rejected
call leaves the model bit-identical."""

import copy

import pytest
import torch
import zoo

import structinit
from rejection import check_rejected
from structinit.adapters.registry import layer_relative_bias

zoo.require_packages()

N_IMAGES = 8  # enough rows for a hit rate: 8 images × every grid row × every head


@pytest.fixture(scope="module", params=[m.name for m in zoo.CATALOGUE])
def built(request):
    entry = zoo.BY_NAME[request.param]
    return entry, zoo.build(entry)


@pytest.fixture(scope="module")
def pristine_qk(built):
    return qk(built[1])  # the package's own init, before any scheme


def qk(model):
    """Every layer's W_q and W_k (not the biases: packages build them as zeros, and the schemes
    write zeros too), and its relative position bias table if it has one (Swin, BEiT), as one
    tuple per layer."""
    out = []
    for name, ad in structinit.find_attention_layers(model):
        wq, _, wk, _ = ad.read_qk()
        rb = layer_relative_bias(model, name, ad)  # its own, or one its block or the model hands it
        table = () if rb is None else (rb.table.detach().clone(),)
        out.append((wq.clone(), wk.clone(), *table))
    return out


def test_catalogue_spans_the_packages_the_readme_names():
    assert len(zoo.CATALOGUE) >= 15
    assert {m.package for m in zoo.CATALOGUE} >= {"timm", "torchvision", "vit-pytorch", "open_clip", "transformers"}


def test_impulse_keeps_its_argmax_on_real_images(built):
    entry, base = built
    if "impulse" in entry.refused:
        pytest.skip(f"impulse refuses {entry.name} ({entry.refused['impulse']}): tested below")
    model = copy.deepcopy(base)
    structinit.init_(model, "impulse", seed=0)
    images, _ = zoo.real_images(N_IMAGES, entry.image_size)
    summary = structinit.fidelity_summary(structinit.impulse_fidelity(model, images, batch_size=4))
    assert summary.hit_first >= 0.95 and summary.hit_mean >= 0.90, summary


@pytest.mark.parametrize("scheme", zoo.SCHEMES)
def test_every_scheme_inits_the_attention_without_hints(built, pristine_qk, scheme):
    entry, model = built  # the schemes run one after another on the same model, each from scratch
    if scheme in entry.refused:  # a scheme that cannot work on this model says so and writes nothing
        check_rejected(model, lambda m: structinit.init_(m, scheme, seed=0), ValueError, entry.refused[scheme])
        return
    structinit.init_(model, scheme, seed=0)
    after = qk(model)
    assert len(after) == len(pristine_qk)
    for before, now in zip(pristine_qk, after):
        changed = [not torch.equal(a, b) for a, b in zip(before, now)]
        if scheme == "impulse" and len(now) == 3:  # relative bias: the impulse is in the table
            assert changed[2] and not changed[0] and not changed[1], "impulse must write the table, not q/k"
        else:
            assert changed[0] and changed[1], "the init left a q/k weight as built"


BAD_CALLS = {
    "bad option value": (lambda m: structinit.init_(m, "impulse", kernel_size=4), ValueError, "kernel_size"),
    "misspelt option": (lambda m: structinit.init_(m, "mimetic", alpah=0.5), (TypeError, ValueError), "alpah"),
    "layer out of range": (lambda m: structinit.init_(m, "impulse", layers=[99]), ValueError, "layers contains 99"),
    "unknown scheme": (lambda m: structinit.init_(m, "impulsive"), (KeyError, ValueError), "impulsive"),
    "bad offsets": (lambda m: structinit.init_(m, "impulse", offsets=[(5, 5)]), ValueError, "offset"),
}


def test_a_rejected_call_leaves_the_model_bit_identical(built):
    _, model = built
    pe = structinit.find_position_embedding(model).pos_embed  # SimpleViT's is not in the state dict
    pe_before = None if pe is None else pe.detach().clone()
    for bad, (call, exc, match) in BAD_CALLS.items():
        check_rejected(model, call, exc, match)
        assert pe is None or torch.equal(pe, pe_before), bad
