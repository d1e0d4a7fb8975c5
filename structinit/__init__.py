"""structinit — structured, learning-free initialisation of attention layers.

    import structinit
    model = structinit.create_model("vit_tiny_patch2_32")
    structinit.init_(model, "impulse", seed=0)          # or "mimetic", "timm", "pytorch", …
    structinit.impulse_fidelity(model)                   # {'mass': (L×H), 'hit': (L×H)}
"""

from structinit.adapters import (
    AttentionAdapter,
    FusedQKVAdapter,
    MultiheadAttentionAdapter,
    SeparateQKVAdapter,
    find_attention_layers,
    register_adapter,
    unregister_adapter,
)
from structinit.analysis import attention_maps, impulse_fidelity
from structinit.augment import Augment
from structinit.compare import compare
from structinit.data import ArrayDataset, holdout_split, load_dataset, stratified_subset
from structinit.layout import TokenLayout, infer_layout
from structinit.mimetic_math import mimetic_factors, mimetic_qk, mimetic_vo
from structinit.models import VisionTransformer, create_model, list_models
from structinit.posembed import sincos_2d
from structinit.recipes import RECIPES, recipe
from structinit.schemes.baselines import (
    jax_init_,
    kaiming_uniform_init_,
    pytorch_init_,
    timm_init_,
    trunc_normal_init_,
    xavier_fused_init_,
    xavier_init_,
)
from structinit.schemes.impulse import impulse_init_
from structinit.schemes.mimetic import mimetic_init_
from structinit.schemes.registry import init_, register_scheme, schemes
from structinit.solvers import analytic_qk, closed_form_qk, gd_qk, impulse_qk
from structinit.targets import (
    enumerated_offsets,
    impulse_matrix,
    kernel_offsets,
    random_offsets,
    target_index,
)
from structinit.train import TrainConfig, train

__version__ = "0.1.0"

__all__ = [
    # one call for a whole model
    "init_", "schemes", "register_scheme",
    # per-scheme functions
    "impulse_init_", "mimetic_init_", "pytorch_init_", "timm_init_", "jax_init_",
    "xavier_init_", "xavier_fused_init_", "trunc_normal_init_", "kaiming_uniform_init_",
    # tensor-level helpers for your own layers
    "impulse_matrix", "target_index", "kernel_offsets", "enumerated_offsets", "random_offsets",
    "impulse_qk", "analytic_qk", "closed_form_qk", "gd_qk", "mimetic_factors", "mimetic_qk", "mimetic_vo",
    "sincos_2d",
    # models
    "VisionTransformer", "create_model", "list_models",
    # adapters and layout
    "AttentionAdapter", "FusedQKVAdapter", "SeparateQKVAdapter", "MultiheadAttentionAdapter",
    "register_adapter", "unregister_adapter", "find_attention_layers", "TokenLayout", "infer_layout",
    # diagnostics
    "attention_maps", "impulse_fidelity",
    # training harness
    "TrainConfig", "train", "recipe", "RECIPES", "compare",
    "ArrayDataset", "load_dataset", "stratified_subset", "holdout_split", "Augment",
]
