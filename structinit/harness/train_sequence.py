"""The training loop for synthetic sequence tasks (copying, multi-query associative recall),
top to bottom in one file like :mod:`structinit.harness.train`, with the same guarantees.

There is no dataset: every step draws a fresh batch from the task's generator, seeded by
(seed, step), and the held-out set is fixed per task configuration (the same for every
training seed and init). The loop runs for a fixed number of optimiser steps; every
``eval_every`` steps it evaluates on the held-out set and writes an atomic checkpoint
(model, optimiser, history). Because each batch depends only on (seed, step), a killed run
resumed from its last checkpoint repeats exactly the computation it would have done: on CPU
the final weights are bit-identical to an uninterrupted run.

The run folder holds what an image run holds (``checkpoint.pt``, ``metrics.jsonl/.csv``,
``model.safetensors``, ``result.json``) and is locked while it trains, so ``compare``,
``report`` and the ``runs`` helpers read it the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from structinit.harness.build import construct_and_plan
from structinit.harness.checkpoint import (
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
from structinit.harness.train import CHECKPOINT, NonFiniteLossError, _versions, cosine_lr
from structinit.schemes.plan import Plan
from structinit.schemes.registry import get_scheme
from structinit.utils import derived_generator
from structinit.utils.optional_imports import require

__all__ = ["SequenceConfig", "plan_sequence_model", "train_sequence"]

# What a sequence run's checkpoint holds (an image run's also has epoch and scaler).
RUN_STATE_KEYS = ("config", "step", "model", "optimizer", "history", "wall_s")
# Parameters that must not decay towards zero: Mamba's A_log (decay would pull A to −1, a
# fast-forgetting state, undoing exactly what the mimetic init sets up) and its skip D, like
# the official implementation's _no_weight_decay; and position embeddings, as for the ViTs.
NO_DECAY_SUFFIXES = ("A_log", ".D", "pos_embed")


@dataclass
class SequenceConfig:
    """Everything a sequence-task run depends on (saved in the checkpoint and result.json)."""

    model: str = "mamba_seq_2x64"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    init: str = "default"
    init_options: dict[str, Any] = field(default_factory=dict)
    task: str = "copy"
    task_options: dict[str, Any] = field(default_factory=dict)
    steps: int = 2000
    batch_size: int = 64
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup_steps: int = 100
    warmup_lr: float = 1e-5
    weight_decay: float = 0.1
    eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float | None = 1.0
    eval_every: int = 250               # steps between evaluations and checkpoints
    heldout_size: int = 1000            # the fixed held-out examples of the task configuration
    seed: int = 0                       # the training stream
    init_seed: int | None = None        # model construction and init (default: seed)
    out_dir: str = "runs/seq"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_task(cfg: SequenceConfig):
    """The task of ``cfg`` (:func:`structinit.data.sequence_tasks.make_task`); errors are input errors."""
    from structinit.data.sequence_tasks import make_task as _make

    with user_input("task"):
        return _make(cfg.task, **cfg.task_options)


def plan_sequence_model(cfg: SequenceConfig, task) -> tuple[nn.Module, Plan]:
    """The run's model for ``task`` (vocabulary and length), constructed from ``init_seed``,
    and its init planned but not written, as :func:`structinit.harness.build.plan_model` does
    for images: ``compare`` checks every spec on exactly this model before the first run."""
    return construct_and_plan(cfg, {"vocab_size": task.vocab_size, "max_len": task.seq_len})


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only, and not on A_log, D or position embeddings (see NO_DECAY_SUFFIXES)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            skip = p.ndim < 2 or name.endswith(NO_DECAY_SUFFIXES) or name == "D"
            (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate_sequences(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                       batch_size: int) -> dict[str, float]:
    """Held-out token accuracy (over scored positions), exact-match rate (every scored position
    of an example right) and mean loss per scored token."""
    from structinit.data.sequence_tasks import sequence_accuracy

    model.eval()
    correct = scored = exact = loss_sum = 0.0
    for start in range(0, len(inputs), batch_size):
        x, y = inputs[start:start + batch_size], targets[start:start + batch_size]
        logits = model(x).float()
        n_scored = float((y != -100).sum())
        token_acc, sequence_acc = sequence_accuracy(logits, y)
        correct += token_acc * n_scored
        scored += n_scored
        exact += sequence_acc * len(x)
        loss_sum += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"))
    model.train()
    return {"holdout_acc": correct / scored, "holdout_exact": exact / len(inputs), "holdout_loss": loss_sum / scored}


def _check_inputs(cfg: SequenceConfig):
    """The task, after every check that builds nothing: a typo fails at once."""
    for name in ("steps", "batch_size", "eval_every", "heldout_size"):
        with user_input(name):
            value = getattr(cfg, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
    with user_input("lr"):
        if not (isinstance(cfg.lr, (int, float)) and math.isfinite(cfg.lr) and cfg.lr > 0):
            raise ValueError(f"lr={cfg.lr!r}: expected a positive finite number, e.g. 1e-3")
    with user_input("init"):
        get_scheme(cfg.init)
    with user_input("out_dir"):
        check_out_dir(cfg.out_dir)
    return make_task(cfg)


def train_sequence(cfg: SequenceConfig, resume: bool = False, progress: bool = True,
                   wait: bool = False) -> dict[str, Any]:
    """Train ``cfg.model`` on ``cfg.task`` for ``cfg.steps`` steps; return the result (also
    written to ``out_dir/result.json``). ``resume=True`` returns a finished run's result and
    continues a half-finished one from its last checkpoint; ``wait`` is as in
    :func:`~structinit.harness.train.train`. Runs on CPU, in float32."""
    task = _check_inputs(cfg)
    with lock_run(cfg.out_dir, wait=wait):
        return _train(cfg, task, resume, progress)


def _train(cfg: SequenceConfig, task, resume: bool, progress: bool) -> dict[str, Any]:
    out = Path(cfg.out_dir)
    ckpt_path, result_path = out / CHECKPOINT, out / "result.json"
    state = resume_state(ckpt_path, resume, cfg.to_dict(), RUN_STATE_KEYS)
    model, plan = plan_sequence_model(cfg, task)
    plan.commit()
    fingerprint = init_fingerprint(model)
    if state is not None:
        with user_input("resume"):
            check_same_init(state, fingerprint, ckpt_path)
        if state.get("finished") and result_path.exists():
            return json.loads(result_path.read_text())
    held_x, held_y = task.heldout(cfg.heldout_size)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    start, history, wall_before = 0, [], 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start, history, wall_before = state["step"], state["history"], state["wall_s"]
    log = MetricsLog(out, history)
    out.mkdir(parents=True, exist_ok=True)
    log.flush()  # metric files agree with the checkpoint, even after a kill
    run_start = time.perf_counter()
    step = start
    while step < cfg.steps:
        chunk_end = min(step + cfg.eval_every, cfg.steps)
        bar = _progress(step, chunk_end, cfg.steps, progress)
        loss_sum = torch.zeros(())
        correct = scored = torch.zeros(())
        t0, first = time.perf_counter(), step
        for i in range(first, chunk_end):
            lr = cosine_lr(i, cfg.steps, cfg.warmup_steps, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = task.batch(cfg.batch_size, derived_generator(cfg.seed, i))
            logits = model(x).float()
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            mask = y != -100
            loss_sum += loss.detach()
            correct = correct + ((logits.detach().argmax(-1) == y) & mask).sum()
            scored = scored + mask.sum()
            if bar is not None:
                bar.set_postfix(loss=f"{loss_sum.item() / (i + 1 - first):.3f}",
                                acc=f"{float(correct) / max(1.0, float(scored)):.3f}")
                bar.update(1)
        step = chunk_end
        if bar is not None:
            bar.close()
        seconds = time.perf_counter() - t0
        if not math.isfinite(float(loss_sum)):
            raise NonFiniteLossError(f"step {step}: the training loss is not finite (lr {lr:.3g}); stopped without "
                                     f"overwriting {ckpt_path}, which holds the last good step ({first})")
        row = {"step": step, "lr": lr, "train_loss": float(loss_sum) / (step - first),
               "train_acc": float(correct) / max(1.0, float(scored)),
               "sequences_per_s": (step - first) * cfg.batch_size / seconds,
               "wall_s": wall_before + time.perf_counter() - run_start}
        row |= evaluate_sequences(model, held_x, held_y, 4 * cfg.batch_size)
        history = [*history, row]
        save_checkpoint(ckpt_path, {
            "config": cfg.to_dict(), "step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "history": history, "wall_s": row["wall_s"], "finished": step == cfg.steps,
            "init_fingerprint": fingerprint,
        })
        log.append(row)
    result = _result(cfg, task, history) | {"init_fingerprint": fingerprint}
    metadata = {"config": json.dumps(cfg.to_dict(), sort_keys=True), "init_fingerprint": fingerprint}
    save_weights(out / WEIGHTS, model.state_dict(), metadata)  # before result.json: a finished run has them
    write_json(result_path, result)
    return result


def _progress(first: int, last: int, total: int, enabled: bool):
    if not enabled:
        return None
    tqdm = require("tqdm", "the progress bar (progress=False or --no-progress turns it off)").tqdm
    return tqdm(total=last - first, desc=f"steps {first + 1}–{last}/{total}", leave=False, dynamic_ncols=True)


def _result(cfg: SequenceConfig, task, history: list[dict]) -> dict[str, Any]:
    last = history[-1] if history else {}
    return {"config": cfg.to_dict(), "kind": "sequence", "task": task.name, "task_options": task.options(),
            "seed": cfg.seed, "versions": _versions(), "steps_done": last.get("step", 0),
            "wall_s": last.get("wall_s", 0.0),
            "final": {k: v for k, v in last.items() if k.startswith("holdout_")}, "history": history}
