"""The training loop every run shares, top to bottom in :func:`_train` and the helpers it calls
(nanoGPT / airbench style).

A run is a config and a :class:`Task`, which knows its data, its loss and its evaluation; the
loop does the rest the same way for every task: lock the run folder, resume from the last
checkpoint (refusing one that started from other initial weights, returning a finished run's
result), train in chunks, stop on a non-finite loss without overwriting the last good
checkpoint, write an atomic checkpoint and the metric log after every chunk, and export the
weights and the result at the end.

Every random choice comes from generators seeded by (seed, chunk or step, rank), so a resumed
run repeats exactly the computation it would have done: on CPU the final weights are
bit-identical to an uninterrupted run. Distributed data parallel runs under ``torchrun`` (gloo
on CPUs, NCCL on GPUs): each rank takes its share of every batch.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from structinit.harness.config import check_config
from structinit.harness.errors import NonFiniteLossError, RunIOError, user_input
from structinit.harness.run.checkpoint import (
    EMA_WEIGHTS,
    WEIGHTS,
    BackgroundWrites,
    MetricsLog,
    atomic_write_bytes,
    check_same_init,
    checkpoint_bytes,
    init_fingerprint,
    load_weights,
    result_digest,
    resume_state,
    run_id,
    save_weights,
    state_digest,
    write_json,
)
from structinit.harness.run.device import (
    Placement,
    describe_device,
    placement,
    precision_name,
    resolve_precision,
    versions,
)
from structinit.harness.run.folder import check_out_dir, comparison_in, inside_comparison, lock_run
from structinit.harness.run.step import TrainStep
from structinit.models import create_model
from structinit.schemes.plan import Plan
from structinit.schemes.registry import plan_init
from structinit.utils.optional_imports import require

__all__ = ["CHECKPOINT", "RESULT", "Chunk", "Task", "check_fits_image", "check_run", "construct_and_plan", "run_task"]

CHECKPOINT, RESULT = "checkpoint.pt", "result.json"


@dataclass(frozen=True)
class Chunk:
    """Steps [first, last) of a run, after which it checkpoints (and evaluates if ``evaluate``)."""

    number: int  # 1-based: the epoch, or the chunk of eval_every steps
    first: int
    last: int
    evaluate: bool
    full: bool = True  # evaluate every split; False: only those the task scores at every evaluation


class Task(Protocol):
    """What a run trains on; :mod:`structinit.harness.tasks` has the image and sequence tasks."""

    cfg: Any
    unit: str  # what a chunk is called in messages: "epoch", "step"
    free_fields: tuple[str, ...]  # config fields that change how it computes, not what: a resume may change them
    examples: str  # what a batch holds: "images", "sequences" (the row's <examples>_per_s)
    state_keys: tuple[str, ...]  # what its checkpoint must hold to resume
    added_fields: dict[str, Any]  # config fields added since older checkpoints: the value they ran with

    def check(self) -> str: ...  # its own checks that load nothing (input errors); the precision it runs in
    def model_sizes(self) -> dict[str, Any]: ...  # the model arguments the data decides, before prepare()
    def prepare(self, where: Placement) -> dict[str, Any]: ...  # load the data; the model arguments it decides
    def schedule(self) -> tuple[list[Chunk], int, int]: ...  # (the chunks, total steps, warm-up steps)
    def batches(self, chunk: Chunk, where: Placement) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...
    #   this rank's (input, target) of every step of the chunk, on the device
    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...
    def count(self, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]: ...
    #   (right predictions, scored predictions, the loss's weight in the chunk's mean)
    def evaluate(self, model: nn.Module, dtype, where: Placement, final: bool, robust: bool = True,
                 full: bool = True) -> dict: ...
    def row(self, chunk: Chunk) -> dict[str, Any]: ...  # what a metric row and checkpoint say beyond "step"
    def result(self, history: list[dict]) -> dict[str, Any]: ...  # its part of result.json, "final" among it


def run_task(task: Task, resume: bool = False, progress: bool = True, wait: bool = False) -> dict[str, Any]:
    """Train ``task`` as :func:`structinit.harness.tasks.train` trains a config (see there)."""
    where = placement()
    dtype = check_run(task, where)
    with lock_run(task.cfg.out_dir, wait=wait, enabled=where.writes):
        try:
            return _train(task, resume, progress, where, dtype)
        except RunIOError as err:  # one line: what failed, and that the run can go on from its checkpoint
            ckpt = Path(task.cfg.out_dir) / CHECKPOINT
            keep = (f"the last good checkpoint {ckpt} is kept: free some space (or fix the folder) and run again "
                    "with resume=True (--resume)") if ckpt.exists() else "no checkpoint was written yet"
            raise RunIOError(f"{err}; {keep}") from err.__cause__
        finally:  # a task's helpers (augmentation workers) end with its run, however it ends
            getattr(task, "close", lambda: None)()


def construct_and_plan(cfg, sizes: dict) -> tuple[nn.Module, Plan]:
    """``cfg.model`` built with ``sizes`` (what the data decides) and ``cfg.model_kwargs``,
    constructed under ``init_seed`` (construction draws from the global RNG, which is forked
    and restored), and ``cfg.init`` planned on it but not written (``plan.commit()`` does)."""

    kwargs = {**sizes, **cfg.model_kwargs}
    seed = cfg.seed if cfg.init_seed is None else cfg.init_seed
    with torch.random.fork_rng(devices=[]), user_input("model"):  # construction draws from the global RNG
        torch.manual_seed(seed)
        model = create_model(cfg.model, **kwargs)
    if "img_size" in kwargs:
        with user_input("model"):
            check_fits_image(cfg.model, model, kwargs["img_size"], kwargs.get("in_chans"))
    with user_input("init"):
        return model, plan_init(model, cfg.init, seed=seed, **cfg.init_options)


def check_fits_image(name: str, model: nn.Module, img_size: int | tuple[int, int], in_chans: int | None) -> None:
    """Refuse ``model`` (built as ``name``) when its first convolution on the image, a ViT's
    patch embedding or a ConvMixer's stem, is larger than the ``img_size`` image: it would make
    no token at all, which surfaces later as a riddle (an init's ``grid=(0, 0)``, a convolution's
    error in the first step). A ``ValueError`` naming the model and the ``model_kwargs`` that fix it."""
    first = next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)), None)
    if first is None or (in_chans is not None and first[1].in_channels != in_chans) or first[1].padding == "same":
        return
    where, conv = first
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    padding = (0, 0) if conv.padding == "valid" else conv.padding
    out = [(n + 2 * p - d * (k - 1) - 1) // s + 1
           for n, p, d, k, s in zip((h, w), padding, conv.dilation, conv.kernel_size, conv.stride)]
    if min(out) >= 1:
        return
    kh, kw = conv.kernel_size
    size = f"{kh}" if kh == kw else f"{kh}x{kw}"
    if conv.kernel_size != conv.stride:  # not a patch embedding: no patch_size to suggest
        raise ValueError(f"model={name!r} (--model): its first convolution, {where} ({size} kernel, stride "
                         f"{conv.stride[0]}), is larger than the {h}x{w} image and leaves nothing of it; choose a "
                         "model made for larger images, or set its size in model_kwargs (--set model_kwargs=…)")
    side = math.gcd(h, w)
    patch = max(p for p in range(1, side + 1) if side % p == 0 and (side // p >= 4 or p == 1))
    raise ValueError(f"model={name!r} (--model): its patch, {size} ({where}), is larger than the {h}x{w} image and "
                     f"leaves no token; pass a smaller patch_size in model_kwargs, e.g. model_kwargs={{'patch_size': "
                     f"{patch}}} (--set \"model_kwargs={{'patch_size': {patch}}}\")")


def check_run(task: Task, where: Placement) -> torch.dtype | None:
    """Every check of ``task``'s run that loads nothing, cheap ones first so that a typo never
    waits for a dataset: the folder, the config's fields (the init's name among them; its options
    are checked on the model, once the data says its size), the batch split over processes, the
    task's own checks; returns the autocast dtype (None: fp32)."""
    cfg = task.cfg
    with user_input("out_dir"):
        check_out_dir(cfg.out_dir)
        if why := comparison_in(cfg.out_dir):  # report and compare would read the run as one of its runs
            raise ValueError(f"out_dir={cfg.out_dir} is a comparison's folder ({why}); a run written there would "
                             "be mixed with the comparison's; choose another out_dir (--out)")
        if why := inside_comparison(cfg.out_dir, cfg.seed):
            raise ValueError(f"out_dir={cfg.out_dir} lies inside a comparison: {why}, whose report would count "
                             "this run as one of its own; choose another out_dir (--out)")
    check_config(cfg)
    with user_input("batch_size"):
        if cfg.batch_size % where.world:
            raise ValueError(f"batch_size={cfg.batch_size} is not divisible by the {where.world} processes")
    precision = task.check()
    with user_input("precision"):
        return resolve_precision(precision, where.device)


