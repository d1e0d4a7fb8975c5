"""Position-embedding discovery: the built-in finders (timm, Hugging Face, generic names such
as vit-pytorch's), the registry users extend, and the token-count checks fidelity makes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import structinit
from attention_modules import SepAttention, SepViT
from rejection import check_rejected
from structinit.functional.posembed import sincos_2d


class PytorchStyleViT(nn.Module):
    """vit-pytorch's layout: ``pos_embedding`` (1, N+1, D) and ``cls_token`` at the root, a
    patch convolution, ``image_size``; the grid comes from the convolution."""

    def __init__(self, image_size=(16, 24), patch=4, dim=32, heads=2, extra_token=False):
        super().__init__()
        self.image_size = image_size
        self.to_patch = nn.Conv2d(3, dim, patch, stride=patch)
        n = (image_size[0] // patch) * (image_size[1] // patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.ModuleList([SepAttention(dim, heads)])
        self.extra_token = extra_token  # a token from nowhere: breaks the recorded layout

    def forward(self, img):
        x = self.to_patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embedding
        if self.extra_token:
            x = torch.cat([torch.zeros_like(x[:, :1]), x], 1)
        for layer in self.attn:
            x = x + layer(self.norm(x))
        return x[:, 0]


def _zero_class_token(model: PytorchStyleViT) -> PytorchStyleViT:
    """The model with its class token's position row zero as well as the token: the written q/k
    give it logit 0, below every head's target (with a random row it takes a third of the rows,
    and impulse refuses: this model has no MLP and no residual write to reserve position in)."""
    with torch.no_grad():
        model.pos_embedding[:, 0] = 0
    return model


def test_generic_finder_reads_a_vit_pytorch_layout():
    model = PytorchStyleViT()
    found = structinit.find_position_embedding(model)
    assert (found.source, found.pos_embed_name, found.grid, found.num_prefix_tokens) == (
        "generic", "pos_embedding", (4, 6), 1)
    assert structinit.infer_layout(model) == structinit.TokenLayout((4, 6), 1)
    structinit.init_(model, "impulse", reserve="patch", seed=0)  # the patch conv is found by its stride
    assert bool((structinit.impulse_fidelity(model, torch.randn(2, 3, 16, 24))["hit"] == 1).all())


def test_timm_finder_has_priority_and_reads_grid_size():
    model = SepViT(img=(8, 12))
    found = structinit.find_position_embedding(model)
    assert found.source == "timm" and found.grid == (4, 6) and found.num_prefix_tokens == 0


@settings(max_examples=15, deadline=None)
@given(side=st.integers(2, 9), as_buffer=st.booleans(), two_d=st.booleans())
def test_plain_tensor_of_shape_n_by_d_is_found(side, as_buffer, two_d):
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            shape = (side * side, 16) if two_d else (1, side * side, 16)
            if as_buffer:
                self.register_buffer("pos_emb", torch.zeros(shape))
            else:
                self.pos_emb = nn.Parameter(torch.zeros(shape))

    found = structinit.find_position_embedding(Plain())
    assert found.pos_embed_name == "pos_emb" and found.num_prefix_tokens is None
    assert structinit.infer_layout(Plain()) == structinit.TokenLayout((side, side), 0)


def test_two_candidates_are_ambiguous_and_the_error_asks_for_hints():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos_embedding = nn.Parameter(torch.zeros(1, 16, 8))
            self.position_embeddings = nn.Parameter(torch.zeros(1, 16, 8))

    assert structinit.find_position_embedding(Two()).pos_embed is None
    with pytest.raises(ValueError, match=r"pass grid=\(h, w\)"):
        structinit.infer_layout(Two())


def test_a_model_without_a_position_embedding_is_told_so_and_what_to_pass():
    # Twins-like: position comes from convolutions, and no patch embedding states a grid
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"Sequential: it has no position embedding structinit can find .*pass "
                                         r"grid=\(h, w\), and to impulse also pos_embed=.*or use 'mimetic'"):
        structinit.infer_layout(model)


def test_user_finder_is_tried_first_and_can_be_removed():
    model = SepViT()
    seen = []

    def finder(m):
        seen.append(type(m).__name__)
        return structinit.Discovery(m.pos_embed, "mine", grid=(4, 16), num_prefix_tokens=0, source="mine")

    structinit.register_position_finder("mine", finder)
    try:
        assert structinit.infer_layout(model).grid == (4, 16) and seen == ["SepViT"]
    finally:
        structinit.unregister_position_finder("mine")
    assert structinit.infer_layout(model).grid == (8, 8)


def test_a_finder_that_returns_something_else_is_named():
    structinit.register_position_finder("broken", lambda m: {"grid": (8, 8)})
    try:
        with pytest.raises(TypeError, match=r"finder 'broken' returned dict, not a Discovery"):
            structinit.infer_layout(SepViT())
    finally:
        structinit.unregister_position_finder("broken")


@pytest.mark.parametrize("bad", [("", lambda m: None), ("x", 3)])
def test_register_position_finder_checks_its_arguments(bad):
    with pytest.raises((TypeError, ValueError), match=r"name=|finder="):
        structinit.register_position_finder(*bad)


def test_a_token_the_layout_does_not_know_is_refused_at_init_and_by_fidelity_after_it():
    model = PytorchStyleViT(extra_token=True)  # the forward prepends a token the layout does not know
    check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"attention layer 'attn.0' \(SepAttention\) receives 26 tokens, but the model's layout is 1 prefix "
                   r"\+ 24 grid \(4×6\) tokens")
    model = _zero_class_token(PytorchStyleViT())
    structinit.init_(model, "impulse", seed=0)
    model.extra_token = True  # a forward that changed after the init
    with pytest.raises(ValueError, match=r"'attn.0' received 26 tokens, but the layout has 1 prefix \+ 24 grid"):
        structinit.impulse_fidelity(model, torch.randn(2, 3, 16, 24))


def test_fidelity_without_a_record_checks_the_explicit_layout():
    model = PytorchStyleViT()
    offsets = [(0, 0), (1, 1)]
    with pytest.raises(ValueError, match=r"num_prefix_tokens=0, but PytorchStyleViT has 1 prefix"):
        structinit.impulse_fidelity(model, torch.randn(2, 3, 16, 24), offsets=offsets, num_prefix_tokens=0)
    # 25 PE rows fit a 5×5 grid whose prefix tokens have no row, but 25 tokens arrive, not 1 + 25.
    with pytest.raises(ValueError, match=r"received 25 tokens, but the layout has 1 prefix \+ 25 grid \(5×5\) = 26"):
        structinit.impulse_fidelity(model, torch.randn(2, 3, 16, 24), offsets=offsets, grid=(5, 5))
    with pytest.raises(ValueError, match=r"`pos_embedding` has 25 rows, but a 3×3 grid with 1 prefix .* needs 9 to 10"):
        structinit.impulse_fidelity(model, torch.randn(2, 3, 16, 24), offsets=offsets, grid=(3, 3))


def test_impulse_init_records_the_prefix_tokens_it_found():
    model = _zero_class_token(PytorchStyleViT())
    structinit.init_(model, "impulse", seed=0)
    assert structinit.get_record(model.attn[0])["num_prefix_tokens"] == 1


class ConvPositionMHA(nn.Module):
    """A patch conv and a positional depthwise conv (position from convolutions, as PVT-v2,
    NextViT, MobileViT), then self-attention: no tensor of the tokens' width is ever added."""

    def __init__(self, dim: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv2d(3, dim, 2, stride=2)
        self.peg = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.head = nn.Linear(dim, 10)

    def tokens(self, img):
        """(B, h·w, D): the patch map with what carries its position, flattened."""
        x = self.patch(img)
        return (x + self.peg(x)).flatten(2).transpose(1, 2)

    def forward(self, img):
        x = self.tokens(img)
        n = self.norm(x)
        x = x + self.attn(n, n, n, need_weights=False)[0]
        return self.head(x.mean(1))


def test_tokens_that_carry_no_position_are_named_so_for_impulse_and_mimetic_still_sets_them():
    from rejection import check_rejected

    message = check_rejected(ConvPositionMHA(), lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                             r"cannot infer the token grid of ConvPositionMHA: its tokens carry no position, since "
                             r"the model holds no tensor of their width \(16\) and more than one row outside its "
                             r"layers' weights")
    assert "use 'mimetic', which needs neither" in message
    structinit.init_(ConvPositionMHA(), "mimetic", seed=0)  # mimetic needs no position


class ClassTokenNoPosition(ConvPositionMHA):
    """BEiT as Hugging Face builds it by default: a class token, and no absolute or relative
    position anywhere (a (1, 1, D) token is the same for every position)."""

    def __init__(self, dim: int = 16):
        super().__init__(dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))

    def forward(self, img):
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1)
        n = self.norm(x)
        x = x + self.attn(n, n, n, need_weights=False)[0]
        return self.head(x[:, 0])


