"""Class-balanced subsets and held-out splits: exact balance, determinism, disjointness."""

import numpy as np
import pytest
import torch

from structinit.data import ArrayDataset, holdout_split, stable_permutation, stratified_subset


def indexed(counts):
    """Dataset whose image i encodes i (pixels i % 256, i // 256); class k has counts[k] images, interleaved."""
    labels = torch.cat([torch.full((c,), k) for k, c in enumerate(counts)])
    labels = labels[torch.from_numpy(stable_permutation(len(labels), 123))]  # classes interleaved
    i = torch.arange(len(labels))
    images = torch.stack([i % 256, i // 256], dim=1).to(torch.uint8).reshape(-1, 1, 1, 2)
    return ArrayDataset(images, labels, [str(k) for k in range(len(counts))], "indexed", (0.5,), (0.25,))


def ids(ds):
    return (ds.images[:, 0, 0, 0].long() + 256 * ds.images[:, 0, 0, 1].long()).tolist()


def test_stable_permutation_is_fixed():
    # pinned values: the subsets a seed picks must not change with numpy/torch versions
    assert stable_permutation(10, 0).tolist() == [3, 5, 7, 4, 1, 2, 8, 9, 6, 0]
    assert stable_permutation(10, 1).tolist() == [7, 0, 6, 8, 3, 1, 2, 9, 5, 4]
    assert sorted(stable_permutation(1000, 7).tolist()) == list(range(1000))


def test_stratified_subset_balance_and_determinism():
    ds = indexed([50] * 10)
    sub = stratified_subset(ds, 95, seed=0)
    counts = sub.class_counts().tolist()
    assert sum(counts) == 95 and sorted(counts) == [9] * 5 + [10] * 5
    assert ids(sub) == sorted(ids(sub))  # original order kept
    assert ids(stratified_subset(ds, 95, seed=0)) == ids(sub)
    assert ids(stratified_subset(ds, 95, seed=1)) != ids(sub)
    assert stratified_subset(ds, 100, seed=3).class_counts().tolist() == [10] * 10
    # nested: for one seed a bigger subset contains the smaller one
    assert set(ids(stratified_subset(ds, 40, seed=2))) <= set(ids(stratified_subset(ds, 77, seed=2)))
    assert len(set(ids(sub))) == 95


def test_stratified_subset_redistributes_a_short_class():
    ds = indexed([2, 30, 30])
    sub = stratified_subset(ds, 30, seed=0)
    assert sub.class_counts().tolist()[0] == 2 and sum(sub.class_counts().tolist()) == 30
    assert sorted(sub.class_counts().tolist()[1:]) == [14, 14]


@pytest.mark.parametrize(("size", "message"), [(501, "larger than the 500 images"), (9, "smaller than the 10 classes")])
def test_stratified_subset_rejects(size, message):
    with pytest.raises(ValueError, match=f"size={size}: {message}"):
        stratified_subset(indexed([50] * 10), size, seed=0)


def test_holdout_split_stratified_is_disjoint_and_covering():
    ds = indexed([40, 35, 25])
    train, held = holdout_split(ds, 30, seed=5)
    assert len(train) == 70 and held.class_counts().tolist() == [10, 10, 10]
    assert not set(ids(train)) & set(ids(held)) and set(ids(train)) | set(ids(held)) == set(range(100))
    assert ids(holdout_split(ds, 30, seed=5)[1]) == ids(held)
    assert ids(holdout_split(ds, 30, seed=6)[1]) != ids(held)


def test_holdout_split_last_takes_the_last_images():
    ds = indexed([20] * 5)
    train, held = holdout_split(ds, 25, mode="last")
    assert ids(train) == list(range(75)) and ids(held) == list(range(75, 100))
    assert held.mean == ds.mean and torch.equal(held.labels, ds.labels[75:])


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"holdout": 0}, ValueError, "holdout=0: expected 0 < holdout < 100"),
        ({"holdout": 100}, ValueError, "holdout=100"),
        ({"holdout": 10, "mode": "first"}, ValueError, "mode='first'"),
        ({"holdout": 2.5}, TypeError, "holdout=2.5: expected an int"),
    ],
)
def test_holdout_split_rejects(kw, error, message):
    with pytest.raises(error, match=message):
        holdout_split(indexed([50, 50]), **kw)


def test_subset_of_numpy_indices():
    ds = indexed([3, 3])
    assert ids(ds.subset(np.array([5, 0]))) == [5, 0]
