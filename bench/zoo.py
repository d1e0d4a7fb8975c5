"""The zoo: structinit's attention inits on ViTs built by the public packages, with no hints.

Every model is built from code (no weights) by its own package: timm, torchvision,
vit-pytorch, open_clip, Hugging Face transformers, and a plain ``nn.TransformerEncoder`` ViT.
For each model × scheme the table shows ✓ (or ✗ and the error's first line) and the seconds
``structinit.init_`` took; for impulse also the argmax hit on real images (CIFAR-10 test
images resized to the model's input size; sklearn's digits when CIFAR-10 is absent) at
layer 1 and averaged over layers (:func:`structinit.impulse_fidelity`). Small configurations
are used where a package allows them without leaving the architecture family; the models
the documentation names keep their names and sizes.

    .venv-zoo/bin/python bench/zoo.py                      # the zoo table of docs/results/zoo.md (≈ 4 min on 2 cores)
    .venv-zoo/bin/python bench/zoo.py --models tv_vit_b_16 --schemes impulse

It needs the zoo venv (``bash scripts/setup_zoo.sh``); ``tests/zoo`` runs the same catalogue.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import structinit

SCHEMES = ("impulse", "mimetic", "timm", "pytorch", "jax", "xavier")
PACKAGES = ("timm", "torchvision", "vit_pytorch", "open_clip", "transformers")
CIFAR = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "cifar-10-batches-py"


@dataclass(frozen=True)
class ZooModel:
    """One catalogue entry: ``build()`` returns the model (random weights, eval mode), which
    takes (B, 3, image_size, image_size) images."""

    name: str
    package: str
    build: Callable[[], nn.Module]
    image_size: int
    what: str
    refused: dict[str, str] = field(default_factory=dict)  # scheme → what its clear error says


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


def _vit_pytorch(module: str, cls: str, **kw) -> Callable[[], nn.Module]:
    def build():
        import importlib

        opts = dict(image_size=32, patch_size=4, num_classes=10, dim=96, depth=4, heads=3, mlp_dim=192, dim_head=32)
        return getattr(importlib.import_module(f"vit_pytorch.{module}"), cls)(**(opts | kw))
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


CATALOGUE: tuple[ZooModel, ...] = (
    ZooModel("timm_vit_tiny_patch16_224", "timm", _timm("vit_tiny_patch16_224"), 224, "ViT-Ti/16"),
    ZooModel("timm_deit_tiny_distilled_patch16_224", "timm", _timm("deit_tiny_distilled_patch16_224"), 224,
             "DeiT-Ti, class + distillation token"),
    ZooModel("timm_vit_small_patch16_224_32px", "timm", _timm("vit_small_patch16_224", img_size=32, patch_size=4),
             32, "ViT-S at 32 px, patch 4"),
    ZooModel("timm_vit_base_patch14_reg4_dinov2", "timm", _timm("vit_base_patch14_reg4_dinov2", img_size=224),
             224, "DINOv2 ViT-B/14, 4 registers, LayerScale (224 px)"),
    ZooModel("timm_vit_medium_patch16_gap_256", "timm", _timm("vit_medium_patch16_gap_256"), 256,
             "no class token, global average pool"),
    ZooModel("timm_eva02_tiny_patch14_224", "timm", _timm("eva02_tiny_patch14_224"), 224,
             "EVA-02: absolute PE and RoPE, SwiGLU", refused={"impulse": "rotary position embeddings"}),
    ZooModel("timm_vit_small_dynamic_32px", "timm", _timm("vit_small_patch16_224", img_size=32, patch_size=4,
                                                          dynamic_img_size=True), 32, "dynamic_img_size=True"),
    ZooModel("timm_swin_tiny_patch4_window7_224", "timm", _timm("swin_tiny_patch4_window7_224"), 224,
             "Swin-T: shifted 7×7 windows, relative position bias, patch merging"),
    ZooModel("timm_beit_base_patch16_224", "timm", _timm("beit_base_patch16_224"), 224,
             "BEiT-B: relative position bias with class-token rows, no absolute PE"),
    ZooModel("tv_vit_b_16", "torchvision", _torchvision("vit_b_16"), 224, "class token `class_token`"),
    ZooModel("tv_vit_b_32", "torchvision", _torchvision("vit_b_32"), 224, "class token `class_token`"),
    ZooModel("vitpytorch_ViT", "vit-pytorch", _vit_pytorch("vit", "ViT"), 32, "fused `to_qkv`, norm inside"),
    ZooModel("vitpytorch_SimpleViT", "vit-pytorch", _vit_pytorch("simple_vit", "SimpleViT"), 32,
             "sin-cos PE as a plain tensor attribute"),
    ZooModel("vitpytorch_DistillableViT", "vit-pytorch", _vit_pytorch("distill", "DistillableViT"), 32,
             "the student ViT of DistillWrapper"),
    ZooModel("vitpytorch_ViT_patch_dropout", "vit-pytorch", _vit_pytorch("vit_with_patch_dropout", "ViT"), 32,
             "PE without a class-token row"),
    ZooModel("openclip_ViT-B-32", "open_clip", _open_clip("ViT-B-32"), 224, "`.visual`, class token (D,)"),
    ZooModel("openclip_ViT-S-32", "open_clip", _open_clip("ViT-S-32"), 224, "`.visual`, ViT-S/32"),
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
    ZooModel("timm_beit_shared_rel_pos_bias", "timm",
             _timm("beit_base_patch16_224", use_rel_pos_bias=False, use_shared_rel_pos_bias=True, depth=4), 224,
             "BEiT-B (4 layers), one relative bias table shared by every layer"),
    ZooModel("hf_Dinov2Model", "transformers", _huggingface("Dinov2Config", "Dinov2Model"), 32,
             "DINOv2, LayerScale"),
    ZooModel("torch_TransformerEncoder_ViT", "torch", EncoderViT, 32, "nn.TransformerEncoder (this file)"),
)
BY_NAME = {m.name: m for m in CATALOGUE}


def require_packages() -> None:
    """Skip the calling test module when a zoo package is missing (the main venv has none)."""
    import pytest

    for package in PACKAGES:
        pytest.importorskip(package, reason=f"{package} is in the zoo venv only (bash scripts/setup_zoo.sh)")


def build(entry: ZooModel, seed: int = 0) -> nn.Module:
    """``entry``'s model with its package's default init, seeded, in eval mode."""
    torch.manual_seed(seed)
    return entry.build().eval()


# -- real images ---------------------------------------------------------------------------

def real_images(n: int, size: int, cifar_dir: Path = CIFAR) -> tuple[torch.Tensor, str]:
    """(n, 3, size, size) float32 real images, standardised, and where they came from: the first
    ``n`` CIFAR-10 test images (pickle ``test_batch``, ``b'data'`` uint8 N×3072) or, without
    CIFAR-10, sklearn's 8×8 digits; bilinear resize to ``size``."""
    batch = cifar_dir / "test_batch"
    if batch.is_file():
        from structinit.data.safe_pickle import load_pickle  # never unpickles code

        raw = load_pickle(batch.read_bytes(), batch)[b"data"][:n]
        x, source = torch.as_tensor(raw).float().reshape(-1, 3, 32, 32) / 255, "CIFAR-10 test"
    else:
        from sklearn.datasets import load_digits

        x = torch.tensor(load_digits().images[:n], dtype=torch.float32)[:, None].repeat(1, 3, 1, 1) / 16
        source = "sklearn digits"
    x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    return (x - x.mean()) / x.std(), source


