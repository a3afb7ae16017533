"""`p2res`: P²RES's two-fold parallelism (PPoPP'24 poster). Counting-only, exact (0 stale reads).

A performance model picks the rows every rank replicates, once, from a profiled prefix of the stream
(`profile(batches)`; the simulator passes its first ceil(`profile_fraction` x steps) global batches, 5% by
default; without the call the first `plan()` profiles its window). Per row k, per step of the prefix, under the
contiguous split and the ROW_WISE home:
  * expected all-to-all traffic `a2a[k] = 2 x E[lookups of k by samples not on its home rank]` — TorchRec's
    ROW_WISE all-to-all sends a value per remote lookup and gets its gradient back, which is what P²RES models;
  * all-reduce cost `ar[k] = 2 (R-1) x P(k is read in a step)` — the volume of a ring all-reduce of one row.
Rows with `a2a > ar` are replicated, largest `a2a - ar` first, at most `hot_budget` of them (rows per rank; default
the memory the caching policies get). Every step a replicated row is read locally by every reader (`hit`) and its
gradient is all-reduced (`allreduce`, when some sample read it); the other rows are read from their home rank.

Note the counters of every policy here count one value per distinct (key, reader) pair (readers deduplicate), not
per lookup, so the rows the model replicates because many samples of a rank read them can cost more counted rows
(2 (R-1) per step) than the home path would (2 per remote reader rank): the model is P²RES's, the accounting is
the simulator's.
"""

from __future__ import annotations

import numpy as np

from herald_torchrec.schedule.baselines.replicated import ReplicaPolicyBase
from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.plan import ReplicaSync


class P2resPolicy(ReplicaPolicyBase):
    name = "p2res"

    def model(self, batches: list[GlobalBatch]) -> tuple[np.ndarray, np.ndarray]:
        """(a2a, ar) per global row: expected all-to-all traffic and all-reduce cost per step, in rows."""
        n = self.layout.total_rows
        remote = np.zeros(n, dtype=np.int64)
        touched = np.zeros(n, dtype=np.int64)
        for b in batches:
            smp, _, gid = b.flat()
            rank = smp // self.batch_per_rank
            remote += np.bincount(gid[rank != self.home[gid]], minlength=n)
            touched[np.unique(gid)] += 1
        steps = len(batches)
        return 2.0 * remote / steps, 2.0 * (self.num_ranks - 1) * touched / steps

    def _choose(self, batches: list[GlobalBatch]) -> np.ndarray:
        a2a, ar = self.model(batches)
        return self.top_rows(a2a - ar, self.hot_budget)

    def _replica_keys(self, batch: GlobalBatch, keys: np.ndarray) -> tuple[np.ndarray, ReplicaSync, dict]:
        return self.replicated[keys], ReplicaSync(), {}
