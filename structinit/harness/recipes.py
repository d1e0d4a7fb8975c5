"""Named training recipes: complete config presets, in a :class:`~structinit.utils.Registry`
like every other named choice (add your own with ``RECIPES.register("name", {...})``):
:data:`RECIPES` for image runs (:class:`~structinit.harness.config.ImageConfig`),
:data:`SEQUENCE_RECIPES` for sequence-task runs (:class:`~structinit.harness.config.SequenceConfig`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from structinit.harness.config import ImageConfig, SequenceConfig
from structinit.utils import Registry

RECIPES: Registry[dict[str, Any]] = Registry("recipe")

# The 2024 paper's CIFAR setting (Zheng, Li, Lucey): ViT-Ti/2 on 32×32, no class token,
# average pooling, fixed sin-cos PE; AdamW with eps 1e-3; 10 warm-up epochs; RandAugment
# m9 (std 0.5) and flips, no crop; label smoothing 0.1; 200 epochs. The whole test set is scored
# every 10 epochs and at the end, so that evaluation stays a small part of the run. (A copy of
# CIFAR-10 whose test images are exact only up to some N can score those N every epoch too:
# test_prefix=N, test_every=10, eval_every=1, as scripts/gpu_draw.sh does for the shared copy.)
RECIPES.register("paper-cifar", dict(
    model="vit_tiny_patch2_32", dataset="cifar10", epochs=200, batch_size=512, lr=1e-3, eps=1e-3,
    weight_decay=0.01, grad_clip=3.0, min_lr=1e-6, warmup_epochs=10, warmup_lr=1e-5,
    augment="flip,ra2-9-0.5", label_smoothing=0.1, precision="auto", eval_every=10,
))
# CPU scale: ViT dim 128, depth 6, 4 heads, patch 4; 5,000 class-stratified images from
# CIFAR-10 batches 1–4, evaluated on the last 10,000 training images (lossless); 30 epochs.
RECIPES.register("cpu-cifar", dict(
    model="vit_cpu_patch4_32", dataset="cifar10", epochs=30, batch_size=128, lr=1e-3, eps=1e-8,
    weight_decay=0.05, grad_clip=1.0, min_lr=1e-5, warmup_epochs=2, augment="crop4,flip",
    label_smoothing=0.1, precision="auto", train_size=5000, holdout=10000, holdout_mode="last",
    eval_every=3,  # evaluating 10k held-out images costs a fair share of a 5k-image epoch
))
# The embedded demo: scikit-learn's 8×8 digits, no download, seconds per run. 300 training
# images (30 per class) put it in the small-data regime where the init matters.
RECIPES.register("digits", dict(
    model="vit_cpu_patch2_8", dataset="digits", train_size=300, epochs=30, batch_size=64, lr=2e-3, eps=1e-8,
    weight_decay=0.05, grad_clip=1.0, min_lr=1e-5, warmup_epochs=2, augment="none",
    label_smoothing=0.1, precision="fp32",
))

# Where locality matters more: the paper's 16×16 token grid (patch 2 on 32×32) at CPU scale.
# Same data and held-out protocol as cpu-cifar; ViT D 96, depth 4, 3 heads; 25 epochs, fewer
# than cpu-cifar's since its 16×16 grid has four times the tokens.
RECIPES.register("cpu-cifar16", dict(
    model="vit_cpu_patch2_32", dataset="cifar10", epochs=25, batch_size=128, lr=1e-3, eps=1e-8,
    weight_decay=0.05, grad_clip=1.0, min_lr=1e-5, warmup_epochs=2, augment="crop4,flip",
    label_smoothing=0.1, precision="auto", train_size=5000, holdout=10000, holdout_mode="last",
    eval_every=5,
))

# Certified ℓ₂ robustness (Trockman & Kolter, ICLR 2021) at CPU scale: the Cayley
# KWLarge at width (16, 32, 256), the multi-class hinge loss with the margin that certifies
# ε = 36/255 in pixel space (√2·ε/min(std), train.hinge_margin), Adam without weight decay or
# gradient clipping, no label smoothing, crop and flip, fp32 (bf16 breaks orthogonality).
# Same data protocol as cpu-cifar. The paper mean-centres only; the harness also divides by
# std, which the certificate and the margin account for exactly (train.input_lipschitz).
# Evaluation every 5 epochs and the final PGD on 1,000 images (10 steps) keep the robustness
# checks a small part of the run.
# The plain-conv baseline: --set "model_kwargs={'conv': 'plain'}".
RECIPES.register("cpu-cifar-lipschitz", dict(
    model="kwlarge_cpu", dataset="cifar10", epochs=50, batch_size=128, lr=1e-3, eps=1e-8,
    weight_decay=0.0, grad_clip=None, min_lr=1e-5, warmup_epochs=2, augment="crop4,flip",
    label_smoothing=0.0, precision="fp32", train_size=5000, holdout=10000, holdout_mode="last",
    eval_every=5, loss="hinge", certify_eps=36 / 255,
))

# The ConvMixer benchmark: cpu-cifar's data and held-out protocol with ConvMixer-128/6
# (k 5, p 2). The optimisation follows convmixer-cifar10 (AdamW, wd 0.01, lr 0.01 at batch 512,
# 25 epochs), with the lr scaled by √(128/512) for batch 128 and cpu-cifar's augmentation.
RECIPES.register("cpu-cifar-convmixer", dict(
    model="convmixer_cpu_128_6", dataset="cifar10", epochs=25, batch_size=128, lr=5e-3, eps=1e-8,
    weight_decay=0.01, grad_clip=1.0, min_lr=1e-5, warmup_epochs=2, augment="crop4,flip",
    label_smoothing=0.1, precision="auto", train_size=5000, holdout=10000, holdout_mode="last",
    eval_every=5,
))


def preset(registry: Registry, kind: type, name: str, overrides: dict[str, Any]):
    """The entry ``name`` of ``registry`` as a ``kind`` config, with ``overrides`` (unknown keys rejected)."""
    base = registry[name]  # an unknown name is a ValueError listing the valid ones
    fields = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"unknown training option(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}")
    return kind(**{**base, **overrides})


def recipe(name: str, **overrides: Any) -> ImageConfig:
    """The image recipe ``name`` as a ImageConfig, with ``overrides`` applied (unknown keys rejected)."""
    return preset(RECIPES, ImageConfig, name, overrides)


# Sequence runs (copying and multi-query associative recall, Mamba and a causal
# Transformer of matched size). The problem and its options come from `--task copy:length=64`;
# a recipe fixes the optimisation: one step budget per setting, the same for every init.
SEQUENCE_RECIPES: Registry[dict[str, Any]] = Registry("sequence recipe")
# seq-cpu: 1,000 steps of 32 sequences, the same for every init. A Mamba step (mambapy's
# parallel scan) costs several Transformer steps and grows with the sequence length, so
# CPU-scale runs keep sequences short.
SEQUENCE_RECIPES.register("seq-cpu", dict(
    model="mamba_seq_2x64", task="copy", steps=1000, batch_size=32, lr=2e-3, min_lr=1e-5, warmup_steps=50,
    weight_decay=0.1, grad_clip=1.0, eval_every=100, heldout_size=512,
))


def sequence_recipe(name: str, **overrides: Any) -> SequenceConfig:
    """The sequence recipe ``name`` as a SequenceConfig, with ``overrides`` applied (unknown keys rejected)."""
    return preset(SEQUENCE_RECIPES, SequenceConfig, name, overrides)
