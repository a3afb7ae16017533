"""What every data source gives the trainer and the scheduler: chronological *global* batches of `Samples`.

Why global batches: every rank sees the same global batch stream (rank r trains rows [r*B, (r+1)*B) unless a
scheduler permutes them), so all ranks run out of data at the same step and the scheduler can be run on every rank
without broadcasting anything. Incomplete trailing global batches are dropped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator

from herald_torchrec.data.samples import Samples
from herald_torchrec.data.synthetic import SyntheticCTR, SyntheticSpec


class DataSource(ABC):
    feature_names: list[str]  # the single-hot `Samples.ids` columns in order, then the bag features
    bag_features: tuple[str, ...] = ()  # multi-hot features (`Samples.bags`), the tail of feature_names
    table_rows: list[int]
    num_dense: int

    @abstractmethod
    def train_batches(self, global_batch: int) -> Iterator[Samples]:
        """One pass (epoch) over the training split, in log order."""

    @abstractmethod
    def val_batches(self, global_batch: int) -> Iterator[Samples]:
        """The held-out split, in log order."""

    def train_slices(self, global_batch: int, lo: int, hi: int) -> Iterator[Samples]:
        """Samples [lo, hi) of each training global batch (one rank's slice). A source that can make a slice on its
        own (the synthetic log) overrides this, so a rank does not build the whole global batch to keep 1/R of it."""
        return (b.take(slice(lo, hi)) for b in self.train_batches(global_batch))

    def val_slices(self, global_batch: int, lo: int, hi: int) -> Iterator[Samples]:
        """Samples [lo, hi) of each held-out global batch."""
        return (b.take(slice(lo, hi)) for b in self.val_batches(global_batch))

    def describe(self) -> dict:
        return {"features": len(self.feature_names), "rows": int(sum(self.table_rows)), "dense": self.num_dense}


class SyntheticSource(DataSource):
    """The embedded default: `SyntheticCTR`, with an epoch of `epoch_batches` global batches."""

    def __init__(self, spec: SyntheticSpec, epoch_batches: int = 1000, val_batches: int = 20) -> None:
        if epoch_batches < 1 or val_batches < 1:
            raise ValueError(
                f"synthetic: epoch_batches and val_batches must be >= 1, got {epoch_batches}, {val_batches}"
            )
        self.gen = SyntheticCTR(spec)
        self.feature_names = self.gen.feature_names
        self.table_rows = self.gen.table_rows
        self.num_dense = self.gen.num_dense
        self.epoch_batches = epoch_batches
        self.num_val = val_batches

    def train_batches(self, global_batch: int) -> Iterator[Samples]:
        return self.train_slices(global_batch, 0, global_batch)

    def val_batches(self, global_batch: int) -> Iterator[Samples]:
        return self.val_slices(global_batch, 0, global_batch)

    def train_slices(self, global_batch: int, lo: int, hi: int) -> Iterator[Samples]:
        it = self.gen.train_indices()
        for _ in range(self.epoch_batches):
            yield self.gen.batch_slice(next(it), global_batch, lo, hi)

    def val_slices(self, global_batch: int, lo: int, hi: int) -> Iterator[Samples]:
        for i in self.gen.val_indices(self.num_val):
            yield self.gen.batch_slice(i, global_batch, lo, hi)