def test_a_class_token_is_no_position_for_the_tokens_to_carry():
    from rejection import check_rejected

    check_rejected(ClassTokenNoPosition(), lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                   r"cannot infer the token grid of ClassTokenNoPosition: its tokens carry no position")


class ComputedPosition(ConvPositionMHA):
    """A sin-cos table computed from the patch map in every forward and added to its tokens (as
    vit-pytorch's SimpleViT variants do): position no tensor of the model holds."""

    def tokens(self, img):
        x = self.patch(img)
        return x.flatten(2).transpose(1, 2) + sincos_2d(tuple(x.shape[-2:]), x.shape[1]).to(x.dtype)


def test_position_a_forward_computes_is_not_called_no_position():
    from rejection import check_rejected

    message = check_rejected(ComputedPosition(), lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                             r"cannot infer the token grid of ComputedPosition: its tokens carry position from a table "
                             r"its forward computes each call and adds to them, which impulse cannot write")
    assert "carry no position" not in message


class ResizedPosition(ConvPositionMHA):
    """A 4×4 position embedding kept channels first and resized to the patch grid of whatever
    image comes in (DINOv2's interpolation), with no image size stated."""

    def __init__(self, dim: int = 16):
        super().__init__(dim)
        self.pos_embed = nn.Parameter(torch.randn(1, dim, 4, 4) * 0.02)

    def tokens(self, img):
        x = self.patch(img)
        x = x + nn.functional.interpolate(self.pos_embed, size=x.shape[-2:], mode="bicubic", align_corners=False)
        return x.flatten(2).transpose(1, 2)


