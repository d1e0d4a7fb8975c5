"""Looking inside an initialised or trained model: attention maps through one capture path,
impulse fidelity, where attention looks (distance, entropy, local mass), and layer-by-layer
representation similarity (linear CKA), and the figures that draw them."""

from structinit.analysis.capture import attention_maps, check_all_called, run_with_hooks
from structinit.analysis.cka import MinibatchCKA, cka_matrix, linear_cka, unbiased_hsic
from structinit.analysis.curves import curves_figure
from structinit.analysis.fidelity import FidelitySummary, attention_layouts, fidelity_summary, impulse_fidelity
from structinit.analysis.figures import attention_figure, cka_figure, comparison_figure, overlay_figure
from structinit.analysis.metrics import (
    attention_entropy,
    attention_metrics,
    local_attention_mass,
    mean_attention_distance,
)

__all__ = ["FidelitySummary", "MinibatchCKA", "attention_entropy", "attention_figure", "attention_layouts",
           "attention_maps", "attention_metrics", "cka_figure", "comparison_figure", "curves_figure", "overlay_figure",
           "check_all_called", "cka_matrix", "fidelity_summary", "impulse_fidelity", "linear_cka",
           "local_attention_mass", "mean_attention_distance", "run_with_hooks", "unbiased_hsic"]
