"""A run's model: constructed from its config under the init seed, its init planned on it.

:func:`construct_and_plan` is the one place a run's model is made, so that ``compare`` can
check an init spec on exactly the model the run will train before the first run starts.
"""

from __future__ import annotations

import torch
from torch import nn

from structinit.harness.errors import user_input
from structinit.schemes.plan import Plan

__all__ = ["construct_and_plan"]


def construct_and_plan(cfg, sizes: dict) -> tuple[nn.Module, Plan]:
    """``cfg.model`` built with ``sizes`` (what the data decides) and ``cfg.model_kwargs``,
    constructed under ``init_seed`` (construction draws from the global RNG, which is forked
    and restored), and ``cfg.init`` planned on it but not written (``plan.commit()`` does)."""
    from structinit.models import create_model
    from structinit.schemes.registry import plan_init

    kwargs = {**sizes, **cfg.model_kwargs}
    seed = cfg.seed if cfg.init_seed is None else cfg.init_seed
    with torch.random.fork_rng(devices=[]), user_input("model"):  # construction draws from the global RNG
        torch.manual_seed(seed)
        model = create_model(cfg.model, **kwargs)
    with user_input("init"):
        return model, plan_init(model, cfg.init, seed=seed, **cfg.init_options)