def test_an_embedding_the_forward_resizes_to_the_probe_is_refused_with_advice_that_fits_it():
    """The layer takes another count of tokens than the embedding's grid gives: the refusal adds
    that a resized embedding blurs the offsets impulse writes on its own grid (passing grid= or
    an image of the embedding's size would leave the model at another size than it runs at)."""
    message = check_rejected(ResizedPosition(), lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                             r"receives \d+ tokens, but the model's layout is 0 prefix \+ 16 grid \(4×4\)")
    assert "where the forward resizes its position embedding to the image's grid (the probe was" in message
    assert "build the model with an embedding of the grid it runs on" in message


def test_a_position_embedding_kept_channels_first_is_not_called_no_position():
    """A (1, D, h, w) table the finders do not place (Visformer's per stage, TNT's pixel one) is
    a position the refusal must not deny: the message stays the one that asks for the grid."""
    from rejection import check_rejected

    model = ConvPositionMHA()
    model.stage_pos = nn.Parameter(torch.zeros(1, 16, 4, 4))  # held, channels first, under no known name
    message = check_rejected(model, lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                             r"cannot infer the token grid of ConvPositionMHA")
    assert "carry no position" not in message


def test_a_model_no_probe_runs_through_is_not_said_to_carry_no_position():
    """A forward that needs more than images (a vision tower's grid_thw) cannot be probed: a
    rotation it hands its layers may be its position, so the refusal only asks for the grid."""
    from rejection import check_rejected

    class NeedsGrid(ConvPositionMHA):
        def forward(self, img, grid_thw):
            return super().forward(img)

    message = check_rejected(NeedsGrid(), lambda m: structinit.init_(m, "impulse", seed=0), ValueError,
                             r"cannot infer the token grid of NeedsGrid")
    assert "carry no position" not in message


class _WindowsAfterProjection(nn.Module):
    """A fused ``qkv`` and ``proj`` (names an adapter claims); the 16×16 row-major tokens cut into
    4 windows of 4 rows after the projection (Hiera's mask units), each window its own softmax."""

    def __init__(self, dim, heads):
        super().__init__()
        self.num_heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, 4, n // 4, 3, self.num_heads, -1).permute(3, 0, 4, 1, 2, 5)
        context = torch.nn.functional.scaled_dot_product_attention(q, k, v)  # (B, heads, 4, 64, r)
        return self.proj(context.permute(0, 2, 3, 1, 4).reshape(b, n, d))


class _OverlappingPatches(nn.Module):
    """Hugging Face's layout with Hiera's patches: ``embeddings.patch_embeddings`` states an image
    size of 32 and a patch size of 4 (an 8×8 grid by division), but cuts 7-pixel patches at stride
    2, 16×16 of them; ``embeddings.position_embeddings`` has their 256 rows. Its attention takes
    windows of them, so that no layer receives the whole grid to read it from."""

    def __init__(self, dim=48, heads=3):
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.patch_embeddings = nn.Conv2d(3, dim, 7, stride=2, padding=3)
        self.embeddings.patch_embeddings.image_size, self.embeddings.patch_embeddings.patch_size = 32, 4
        self.embeddings.position_embeddings = nn.Parameter(torch.randn(1, 256, dim) * 0.02)
        self.norm = nn.LayerNorm(dim)
        self.attn = _WindowsAfterProjection(dim, heads)

    def forward(self, images):
        x = self.embeddings.patch_embeddings(images).flatten(2).transpose(1, 2)
        x = x + self.embeddings.position_embeddings
        return x + self.attn(self.norm(x))


def test_a_named_grid_its_own_embeddings_rows_do_not_fill_gives_way_to_theirs():
    torch.manual_seed(0)
    model = _OverlappingPatches()
    assert structinit.find_position_embedding(model).grid == (16, 16)
    assert structinit.infer_layout(model).grid == (16, 16)
