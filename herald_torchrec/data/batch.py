"""Samples (numpy, host) -> TorchRec `Batch` (dense tensor, KeyedJaggedTensor, labels).

Keys are resolved by name against the source's `feature_names` (single-hot `ids` columns first, then the bags), so
a model that reads a subset of the features, in any order, gets exactly its keys. The KJT is built in TorchRec's
own layout: values key-major (all of key 0's samples, then key 1's, ...), int64, one length per (key, sample).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from herald_torchrec.data.samples import Samples


def _feature_arrays(samples: Samples, key: str, source_features: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(lengths int32 [N], values int64) of one feature of `samples`."""
    bags = samples.bags or {}
    if key in bags:
        bag = bags[key]
        return bag.lengths.astype(np.int32), bag.values
    names = list(source_features)
    if key not in names:
        raise ValueError(f"to_batch: key '{key}' is not a feature of the source {names}")
    col = names.index(key)
    if col >= samples.ids.shape[1]:
        raise ValueError(
            f"to_batch: key '{key}' is feature {col} of {names}, past the {samples.ids.shape[1]} single-hot id "
            f"columns, and the samples have no bag of that name (bags: {sorted(bags)})"
        )
    return np.ones(len(samples), dtype=np.int32), samples.ids[:, col]


def to_batch(samples: Samples, keys: Sequence[str] | Sequence[int], source_features: Sequence[str]) -> Batch:
    """A torchrec `Batch` whose KJT holds `keys` (each an ids column or a bag of `samples`, found by name in
    `source_features`), one length per sample per key; empty bags give length 0.

    Compatibility: the older call `to_batch(samples, columns, keys)` (column indices into `samples.ids`, then the
    KJT keys) is still accepted until every caller passes names."""
    keys = list(keys)
    if keys and all(isinstance(k, (int, np.integer)) for k in keys):  # legacy (columns, keys): single-hot only
        columns, keys = [int(k) for k in keys], list(source_features)
        if len(columns) != len(keys):
            raise ValueError(f"to_batch: {len(columns)} columns but {len(keys)} keys")
        n = len(samples)
        lengths = [np.ones(n * len(keys), dtype=np.int32)]
        values = [np.ascontiguousarray(samples.ids[:, columns].T).reshape(-1)]
    else:
        pairs = [_feature_arrays(samples, k, source_features) for k in keys]
        lengths, values = [p[0] for p in pairs], [p[1] for p in pairs]
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.from_numpy(np.concatenate(values) if values else np.zeros(0, np.int64)),
        lengths=torch.from_numpy(np.concatenate(lengths) if lengths else np.zeros(0, np.int32)),
    )
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(samples.dense)),
        sparse_features=kjt,
        labels=torch.from_numpy(np.ascontiguousarray(samples.labels)),
    )