def _train(task: Task, resume: bool, progress: bool, where: Placement, dtype) -> dict[str, Any]:
    cfg, device = task.cfg, where.device
    out = Path(cfg.out_dir)
    ckpt_path = out / CHECKPOINT
    state = resume_state(ckpt_path, resume, cfg.to_dict(), task.state_keys, defaults=task.added_fields,
                         as_ran=lambda c: {**{k: v for k, v in c.items() if k not in task.free_fields},
                                           "precision": precision_name(resolve_precision(c["precision"], device))})
    model, plan = construct_and_plan(cfg, task.prepare(where))  # the one place a run's model is made
    plan.commit()
    fingerprint = init_fingerprint(model)
    if state is not None and (saved := _finished_run(task, where, state, fingerprint)) is not None:
        return saved
    model = model.to(device)
    chunks, total, warmup = task.schedule()
    train_step = TrainStep(model, task, where, dtype, total, warmup)
    done, history, wall_before, starts = _restore(state, model, train_step, chunks)
    log = MetricsLog(out, history) if where.writes else None
    if log is not None:
        log.flush()  # metric files agree with the checkpoint, even after a kill
    run_start = time.perf_counter()
    writes = BackgroundWrites()
    try:
        for chunk in (c for c in chunks if c.first >= done):
            row = _chunk_row(task, where, dtype, train_step, chunks, chunk, progress,
                             wall=lambda: wall_before + time.perf_counter() - run_start)
            history = [*history, row]
            if where.writes:
                # Serialised now (the next step changes the tensors), written while the next chunk trains; the
                # metrics follow the checkpoint, so that they are never ahead of it.
                blob = checkpoint_bytes({
                    "config": cfg.to_dict(), **task.row(chunk), "step": chunk.last, "model": model.state_dict(),
                    **train_step.state(), "history": history, "wall_s": row["wall_s"],
                    "finished": chunk is chunks[-1], "init_fingerprint": fingerprint, "starts": starts,
                })
                writes.submit(partial(_persist, ckpt_path, blob, log, row))
            if where.world > 1:
                torch.distributed.barrier()
    except BaseException:  # the chunk before is on disk, whole, before the error goes on
        writes.wait(raise_error=False)
        raise
    writes.wait()
    return _write_result(task, where, dtype, model, train_step.ema, history, fingerprint, starts)


