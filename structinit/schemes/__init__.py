"""Initialisation schemes applied to whole models, each selectable by name: the registry,
the plan/commit machinery, records of what an init wrote, and the schemes themselves.

Every scheme module is imported here, so the registry is complete whoever imports it.
"""

from structinit.schemes import (
    conv_filters,  # registers the depthwise-conv schemes
    token_mixing,  # noqa: F401  registers impulse for MLP-Mixer token mixing
)
from structinit.schemes.baselines import (
    default_init_,
    jax_init_,
    kaiming_uniform_init_,
    pytorch_init_,
    timm_init_,
    trunc_normal_init_,
    xavier_fused_init_,
    xavier_init_,
)
from structinit.schemes.impulse import impulse_init_, plan_impulse
from structinit.schemes.mimetic import mimetic_init_, plan_mimetic
from structinit.schemes.plan import Plan
from structinit.schemes.records import get_record, record_attr, set_record
from structinit.schemes.registry import (
    SCHEMES,
    TARGETS,
    Scheme,
    get_scheme,
    init_,
    plan_init,
    register_planner,
    register_scheme,
    schemes,
)
from structinit.schemes.ssm_mimetic import plan_ssm_mimetic, ssm_mimetic_init_

__all__ = [
    "SCHEMES", "TARGETS", "Plan", "Scheme", "get_record", "get_scheme", "impulse_init_", "init_",
    "jax_init_", "kaiming_uniform_init_", "mimetic_init_", "plan_impulse", "plan_init", "plan_mimetic",
    "pytorch_init_", "record_attr", "register_planner", "register_scheme", "schemes", "set_record",
    "timm_init_", "trunc_normal_init_", "xavier_fused_init_", "xavier_init_",
    "conv_filters", "default_init_", "plan_ssm_mimetic", "ssm_mimetic_init_",
]  # fmt: skip
