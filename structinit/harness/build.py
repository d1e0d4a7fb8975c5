"""What a run is made of, built from its :class:`~structinit.harness.train.TrainConfig`: the
data splits and the model. :func:`plan_model` is the one place a run's model is made, so that
:func:`~structinit.harness.compare.compare` can check an init spec on exactly the model the
run will train."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from structinit.harness.errors import user_input
from structinit.schemes.plan import Plan

if TYPE_CHECKING:
    from structinit.harness.train import TrainConfig

__all__ = ["build_model", "check_data", "construct_and_plan", "load_data", "load_train_split", "plan_model"]


def check_data(cfg: TrainConfig) -> None:
    """The checks of ``cfg``'s data that need no loading: the dataset's name, a ``data_dir``
    where the dataset reads one, and that it exists unless it is to be downloaded. Errors are
    marked as input errors (:func:`~structinit.harness.errors.user_input`)."""
    # load_dataset's own name check (aliases included), without loading anything
    from structinit.data import DATASET_LOADERS, DatasetNotFoundError
    from structinit.data.registry import _canonical

    with user_input("dataset"):
        name = _canonical(cfg.dataset)
    mode = DATASET_LOADERS[name].root_mode
    if mode == "ignored":  # bundled with a package: data_dir plays no part
        return
    with user_input("data_dir"):
        if cfg.data_dir is None:
            if mode == "required":
                raise ValueError(f"dataset={name!r} reads your own images: data_dir is required, the folder with "
                                 "one sub-folder of images per class")
            return
        if not Path(cfg.data_dir).expanduser().exists() and not (cfg.download and mode == "search"):
            fetch = f"pass download=True (--download) to fetch {name} there, or " if mode == "search" else ""
            raise DatasetNotFoundError(f"data_dir={cfg.data_dir} does not exist; {fetch}set data_dir to the folder "
                                       f"that holds the {name} files")


def load_train_split(cfg: TrainConfig):
    """The whole training split of ``cfg.dataset`` (before any holdout or subset)."""
    from structinit.data import load_dataset

    with user_input("dataset"):
        return load_dataset(cfg.dataset, cfg.data_dir, "train", download=cfg.download)


def load_data(cfg: TrainConfig):
    """(train set, {name: eval set}); the first eval set is the one a run is judged on."""
    from structinit.data import holdout_split, load_dataset, stratified_subset

    train_ds = load_train_split(cfg)
    evals = {}
    if cfg.holdout:
        with user_input("holdout"):
            train_ds, held = holdout_split(train_ds, cfg.holdout, seed=cfg.seed, mode=cfg.holdout_mode)
        evals["holdout"] = held
    else:
        with user_input("dataset"):
            test = load_dataset(cfg.dataset, cfg.data_dir, "test", download=cfg.download)
        evals["test"] = test
        if cfg.test_prefix:
            evals[f"test_first{cfg.test_prefix}"] = test.subset(torch.arange(min(cfg.test_prefix, len(test))))
    if cfg.train_size:
        with user_input("train_size"):
            train_ds = stratified_subset(train_ds, cfg.train_size, seed=cfg.seed)
    return train_ds, evals


def plan_model(cfg: TrainConfig, image_shape: tuple[int, int, int], num_classes: int) -> tuple[nn.Module, Plan]:
    """The run's model for images (C, H, W) and ``num_classes``, constructed from ``init_seed``,
    and its init planned but not written (``plan.commit()`` applies it).

    The only place a run's model is made: :func:`~structinit.harness.train.train` commits
    the plan, and :func:`~structinit.harness.compare.compare` plans every spec first, so that
    a bad init option fails before the first run instead of hours into a comparison.
    """
    c, h, _ = image_shape
    return construct_and_plan(cfg, {"num_classes": num_classes, "in_chans": c, "img_size": h})


def construct_and_plan(cfg, sizes: dict) -> tuple[nn.Module, Plan]:
    """``cfg.model`` built with ``sizes`` (what the data decides) and ``cfg.model_kwargs``,
    constructed under ``init_seed`` (construction draws from the global RNG, which is forked
    and restored), and ``cfg.init`` planned on it; image and sequence runs share this."""
    from structinit.models import create_model
    from structinit.schemes.registry import plan_init

    kwargs = {**sizes, **cfg.model_kwargs}
    seed = cfg.seed if cfg.init_seed is None else cfg.init_seed
    with torch.random.fork_rng(devices=[]), user_input("model"):  # construction draws from the global RNG
        torch.manual_seed(seed)
        model = create_model(cfg.model, **kwargs)
    with user_input("init"):
        return model, plan_init(model, cfg.init, seed=seed, **cfg.init_options)


def build_model(cfg: TrainConfig, train_ds) -> nn.Module:
    """The named model, sized for ``train_ds``, constructed and initialised from ``init_seed``."""
    model, plan = plan_model(cfg, train_ds.image_shape, train_ds.num_classes)
    plan.commit()
    return model