def _finished_run(task: Task, where: Placement, state: dict, fingerprint: str) -> dict[str, Any] | None:
    """Resuming from ``state`` (a checkpoint of this run's init, else a ValueError): the result of
    a finished run whose result.json and exported weights are whole and its own, else None."""
    out = Path(task.cfg.out_dir)
    ckpt_path = out / CHECKPOINT
    with user_input("resume"):
        check_same_init(state, fingerprint, ckpt_path)
    if not state.get("finished"):
        return None
    saved = finished_result(out / RESULT)
    if (_is_this_run(saved, state, fingerprint, task.result(state["history"]))
            and _holds(out / WEIGHTS, state["model"])
            and (not task.cfg.ema_decay or (out / EMA_WEIGHTS).is_file())):
        return saved
    # The checkpoint holds the whole run: what is missing, unreadable or another run's is written again
    # from it below, with no step trained (the result's device and versions are then this machine's).
    if where.writes:
        print(f"{out}: the run is finished, but its result.json or exported weights are missing, "
              f"unreadable or not this run's; writing them again from {ckpt_path}", file=sys.stderr, flush=True)
    return None


def _restore(state: dict | None, model: nn.Module, train_step: TrainStep,
             chunks: list[Chunk]) -> tuple[int, list[dict], float, list[int]]:
    """(steps done, metric history, wall seconds before, starts) of a run, with the model and the
    training state loaded from ``state`` when it resumes."""
    done, history, wall_before = 0, [], 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        train_step.load_state(state)
        history, wall_before = state["history"], state["wall_s"]
        done = state["step"] if "step" in state else chunks[state["epoch"] - 1].last if state["epoch"] else 0
    # The step each process that trained this run started from: [0] for a run never stopped,
    # [0, 120] for one resumed from its step-120 checkpoint.
    starts = [*(state.get("starts", []) if state else []), done]
    return done, history, wall_before, starts


