"""The training loop: one file, top to bottom (nanoGPT / airbench style).

The whole dataset lives on the training device as uint8 tensors; each epoch draws a
permutation and augments whole batches there. Every random choice comes from generators
seeded by (seed, epoch, rank), and the checkpoint written after every epoch holds the
model, optimiser, EMA and metric history, so a killed run resumed with ``resume=True``
repeats exactly the computation it would have done: on CPU the final weights are
bit-identical to an uninterrupted run.

Distributed data parallel runs under ``torchrun`` (gloo on CPU, NCCL on GPU): each rank
takes every world-th image of the epoch's permutation and a batch of batch_size / world.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from structinit.analysis.certify import logit_margins, multiclass_hinge_loss
from structinit.harness.build import build_model, check_data, load_data
from structinit.harness.certified import (
    check_certified_options,
    hinge_margin,
    model_lipschitz,
    pgd_accuracy,
    pixel_cert_threshold,
)
from structinit.harness.checkpoint import (
    EMA_WEIGHTS,
    WEIGHTS,
    MetricsLog,
    check_same_init,
    init_fingerprint,
    resume_state,
    save_checkpoint,
    save_weights,
    write_json,
)
from structinit.harness.errors import user_input
from structinit.harness.runfolder import check_out_dir, lock_run
from structinit.schemes.registry import get_scheme
from structinit.utils import derived_generator
from structinit.utils.optional_imports import require

CHECKPOINT = "checkpoint.pt"
# Fields added after runs were made: a checkpoint without one ran with this value and resumes.
_ADDED_FIELDS = {"loss": "ce", "hinge_margin": None, "certify_eps": None}


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/Inf loss; the last good checkpoint is left in place."""


@dataclass
class TrainConfig:
    """Everything a run depends on (saved in the checkpoint and result.json)."""

    model: str = "vit_cpu_patch4_32"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    init: str = "pytorch"
    init_options: dict[str, Any] = field(default_factory=dict)
    dataset: str = "digits"
    data_dir: str | None = None
    download: bool = False
    train_size: int | None = None       # class-stratified subset of the training images
    holdout: int = 0                    # >0: evaluate on this many held-out training images
    holdout_mode: str = "last"          # 'last' images in order, or 'stratified'
    test_prefix: int | None = None      # also report accuracy on test images [0, test_prefix)
    epochs: int = 30
    batch_size: int = 128
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup_epochs: float = 2.0
    warmup_lr: float = 1e-5
    weight_decay: float = 0.05
    eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.999)
    label_smoothing: float = 0.1        # cross-entropy only (loss='ce')
    loss: str = "ce"                    # 'ce' (cross-entropy) | 'hinge' (multi-class hinge, certified training)
    hinge_margin: float | None = None   # loss='hinge': None → √2·certify_eps/min(std), else 0.5 (_hinge_margin)
    certify_eps: float | None = None    # ℓ₂ radius in pixel space [0, 1]: adds <split>_cert_acc, _pgd_acc
    grad_clip: float | None = 1.0
    augment: str = "crop4,flip"
    precision: str = "auto"             # auto | fp32 | bf16 | fp16
    compile: bool = False
    ema_decay: float | None = None
    eval_every: int = 1
    seed: int = 0                       # data order and augmentation
    init_seed: int | None = None        # model construction and init (default: seed)
    out_dir: str = "runs/run"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- helpers
