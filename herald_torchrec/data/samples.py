"""Host-side sample block shared by every data source, the scheduler and the trainer (numpy, no torch).

Single-hot features (one id per sample, e.g. Criteo's C1..C26) live in the dense int64 matrix `ids`; multi-hot
features (a variable-length bag of ids per sample, e.g. the tokens of a product title) live in `bags`, one jagged
`Bag` per feature, the same lengths + values layout as a KeyedJaggedTensor's, so that turning a block into a
torchrec `Batch` is a copy, not a loop. Empty bags (length 0) are allowed: a missing title is "no tokens".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Index = np.ndarray | slice


def _as_positions(index: Index, n: int) -> np.ndarray | slice:
    """A take index as int64 positions (boolean masks and fancy indices), or a step-1 slice left as it is."""
    if isinstance(index, slice):
        start, stop, step = index.indices(n)
        if step == 1:
            return slice(start, max(start, stop))
        return np.arange(start, stop, step, dtype=np.int64)
    idx = np.asarray(index)
    if idx.dtype == bool:
        if idx.shape != (n,):
            raise IndexError(f"boolean index of shape {idx.shape} for {n} samples")
        return np.flatnonzero(idx)
    idx = idx.astype(np.int64, copy=False).reshape(-1)
    return np.where(idx < 0, idx + n, idx)


@dataclass
class Bag:
    """One multi-hot feature over N samples: sample i holds values[offsets[i]:offsets[i] + lengths[i]]."""

    lengths: np.ndarray  # int64 [N], >= 0
    values: np.ndarray  # int64 [lengths.sum()]

    def __post_init__(self) -> None:
        if self.lengths.dtype != np.int64 or self.values.dtype != np.int64:
            raise TypeError(f"Bag lengths and values must be int64, got {self.lengths.dtype}, {self.values.dtype}")
        if self.lengths.ndim != 1 or self.values.ndim != 1:
            raise ValueError(f"Bag lengths and values must be 1-D, got {self.lengths.shape}, {self.values.shape}")
        total = int(self.lengths.sum())
        if total != self.values.shape[0] or (self.lengths.size and int(self.lengths.min()) < 0):
            raise ValueError(f"Bag: lengths (sum {total}, non-negative) must cover values ({self.values.shape[0]})")

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def offsets(self) -> np.ndarray:
        """int64 [N + 1]: where each sample's values start (and the end of the last one)."""
        out = np.zeros(self.lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out

    def take(self, index: Index) -> "Bag":
        pos = _as_positions(index, len(self))
        off = self.offsets
        if isinstance(pos, slice):  # contiguous: views, like numpy's basic slicing of `ids`
            return Bag(self.lengths[pos], self.values[off[pos.start] : off[pos.stop]])
        lengths = self.lengths[pos]
        starts = off[pos]
        new_off = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=new_off[1:])
        # value j of the result comes from starts[i] + (j - new_off[i]) for the sample i it belongs to
        src = np.arange(int(new_off[-1]), dtype=np.int64) + np.repeat(starts - new_off[:-1], lengths)
        return Bag(lengths, self.values[src])

    @staticmethod
    def concat(parts: list["Bag"]) -> "Bag":
        return Bag(np.concatenate([p.lengths for p in parts]), np.concatenate([p.values for p in parts]))


@dataclass
class Samples:
    """N samples: dense features, single-hot ids (int64 — ids never pass through float), labels and optional
    multi-hot bags keyed by feature name. A source's `feature_names` lists the `ids` columns first, then the bags."""

    dense: np.ndarray  # float32 [N, num_dense]
    ids: np.ndarray  # int64 [N, num_single_hot]
    labels: np.ndarray  # float32 [N]
    bags: dict[str, Bag] | None = None

    def __post_init__(self) -> None:
        if self.ids.dtype != np.int64:
            raise TypeError(f"Samples.ids must be int64, got {self.ids.dtype}")
        n = self.ids.shape[0]
        if self.dense.shape[0] != n or self.labels.shape[0] != n:
            raise ValueError(
                f"Samples: row counts differ (dense {self.dense.shape[0]}, ids {n}, labels {self.labels.shape[0]})"
            )
        for name, bag in (self.bags or {}).items():
            if len(bag) != n:
                raise ValueError(f"Samples: bag '{name}' has {len(bag)} samples, ids have {n}")

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def take(self, index: Index) -> "Samples":
        """The samples at `index` (a slice, int positions or a boolean mask), bags included."""
        bags = {k: b.take(index) for k, b in self.bags.items()} if self.bags else None
        return Samples(self.dense[index], self.ids[index], self.labels[index], bags)

    def copy(self) -> "Samples":
        """A block that owns its arrays (a slice of a large block would otherwise keep the whole block alive)."""
        bags = {k: Bag(b.lengths.copy(), b.values.copy()) for k, b in self.bags.items()} if self.bags else None
        return Samples(self.dense.copy(), self.ids.copy(), self.labels.copy(), bags)

    @staticmethod
    def concat(parts: list["Samples"]) -> "Samples":
        names = [sorted(p.bags) if p.bags else [] for p in parts]
        if any(n != names[0] for n in names):
            raise ValueError(f"Samples.concat: the parts have different bags: {names}")
        bags = {k: Bag.concat([p.bags[k] for p in parts]) for k in names[0]} if names[0] else None
        return Samples(
            np.concatenate([p.dense for p in parts]),
            np.concatenate([p.ids for p in parts]),
            np.concatenate([p.labels for p in parts]),
            bags,
        )
