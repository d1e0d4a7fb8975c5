"""One optimisation step: the step every run takes, and the one the throughput benchmark times.

:class:`TrainStep` owns what a step changes: the optimiser (AdamW, fused on CUDA), the loss
scaler (fp16 only), the weight average (``ema_decay``) and the compiled or distributed view of
the model. Calling it with the step's index and batch sets the learning rate of the schedule,
runs forward under autocast, the task's loss, backward, gradient clipping and the update. It
reads nothing back from the device, so the host can queue the next batch while this one runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from structinit.harness.run.device import Placement
from structinit.harness.run.optim import EMA, cosine_lr, param_groups

__all__ = ["TrainStep"]


class TrainStep:
    """The step of a run of ``task`` (its ``cfg``) on ``model``, placed by ``where``, with
    autocast ``dtype`` (None: fp32), ``total`` steps and ``warmup`` warm-up steps.

    ``step(i, x, y)`` takes optimisation step ``i`` (0-based; it picks the learning rate) on
    input ``x`` and target ``y`` and returns ``(loss, logits)``, both detached and still on the
    device. ``model`` is the plain module (what is checkpointed and evaluated); ``net`` is what
    the step calls: the model wrapped for data parallelism and ``torch.compile`` when the run
    asks for them.
    """

    def __init__(self, model: nn.Module, task: Any, where: Placement, dtype: torch.dtype | None, total: int,
                 warmup: int):
        cfg, device = task.cfg, where.device
        self.model, self.task, self.cfg, self.dtype, self.device = model, task, cfg, dtype, device
        self.total, self.warmup = total, warmup
        # The fused kernel updates every tensor in one launch; on the CPU the default path is kept,
        # so that CPU runs stay bit-identical to those made before.
        fused = {"fused": True} if device.type == "cuda" else {}
        self.opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                     **fused)
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)
        self.ema = EMA(model, cfg.ema_decay) if cfg.ema_decay else None
        net = model
        if where.world > 1:
            ids = [device.index] if device.type == "cuda" else None
            net = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        mode = cfg.compile_mode
        self.net = torch.compile(net, mode=mode) if cfg.compile else net
        # CUDA graphs (reduce-overhead, max-autotune) write each step's outputs into the same memory: the
        # step marks where one step begins and hands back copies.
        self.graphs = cfg.compile and mode in ("reduce-overhead", "max-autotune") and device.type == "cuda"

    def lr(self, step: int) -> float:
        """The learning rate of step ``step``: warm-up, then cosine decay (:func:`cosine_lr`)."""
        return cosine_lr(step, self.total, self.warmup, self.cfg)

    def __call__(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lr = self.lr(step)
        for group in self.opt.param_groups:
            group["lr"] = lr
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            logits = self.net(x)
        if self.graphs:
            logits = logits.clone()
        loss = self.task.loss(logits, y)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.cfg.grad_clip:
            self.scaler.unscale_(self.opt)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        if self.ema is not None:
            self.ema.update(self.model)
        return loss.detach(), logits.detach()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the step beyond the model: optimiser, scaler and average."""
        return {"optimizer": self.opt.state_dict(), "scaler": self.scaler.state_dict(),
                "ema": None if self.ema is None else self.ema.state}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's :meth:`state`."""
        self.opt.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            self.ema.state = {k: v.to(self.device) for k, v in state["ema"].items()}