def _chunk_row(task: Task, where: Placement, dtype, train_step: TrainStep, chunks: list[Chunk], chunk: Chunk,
               progress: bool, wall) -> dict[str, Any]:
    """Train ``chunk``, evaluate if it says so, and return its metric row (``wall()``: the run's
    seconds so far, over every process that trained it)."""
    device, model = where.device, train_step.model
    loss_sum, right, scored = (torch.zeros((), device=device) for _ in range(3))
    weight = 0
    bar = _progress(chunk, len(chunks), task.unit, progress and where.writes)
    t0 = time.perf_counter()
    for step, (x, y) in zip(range(chunk.first, chunk.last), task.batches(chunk, where)):
        loss, logits = train_step(step, x, y)
        good, n, w = task.count(logits, y)
        loss_sum += loss * w
        right, scored, weight = right + good, scored + n, weight + w
        if bar is not None and (step % 10 == 9 or step == chunk.last - 1):
            bar.set_postfix(loss=f"{loss_sum.item() / weight:.3f}", acc=f"{right.item() / scored.item():.3f}")
            bar.update(step + 1 - chunk.first - bar.n)
    if bar is not None:
        bar.close()
    totals = where.all_reduce(torch.stack([loss_sum.double(), right.double(), scored.double(),
                                           torch.tensor(float(weight), dtype=torch.float64, device=device)]))
    totals = totals.cpu()  # waits for the chunk's last step: the time below is the device's too
    seconds = time.perf_counter() - t0
    lr = train_step.lr(chunk.last - 1)
    if not math.isfinite(float(totals[0])):
        raise NonFiniteLossError(
            f"{task.unit} {chunk.number} (steps {chunk.first + 1}–{chunk.last}): the training loss is not "
            f"finite (lr {lr:.3g}); stopped without overwriting {Path(task.cfg.out_dir) / CHECKPOINT}, which holds "
            f"the run up to step {chunk.first}")
    row = {**task.row(chunk), "step": chunk.last, "lr": lr, "train_loss": float(totals[0]) / float(totals[3]),
           "train_acc": float(totals[1]) / max(1.0, float(totals[2])),
           f"{task.examples}_per_s": (chunk.last - chunk.first) * task.cfg.batch_size / seconds, "wall_s": wall()}
    if chunk.evaluate:
        row |= task.evaluate(model, dtype, where, final=chunk is chunks[-1], full=chunk.full)
        if train_step.ema is not None:  # the averaged weights too, then the live ones back
            live = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model.load_state_dict(train_step.ema.state)
            scores = task.evaluate(model, dtype, where, False, robust=False, full=chunk.full)
            row |= {f"ema_{k}": v for k, v in scores.items() if k.endswith("_acc")}
            model.load_state_dict(live)
    return row


