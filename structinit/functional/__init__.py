"""Tensor maths, tensor in and tensor out, in the style of ``torch.nn.init``: impulse targets
and offsets, position embeddings, attention probabilities, the impulse solvers (analytic,
closed form, gradient descent) and their registry, and mimetic factors. Every random draw
takes ``generator=``. Nothing here knows about ``nn.Module``."""

from structinit.functional.attention import attention_probs, layer_norm_tokens
from structinit.functional.cayley_conv import (
    cayley,
    cayley_conv_matrices,
    fft_circular_conv,
    fft_conv_weight,
    orthogonality_error,
    semi_orthogonal_cayley,
    space_to_depth,
)
from structinit.functional.conv_filters import (
    box_filters,
    depth_sigma,
    estimate_covariance,
    fit_depth_schedule,
    fit_kronecker_sigma,
    gaussian_filters,
    gaussian_kronecker_covariance,
    impulse_filters,
    random_filters,
    relative_depth_map,
    resize_covariance,
    sample_filters,
)
from structinit.functional.gated import gated_mixture, gaussian_positional_weight, relative_positions
from structinit.functional.impulse_analytic import (
    analytic_qk,
    axis_kernel,
    calibrate_logit_scale,
    impulse_qk,
    ridge_readout,
)
from structinit.functional.impulse_closed_form import closed_form_qk, pinv_projector
from structinit.functional.impulse_gd import gd_qk
from structinit.functional.impulse_solvers import (
    IMPULSE_SOLVERS,
    AnalyticSolver,
    ClosedFormSolver,
    GradientDescentSolver,
    ImpulseSolver,
    LayerSpec,
    SolvedLayer,
    make_impulse_solver,
)
from structinit.functional.mimetic import NOISE, mimetic_factors, mimetic_noise, mimetic_qk, mimetic_vo
from structinit.functional.mixer import token_mixing_impulse
from structinit.functional.orthogonal import (
    cayley_kernel,
    centre_tap,
    conv_weight_from_fft,
    delta_orthogonal_kernel,
    orthogonal_matrix,
)
from structinit.functional.posembed import sincos_2d, sincos_frequencies
from structinit.functional.pseudo_input import PSEUDO_INPUTS, pseudo_input
from structinit.functional.relative import impulse_bias_table, impulse_logit, offset_row, relative_position_index
from structinit.functional.rope import rope_impulse_terms, rope_impulse_terms_2d, rope_logits
from structinit.functional.targets import (
    Offset,
    check_kernel_size,
    check_offsets,
    enumerated_offsets,
    impulse_matrix,
    kernel_offsets,
    random_offsets,
    target_index,
)

__all__ = [
    "IMPULSE_SOLVERS", "NOISE", "PSEUDO_INPUTS", "AnalyticSolver", "ClosedFormSolver", "GradientDescentSolver",
    "ImpulseSolver", "LayerSpec", "Offset", "SolvedLayer", "analytic_qk", "attention_probs", "axis_kernel",
    "calibrate_logit_scale", "check_kernel_size", "check_offsets", "closed_form_qk", "enumerated_offsets",
    "gd_qk", "impulse_matrix", "impulse_qk", "kernel_offsets", "layer_norm_tokens", "make_impulse_solver",
    "mimetic_factors", "mimetic_noise", "mimetic_qk", "mimetic_vo", "pinv_projector", "pseudo_input",
    "random_offsets", "ridge_readout", "sincos_2d", "sincos_frequencies", "target_index",
    "box_filters", "depth_sigma", "estimate_covariance", "fit_depth_schedule", "fit_kronecker_sigma",
    "gaussian_filters", "gaussian_kronecker_covariance", "gated_mixture", "gaussian_positional_weight",
    "relative_positions",
    "impulse_filters", "random_filters", "relative_depth_map", "resize_covariance", "sample_filters",
    "cayley", "cayley_conv_matrices", "cayley_kernel", "centre_tap", "conv_weight_from_fft", "delta_orthogonal_kernel",
    "fft_circular_conv", "fft_conv_weight", "orthogonal_matrix", "orthogonality_error", "semi_orthogonal_cayley",
    "space_to_depth", "impulse_bias_table", "impulse_logit", "offset_row", "relative_position_index",
    "rope_impulse_terms", "rope_impulse_terms_2d", "rope_logits",
    "token_mixing_impulse",
]  # fmt: skip
