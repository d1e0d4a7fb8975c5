"""The traced finders on a model whose names say nothing: the position embedding and the class
token are found by perturbing each candidate tensor and watching which token rows change, in
the model's own dtype, and the patch embedding by which layer's output the position embedding
leaves alone."""

import pytest
import torch
from torch import nn

import structinit
from structinit.adapters.survey import ModelSurvey
from structinit.adapters.trace import traced_discovery, traced_patch_embedding
from structinit.models.vit import Attention


class Unnamed(nn.Module):
    """A ViT whose tensors carry no name a finder knows: ``where`` is the position embedding of
    the class token and the 4×4 grid, ``summary`` the class token."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, 4)
        self.summary = nn.Parameter(torch.randn(1, 1, dim))
        self.where = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.mix = Attention(dim, 2)
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.summary.expand(x.shape[0], -1, -1), x], 1) + self.where
        return self.head(self.mix(x)[:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_traced_discovery_in_the_models_dtype(dtype):
    torch.manual_seed(0)
    model = Unnamed().to(dtype)
    found = traced_discovery(ModelSurvey(model))
    assert found is not None, f"nothing traced in {dtype}"
    assert found.pos_embed is model.where
    assert found.num_prefix_tokens == 1
    assert found.grid == (4, 4)
    assert [t for _, t in found.prefix_tokens] == [model.summary]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traced_patch_embedding(dtype):
    torch.manual_seed(0)
    model = Unnamed().to(dtype)
    [(name, weight, bias)] = traced_patch_embedding(ModelSurvey(model))
    assert name == "stem" and weight is model.stem.weight and bias is model.stem.bias


class Checked(nn.Module):
    """A ViT, named as timm names it, that refuses to run with a position embedding it did not
    start with (a model that checks its own tensors)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 4, 4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.register_buffer("expected", self.pos_embed.detach().clone())
        self.attn = Attention(dim, 2)

    def forward(self, x):
        if not torch.equal(self.pos_embed, self.expected):
            raise ValueError("the position embedding changed")
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        return self.attn(x)


def test_traced_patch_embedding_when_the_perturbed_forward_fails():
    """A model that refuses the perturbed position embedding gives no answer (None), not an
    IndexError, and its position embedding is restored bit for bit."""
    torch.manual_seed(0)
    model = Checked()
    before = model.pos_embed.detach().clone()
    assert traced_patch_embedding(ModelSurvey(model)) is None
    assert torch.equal(model.pos_embed, before)
    assert model(torch.randn(1, 3, 16, 16)).shape == (1, 17, 16)


class FixedTable(nn.Module):
    """A ViT whose fixed sin-cos table is a plain float32 attribute, cast to the tokens' dtype in
    the forward (vit-pytorch's SimpleViT): after ``.to(bfloat16)`` the table stays float32."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, 4)
        self.table = torch.randn(16, dim)
        self.mix = Attention(dim, 2)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        return self.mix(x + self.table.to(x.dtype))


def test_a_table_held_in_another_dtype_than_the_model_is_traced_in_the_models():
    torch.manual_seed(0)
    model = FixedTable().to(torch.bfloat16)
    found = traced_discovery(ModelSurvey(model))
    assert found is not None and found.pos_embed is model.table and found.grid == (4, 4)


def test_a_16_bit_q_k_norm_is_run_in_its_own_dtype():
    """The adapters recompute q and k in float32 and run the model's own q/k norms on them: a
    bf16 LayerNorm refuses float32 input, so it gets its own dtype (it raised 'mixed dtype')."""
    torch.manual_seed(0)
    model = structinit.create_model("vit_micro_patch2_16")
    for block in model.blocks:
        block.attn.q_norm, block.attn.k_norm = nn.LayerNorm(16), nn.LayerNorm(16)
    model = model.to(torch.bfloat16)
    structinit.init_(model, "mimetic", seed=0)
    assert all(torch.isfinite(p).all() for p in model.parameters())