def _write_result(task: Task, where: Placement, dtype, model: nn.Module, ema, history: list[dict], fingerprint: str,
                  starts: list[int]) -> dict[str, Any]:
    """The finished run's result; written with its exported weights by the process that writes."""
    cfg, out = task.cfg, Path(task.cfg.out_dir)
    result = {"config": cfg.to_dict(), "seed": cfg.seed, "world_size": where.world, "versions": versions(),
              "precision": precision_name(dtype), "device": describe_device(where.device),
              "wall_s": history[-1]["wall_s"] if history else 0.0, "history": history,
              "init_fingerprint": fingerprint, "starts": starts, **task.result(history)}
    result["run_id"] = run_id(result["config"], fingerprint, result.get("data", {}), task.free_fields)
    result["weights_sha256"] = state_digest(model.state_dict(), by_name=True)
    result["result_sha256"] = result_digest(result)  # last: it covers every other entry
    if where.writes:  # the weights before result.json: a finished run always has them
        # The files timm and Hugging Face load from; their header holds the config (JSON), the init fingerprint,
        # the run's id and the structinit version, so the file alone says how it was made and by which run.
        metadata = {"config": json.dumps(cfg.to_dict(), sort_keys=True), "init_fingerprint": fingerprint,
                    "run_id": result["run_id"], "structinit_version": versions()["structinit"]}
        save_weights(out / WEIGHTS, model.state_dict(), metadata)
        if ema is not None:
            save_weights(out / EMA_WEIGHTS, ema.state, metadata)
        write_json(out / RESULT, result)
    return result


def _persist(ckpt_path: Path, blob: bytes, log: MetricsLog, row: dict) -> None:
    """Write a chunk's checkpoint (its bytes), then its metrics row."""
    atomic_write_bytes(ckpt_path, lambda f: f.write(blob))
    log.append(row)


def _is_this_run(saved: dict | None, state: dict, fingerprint: str, scores: dict) -> bool:
    """Whether a result.json is the one this checkpoint's run wrote: its history, init, seed and
    the scores read from that history (``scores``) are the checkpoint's (a file copied from
    another seed, or edited, is not)."""
    if saved is None or saved.get("history") != state["history"] or saved.get("init_fingerprint") != fingerprint:
        return False
    scores = json.loads(json.dumps(scores))  # as the file holds them: tuples are lists there
    return saved.get("seed") == state["config"].get("seed") and all(saved.get(k) == v for k, v in scores.items())


def _holds(path: Path, model_state: dict[str, torch.Tensor]) -> bool:
    """Whether the exported weights at ``path`` load and are the checkpoint's final weights (not a
    truncated file, nor another run's with the same init)."""
    try:
        tensors, _ = load_weights(path)
    except (OSError, ValueError, RunIOError):
        return False
    return tensors.keys() == model_state.keys() and all(
        torch.equal(tensors[k], v.detach().cpu()) for k, v in model_state.items())


def finished_result(path: Path) -> dict[str, Any] | None:
    """The result a finished run wrote at ``path``, or None when it is missing or is not one (not
    JSON, or lacking its config, final scores or history)."""
    try:
        result = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return result if isinstance(result, dict) and all(k in result for k in ("config", "final", "history")) else None


def _progress(chunk: Chunk, chunks: int, unit: str, enabled: bool):
    if not enabled:
        return None
    tqdm = require("tqdm", "the progress bar (progress=False or --no-progress turns it off)").tqdm
    where = f"epoch {chunk.number}/{chunks}" if unit == "epoch" else f"steps {chunk.first + 1}–{chunk.last}"
    return tqdm(total=chunk.last - chunk.first, desc=where, leave=False, dynamic_ncols=True)
