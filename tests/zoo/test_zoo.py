"""Every catalogue model (``bench/zoo.py``: ViTs built by timm, torchvision, vit-pytorch,
open_clip, transformers and torch itself) × every attention scheme, with no hints: each init
works and writes the attention, impulse keeps its argmax on real images, and every rejected
call leaves the model bit-identical."""

import copy
import warnings

import pytest
import torch
import zoo

import structinit
from rejection import check_rejected
from structinit.adapters.observe import observe, real_maps
from structinit.adapters.provenance_tokens import module_output
from structinit.adapters.survey import layer_relative_bias
from structinit.schemes.checks import diagonal_strength

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


def test_catalogue_spans_the_packages_and_the_kinds_of_attention_people_ship():
    assert len(zoo.CATALOGUE) >= 40
    packages = {m.package for m in zoo.CATALOGUE}
    assert packages >= {"timm", "torchvision", "vit-pytorch", "open_clip", "transformers", "x-transformers"}
    refusals = " ".join(why for m in zoo.CATALOGUE for why in m.refused.values())
    # (attention no trace reads, refused as such, is written by hand: tests/test_traced_attention.py)
    for kind in ("rotates q and k by position", "normalised", "forms no softmax", "the value path is not linear"):
        assert kind in refusals, kind
    assert any(m.skipped for m in zoo.CATALOGUE)
    # talking heads (a Linear(h, h) and (h, h) parameters) are set, not refused
    assert {m.package for m in zoo.CATALOGUE if "talking heads" in m.what and not m.refused} >= {"timm", "vit-pytorch"}


def test_impulse_hits_on_the_models_own_maps_or_refuses_clearly(built):
    """Impulse either refuses with the catalogue's reason (the model bit-identical), or the
    model's own attention maps, on real images, put each head's argmax on its target; the
    attention-pooling heads the catalogue names are left alone, and listed."""
    entry, base = built
    model = copy.deepcopy(base)
    if "impulse" in entry.refused:
        check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0), ValueError, entry.refused["impulse"])
        return
    skipped_before = {n: copy.deepcopy(model.get_submodule(n).state_dict()) for n in entry.skipped}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        structinit.init_(model, "impulse", seed=0, **entry.options.get("impulse", {}))
    record = structinit.get_record(model, "init")
    assert [n for n, _ in record["skipped"]] == list(entry.skipped)
    assert bool(record["head_mixers"]) == ("talking heads" in entry.what)
    for name, state in skipped_before.items():
        assert all(torch.equal(v, model.get_submodule(name).state_dict()[k]) for k, v in state.items()), name
    images, _ = zoo.real_images(N_IMAGES, entry.image_size)
    summary = structinit.fidelity_summary(structinit.impulse_fidelity(model, images, batch_size=4))
    assert summary.hit_first >= 0.95 and summary.hit_mean >= 0.90, summary


def test_mimetic_structure_is_in_the_models_own_attention_or_refused_clearly(built):
    """Mimetic either refuses with the catalogue's reason, or, as the model itself computes it:
    every head's own attention logits favour the diagonal (W_q W_kᵀ ≈ αZ + βI with β > 0), and
    the value path of a layer whose output projection is inside it is x ↦ x M with a negative
    diagonal (W_v W_o ≈ γZ − δI). Flipping W_k or W_o fails these."""
    entry, base = built
    model = copy.deepcopy(base)
    if "mimetic" in entry.refused:
        check_rejected(model, lambda m: structinit.init_(m, "mimetic", seed=0), ValueError, entry.refused["mimetic"])
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        structinit.init_(model, "mimetic", seed=0)
    chosen = structinit.find_attention_layers(model)
    # Noise images: the structure is in q kᵀ whatever the content, and real images can be flat over a
    # whole window (sklearn's digits, the fallback without CIFAR-10), which leaves no diagonal to see.
    images = torch.randn(4, 3, entry.image_size, entry.image_size, generator=torch.Generator().manual_seed(0))
    calls, _ = observe(model, images, [(ad.module, ad.input_module, ad) for _, ad in chosen])
    for (name, ad), real in zip(chosen, real_maps(model, images, chosen, calls)):
        logits = real.logits if real.logits is not None else real.probs.clamp_min(1e-30).log()
        call = calls[ad.module]
        if ad.masks_self:  # the model hides the diagonal: its logits elsewhere are those of the q kᵀ written
            eye = torch.eye(logits.shape[-1], dtype=torch.bool)
            with torch.no_grad():
                q, k = ad.qk_features(call.x.float())
            written = q @ k.transpose(-2, -1) * ad.scale
            torch.testing.assert_close(_off_diagonal_centred(logits.float(), eye), _off_diagonal_centred(written, eye),
                                       atol=1e-3, rtol=1e-3)
            logits = written
        assert (diagonal_strength(logits) > 0.25).all(), (name, diagonal_strength(logits))  # flipped W_k: < 0
        out = module_output(call)
        x = call.x
        if out is None or x is None or x.ndim != 3 or out.shape != x.shape or real.probs.shape[-1] != x.shape[-2]:
            continue  # a windowed layer, or the output projection sits in a sibling module
        (wv, bv), (wo, bo) = ad.linear_views()["v"], ad.linear_views()["o"]
        v = torch.nn.functional.linear(x.float(), wv.float(), None if bv is None else bv.float())
        v = v.unflatten(-1, (real.probs.shape[1], -1)).transpose(1, 2)
        expected = (real.probs @ v).transpose(1, 2).flatten(2)  # the per-head context …
        if any(wo.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in ad.module.parameters()):
            # … through the output projection, when the module has it
            expected = torch.nn.functional.linear(expected, wo.float(), None if bo is None else bo.float())
        torch.testing.assert_close(out.float(), expected, atol=1e-4, rtol=1e-3)  # the model's own value path
        product = wv.detach().double().T @ wo.detach().double().T  # W_v W_o (D×D), the path just checked
        assert product.diagonal().mean() < -0.2, (name, product.diagonal().mean())  # γZ − δI: −δ on average


def _off_diagonal_centred(logits: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    """The off-diagonal logits of each row, less their mean (a softmax ignores a constant per row)."""
    off = logits[..., ~eye].reshape(*logits.shape[:-1], -1)
    return off - off.mean(-1, keepdim=True)


BAD_CALLS = {
    "bad option value": (lambda m: structinit.init_(m, "impulse", kernel_size=4), ValueError, "kernel_size"),
    "misspelt option": (lambda m: structinit.init_(m, "mimetic", alpah=0.5), (TypeError, ValueError), "alpah"),
    "layer out of range": (lambda m: structinit.init_(m, "impulse", layers=[99]), ValueError, "layers contains 99"),
    "unknown scheme": (lambda m: structinit.init_(m, "impulsive"), (KeyError, ValueError), "impulsive"),
    "bad offsets": (lambda m: structinit.init_(m, "impulse", offsets=[(5, 5)]), ValueError, "offset"),
}


def test_a_rejected_call_leaves_the_model_bit_identical(built):
    entry, model = built
    if entry.refused:  # the model's own refusal comes first; that it leaves the model as it was is checked above
        pytest.skip("bad options are checked on the models every attention scheme takes")
    pe = structinit.find_position_embedding(model).pos_embed  # SimpleViT's is not in the state dict
    pe_before = None if pe is None else pe.detach().clone()
    for bad, (call, exc, match) in BAD_CALLS.items():
        check_rejected(model, call, exc, match)
        assert pe is None or torch.equal(pe, pe_before), bad