def cosine_lr(step: int, total: int, warmup: int, cfg: TrainConfig) -> float:
    """Linear warm-up from warmup_lr to lr over ``warmup`` steps, then cosine to min_lr."""
    if step < warmup:
        return cfg.warmup_lr + (cfg.lr - cfg.warmup_lr) * step / warmup
    t = (step - warmup) / max(1, total - warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype (None = fp32). 'auto' is bf16 where the hardware has it natively."""
    if precision not in ("auto", "fp32", "bf16", "fp16"):
        raise ValueError(f"precision={precision!r}: expected auto, fp32, bf16 or fp16")
    if precision == "fp32":
        return None
    if precision == "fp16":
        return torch.float16
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_native_bf16() else None


def _cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in ("avx512_bf16", "amx_bf16"))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: not on biases, norms, position embeddings or tokens."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.ndim < 2 or name.endswith(("pos_embed", "cls_token", "reg_token"))
        (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class EMA:
    """Exponential moving average of the weights: ema ← d·ema + (1−d)·w after every step."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.state[k].mul_(self.decay).add_(v.detach(), alpha=1 - self.decay)
            else:
                self.state[k].copy_(v)


@torch.no_grad()
def evaluate(model, images, labels, mean, std, batch_size, dtype, world, rank,
             cert_threshold: float | None = None):
    """(accuracy, mean cross-entropy) over images[rank::world], reduced over ranks; with
    ``cert_threshold`` also the certified accuracy, the fraction whose logit margin
    f_y − max_{j≠y} f_j exceeds it (:func:`pixel_cert_threshold`): (accuracy, loss, certified)."""
    model.eval()
    correct = torch.zeros((), dtype=torch.float64, device=images.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=images.device)
    certified = torch.zeros((), dtype=torch.float64, device=images.device)
    idx = torch.arange(rank, len(images), world, device=images.device)
    for start in range(0, len(idx), batch_size):
        b = idx[start : start + batch_size]
        x = (images[b].float() / 255 - mean) / std
        with torch.autocast(images.device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(x)
        loss_sum += F.cross_entropy(logits.float(), labels[b], reduction="sum").double()
        correct += (logits.argmax(-1) == labels[b]).sum().double()
        if cert_threshold is not None:
            certified += (logit_margins(logits.float(), labels[b]) > cert_threshold).sum().double()
    totals = torch.stack([correct, loss_sum, certified,
                          torch.tensor(len(idx), dtype=torch.float64, device=images.device)])
    if world > 1:
        dist.all_reduce(totals)
    model.train()
    acc, loss = float(totals[0] / totals[3]), float(totals[1] / totals[3])
    return (acc, loss) if cert_threshold is None else (acc, loss, float(totals[2] / totals[3]))


# ----------------------------------------------------------------------------- setup
def _dist_env() -> tuple[int, int, int]:
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))


def _versions() -> dict[str, str]:
    import structinit

    return {"python": sys.version.split()[0], "torch": torch.__version__, "structinit": structinit.__version__,
            "platform": platform.platform()}


# ----------------------------------------------------------------------------- the loop
def train(cfg: TrainConfig, resume: bool = False, progress: bool = True, wait: bool = False) -> dict[str, Any]:
    """Train, evaluate every ``eval_every`` epochs, checkpoint every epoch; return the result
    (also written to ``out_dir/result.json``). With ``resume=True`` a finished run returns its
    result and a half-finished one continues from its last checkpoint.

    The settings, ``out_dir`` and the data are checked before anything is loaded or written;
    errors in them are marked as input errors (:mod:`structinit.harness.errors`). While the run
    trains, its folder is locked (:func:`~structinit.harness.runfolder.lock_run`): another process
    on the same ``out_dir`` raises :class:`~structinit.harness.errors.RunLockedError`, or with
    ``wait=True`` waits until this one is done."""
    world, rank, local_rank = _dist_env()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    dtype, augment = _check_inputs(cfg, device, world)
    with lock_run(cfg.out_dir, wait=wait, enabled=rank == 0):  # only rank 0 writes
        return _train(cfg, resume, progress, device, dtype, augment)


def _check_inputs(cfg: TrainConfig, device: torch.device, world: int):
    """(autocast dtype, augmentation) of ``cfg``, after every check that needs no data: cheap
    ones first, so that a typo never waits for a dataset to load."""
    from structinit.augment import Augment

    with user_input("batch_size"):
        if cfg.batch_size % world:
            raise ValueError(f"batch_size={cfg.batch_size} is not divisible by the {world} processes")
    with user_input("precision"):
        dtype = resolve_precision(cfg.precision, device)
    with user_input("augment"):
        augment = Augment.parse(cfg.augment)
    check_certified_options(cfg)
    with user_input("init"):
        get_scheme(cfg.init)  # the options are checked on the model, once the data says its size
    with user_input("out_dir"):
        check_out_dir(cfg.out_dir)
    check_data(cfg)
    return dtype, augment


