"""`fae`: FAE's hot/cold mini-batches over a replicated hot set (FAE, VLDB'22). Counting-only, exact.

* Hot set: `profile(batches)` counts the accesses of every row of every table in a prefix of the stream
  (`profile_fraction`, 5% by default; the simulator passes its first ceil(5% x steps) global batches) and keeps the
  `hot_budget` most accessed rows (rows per rank: every rank holds them all; default: the memory the caching
  policies get, sum over tables of ceil(cache_ratio x rows)). Without a `profile()` call the first `plan()`
  profiles the window it is given.
* A sample is hot iff all its ids are hot. `reorder(batches)` is FAE's input reordering: within a window of W
  global batches it moves the hot samples first and the cold ones after (each class in stream order) and cuts the
  result into W global batches — floor(H / N) purely hot ones, then the rest (the last hot samples join cold
  ones: a mixed batch is a cold batch). The `plan(batches)` interface plans one given global batch, so reordering
  is a step of the stream before it: the simulator applies `reorder` to each window of `window` batches
  (`--fae-window`) before building this policy's batches.
* A hot batch (every sample hot) reads the replicas (`hit`) and all-reduces the gradients of the hot rows it
  touched (`allreduce`). Any other batch is cold: every row, hot ones included, is read through its home
  (ROW_WISE: `hit` at home, `shared_value` + `shared_grad` elsewhere).
* Hot rows are synchronised only when the run switches: cold -> hot copies the hot rows cold batches updated from
  their home to every replica (`replica_sync`, R-1 rows each, with optimizer state); hot -> cold writes the hot
  rows hot batches updated back to their home copy, which costs no transfer (the home rank holds a replica too).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from herald_torchrec.schedule.baselines.replicated import ReplicaPolicyBase
from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.plan import ReplicaSync


class FaePolicy(ReplicaPolicyBase):
    name = "fae"

    def __init__(self, *args, window: int = 8, **kwargs) -> None:
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
            raise ValueError(f"fae: window must be an integer >= 1 (global batches reordered together), got {window!r}")
        self.window = int(window)
        super().__init__(*args, **kwargs)
        n = self.layout.total_rows
        self.hot_run = False  # the run in progress: False before the first hot batch
        self.dirty_rep = np.zeros(n, dtype=bool)  # hot rows updated through replicas since the last write-back
        self.dirty_home = np.zeros(n, dtype=bool)  # hot rows updated at home since the last copy to replicas
        self.hot_batches = 0

    def _choose(self, batches: list[GlobalBatch]) -> np.ndarray:
        counts = np.zeros(self.layout.total_rows, dtype=np.int64)
        for b in batches:
            counts += np.bincount(b.flat()[2], minlength=counts.shape[0])
        return self.top_rows(counts, self.hot_budget)

    def sample_hot(self, batch: GlobalBatch) -> np.ndarray:
        """bool [N]: samples all of whose ids are hot (a sample without ids is hot)."""
        smp, _, gid = batch.flat()
        cold = np.bincount(smp[~self.replicated[gid]], minlength=batch.num_samples)
        return cold == 0

    def reorder(self, batches: Sequence[GlobalBatch]) -> list[GlobalBatch]:
        """FAE's reordering of one window: hot samples first, then cold, same number of batches and samples."""
        batches = list(batches)
        if not batches:
            return []
        if not self.profiled:
            raise ValueError("fae: reorder() needs the hot set: call profile(batches) first")
        n = batches[0].num_samples
        if any(b.num_samples != n for b in batches):
            raise ValueError("fae: reorder() needs global batches of equal size")
        hot = np.concatenate([self.sample_hot(b) for b in batches])
        order = np.concatenate([np.flatnonzero(hot), np.flatnonzero(~hot)])
        big = concat_batches(batches)
        out = []
        for i, b in enumerate(batches):
            nb = big.take(order[i * n : (i + 1) * n])
            nb.index = b.index
            out.append(nb)
        return out

    def _replica_keys(self, batch: GlobalBatch, keys: np.ndarray) -> tuple[np.ndarray, ReplicaSync, dict]:
        hot_batch = bool(self.replicated[keys].all())
        sync = ReplicaSync()
        extra = {}
        if hot_batch:
            self.hot_batches += 1
            if not self.hot_run:  # cold -> hot: copy what cold batches changed to every replica
                rows = np.flatnonzero(self.dirty_home)
                sync.to_replicas_table, sync.to_replicas_row = self.rowset(rows)
                extra["replica_sync"] = (self.num_ranks - 1) * int(rows.shape[0])
                self.dirty_home[:] = False
                self.hot_run = True
            self.dirty_rep[keys] = True
            return np.ones(keys.shape[0], dtype=bool), sync, extra
        if self.hot_run:  # hot -> cold: write the replicas back home (local at the home rank)
            rows = np.flatnonzero(self.dirty_rep)
            sync.to_home_table, sync.to_home_row = self.rowset(rows)
            self.dirty_rep[:] = False
            self.hot_run = False
        self.dirty_home[keys[self.replicated[keys]]] = True
        return np.zeros(keys.shape[0], dtype=bool), sync, extra

    def describe(self) -> dict:
        d = super().describe()
        d.update({"window": self.window, "hot_batches": self.hot_batches})
        return d


def concat_batches(batches: Sequence[GlobalBatch]) -> GlobalBatch:
    """One GlobalBatch holding the samples of several (in order)."""
    first = batches[0]
    offs, vals = [], []
    for t in range(first.num_tables):
        o = [first.offsets[t]]
        shift = first.offsets[t][-1]
        for b in batches[1:]:
            o.append(b.offsets[t][1:] + shift)
            shift += b.offsets[t][-1]
        offs.append(np.concatenate(o))
        vals.append(np.concatenate([b.values[t] for b in batches]))
    return GlobalBatch(offs, vals, first.layout, first.index)
