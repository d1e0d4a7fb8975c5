"""Synthetic sequence problems for sequence models (the experiments on the mimetic init of Mamba):
what a sequence run trains on, the one its config's ``task`` field names.

Each problem draws whole batches of token sequences on the CPU from a ``torch.Generator`` (no
Python loop per token or per example), for next-token training with ``ignore_index=-100``:
``copy`` (:class:`CopyProblem`; Jelassi et al. 2024, "Repeat After Me") and ``mqar``
(:class:`MQARProblem`; Arora et al. 2023, Zoology).

    from structinit.data import make_sequence_problem, sequence_accuracy
    problem = make_sequence_problem("copy", length=32, vocab=16)
    inputs, targets = problem.batch(64, torch.Generator().manual_seed(0))   # (64, 64) each
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    val_inputs, val_targets = problem.heldout(1000)                          # the same for every seed
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from structinit.utils import Registry, check_int, check_options, derived_generator
from structinit.utils.checks import check_bool
from structinit.utils.seeding import check_generator

__all__ = ["IGNORE_INDEX", "SEQUENCE_PROBLEMS", "CopyProblem", "MQARProblem", "SequenceProblem",
           "make_sequence_problem", "sequence_accuracy"]

IGNORE_INDEX = -100  # targets that are not scored (torch's cross_entropy default)
_HELDOUT_KEY = 0x5E9_4E1D  # derived_generator(_HELDOUT_KEY, seed): never a plain manual_seed(s) stream

SEQUENCE_PROBLEMS: Registry[type] = Registry("sequence problem")


def _permutations(n: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """(n, size) LongTensor: an independent uniform random permutation of ``range(size)`` per row."""
    return torch.rand(n, size, generator=generator).argsort(dim=1)


class SequenceProblem:
    """The interface every problem follows (a frozen dataclass of its options, validated on creation).

    Attributes:
        name: the registry name.
        vocab_size: the number of token ids, specials included (the model's embedding size).
        seq_len: the length L of a model input.
    """

    name: str = ""

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def seq_len(self) -> int:
        raise NotImplementedError

    def _draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def batch(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` fresh examples: (inputs, targets), LongTensors of shape (n, seq_len) on the CPU;
        targets are ``IGNORE_INDEX`` (−100) where nothing is scored.

        Examples:
            >>> problem = make_sequence_problem("copy", length=4, vocab=3)
            >>> inputs, targets = problem.batch(2, torch.Generator().manual_seed(0))
            >>> inputs.shape, int((targets != -100).sum())
            (torch.Size([2, 8]), 8)
        """
        n = check_int("n", n, low=1)
        return self._draw(n, check_generator(generator, f"{self.name}.batch"))

    def heldout(self, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed held-out set of ``n`` examples, the same for every training seed.

        It is drawn from ``derived_generator(key, seed)`` with a fixed key, a stream that no
        ``torch.Generator().manual_seed(s)`` used for training batches shares.
        """
        n = check_int("n", n, low=1)
        seed = check_int("seed", seed, low=0)
        return self._draw(n, derived_generator(_HELDOUT_KEY, seed))

    def options(self) -> dict[str, Any]:
        """The problem's options as a JSON-able dict (``make_sequence_problem(problem.name,
        **problem.options())`` rebuilds it)."""
        return dataclasses.asdict(self)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        raise NotImplementedError


@SEQUENCE_PROBLEMS.register("copy")
@dataclass(frozen=True)
class CopyProblem(SequenceProblem):
    """Copying (Jelassi et al. 2024): ``s  SEP  s`` with s a uniform random string.

    Tokens 0 … vocab−1 are the alphabet and ``vocab`` is the separator, so ``vocab_size =
    vocab + 1``. The full sequence has 2·length + 1 tokens; ``inputs = seq[:-1]`` and
    ``targets = seq[1:]`` (``seq_len = 2·length``) with every target before the separator
    set to −100, so exactly ``length`` positions are scored: at input position length + i the
    target is s[i].

    Args:
        length: the string length (≥ 1).
        vocab: the alphabet size (≥ 2).

    Examples:
        >>> problem = CopyProblem(length=3, vocab=5)
        >>> x, y = problem.batch(1, torch.Generator().manual_seed(0))
        >>> bool((y[0, 3:] == x[0, :3]).all()) and bool((y[0, :3] == -100).all())
        True
    """

    length: int = 32
    vocab: int = 16
    name = "copy"

    def _validate(self) -> None:
        check_int("length", self.length, low=1)
        check_int("vocab", self.vocab, low=2)

    @property
    def vocab_size(self) -> int:
        return self.vocab + 1

    @property
    def seq_len(self) -> int:
        return 2 * self.length

    @property
    def separator(self) -> int:
        """The separator token id (= vocab)."""
        return self.vocab

    def _draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.randint(self.vocab, (n, self.length), generator=generator)
        sep = torch.full((n, 1), self.separator, dtype=torch.long)
        inputs = torch.cat([s, sep, s[:, :-1]], dim=1)
        targets = torch.cat([torch.full((n, self.length), IGNORE_INDEX, dtype=torch.long), s], dim=1)
        return inputs, targets


@SEQUENCE_PROBLEMS.register("mqar")
@dataclass(frozen=True)
class MQARProblem(SequenceProblem):
    """Multi-query associative recall (Zoology, Arora et al. 2023).

    Token 0 is the pad token; keys come from [1, vocab//2) and values from [vocab//2, vocab)
    (disjoint halves, as in Zoology), so ``vocab_size = vocab``. An input of ``seq_len =
    length`` tokens is ``k₁ v₁ k₂ v₂ … k_p v_p`` (p = pairs distinct keys, distinct values)
    followed by the remainder, in which each key appears once as a query, in a random order and
    at uniformly random distinct positions. The target at a query position is that key's value
    (the next token the model must predict); every other target is −100, so exactly ``pairs``
    positions are scored. The rest of the remainder is token 0, or with ``noise=True`` (Zoology's
    ``random_non_queries``) uniform random tokens from the whole vocabulary, never scored.

    Args:
        pairs: the number of key–value pairs p (≥ 1).
        length: the input length; needs 4·pairs ≤ length (Zoology's constraint: the pairs take
            2·pairs tokens and the queries the rest).
        vocab: the vocabulary size; needs vocab//2 − 1 ≥ pairs keys and vocab − vocab//2 ≥ pairs
            values.
        noise: fill non-query positions of the remainder with random tokens instead of 0.

    Examples:
        >>> problem = MQARProblem(pairs=2, length=8, vocab=16)
        >>> x, y = problem.batch(1, torch.Generator().manual_seed(0))
        >>> keys, values = x[0, 0:4:2], x[0, 1:4:2]
        >>> answered = {int(x[0, t]): int(y[0, t]) for t in range(8) if y[0, t] != -100}
        >>> answered == dict(zip(keys.tolist(), values.tolist()))
        True
    """

    pairs: int = 8
    length: int = 64
    vocab: int = 256
    noise: bool = False
    name = "mqar"

    def _validate(self) -> None:
        check_int("pairs", self.pairs, low=1)
        check_int("length", self.length, low=1)
        check_int("vocab", self.vocab, low=1)
        check_bool("noise", self.noise)
        if 4 * self.pairs > self.length:
            raise ValueError(f"length={self.length}: mqar needs length ≥ 4·pairs = {4 * self.pairs} "
                             f"(2·pairs tokens of pairs, then room for the queries); raise length or lower pairs")
        need = 2 * self.pairs + 2  # keys from [1, vocab//2) and values from [vocab//2, vocab)
        if self.vocab // 2 - 1 < self.pairs:
            raise ValueError(f"vocab={self.vocab}: mqar draws pairs={self.pairs} distinct keys from "
                             f"[1, vocab//2) and distinct values from [vocab//2, vocab); use vocab ≥ {need}")

    @property
    def vocab_size(self) -> int:
        return self.vocab

    @property
    def seq_len(self) -> int:
        return self.length

    def _draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        p, half = self.pairs, self.vocab // 2
        keys = _permutations(n, half - 1, generator)[:, :p] + 1  # distinct, in [1, half)
        values = _permutations(n, self.vocab - half, generator)[:, :p] + half  # distinct, in [half, vocab)
        context = torch.stack([keys, values], dim=2).reshape(n, 2 * p)  # k1 v1 k2 v2 …
        rest = self.length - 2 * p
        where = _permutations(n, rest, generator)[:, :p] + 2 * p  # query position of key j, distinct
        inputs = (torch.randint(self.vocab, (n, self.length), generator=generator) if self.noise
                  else torch.zeros(n, self.length, dtype=torch.long))
        inputs[:, : 2 * p] = context
        inputs.scatter_(1, where, keys)
        targets = torch.full((n, self.length), IGNORE_INDEX, dtype=torch.long)
        targets.scatter_(1, where, values)
        return inputs, targets


def make_sequence_problem(name: str, **options: Any) -> SequenceProblem:
    """The problem ``name`` (one of ``SEQUENCE_PROBLEMS``: ``copy``, ``mqar``) with ``options``.

    Examples:
        >>> problem = make_sequence_problem("mqar", pairs=4, length=32, vocab=64)
        >>> problem.vocab_size, problem.seq_len, problem.options()
        (64, 32, {'pairs': 4, 'length': 32, 'vocab': 64, 'noise': False})
    """
    cls = SEQUENCE_PROBLEMS.get(name)
    check_options(cls, options, f"make_sequence_problem({name!r})", valid=[f.name for f in dataclasses.fields(cls)])
    return cls(**options)


def sequence_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """(token accuracy, sequence accuracy) of argmax predictions on the scored positions.

    Args:
        logits: (n, L, vocab) model outputs.
        targets: (n, L) LongTensor, ``IGNORE_INDEX`` (−100) where nothing is scored.

    Returns:
        The fraction of scored positions predicted right, and the fraction of examples whose
        every scored position is right (an example without scored positions counts as right).

    Examples:
        >>> targets = torch.tensor([[-100, 1], [2, 0]])
        >>> sequence_accuracy(torch.nn.functional.one_hot(targets.clamp(min=0), 3).float(), targets)
        (1.0, 1.0)
    """
    if logits.ndim != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"logits of shape {tuple(logits.shape)} and targets of shape {tuple(targets.shape)}: "
                         "expected logits (n, L, vocab) and targets (n, L)")
    scored = targets != IGNORE_INDEX
    total = int(scored.sum())
    if total == 0:
        raise ValueError("targets score no position (all are -100); pass the targets of a problem's batch")
    right = (logits.argmax(dim=-1) == targets) & scored
    token = right.sum().item() / total
    sequence = (right | ~scored).all(dim=1).double().mean().item()
    return token, sequence
