"""Image classification: the task of a :class:`~structinit.harness.config.ImageConfig` run,
certified robustness included (Trockman & Kolter, ICLR 2021; the maths is in
:mod:`structinit.analysis.certify`).

The whole dataset lives on the training device as uint8 tensors; each epoch draws a
permutation seeded by (seed, epoch), and each batch its augmentation from a generator seeded by
(seed, epoch, rank, batch), so that a batch is the same wherever it is augmented: on the device,
or on the CPU in a thread or in worker processes (:mod:`~structinit.harness.tasks.image_batches`).
A chunk of the run is an epoch. Evaluation scores every held-out or
test split (accuracy and cross-entropy), and with ``certify_eps`` the certified accuracy of
models that declare a Lipschitz bound and, at the end, the ℓ₂ PGD accuracy
(:func:`pgd_accuracy`): certified training is an option of this task.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from structinit.analysis.certify import (
    logit_margins,
    model_lipschitz,
    multiclass_hinge_loss,
    pgd_l2_accuracy,
    pixel_cert_threshold,
)
from structinit.augment import Augment
from structinit.data import DATASET_LOADERS, DatasetNotFoundError, holdout_split, load_dataset, stratified_subset
from structinit.data.registry import canonical_name
from structinit.harness.config import ImageConfig
from structinit.harness.errors import user_input
from structinit.harness.run.device import Placement, resolve_precision
from structinit.harness.run.lifecycle import Chunk, construct_and_plan
from structinit.harness.run.step import TrainStep
from structinit.harness.tasks.image_batches import AugmentWorkers, EpochBatches
from structinit.utils import derived_generator, to_device
from structinit.utils.background import ahead

__all__ = ["PAPER_HINGE_MARGIN", "ImageTask", "check_data", "eval_images", "evaluate", "hinge_margin", "image_sizes",
           "image_step",
           "load_data", "load_train_split", "pgd_accuracy", "plan_model", "test_images"]


def check_data(cfg: ImageConfig) -> None:
    """The checks of ``cfg``'s data that need no loading: the dataset's name, a ``data_dir``
    where the dataset reads one, and that it exists unless it is to be downloaded."""

    with user_input("dataset"):
        name = canonical_name(cfg.dataset)
    mode = DATASET_LOADERS[name].root_mode
    if mode == "ignored":  # bundled with a package: data_dir plays no part
        return
    with user_input("data_dir"):
        if cfg.data_dir is None:
            if mode == "required":
                raise ValueError(f"dataset={name!r} reads your own images: data_dir is required, the folder with "
                                 "one sub-folder of images per class")
            return
        reads_file = DATASET_LOADERS[name].file_root
        if Path(cfg.data_dir).expanduser().is_file():
            if reads_file is None:
                raise DatasetNotFoundError(f"data_dir={cfg.data_dir} is a file, not a folder, and holds no {name} "
                                           f"data; set data_dir to the folder that holds the {name} files")
            reads_file(Path(cfg.data_dir).expanduser())  # an archive read in place, or one line saying it is none
        if not Path(cfg.data_dir).expanduser().exists() and not (cfg.download and mode == "search"):
            fetch = f"pass download=True (--download) to fetch {name} there, or " if mode == "search" else ""
            raise DatasetNotFoundError(f"data_dir={cfg.data_dir} does not exist; {fetch}set data_dir to the folder "
                                       f"that holds the {name} files")


def load_train_split(cfg: ImageConfig):
    """The whole training split of ``cfg.dataset`` (before any holdout or subset)."""

    with user_input("dataset"):
        return load_dataset(cfg.dataset, cfg.data_dir, "train", download=cfg.download)


def load_data(cfg: ImageConfig):
    """(train set, {name: eval set}); the first eval set is the one a run is judged on."""

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


def image_step(cfg: ImageConfig, data, device: torch.device) -> tuple[ImageTask, TrainStep]:
    """(the task, the step) of the run ``cfg`` on the training images ``data`` (an
    :class:`~structinit.data.ArrayDataset`) on one ``device``, built as ``structinit train``
    builds them: the model initialised, :class:`ImageTask.batches` to draw batches from and the
    run's :class:`~structinit.harness.run.step.TrainStep`. The throughput benchmark times these."""
    task = ImageTask(cfg)
    dtype = resolve_precision(task.check(), device)
    where = Placement(1, 0, device)
    model, plan = construct_and_plan(cfg, task.place(data, {}, where))
    plan.commit()
    _, total, warmup = task.schedule()
    return task, TrainStep(model.to(device).train(), task, where, dtype, total, warmup)


