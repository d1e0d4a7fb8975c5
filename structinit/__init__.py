"""structinit — structured, learning-free initialisation of attention layers.

    import structinit
    model = structinit.create_model("vit_tiny_patch2_32")
    structinit.init_(model, "impulse", seed=0)          # or "mimetic", "timm", "pytorch", …
    structinit.init_(mamba, "mimetic", seed=0)          # a mambapy Mamba: the SSM mimetic init
    structinit.impulse_fidelity(model)                   # {'mass': (L×H), 'hit': (L×H)}

Importing structinit loads the init API only (torch, numpy, scipy). The training harness,
datasets and augmentation (``ImageConfig``, ``train``, ``compare``, ``load_dataset``, …) are
imported on first use and need the ``harness`` extra: ``pip install -e ".[harness]"`` in a clone.
"""

try:  # `python -m structinit`: a stop while torch loads is one line (structinit_cli), as for the command
    import structinit_cli as _launcher
except ImportError:  # the package without its launcher module
    _launcher = None
if _launcher is not None and _launcher.started_as_module():
    _launcher.guard_startup()

import importlib

from structinit.adapters import (
    AttentionAdapter,
    Discovery,
    FusedQKVAdapter,
    MultiheadAttentionAdapter,
    SeparateQKVAdapter,
    TokenLayout,
    find_attention_layers,
    find_depthwise_convs,
    find_position_embedding,
    find_ssm_layers,
    infer_layout,
    register_adapter,
    register_position_finder,
    unregister_adapter,
    unregister_position_finder,
)
from structinit.analysis import (
    MinibatchCKA,
    attention_entropy,
    attention_figure,
    attention_maps,
    attention_metrics,
    cka_figure,
    cka_matrix,
    comparison_figure,
    curves_figure,
    fidelity_summary,
    impulse_fidelity,
    linear_cka,
    local_attention_mass,
    mean_attention_distance,
    overlay_figure,
    unbiased_hsic,
)
from structinit.analysis.certify import (
    certified_accuracy,
    empirical_lipschitz,
    logit_margins,
    multiclass_hinge_loss,
)
from structinit.functional import (
    IMPULSE_SOLVERS,
    analytic_qk,
    attention_probs,
    closed_form_qk,
    enumerated_offsets,
    gd_qk,
    impulse_matrix,
    impulse_qk,
    kernel_offsets,
    mimetic_factors,
    mimetic_qk,
    mimetic_vo,
    random_offsets,
    sincos_2d,
    target_index,
)
from structinit.models import (
    CayleyConv2d,
    CayleyLinear,
    ConvMixer,
    GroupSort,
    KWLarge,
    LipschitzAvgPool,
    SpaceToDepth,
    VisionTransformer,
    create_model,
    list_models,
    register_model,
)
from structinit.schemes import (
    Plan,
    default_init_,
    get_record,
    impulse_init_,
    init_,
    jax_init_,
    kaiming_uniform_init_,
    mimetic_init_,
    plan_init,
    pytorch_init_,
    register_scheme,
    schemes,
    set_record,
    ssm_mimetic_init_,
    timm_init_,
    trunc_normal_init_,
    xavier_fused_init_,
    xavier_init_,
)
from structinit.schemes.conv_filters import (
    conv_box_init_,
    conv_gaussian_init_,
    conv_impulse_init_,
    conv_random_init_,
    conv_softmax_init_,
    covariance_init_,
    covariance_transfer_init_,
)
from structinit.schemes.orthogonal import orthogonal_init_

__version__ = "0.1.0"

# The harness, data and augmentation stacks (PIL, scipy.io, matplotlib, tqdm, scikit-learn) are
# loaded on first access, so that `import structinit` stays light for users who only initialise.
_LAZY = {
    "ImageConfig": "structinit.harness.config", "train": "structinit.harness.tasks",
    "recipe": "structinit.harness.recipes", "RECIPES": "structinit.harness.recipes",
    "compare": "structinit.harness.compare",
    "ArrayDataset": "structinit.data", "load_dataset": "structinit.data",
    "stratified_subset": "structinit.data", "holdout_split": "structinit.data",
    "Augment": "structinit.augment",
}  # fmt: skip


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'structinit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    # one call for a whole model
    "init_", "plan_init", "Plan", "schemes", "register_scheme", "get_record", "set_record",
    # per-scheme functions
    "impulse_init_", "mimetic_init_", "pytorch_init_", "timm_init_", "jax_init_",
    "xavier_init_", "xavier_fused_init_", "trunc_normal_init_", "kaiming_uniform_init_",
    "conv_impulse_init_", "conv_box_init_", "conv_gaussian_init_", "conv_random_init_", "conv_softmax_init_",
    "covariance_init_", "covariance_transfer_init_", "orthogonal_init_", "ssm_mimetic_init_", "default_init_",
    # tensor-level helpers for your own layers
    "impulse_matrix", "target_index", "kernel_offsets", "enumerated_offsets", "random_offsets",
    "impulse_qk", "analytic_qk", "closed_form_qk", "gd_qk", "IMPULSE_SOLVERS",
    "mimetic_factors", "mimetic_qk", "mimetic_vo", "sincos_2d", "attention_probs",
    # models
    "VisionTransformer", "ConvMixer", "create_model", "list_models", "register_model",
    # orthogonal (1-Lipschitz) layers
    "CayleyConv2d", "CayleyLinear", "GroupSort", "LipschitzAvgPool", "SpaceToDepth", "KWLarge",
    # adapters and layout
    "AttentionAdapter", "FusedQKVAdapter", "SeparateQKVAdapter", "MultiheadAttentionAdapter",
    "register_adapter", "unregister_adapter", "find_attention_layers", "find_depthwise_convs", "find_ssm_layers",
    "TokenLayout",
    "infer_layout",
    "find_position_embedding", "register_position_finder", "unregister_position_finder", "Discovery",
    # diagnostics
    "attention_maps", "impulse_fidelity", "fidelity_summary",
    "attention_metrics", "mean_attention_distance", "attention_entropy", "local_attention_mass",
    "cka_matrix", "linear_cka", "MinibatchCKA", "unbiased_hsic",
    "multiclass_hinge_loss", "logit_margins", "certified_accuracy", "empirical_lipschitz",
    # figures (matplotlib, from the harness extra)
    "attention_figure", "comparison_figure", "overlay_figure", "curves_figure", "cka_figure",
    # training harness (imported on first use)
    "ImageConfig", "train", "recipe", "RECIPES", "compare",
    "ArrayDataset", "load_dataset", "stratified_subset", "holdout_split", "Augment",
]  # fmt: skip
