"""`het_bsp`: HET's embedding cache with staleness bound 0 (the Herald paper's baseline). Counting-only.

Contiguous split; per worker and table an LRU cache of ceil(cache_ratio x rows) rows; every update is pushed every
step (pending updates > s = 0), a read pulls when the row is not cached (`miss_pull`) or the PS has a newer version
than the cached copy (`update_pull`). See `schedule.cache` for the exact model.
"""

from __future__ import annotations

import numpy as np

from herald_torchrec.schedule.batch import GlobalBatch
from herald_torchrec.schedule.cache import WorkerCaches
from herald_torchrec.schedule.directory import home_blocks
from herald_torchrec.schedule.plan import Plan, ReadVersions
from herald_torchrec.schedule.policy import CACHE_KINDS, SchedulePolicy, split_gid


class CachePolicyBase(SchedulePolicy):
    executable = False
    kinds = CACHE_KINDS
    push_all = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        rows = np.array(self.layout.table_rows, dtype=np.int64)
        self.table_of = np.repeat(np.arange(rows.shape[0], dtype=np.int64), rows)
        self.caches = self._make_caches()
        self.block = home_blocks(self.layout.table_rows, self.num_ranks)

    def _make_caches(self) -> WorkerCaches:
        return WorkerCaches(self.layout, self.num_ranks, self.cache_ratio, self.table_of)

    def assign(self, batch: GlobalBatch) -> np.ndarray:
        """Rank of every sample."""
        return np.repeat(np.arange(self.num_ranks, dtype=np.int64), self.batch_per_rank)

    def _plan(self, batches: list[GlobalBatch]) -> Plan:
        b = batches[0]
        sample_rank = self.assign(b)
        rd = self.reads(b, sample_rank)
        pg = rd.keys[rd.pair_key]
        counters, ver = self.caches.execute(pg, rd.pair_rank, rd.count, rd.keys, rd.pair_key, self.step, self.push_all)
        t, row = split_gid(self.layout, self.table_of, pg)
        order = np.argsort(sample_rank.astype(np.int16), kind="stable").astype(np.int64)
        return Plan(step=self.step, num_ranks=self.num_ranks, batch_per_rank=self.batch_per_rank, sample_order=order,
                    counters=counters, executable=False,
                    reads=ReadVersions(table=t, row=row, rank=rd.pair_rank.copy(), version=ver))

    def describe(self) -> dict:
        d = super().describe()
        d["cache_fill"] = self.caches.occupancy()
        return d


class HetBspPolicy(CachePolicyBase):
    name = "het_bsp"
    push_all = True