def image_sizes(image_shape: tuple[int, int, int], num_classes: int) -> dict[str, int]:
    """The model arguments the data decides: classes, channels and image size."""
    return {"num_classes": num_classes, "in_chans": image_shape[0], "img_size": image_shape[1]}


def plan_model(cfg: ImageConfig, image_shape: tuple[int, int, int], num_classes: int):
    """(model, plan): the run's model for images (C, H, W), its init planned, not written."""
    return construct_and_plan(cfg, image_sizes(image_shape, num_classes))


# ----------------------------------------------------------------------------- certified robustness
# The PGD evaluation (certify_eps set, final evaluation only): ℓ₂ PGD with this many steps of
# ε/4 (Trockman & Kolter's evaluation) on the first PGD_EXAMPLES images of each split; it costs
# about 3·PGD_STEPS forward passes per image, so a 10,000-image split is subsampled.
PGD_STEPS = 10
PGD_EXAMPLES = 1000
# The paper's hinge margin (the Trockman & Kolter repo's multi_margin_loss default), used when
# certify_eps is not set.
PAPER_HINGE_MARGIN = 0.5


def hinge_margin(cfg: ImageConfig, std) -> float:
    """The margin of the hinge loss: ``cfg.hinge_margin``, or by default the margin that
    certifies at ``certify_eps`` a 1-Lipschitz model in pixel space, √2·ε/min(std) (the margin
    ≈ √2·ε·L recipe of Trockman & Kolter, with L the normalisation's Lipschitz constant), or
    without ``certify_eps`` the paper's constant 0.5."""
    if cfg.hinge_margin is not None:
        return float(cfg.hinge_margin)
    if cfg.certify_eps is not None:
        return pixel_cert_threshold(cfg.certify_eps, 1.0, std)
    return PAPER_HINGE_MARGIN


def pgd_accuracy(model, images, labels, mean, std, eps, batch_size, where: Placement, seed: int) -> float:
    """ℓ₂ PGD accuracy at radius ``eps`` in pixel space (:func:`structinit.analysis.certify.
    pgd_l2_accuracy`, PGD_STEPS steps, fp32) over the first PGD_EXAMPLES images (this rank's
    share), reduced over ranks; the random starts come from ``seed``."""
    model.eval()
    idx = torch.arange(where.rank, min(len(images), PGD_EXAMPLES), where.world, device=images.device)
    gen = derived_generator(seed, 2)  # 2: the attack's random starts
    right = 0.0
    for start in range(0, len(idx), batch_size):
        b = idx[start : start + batch_size]
        x = images[b].float() / 255
        acc = pgd_l2_accuracy(model, x, labels[b], eps, steps=PGD_STEPS, preprocess=lambda t: (t - mean) / std,
                              clamp=(0.0, 1.0), generator=gen)
        right += acc * len(b)
    totals = where.all_reduce(torch.tensor([right, float(len(idx))], dtype=torch.float64, device=images.device))
    model.train()
    return float(totals[0] / totals[1].clamp_min(1))


@torch.no_grad()
def evaluate(model, images, labels, mean, std, batch_size, dtype, where: Placement,
             cert_threshold: float | None = None):
    """(accuracy, mean cross-entropy) over images[rank::world], reduced over ranks; with
    ``cert_threshold`` also the certified accuracy, the fraction whose logit margin
    f_y − max_{j≠y} f_j exceeds it (:func:`pixel_cert_threshold`): (accuracy, loss, certified)."""
    model.eval()
    device = images.device
    correct, loss_sum, certified = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(3))
    idx = torch.arange(where.rank, len(images), where.world, device=device)
    for start in range(0, len(idx), batch_size):
        b = idx[start : start + batch_size]
        x = (images[b].float() / 255 - mean) / std
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(x)
        loss_sum += F.cross_entropy(logits.float(), labels[b], reduction="sum").double()
        correct += (logits.argmax(-1) == labels[b]).sum().double()
        if cert_threshold is not None:
            certified += (logit_margins(logits.float(), labels[b]) > cert_threshold).sum().double()
    totals = where.all_reduce(torch.stack([correct, loss_sum, certified,
                                           torch.tensor(len(idx), dtype=torch.float64, device=device)]))
    model.train()
    acc, loss = float(totals[0] / totals[3]), float(totals[1] / totals[3])
    return (acc, loss) if cert_threshold is None else (acc, loss, float(totals[2] / totals[3]))


