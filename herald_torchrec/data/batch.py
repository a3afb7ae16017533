"""Samples (numpy, host) -> TorchRec `Batch` (dense tensor, KeyedJaggedTensor, labels)."""

from __future__ import annotations

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from herald_torchrec.data.samples import Samples


def to_batch(samples: Samples, columns: list[int], keys: list[str]) -> Batch:
    """Single-hot ids of `columns` become a KJT with keys `keys` (one value per sample per key)."""
    n = len(samples)
    ids = np.ascontiguousarray(samples.ids[:, columns].T).reshape(-1)  # KJT layout: key-major
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.from_numpy(ids),
        lengths=torch.ones(n * len(keys), dtype=torch.int32),
    )
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(samples.dense)),
        sparse_features=kjt,
        labels=torch.from_numpy(np.ascontiguousarray(samples.labels)),
    )