def _train(cfg: TrainConfig, resume: bool, progress: bool, device: torch.device, dtype, augment) -> dict[str, Any]:
    """:func:`train` once the inputs are checked and the run folder is locked."""
    world, rank, _ = _dist_env()
    out = Path(cfg.out_dir)
    ckpt_path, result_path = out / CHECKPOINT, out / "result.json"
    state = resume_state(ckpt_path, resume, cfg.to_dict(), defaults=_ADDED_FIELDS)

    train_ds, evals = load_data(cfg)
    images, labels = train_ds.images.to(device), train_ds.labels.to(device)
    evals = {k: (v.images.to(device), v.labels.to(device)) for k, v in evals.items()}
    mean = torch.tensor(train_ds.mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(train_ds.std, device=device).view(1, -1, 1, 1)

    model = build_model(cfg, train_ds)
    fingerprint = init_fingerprint(model)
    if state is not None:
        with user_input("resume"):
            check_same_init(state, fingerprint, ckpt_path)
        if state.get("finished") and result_path.exists():
            return json.loads(result_path.read_text())
    model = model.to(device)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)
    ema = EMA(model, cfg.ema_decay) if cfg.ema_decay else None
    start_epoch, history, wall_before = 0, [], 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        if ema is not None:
            ema.state = {k: v.to(device) for k, v in state["ema"].items()}
        start_epoch, history, wall_before = state["epoch"], state["history"], state["wall_s"]
    log = MetricsLog(out, history) if rank == 0 else None
    if log is not None:
        out.mkdir(parents=True, exist_ok=True)
        log.flush()  # metric files agree with the checkpoint, even after a kill
    net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    net = torch.compile(net) if cfg.compile else net

    per_rank = cfg.batch_size // world
    steps = (len(images) // world) // per_rank
    with user_input("batch_size"):
        if steps < 1:
            raise ValueError(f"{len(images)} training images make no full batch of {cfg.batch_size}; lower batch_size")
    total, warmup = steps * cfg.epochs, round(cfg.warmup_epochs * steps)
    margin = hinge_margin(cfg, std)  # used with loss='hinge' only
    run_start = time.perf_counter()
    for epoch in range(start_epoch, cfg.epochs):
        order = torch.randperm(len(images), generator=derived_generator(cfg.seed, epoch)).to(device)
        mine = order[rank::world][: steps * per_rank]
        aug_gen = derived_generator(cfg.seed, epoch, rank, 1)  # 1: augmentation
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device)
        bar = _progress(steps, epoch, cfg.epochs, progress and rank == 0)
        t0 = time.perf_counter()
        for i in range(steps):
            lr = cosine_lr(epoch * steps + i, total, warmup, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            idx = mine[i * per_rank : (i + 1) * per_rank]
            x = (augment(images[idx], aug_gen).float() / 255 - mean) / std
            y = labels[idx]
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                logits = net(x)
            if cfg.loss == "hinge":  # label_smoothing is a cross-entropy option: it plays no part here
                loss = multiclass_hinge_loss(logits.float(), y, margin=margin)
            else:
                loss = F.cross_entropy(logits.float(), y, label_smoothing=cfg.label_smoothing)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if cfg.grad_clip:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(opt)
            scaler.update()
            if ema is not None:
                ema.update(model)
            loss_sum += loss.detach() * len(idx)
            correct += (logits.argmax(-1) == y).sum()
            if bar is not None and (i % 10 == 9 or i == steps - 1):
                seen = (i + 1) * per_rank
                bar.set_postfix(loss=f"{loss_sum.item() / seen:.3f}", acc=f"{correct.item() / seen:.3f}",
                                img_s=f"{seen * world / (time.perf_counter() - t0):.0f}")
                bar.update(i + 1 - bar.n)
        if bar is not None:
            bar.close()
        seconds = time.perf_counter() - t0
        totals = torch.stack([loss_sum.double(), correct.double()])
        if world > 1:
            dist.all_reduce(totals)
        n_seen = steps * per_rank * world
        if not math.isfinite(float(totals[0])):
            raise NonFiniteLossError(
                f"epoch {epoch + 1}: the training loss is not finite (lr {lr:.3g}); stopped without "
                f"overwriting {ckpt_path}, which holds the last good epoch ({epoch})"
            )
        row = {"epoch": epoch + 1, "step": (epoch + 1) * steps, "lr": lr, "train_loss": float(totals[0]) / n_seen,
               "train_acc": float(totals[1]) / n_seen, "images_per_s": n_seen / seconds,
               "wall_s": wall_before + time.perf_counter() - run_start}
        if (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs:
            row |= _evaluate_all(model, ema, evals, mean, std, cfg, dtype, world, rank,
                                 final=epoch + 1 == cfg.epochs)
        history = [*history, row]
        if rank == 0:
            save_checkpoint(ckpt_path, {
                "config": cfg.to_dict(), "epoch": epoch + 1, "model": model.state_dict(),
                "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
                "ema": None if ema is None else ema.state, "history": history, "wall_s": row["wall_s"],
                "finished": epoch + 1 == cfg.epochs, "init_fingerprint": fingerprint,
            })
            log.append(row)
        if world > 1:
            dist.barrier()
    result = _result(cfg, history, world) | {"init_fingerprint": fingerprint}
    if rank == 0:
        export_weights(out, model, ema, cfg, fingerprint)  # before result.json: a finished run always has them
        write_json(result_path, result)
    return result


def export_weights(out: Path, model: nn.Module, ema: EMA | None, cfg: TrainConfig, fingerprint: str) -> None:
    """The final weights as ``out/model.safetensors`` (and ``model_ema.safetensors`` with EMA),
    the files timm and Hugging Face load from; the header holds the config (JSON), the init
    fingerprint and the structinit version, so the file alone says how it was made."""
    import structinit

    metadata = {"config": json.dumps(cfg.to_dict(), sort_keys=True), "init_fingerprint": fingerprint,
                "structinit_version": structinit.__version__}
    save_weights(out / WEIGHTS, model.state_dict(), metadata)
    if ema is not None:
        save_weights(out / EMA_WEIGHTS, ema.state, metadata)


def _evaluate_all(model, ema, evals, mean, std, cfg, dtype, world, rank, final: bool = False) -> dict[str, float]:
    """Accuracy and loss of every split; with ``certify_eps``, the certified accuracy at ε in
    pixel space (models that declare a Lipschitz bound, :func:`model_lipschitz`) and, at the
    final evaluation only, the ℓ₂ PGD accuracy at ε (:func:`pgd_accuracy`)."""
    row, batch = {}, 2 * cfg.batch_size
    bound = model_lipschitz(model)
    threshold = None
    if cfg.certify_eps is not None and bound is not None:
        # The model sees (x − mean)/std: its Lipschitz constant in pixel space is bound/min(std).
        threshold = pixel_cert_threshold(cfg.certify_eps, bound, std)
    for name, (x, y) in evals.items():
        values = evaluate(model, x, y, mean, std, batch, dtype, world, rank, cert_threshold=threshold)
        row[f"{name}_acc"], row[f"{name}_loss"] = values[:2]
        if threshold is not None:
            row[f"{name}_cert_acc"] = values[2]
        if final and cfg.certify_eps is not None:
            row[f"{name}_pgd_acc"] = pgd_accuracy(model, x, y, mean, std, cfg.certify_eps, batch, world, rank,
                                                  cfg.seed)
    if ema is not None:  # evaluate the averaged weights too, then put the live ones back
        live = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(ema.state)
        for name, (x, y) in evals.items():
            row[f"ema_{name}_acc"], _ = evaluate(model, x, y, mean, std, batch, dtype, world, rank)
        model.load_state_dict(live)
    return row


def _progress(steps, epoch, epochs, enabled):
    if not enabled:
        return None
    tqdm = require("tqdm", "the progress bar (progress=False or --no-progress turns it off)").tqdm
    return tqdm(total=steps, desc=f"epoch {epoch + 1}/{epochs}", leave=False, dynamic_ncols=True)


def _result(cfg: TrainConfig, history: list[dict], world: int) -> dict[str, Any]:
    evaluated = [r for r in history if any(k.endswith("_acc") and k != "train_acc" for k in r)]
    last = evaluated[-1] if evaluated else {}
    return {"config": cfg.to_dict(), "seed": cfg.seed, "world_size": world, "versions": _versions(),
            "epochs_done": len(history), "wall_s": history[-1]["wall_s"] if history else 0.0,
            "final": {k: v for k, v in last.items() if k.endswith(("_acc", "_loss"))}, "history": history}