class ImageTask:
    """Classify images: a chunk is an epoch; see the module docstring."""

    unit, examples = "epoch", "images"
    free_fields = ("cpu_prefetch", "aug_workers")
    state_keys = ("config", "epoch", "model", "optimizer", "scaler", "history", "wall_s")
    # Fields added after runs were made: a checkpoint without one ran with this value, and resumes.
    added_fields: ClassVar[dict[str, Any]] = {"loss": "ce", "hinge_margin": None, "certify_eps": None,
                                              "test_every": 1, "cpu_prefetch": 0, "aug_workers": 0,
                                              "compile_mode": "default"}

    def __init__(self, cfg: ImageConfig):
        self.cfg = cfg
        self._workers: AugmentWorkers | None = None  # started by the first batches() with aug_workers

    def check(self) -> str:

        cfg = self.cfg
        with user_input("augment"):
            self.augment = Augment.parse(cfg.augment)
        with user_input("hinge_margin"):
            if cfg.hinge_margin is not None and cfg.loss != "hinge":
                raise ValueError(f"hinge_margin={cfg.hinge_margin!r} applies to loss='hinge' only (loss={cfg.loss!r}); "
                                 "set loss='hinge' or leave hinge_margin at None")
        check_data(cfg)
        with user_input("test_every"):
            if cfg.test_every > 1 and (not cfg.test_prefix or cfg.holdout):
                why = f"holdout={cfg.holdout} scores no test split" if cfg.holdout else "test_prefix is not set"
                raise ValueError(f"test_every={cfg.test_every} leaves the evaluations in between without a score: "
                                 f"{why}; set test_prefix=N (the first N test images, scored at every evaluation) "
                                 "with holdout=0, or test_every=1")
        with user_input("precision"):
            # a certificate rests on exact arithmetic: bf16 or fp16 would break the Lipschitz bound
            if cfg.certify_eps is not None and cfg.precision in ("bf16", "fp16"):
                raise ValueError(f"precision={cfg.precision!r} with certify_eps={cfg.certify_eps:.4g}: a certificate "
                                 "needs fp32 arithmetic; set precision='fp32' (or 'auto', fp32 when certifying)")
        return "fp32" if cfg.certify_eps is not None else cfg.precision

    def model_sizes(self) -> dict[str, int]:
        """The model arguments the data decides (loads the training split's header and shape)."""
        train_ds = load_train_split(self.cfg)
        return image_sizes(train_ds.image_shape, train_ds.num_classes)

    def prepare(self, where: Placement) -> dict[str, int]:
        return self.place(*load_data(self.cfg), where)

    def place(self, train_ds, evals: dict, where: Placement) -> dict[str, int]:
        """Put ``train_ds`` and ``evals`` ({name: split}) on the device, as :meth:`prepare`
        does with the config's data; the throughput benchmark places its own images here.
        Returns the model arguments the data decides."""
        cfg, device = self.cfg, where.device
        self.cpu_images = train_ds.images  # what cpu_prefetch augments
        self.images, self.labels = train_ds.images.to(device), train_ds.labels.to(device)
        self.evals = {k: (v.images.to(device), v.labels.to(device)) for k, v in evals.items()}
        self.sources = {"train": train_ds.source, **{k: v.source for k, v in evals.items()}}  # which copy each was
        self.mean = torch.tensor(train_ds.mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(train_ds.std, device=device).view(1, -1, 1, 1)
        self.per_rank = cfg.batch_size // where.world
        self.steps = (len(self.images) // where.world) // self.per_rank
        with user_input("batch_size"):
            if self.steps < 1:
                raise ValueError(f"{len(self.images)} training images make no full batch of {cfg.batch_size}; "
                                 "lower batch_size")
        self.margin = hinge_margin(cfg, self.std)  # used with loss='hinge' only
        return image_sizes(train_ds.image_shape, train_ds.num_classes)

    def schedule(self) -> tuple[list[Chunk], int, int]:
        cfg, n = self.cfg, self.steps
        chunks = [Chunk(e + 1, e * n, (e + 1) * n, (e + 1) % cfg.eval_every == 0 or e + 1 == cfg.epochs,
                        full=(e + 1) % cfg.test_every == 0 or e + 1 == cfg.epochs)
                  for e in range(cfg.epochs)]
        return chunks, n * cfg.epochs, round(cfg.warmup_epochs * n)

    def batches(self, chunk: Chunk, where: Placement):
        """The batches of ``chunk`` (an epoch) on ``where``'s device: normalised images and their
        labels. Batch i of epoch e is the same wherever it is augmented (see
        :mod:`~structinit.harness.tasks.image_batches`): on the device in the step, on the CPU in a
        thread ``cpu_prefetch`` batches ahead, or in ``aug_workers`` processes."""
        epoch, cfg = chunk.number - 1, self.cfg
        sizes = dict(seed=cfg.seed, rank=where.rank, world=where.world, per_rank=self.per_rank, steps=self.steps)
        on_device = EpochBatches(self.images, self.augment, **sizes)  # labels, and batches augmented in the step
        pin = where.device.type == "cuda"  # pinned: the copy to a GPU is queued without waiting
        if cfg.aug_workers:
            if self._workers is None:
                self._workers = AugmentWorkers(EpochBatches(self.cpu_images, self.augment, **sizes), cfg.aug_workers,
                                               pin=pin)
            uint8 = (to_device(x, where.device) for x in self._workers.epoch(epoch))
        elif cfg.cpu_prefetch:
            on_cpu = EpochBatches(self.cpu_images, self.augment, **sizes)
            made = (on_cpu[epoch * self.steps + i] for i in range(self.steps))
            uint8 = (to_device(x, where.device) for x in ahead((x.pin_memory() if pin else x for x in made),
                                                                 cfg.cpu_prefetch))
        else:
            uint8 = (on_device[epoch * self.steps + i] for i in range(self.steps))
        for i, x in enumerate(uint8):
            yield (x.float() / 255 - self.mean) / self.std, self.labels[on_device.indices(epoch, i, on_device=True)]

    def close(self) -> None:
        """End the augmentation workers, if the run started any."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.cfg.loss == "hinge":  # label_smoothing is a cross-entropy option: it plays no part here
            return multiclass_hinge_loss(logits.float(), y, margin=self.margin)
        return F.cross_entropy(logits.float(), y, label_smoothing=self.cfg.label_smoothing)

    def count(self, logits: torch.Tensor, y: torch.Tensor):
        return (logits.argmax(-1) == y).sum(), len(y), len(y)

    def evaluate(self, model: nn.Module, dtype, where: Placement, final: bool, robust: bool = True,
                 full: bool = True) -> dict:
        """Accuracy and loss of every split (with ``full=False``, of the ``test_prefix`` split
        alone); with ``certify_eps`` (and ``robust``), the certified accuracy at ε in pixel space
        (models that declare a Lipschitz bound) and, at the final evaluation only, the ℓ₂ PGD
        accuracy at ε."""
        cfg, row, batch = self.cfg, {}, 2 * self.cfg.batch_size
        bound = model_lipschitz(model)
        threshold = None
        if robust and cfg.certify_eps is not None and bound is not None:
            # The model sees (x − mean)/std: its Lipschitz constant in pixel space is bound/min(std).
            threshold = pixel_cert_threshold(cfg.certify_eps, bound, self.std)
        for name, (x, y) in self.evals.items():
            if not full and name != f"test_first{cfg.test_prefix}":
                continue
            values = evaluate(model, x, y, self.mean, self.std, batch, dtype, where, cert_threshold=threshold)
            row[f"{name}_acc"], row[f"{name}_loss"] = values[:2]
            if threshold is not None:
                row[f"{name}_cert_acc"] = values[2]
            if robust and final and cfg.certify_eps is not None:
                row[f"{name}_pgd_acc"] = pgd_accuracy(model, x, y, self.mean, self.std, cfg.certify_eps, batch,
                                                      where, cfg.seed)
        return row

    def row(self, chunk: Chunk) -> dict[str, Any]:
        return {"epoch": chunk.number}

    def result(self, history: list[dict]) -> dict[str, Any]:
        evaluated = [r for r in history if any(k.endswith("_acc") and k != "train_acc" for k in r)]
        last = evaluated[-1] if evaluated else {}
        return {"kind": "image", "epochs_done": len(history),
                "final": {k: v for k, v in last.items() if k.endswith(("_acc", "_loss"))},
                "data": {k: v for k, v in getattr(self, "sources", {}).items() if v}}


def test_images(dataset: str, data_dir: str | None, n: int, download: bool = False):
    """(normalised, in [0, 1], class count) of the first ``n`` test images of ``dataset``,
    normalised with the dataset's channel statistics as training does."""

    with user_input("dataset"):
        test = load_dataset(dataset, data_dir, "test", download=download)
    return test.normalised(n), test.images[:n].float() / 255, test.num_classes


def eval_images(cfg: ImageConfig, n: int):
    """(normalised first ``n`` images of the split a run is judged on, class count, their
    description), never downloading: what a report shows attention maps of."""
    _, evals = load_data(dataclasses.replace(cfg, download=False, train_size=None))
    split, ds = next(iter(evals.items()))
    n = min(n, len(ds))
    return ds.normalised(n), ds.num_classes, f"the first {n} {split} images of {ds.name}"
