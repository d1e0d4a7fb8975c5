"""The synthetic sequence problems (copy, mqar) of structinit.data.sequence_tasks."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from structinit.data import (
    IGNORE_INDEX,
    SEQUENCE_PROBLEMS,
    CopyProblem,
    MQARProblem,
    make_sequence_problem,
    sequence_accuracy,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def oracle_logits(targets: torch.Tensor, vocab_size: int, wrong: bool = False) -> torch.Tensor:
    """One-hot logits of the targets (or of a wrong token) on scored positions, 0 elsewhere."""
    labels = targets.clamp(min=0)
    if wrong:
        labels = (labels + 1) % vocab_size
    return F.one_hot(labels, vocab_size).float()


def check_copy(problem: CopyProblem, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    n, length = inputs.shape[0], problem.length
    assert inputs.shape == targets.shape == (n, 2 * length) == (n, problem.seq_len)
    assert inputs.dtype == targets.dtype == torch.long
    assert inputs.min() >= 0 and inputs.max() < problem.vocab_size
    s = inputs[:, :length]
    assert s.max() < problem.vocab  # the alphabet never contains the separator
    assert (inputs[:, length] == problem.separator).all()
    assert torch.equal(inputs[:, length + 1:], s[:, :-1])  # teacher forcing on the copy
    assert (targets[:, :length] == IGNORE_INDEX).all()
    assert torch.equal(targets[:, length:], s)
    assert ((targets != IGNORE_INDEX).sum(1) == length).all()


def check_mqar(problem: MQARProblem, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    n, p, half = inputs.shape[0], problem.pairs, problem.vocab // 2
    assert inputs.shape == targets.shape == (n, problem.length) == (n, problem.seq_len)
    assert inputs.min() >= 0 and inputs.max() < problem.vocab_size
    keys, values = inputs[:, 0:2 * p:2], inputs[:, 1:2 * p:2]
    assert keys.min() >= 1 and keys.max() < half and values.min() >= half and values.max() < problem.vocab
    assert (keys.sort(1).values.diff(dim=1) > 0).all()  # distinct keys
    assert (values.sort(1).values.diff(dim=1) > 0).all()
    scored = targets != IGNORE_INDEX
    assert (scored.sum(1) == p).all()
    assert not scored[:, :2 * p].any()
    for i in range(n):
        pos = scored[i].nonzero().flatten()
        queried = inputs[i, pos]
        assert sorted(queried.tolist()) == sorted(keys[i].tolist())  # each key queried once
        pairing = dict(zip(keys[i].tolist(), values[i].tolist()))
        assert targets[i, pos].tolist() == [pairing[k] for k in queried.tolist()]
        if not problem.noise:  # the rest of the remainder is pad
            rest = torch.ones(problem.length, dtype=torch.bool)
            rest[: 2 * p] = False
            rest[pos] = False
            assert (inputs[i, rest] == 0).all()


def test_registry_and_defaults():
    assert SEQUENCE_PROBLEMS.names() == ["copy", "mqar"]
    copy, mqar = make_sequence_problem("copy"), make_sequence_problem("mqar")
    assert copy.options() == {"length": 32, "vocab": 16} and copy.name == "copy"
    assert (copy.vocab_size, copy.seq_len) == (17, 64)
    assert mqar.options() == {"pairs": 8, "length": 64, "vocab": 256, "noise": False} and mqar.name == "mqar"
    assert (mqar.vocab_size, mqar.seq_len) == (256, 64)
    for problem in (copy, mqar):
        json.dumps(problem.options())
        assert make_sequence_problem(problem.name, **problem.options()) == problem


def test_copy_batch_structure():
    problem = make_sequence_problem("copy", length=10, vocab=5)
    check_copy(problem, *problem.batch(32, gen(0)))


@pytest.mark.parametrize("noise", [False, True])
def test_mqar_batch_structure(noise):
    problem = make_sequence_problem("mqar", pairs=6, length=40, vocab=32, noise=noise)
    inputs, targets = problem.batch(32, gen(1))
    check_mqar(problem, inputs, targets)
    if noise:
        assert (inputs[:, 12:] != 0).float().mean() > 0.5


def test_mqar_query_order_and_positions_vary():
    problem = make_sequence_problem("mqar", pairs=4, length=32, vocab=64)
    inputs, targets = problem.batch(200, gen(2))
    positions = {tuple((targets[i] != IGNORE_INDEX).nonzero().flatten().tolist()) for i in range(200)}
    assert len(positions) > 100
    # the first query is not always the first key
    first = (targets != IGNORE_INDEX).int().argmax(1)
    first_key = inputs.gather(1, first[:, None]).flatten()
    assert 0.1 < (first_key == inputs[:, 0]).float().mean() < 0.5


@pytest.mark.parametrize("name,options", [("copy", dict(length=8, vocab=4)), ("mqar", dict(pairs=3, length=16))])
def test_determinism_by_generator(name, options):
    problem = make_sequence_problem(name, **options)
    a, b, c = problem.batch(16, gen(5)), problem.batch(16, gen(5)), problem.batch(16, gen(6))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    g = gen(5)  # a stream: consecutive batches differ
    assert not torch.equal(problem.batch(16, g)[0], problem.batch(16, g)[0])


@pytest.mark.parametrize("name,options", [("copy", dict(length=12, vocab=8)), ("mqar", dict(pairs=4, length=32))])
def test_heldout_fixed_and_apart_from_training_streams(name, options):
    problem = make_sequence_problem(name, **options)
    x, y = problem.heldout(64)
    x2, y2 = make_sequence_problem(name, **options).heldout(64, seed=0)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(problem.heldout(64, seed=1)[0], x)
    held = {tuple(row) for row in x.tolist()}
    for seed in range(20):  # the seeds a training loop would use
        train = problem.batch(64, gen(seed))[0]
        assert not torch.equal(train, x)
        assert held.isdisjoint(tuple(row) for row in train.tolist())


@pytest.mark.parametrize("name,options", [("copy", dict(length=6, vocab=4)), ("mqar", dict(pairs=3, length=16))])
def test_accuracy_oracle_and_wrong(name, options):
    problem = make_sequence_problem(name, **options)
    _, targets = problem.batch(20, gen(0))
    assert sequence_accuracy(oracle_logits(targets, problem.vocab_size), targets) == (1.0, 1.0)
    assert sequence_accuracy(oracle_logits(targets, problem.vocab_size, wrong=True), targets) == (0.0, 0.0)


def test_accuracy_partial():
    targets = torch.tensor([[IGNORE_INDEX, 1, 2], [0, IGNORE_INDEX, 1]])
    logits = oracle_logits(targets, 3)
    logits[1, 2] = F.one_hot(torch.tensor(0), 3).float()  # one of four scored positions wrong
    logits[0, 0] = F.one_hot(torch.tensor(2), 3).float()  # an unscored position: does not count
    assert sequence_accuracy(logits, targets) == (0.75, 0.5)


def test_accuracy_bad_input():
    with pytest.raises(ValueError, match="expected logits"):
        sequence_accuracy(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="no position"):
        sequence_accuracy(torch.zeros(2, 3, 4), torch.full((2, 3), IGNORE_INDEX))


@pytest.mark.parametrize("name,options,match", [
    ("copy", dict(length=0), "length=0"),
    ("copy", dict(vocab=1), "vocab=1"),
    ("copy", dict(length=3.0), "length=3.0"),
    ("copy", dict(pairs=3), "unknown option"),
    ("mqar", dict(pairs=5, length=19), "length=19.*4·pairs = 20"),
    ("mqar", dict(pairs=8, vocab=17), "vocab=17.*vocab ≥ 18"),
    ("mqar", dict(noise="yes"), "noise="),
    ("mqar", dict(pairs=True), "pairs=True"),
    ("nope", {}, "unknown sequence problem 'nope'"),
])
def test_bad_options_raise_clearly(name, options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make_sequence_problem(name, **options)


def test_bad_batch_arguments():
    problem = make_sequence_problem("copy")
    with pytest.raises(TypeError, match="generator=0"):
        problem.batch(4, 0)
    with pytest.raises(ValueError, match="n=0"):
        problem.batch(0, gen(0))
    with pytest.raises(ValueError, match="seed=-1"):
        problem.heldout(4, seed=-1)


def test_tasks_are_frozen():
    problem = make_sequence_problem("copy")
    with pytest.raises(AttributeError):
        problem.length = 3


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 40), vocab=st.integers(2, 50), pairs=st.integers(1, 10), seed=st.integers(0, 2**31))
def test_property_tasks(length, vocab, pairs, seed):
    copy = make_sequence_problem("copy", length=length, vocab=vocab)
    check_copy(copy, *copy.batch(3, gen(seed)))
    mqar_length, mqar_vocab = 4 * pairs + length, 2 * pairs + 2 + vocab
    mqar = make_sequence_problem("mqar", pairs=pairs, length=mqar_length, vocab=mqar_vocab, noise=bool(seed % 2))
    inputs, targets = mqar.batch(3, gen(seed))
    check_mqar(mqar, inputs, targets)
    assert sequence_accuracy(oracle_logits(targets, mqar.vocab_size), targets) == (1.0, 1.0)
