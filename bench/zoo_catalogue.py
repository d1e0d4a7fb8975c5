"""The zoo's catalogue: ViT-family models built from code (no weights) by timm, torchvision,
vit-pytorch, open_clip, Hugging Face transformers, x-transformers and by hand, each with what
structinit's attention schemes are expected to do on it.

An entry's ``refused`` maps a scheme to a regular expression its clear error must match; a
scheme not listed must work. ``skipped`` names the modules the schemes must leave alone (and
list): attention-pooling, class-attention or reduced-key heads. Small configurations are used
where a package allows them without leaving the architecture family.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import structinit


@dataclass(frozen=True)
class ZooModel:
    """One catalogue entry: ``build()`` returns the model (random weights), which takes
    (B, 3, image_size, image_size) images."""

    name: str
    package: str
    build: Callable[[], nn.Module]
    image_size: int
    what: str
    refused: dict[str, str] = field(default_factory=dict)  # scheme → what its clear error says (a regex)
    # scheme → options it is given: what a user tells it, such as the grid of a model that states no image size
    options: dict[str, dict] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()  # modules every attention scheme leaves alone, by name


# -- builders, one per package ---------------------------------------------------------------

def _timm(name: str, **kw) -> Callable[[], nn.Module]:
    def build():
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10, **kw)
    return build


def _torchvision(name: str) -> Callable[[], nn.Module]:
    def build():
        import torchvision

        return getattr(torchvision.models, name)(weights=None, num_classes=10)
    return build


def _torchvision_vit(**kw) -> Callable[[], nn.Module]:
    """torchvision's VisionTransformer at ViT-B's width (``kw``: patch size, depth): its
    builders fix the depth, and 12 layers add nothing to what the tests show but time."""
    def build():
        from torchvision.models import VisionTransformer

        return VisionTransformer(image_size=224, num_heads=12, hidden_dim=768, mlp_dim=3072, num_classes=10, **kw)
    return build


def _torchvision_swin_v2(**kw) -> Callable[[], nn.Module]:
    """torchvision's ``swin_v2_t`` (patch 4, 8×8 windows, V2 blocks and patch merging) with ``kw``
    (a smaller ``embed_dim``, ``depths``, ``num_heads``)."""
    def build():
        from torchvision.models import swin_transformer as tv

        return tv.SwinTransformer(patch_size=[4, 4], window_size=[8, 8], stochastic_depth_prob=0.0, num_classes=10,
                                  block=tv.SwinTransformerBlockV2, downsample_layer=tv.PatchMergingV2, **kw)
    return build


VITPYTORCH_SMALL = dict(image_size=32, patch_size=4, num_classes=10, dim=96, depth=4, heads=3, mlp_dim=192,
                        dim_head=32)


def _vit_pytorch(module: str, cls: str, base: dict | None = None, **kw) -> Callable[[], nn.Module]:
    def build():
        options = (VITPYTORCH_SMALL if base is None else base) | kw
        return getattr(importlib.import_module(f"vit_pytorch.{module}"), cls)(**options)
    return build


def _open_clip(name: str) -> Callable[[], nn.Module]:
    def build():
        import open_clip

        return open_clip.create_model(name, pretrained=None).visual
    return build


HF_SMALL = dict(image_size=32, patch_size=4, hidden_size=96, num_attention_heads=3, num_hidden_layers=4,
                intermediate_size=192)


def _huggingface(config: str, model: str, base: dict | None = None, **kw) -> Callable[[], nn.Module]:
    """A Hugging Face model from its config: ``base`` (default the small ViT's) updated by ``kw``."""
    def build():
        import transformers

        options = (HF_SMALL if base is None else base) | kw
        return getattr(transformers, model)(getattr(transformers, config)(**options))
    return build


def _x_transformers(**encoder) -> Callable[[], nn.Module]:
    def build():
        from x_transformers import Encoder, ViTransformerWrapper

        layers = Encoder(dim=96, depth=2, heads=3, **encoder)
        return ViTransformerWrapper(image_size=32, patch_size=4, num_classes=10, attn_layers=layers)
    return build


class EncoderViT(nn.Module):
    """A ViT written on ``nn.TransformerEncoder``: patch conv, class token, learned PE,
    pre-norm encoder layers (``nn.MultiheadAttention`` inside), class-token head."""

    def __init__(self, image_size=32, patch=4, dim=96, depth=4, heads=3, classes=10):
        super().__init__()
        self.image_size = image_size
        self.patchify = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.positions = nn.Parameter(torch.randn(1, (image_size // patch) ** 2 + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.patchify(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1) + self.positions
        return self.head(self.encoder(x)[:, 0])


class ShuffledEncoderViT(nn.Module):
    """An MAE-style encoder at mask ratio 0: structinit's ViT whose tokens are put in a random
    order (``torch.rand`` noise, argsort) after the position embedding is added, as MAE's
    random masking does before the blocks."""

    def __init__(self):
        super().__init__()
        self.vit = structinit.create_model("vit_tiny_patch4_32", depth=2)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        vit = self.vit
        x = vit.patch_embed(img) + vit.pos_embed
        order = torch.rand(x.shape[0], x.shape[1], device=x.device).argsort(1)
        x = torch.gather(x, 1, order[..., None].expand_as(x))
        return vit.head(vit.norm(vit.blocks(x)).mean(1))


ROPE_NO_CHANNEL = r"rotates q and k by position \(RoPE\).*no learned q and k biases"


CATALOGUE: tuple[ZooModel, ...] = (
    # -- timm -------------------------------------------------------------------------------
    ZooModel("timm_vit_tiny_patch16_224", "timm", _timm("vit_tiny_patch16_224"), 224, "ViT-Ti/16"),
    ZooModel("timm_deit_tiny_distilled_patch16_224", "timm", _timm("deit_tiny_distilled_patch16_224"), 224,
             "DeiT-Ti, class + distillation token"),
    ZooModel("timm_vit_small_patch16_224_32px", "timm", _timm("vit_small_patch16_224", img_size=32, patch_size=4),
             32, "ViT-S at 32 px, patch 4"),
    ZooModel("timm_vit_base_patch14_reg4_dinov2", "timm", _timm("vit_base_patch14_reg4_dinov2", img_size=224,
                                                                depth=4),
             224, "DINOv2 ViT-B/14 (4 layers), 4 registers, LayerScale (224 px)"),
    ZooModel("timm_vit_medium_patch16_gap_256", "timm", _timm("vit_medium_patch16_gap_256", depth=4), 256,
             "ViT-M (4 layers), no class token, global average pool"),
    ZooModel("timm_eva02_tiny_patch14_224", "timm", _timm("eva02_tiny_patch14_224"), 224,
             "EVA-02: absolute PE and RoPE (k bias a zero buffer: impulse uses a pre-norm channel), SwiGLU"),
    ZooModel("timm_vit_small_dynamic_32px", "timm", _timm("vit_small_patch16_224", img_size=32, patch_size=4,
                                                          dynamic_img_size=True), 32, "dynamic_img_size=True"),
    ZooModel("timm_swin_tiny_patch4_window7_224", "timm", _timm("swin_tiny_patch4_window7_224"), 224,
             "Swin-T: shifted 7×7 windows, relative position bias, patch merging"),
    ZooModel("timm_beit_base_patch16_224", "timm", _timm("beit_base_patch16_224", depth=4), 224,
             "BEiT-B (4 layers): relative position bias with class-token rows, no absolute PE"),
    ZooModel("timm_beit_shared_rel_pos_bias", "timm",
             _timm("beit_base_patch16_224", use_rel_pos_bias=False, use_shared_rel_pos_bias=True, depth=4), 224,
             "BEiT-B (4 layers), one relative bias table shared by every layer"),
    ZooModel("timm_deit3_small_32px", "timm", _timm("deit3_small_patch16_224", img_size=32, patch_size=4, depth=4),
             32, "DeiT-III: LayerScale, no PE on the class token"),
    ZooModel("timm_vit_qk_norm_32px", "timm", _timm("vit_small_patch16_224", img_size=32, patch_size=4, depth=4,
                                                    qk_norm=True), 32, "per-head LayerNorm on q and k",
             refused={"impulse": "q and k are normalised"}),
    ZooModel("timm_vit_map_head_32px", "timm", _timm("vit_small_patch16_224", img_size=32, patch_size=4, depth=4,
                                                     class_token=False, global_pool="map"), 32,
             "attention-pooling head (one learned query)", skipped=("attn_pool",)),
    ZooModel("timm_vit_rope_mixed_32px", "timm", _timm("vit_base_patch16_rope_mixed_224", img_size=32,
                                                       patch_size=4, depth=2, embed_dim=96, num_heads=3), 32,
             "2-D RoPE with learned mixed frequencies (bands that turn with rows and columns)"),
    ZooModel("timm_vit_rope_axial_32px", "timm", _timm("vit_small_patch16_rope_224", img_size=32, patch_size=4,
                                                       depth=4), 32, "2-D axial RoPE, q/k biases"),
    ZooModel("timm_vit_relpos_small_32px", "timm", _timm("vit_relpos_small_patch16_224", img_size=32, patch_size=4,
                                                         depth=4), 32,
             "relative position bias from an MLP (timm's RelPosMlp); impulse fits the MLP, W_q = 0"),
    ZooModel("timm_vit_srelpos_small_32px", "timm", _timm("vit_srelpos_small_patch16_224", img_size=32,
                                                         patch_size=4, depth=4), 32,
             "one relative-bias MLP for every layer (timm's shared_rel_pos), handed to each with its call; impulse "
             "fits it once, W_q = 0"),
    ZooModel("timm_swinv2_tiny_window8_64px", "timm", _timm("swinv2_tiny_window8_256", img_size=64, depths=(2, 2),
                                                           num_heads=(3, 6)), 64,
             "Swin-V2 (2 stages, 64 px): cosine attention, continuous position bias (16·sigmoid of an MLP); impulse "
             "fits the MLP and bounds the logit scale"),
    ZooModel("timm_cait_xxs24_32px", "timm", _timm("cait_xxs24_224", img_size=32, patch_size=4, depth=2), 32,
             "CaiT: talking heads (set to the identity), class-attention blocks",
             skipped=("blocks_token_only.0.attn", "blocks_token_only.1.attn")),
    ZooModel("timm_convit_tiny_32px", "timm", _timm("convit_tiny", img_size=32, patch_size=4, depth=4,
                                                    local_up_to_layer=2), 32,
             "ConViT: gated positional (GPSA) layers; impulse points their positional part at each head's offset"),
    ZooModel("timm_levit_128s", "timm", _timm("levit_128s"), 224,
             "LeViT: q/k/v and output through Linear + BatchNorm, learned attention biases, hard-swish before the "
             "output",
             refused={"impulse": "without biasing other pairs", "mimetic": "the value path is not linear"}),
    ZooModel("timm_shvit_s1", "timm", _timm("shvit_s1"), 224,
             "SHViT: single-head attention on a slice of each token's channels, convolutions with BatchNorm",
             refused={"impulse": "its tokens carry no position",
                      "mimetic": "does not depend on its attention's context.*not linear token by token"}),
    ZooModel("timm_efficientformerv2_s0_64px", "timm", _timm("efficientformerv2_s0", img_size=64), 64,
             "EfficientFormer-V2: heads mixed by 1×1 convolutions around the softmax, beside a learned bias",
             # q, k and v are each a conv and a BatchNorm, two biases a channel; the talking heads set to the identity
             # leave a GELU before the output projection, and the bias table gives mirrored offsets one row
             refused={"impulse": "without biasing other pairs", "mimetic": "the value path is not linear"}),
    ZooModel("timm_twins_pcpvt_small_64px", "timm", _timm("twins_pcpvt_small", img_size=64, depths=(1, 1, 1, 1)), 64,
             "Twins-PCPVT: reduced-key attention, positional depthwise convs, no position embedding",
             refused={"impulse": "cannot infer the token grid"},
             skipped=("blocks.0.0.attn", "blocks.1.0.attn", "blocks.2.0.attn")),
    ZooModel("timm_xcit_nano_12_p16_64px", "timm", _timm("xcit_nano_12_p16_224", img_size=64, depth=2), 64,
             "XCiT: cross-covariance attention (a d×d map over channels), class attention",
             refused={"impulse": "forms no softmax", "mimetic": "forms no softmax"}),
    ZooModel("timm_pit_ti_224", "timm", _timm("pit_ti_224"), 224,
             "PiT: pooling stages on smaller grids, position embedding stored (1, D, h, w)",
             refused={"impulse": r"197 tokens of width 128\) lie off the grid .*carry no position of their own"}),
    ZooModel("timm_visformer_tiny_96px", "timm", _timm("visformer_tiny", img_size=96), 96,
             "Visformer: a convolution stage, then attention stages on 1×1-conv maps, each stage with its own "
             "position embedding (1, D, h, w)"),
    ZooModel("timm_maxvit_pico_rw_64px", "timm", _timm("maxvit_pico_rw_256", img_size=64), 64,
             "MaxViT: q, k and v packed per head, windows and grid cells cut before the call, channels last, "
             "relative position bias; read by the trace"),
    ZooModel("timm_nest_tiny_64px", "timm", _timm("nest_tiny", img_size=64), 64,
             "NesT: tokens in blocks, each level's position embedding added block by block, heads before the "
             "blocks, the context read back head-minor"),
    # -- torchvision --------------------------------------------------------------------------
    ZooModel("tv_vit_b_16", "torchvision", _torchvision_vit(patch_size=16, num_layers=4), 224,
             "ViT-B/16 (4 layers), class token `class_token`"),
    ZooModel("tv_vit_b_32", "torchvision", _torchvision_vit(patch_size=32, num_layers=4), 224,
             "ViT-B/32 (4 layers), class token `class_token`"),
    ZooModel("tv_swin_t", "torchvision", _torchvision("swin_t"), 224,
             "Swin-T: the attention takes a (B, H, W, C) map and cuts its own windows"),
    ZooModel("tv_swin_v2_t_64px", "torchvision", _torchvision_swin_v2(embed_dim=48, depths=[2, 2], num_heads=[2, 4]),
             64, "swin_v2_t's blocks (2 stages, 64 px): cosine attention, continuous position bias, own windows"),
    # -- vit-pytorch --------------------------------------------------------------------------
    ZooModel("vitpytorch_ViT", "vit-pytorch", _vit_pytorch("vit", "ViT"), 32, "fused `to_qkv`, norm inside"),
    ZooModel("vitpytorch_SimpleViT", "vit-pytorch", _vit_pytorch("simple_vit", "SimpleViT"), 32,
             "sin-cos PE as a plain tensor attribute"),
    ZooModel("vitpytorch_DistillableViT", "vit-pytorch", _vit_pytorch("distill", "DistillableViT"), 32,
             "the student ViT of DistillWrapper"),
    ZooModel("vitpytorch_ViT_patch_dropout", "vit-pytorch", _vit_pytorch("vit_with_patch_dropout", "ViT"), 32,
             "PE without a class-token row"),
    ZooModel("vitpytorch_SimpleViT_qk_norm", "vit-pytorch",
             _vit_pytorch("simple_vit_with_qk_norm", "SimpleViT"), 32, "q/k RMSNorm, no softmax scale",
             refused={"impulse": "normalised"}),
    ZooModel("vitpytorch_SimpleViT_registers", "vit-pytorch",
             _vit_pytorch("simple_vit_with_register_tokens", "SimpleViT", num_register_tokens=4), 32,
             "register tokens appended after the grid"),
    ZooModel("vitpytorch_ViT_small_dataset_LSA", "vit-pytorch", _vit_pytorch("vit_for_small_dataset", "ViT"), 32,
             "LSA: learned temperature, masked diagonal; shifted-patch tokenisation",
             refused={"impulse": "masks each token's logit on itself"}),
    ZooModel("vitpytorch_CaiT", "vit-pytorch",
             _vit_pytorch("cait", "CaiT", cls_depth=1, depth=2, dropout=0.0, emb_dropout=0.0, layer_dropout=0.0), 32,
             "CaiT: talking heads as (h, h) parameters (set to the identity), class attention",
             skipped=("cls_transformer.layers.0.0.fn",)),
    ZooModel("vitpytorch_RvT", "vit-pytorch",
             _vit_pytorch("rvt", "RvT", use_rotary=True, use_ds_conv=False, use_glu=False), 32,
             "RvT: 2-D RoPE built at each call for the input's grid (no size stated: impulse is told grid=(8, 8)), "
             "no q/k bias (impulse uses the attention's own LayerNorm)", options={"impulse": {"grid": (8, 8)}}),
    # -- open_clip ----------------------------------------------------------------------------
    ZooModel("openclip_ViT-B-32", "open_clip", _open_clip("ViT-B-32"), 224, "`.visual`, class token (D,)"),
    ZooModel("openclip_ViT-S-32", "open_clip", _open_clip("ViT-S-32"), 224, "`.visual`, ViT-S/32"),
    ZooModel("openclip_coca_ViT-B-32", "open_clip", _open_clip("coca_ViT-B-32"), 224,
             "CoCa: attentional pooler (256 learned queries, cross-attention)", skipped=("attn_pool.attn",)),
    # -- Hugging Face transformers ------------------------------------------------------------
    ZooModel("hf_ViTForImageClassification", "transformers", _huggingface("ViTConfig", "ViTForImageClassification"),
             32, "ViT, 32 px"),
    ZooModel("hf_DeiTForImageClassificationWithTeacher", "transformers",
             _huggingface("DeiTConfig", "DeiTForImageClassificationWithTeacher"), 32, "DeiT, distillation token"),
    ZooModel("hf_SwinForImageClassification", "transformers",
             _huggingface("SwinConfig", "SwinForImageClassification", dict(
                 image_size=32, patch_size=2, embed_dim=48, depths=[2, 2, 2], num_heads=[2, 4, 8], window_size=4)),
             32, "Swin, shifted 4×4 windows, flattened relative index, mask passed by position"),
    ZooModel("hf_BeitForImageClassification", "transformers",
             _huggingface("BeitConfig", "BeitForImageClassification", use_relative_position_bias=True), 32,
             "BEiT, each layer's relative bias held beside the attention and handed to it"),
    ZooModel("hf_Dinov2Model", "transformers", _huggingface("Dinov2Config", "Dinov2Model"), 32,
             "DINOv2, LayerScale"),
    ZooModel("hf_Dinov2WithRegistersModel", "transformers",
             _huggingface("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel", num_register_tokens=4), 32,
             "DINOv2 with 4 registers that have no position rows"),
    ZooModel("hf_Data2VecVisionModel", "transformers",
             _huggingface("Data2VecVisionConfig", "Data2VecVisionModel", use_absolute_position_embeddings=True), 32,
             "Data2Vec: q/k/v in one module, the output projection in a sibling (`output.dense`)"),
    ZooModel("hf_Swinv2ForImageClassification", "transformers",
             _huggingface("Swinv2Config", "Swinv2ForImageClassification", dict(
                 image_size=32, patch_size=2, embed_dim=48, depths=[2, 2], num_heads=[2, 4], window_size=4)), 32,
             "Swin-V2: cosine attention, continuous position bias, sibling output projection"),
    ZooModel("hf_DINOv3ViTModel", "transformers", _huggingface("DINOv3ViTConfig", "DINOv3ViTModel", dict(
                 image_size=32, patch_size=4, hidden_size=96, num_attention_heads=3, num_hidden_layers=4,
                 intermediate_size=192, num_register_tokens=4)), 32,
             "DINOv3: 2-D RoPE on normalised coordinates, 4 registers, no k bias (impulse uses a pre-norm channel)"),
    ZooModel("hf_CLIPVisionModel", "transformers", _huggingface("CLIPVisionConfig", "CLIPVisionModel"), 32,
             "CLIP vision tower: q/k/v/out_proj, pre-LayerNorm"),
    ZooModel("hf_SiglipVisionModel", "transformers",
             _huggingface("SiglipVisionConfig", "SiglipVisionModel", vision_use_head=True), 32,
             "SigLIP: multihead attention-pooling (MAP) head", skipped=("head.attention",)),
    ZooModel("hf_ViTMAEModel", "transformers", _huggingface("ViTMAEConfig", "ViTMAEModel", mask_ratio=0.0), 32,
             "MAE encoder at mask ratio 0: tokens shuffled in the forward"),
    # -- x-transformers -----------------------------------------------------------------------
    ZooModel("xt_ViTransformerWrapper", "x-transformers", _x_transformers(), 32,
             "separate `to_q`, `to_k`, `to_v`, `to_out`"),
    ZooModel("xt_ViTransformerWrapper_rotary", "x-transformers", _x_transformers(rotary_pos_emb=True), 32,
             "1-D RoPE over the flattened grid, no q/k bias, bias-free LayerNorm: no content-free channel",
             refused={"impulse": ROPE_NO_CHANNEL}),
    # -- by hand ------------------------------------------------------------------------------
    ZooModel("torch_TransformerEncoder_ViT", "torch", EncoderViT, 32, "nn.TransformerEncoder (this file)"),
    ZooModel("hand_ShuffledEncoderViT", "torch", ShuffledEncoderViT, 32,
             "MAE-style random token order after the PE (this file)"),
)
BY_NAME = {m.name: m for m in CATALOGUE}
PACKAGES = ("timm", "torchvision", "vit_pytorch", "open_clip", "transformers", "x_transformers")
