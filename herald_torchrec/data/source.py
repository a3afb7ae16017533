"""What every data source gives the trainer and the scheduler: chronological *global* batches of `Samples`.

Why global batches: every rank sees the same global batch stream (rank r trains rows [r*B, (r+1)*B) unless a
scheduler permutes them), so all ranks run out of data at the same step and the scheduler can be run on every rank
without broadcasting anything. Incomplete trailing global batches are dropped.

Why the training split is a stream of samples first: every source splits its data per sample (the synthetic log by
fixed blocks of samples, the file loaders by a hash of the data row), and an epoch's training global batches are
consecutive cuts of that epoch's training samples. `train_batches(g, start)` starts the cuts at training sample
`start` of the epoch, so a resumed run can continue after exactly the samples a checkpoint trained, at any global
batch. A global batch never spans two epochs (each epoch's incomplete tail is dropped).
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
    def train_batches(self, global_batch: int, start: int = 0) -> Iterator[Samples]:
        """One pass (epoch) over the training split, in log order, from its training sample `start`: consecutive
        global batches of its samples start, start+1, ... (the incomplete tail dropped)."""

    @abstractmethod
    def val_batches(self, global_batch: int) -> Iterator[Samples]:
        """The held-out split, in log order."""

    def train_slices(self, global_batch: int, lo: int, hi: int, start: int = 0) -> Iterator[Samples]:
        """Samples [lo, hi) of each training global batch of `train_batches(global_batch, start)` (one rank's
        slice). A source that can make a slice on its own (the synthetic log) overrides this, so a rank does not build
        the whole global batch to keep 1/R of it."""
        return (b.take(slice(lo, hi)) for b in self.train_batches(global_batch, start))

    def val_slices(self, global_batch: int, lo: int, hi: int) -> Iterator[Samples]:
        """Samples [lo, hi) of each held-out global batch."""
        return (b.take(slice(lo, hi)) for b in self.val_batches(global_batch))

    def describe(self) -> dict:
        return {"features": len(self.feature_names), "rows": int(sum(self.table_rows)), "dense": self.num_dense}


class SyntheticSource(DataSource):
    """The embedded default: `SyntheticCTR`, with an epoch of `epoch_batches` blocks of `spec.val_block` training
    samples and `val_batches` held-out blocks evaluated (at the default global batch, a block is a global batch)."""

    def __init__(self, spec: SyntheticSpec, epoch_batches: int = 1000, val_batches: int = 20) -> None:
        if epoch_batches < 1 or val_batches < 1:
            raise ValueError(
                f"synthetic: epoch_batches and val_batches must be >= 1, got {epoch_batches}, {val_batches}"
            )
        self.gen = SyntheticCTR(spec)
        self.feature_names = self.gen.feature_names
        self.table_rows = self.gen.table_rows
        self.num_dense = self.gen.num_dense
        self.epoch_samples = epoch_batches * spec.val_block  # training samples per epoch
        self.val_total = val_batches * spec.val_block  # held-out samples evaluated

    def train_batches(self, global_batch: int, start: int = 0) -> Iterator[Samples]:
        return self.train_slices(global_batch, 0, global_batch, start)

    def val_batches(self, global_batch: int) -> Iterator[Samples]:
        return self.val_slices(global_batch, 0, global_batch)

    def train_slices(self, global_batch: int, lo: int, hi: int, start: int = 0) -> Iterator[Samples]:
        _check_cut(global_batch, lo, hi, start)
        for first in range(start, self.epoch_samples - global_batch + 1, global_batch):
            yield self.gen.train_samples(first + lo, hi - lo)

    def val_slices(self, global_batch: int, lo: int, hi: int) -> Iterator[Samples]:
        _check_cut(global_batch, lo, hi, 0)
        for first in range(0, self.val_total - global_batch + 1, global_batch):
            yield self.gen.val_samples(first + lo, hi - lo)


def _check_cut(global_batch: int, lo: int, hi: int, start: int) -> None:
    if global_batch < 1 or not 0 <= lo <= hi <= global_batch or start < 0:
        raise ValueError(
            f"synthetic: need global_batch >= 1, 0 <= lo <= hi <= global_batch and start >= 0, got "
            f"global_batch={global_batch}, lo={lo}, hi={hi}, start={start}"
        )
