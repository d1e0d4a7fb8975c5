"""Datasets as whole splits in memory (uint8 tensors), with verified downloads and deterministic splits.

    from structinit.data import load_dataset, holdout_split, stratified_subset
    train = load_dataset("cifar10", root="data", download=True)      # images uint8 (50000, 3, 32, 32)
    pool, test = holdout_split(train, 10_000, mode="last")            # lossless test set: batch 5
    small = stratified_subset(pool, 4_000, seed=0)                    # 400 images per class
"""

from structinit.data.datasets import (
    DATASET_STATS,
    ArrayDataset,
    DatasetFormatError,
    DatasetNotFoundError,
    channel_stats,
)
from structinit.data.download import SOURCES, DownloadError, RemoteFile, Source, download
from structinit.data.registry import DATASET_LOADERS, DATASETS, DatasetLoader, default_root, load_dataset
from structinit.data.sequence_tasks import (
    IGNORE_INDEX,
    SEQUENCE_PROBLEMS,
    CopyProblem,
    MQARProblem,
    SequenceProblem,
    make_sequence_problem,
    sequence_accuracy,
)
from structinit.data.splits import holdout_split, stable_permutation, stratified_indices, stratified_subset

__all__ = [
    "ArrayDataset", "load_dataset", "DATASETS", "DATASET_LOADERS", "DatasetLoader", "DATASET_STATS", "default_root",
    "channel_stats",
    "stratified_subset", "stratified_indices", "holdout_split", "stable_permutation",
    "download", "SOURCES", "Source", "RemoteFile",
    "DatasetFormatError", "DatasetNotFoundError", "DownloadError",
    "SEQUENCE_PROBLEMS", "SequenceProblem", "CopyProblem", "MQARProblem", "make_sequence_problem", "sequence_accuracy",
    "IGNORE_INDEX",
]  # fmt: skip
