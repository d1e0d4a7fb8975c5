"""Sequence prediction: the task of a :class:`~structinit.harness.config.SequenceConfig` run,
trained on a synthetic problem of :mod:`structinit.data.sequence_tasks` (copying, multi-query
associative recall) that the config's ``task`` field names.

There is no dataset: every step draws a fresh batch from the problem's generator, seeded by
(seed, step), so a resumed run sees exactly the batches it would have seen. The held-out set
is fixed per problem configuration (the same for every training seed and init). A chunk of the
run is ``eval_every`` steps, after which it evaluates and checkpoints. Token accuracy is
scored on the answer positions only (targets of other positions are -100).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from structinit.data.sequence_tasks import make_sequence_problem, sequence_accuracy
from structinit.harness.config import SequenceConfig
from structinit.harness.errors import user_input
from structinit.harness.run.device import Placement
from structinit.harness.run.lifecycle import Chunk
from structinit.utils import derived_generator

__all__ = ["SequenceTask", "evaluate_sequences", "sequence_problem"]


def sequence_problem(cfg: SequenceConfig):
    """The problem ``cfg`` trains on (:func:`structinit.data.sequence_tasks.make_sequence_problem`
    of its ``task`` and ``task_options``); errors are input errors."""
    with user_input("task"):
        return make_sequence_problem(cfg.task, **cfg.task_options)


@torch.no_grad()
def evaluate_sequences(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int,
                       dtype=None) -> dict[str, float]:
    """Held-out token accuracy (over scored positions), exact-match rate (every scored position
    of an example right) and mean loss per scored token."""
    model.eval()
    correct = scored = exact = loss_sum = 0.0
    for start in range(0, len(inputs), batch_size):
        x, y = inputs[start:start + batch_size], targets[start:start + batch_size]
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(x).float()
        n_scored = float((y != -100).sum())
        token_acc, sequence_acc = sequence_accuracy(logits, y)
        correct += token_acc * n_scored
        scored += n_scored
        exact += sequence_acc * len(x)
        loss_sum += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"))
    model.train()
    return {"holdout_acc": correct / scored, "holdout_exact": exact / len(inputs), "holdout_loss": loss_sum / scored}


class SequenceTask:
    """Predict the answer tokens of generated sequences: a chunk is ``eval_every`` steps."""

    unit, examples = "step", "sequences"
    free_fields = ()
    state_keys = ("config", "step", "model", "optimizer", "history", "wall_s")
    added_fields: ClassVar[dict[str, Any]] = {"precision": "fp32", "compile": False, "ema_decay": None,
                                              "compile_mode": "default"}

    def __init__(self, cfg: SequenceConfig):
        self.cfg = cfg

    def check(self) -> str:
        self.problem = sequence_problem(self.cfg)
        return self.cfg.precision

    def model_sizes(self) -> dict[str, int]:
        problem = getattr(self, "problem", None) or sequence_problem(self.cfg)  # check() built it, if called first
        return {"vocab_size": problem.vocab_size, "max_len": problem.seq_len}

    def prepare(self, where: Placement) -> dict[str, int]:
        held_x, held_y = self.problem.heldout(self.cfg.heldout_size)
        self.held = held_x.to(where.device), held_y.to(where.device)
        return self.model_sizes()

    def schedule(self) -> tuple[list[Chunk], int, int]:
        cfg = self.cfg
        starts = range(0, cfg.steps, cfg.eval_every)
        chunks = [Chunk(i + 1, s, min(s + cfg.eval_every, cfg.steps), True) for i, s in enumerate(starts)]
        return chunks, cfg.steps, cfg.warmup_steps

    def batches(self, chunk: Chunk, where: Placement):
        for step in range(chunk.first, chunk.last):
            x, y = self.problem.batch(self.cfg.batch_size, derived_generator(self.cfg.seed, step))
            yield x[where.rank :: where.world].to(where.device), y[where.rank :: where.world].to(where.device)

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)

    def count(self, logits: torch.Tensor, y: torch.Tensor):
        mask = y != -100
        return ((logits.argmax(-1) == y) & mask).sum(), mask.sum(), 1

    def evaluate(self, model: nn.Module, dtype, where: Placement, final: bool, robust: bool = True,
                 full: bool = True) -> dict:
        return evaluate_sequences(model, *self.held, 4 * self.cfg.batch_size, dtype)

    def row(self, chunk: Chunk) -> dict[str, Any]:
        return {}

    def result(self, history: list[dict]) -> dict[str, Any]:
        last = history[-1] if history else {}
        return {"kind": "sequence", "task": self.problem.name, "task_options": self.problem.options(),
                "steps_done": last.get("step", 0),
                "final": {k: v for k, v in last.items() if k.startswith("holdout_")}}