# -- one model × scheme ----------------------------------------------------------------------

@dataclass
class Cell:
    ok: bool
    seconds: float = float("nan")
    error: str = ""
    hit_first: float = float("nan")
    hit_mean: float = float("nan")


def run_cell(model: nn.Module, scheme: str, images: torch.Tensor | None, seed: int = 0) -> Cell:
    """``init_(model, scheme, seed=seed)`` timed; for impulse with ``images`` its real-image hit."""
    start = time.perf_counter()
    try:
        structinit.init_(model, scheme, seed=seed)
    except Exception as err:  # the table reports every failure, it does not stop at one
        return Cell(False, error=f"{type(err).__name__}: {str(err).splitlines()[0]}")
    cell = Cell(True, time.perf_counter() - start)
    if scheme == "impulse" and images is not None:
        summary = structinit.fidelity_summary(structinit.impulse_fidelity(model, images, batch_size=8))
        cell.hit_first, cell.hit_mean = summary.hit_first, summary.hit_mean
    return cell


def run_model(entry: ZooModel, schemes, n_images: int, seed: int = 0) -> dict[str, Cell]:
    """Every scheme on a fresh copy of ``entry``'s model (one build, copied per scheme)."""
    base = build(entry, seed)
    images, _ = real_images(n_images, entry.image_size) if n_images else (None, "")
    return {s: run_cell(copy.deepcopy(base), s, images, seed) for s in schemes}


# -- the table -------------------------------------------------------------------------------

def format_cell(scheme: str, cell: Cell) -> str:
    if not cell.ok:  # the error's first sentence: enough to say why in a table cell
        error = cell.error.replace("|", "/")
        return f"✗ {error.split(': ', 1)[0]}: {error.split(': ', 1)[-1].split(', as ')[0].split('; ')[0]}"
    text = f"✓ {cell.seconds:.2f} s"
    if scheme == "impulse" and cell.hit_first == cell.hit_first:
        text += f" · hit {cell.hit_first:.3f} / {cell.hit_mean:.3f}"
    return text


def table(rows: dict[str, dict[str, Cell]], schemes) -> str:
    head = "| model | package | " + " | ".join(f"`{s}`" for s in schemes) + " |"
    lines = [head, "|---|---|" + "---|" * len(schemes)]
    for name, cells in rows.items():
        entry = BY_NAME[name]
        lines.append(f"| `{name}` ({entry.what}) | {entry.package} | "
                     + " | ".join(format_cell(s, cells[s]) for s in schemes) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(BY_NAME), help="comma-separated catalogue names")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--images", type=int, default=16, help="real images for impulse's hit (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    names, schemes = args.models.split(","), args.schemes.split(",")
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; the catalogue has {', '.join(BY_NAME)}")
    rows = {}
    for name in names:
        rows[name] = run_model(BY_NAME[name], schemes, args.images, args.seed)
        print(f"{name}: " + ", ".join(f"{s} {format_cell(s, c)}" for s, c in rows[name].items()), flush=True)
    _, source = real_images(1, 32)
    print(f"\nimpulse hit: argmax on target, layer 1 / mean over layers, {args.images} {source} images\n")
    print(table(rows, schemes))


if __name__ == "__main__":
    main()
