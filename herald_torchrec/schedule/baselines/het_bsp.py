"""`het_bsp`: HET's embedding cache with staleness bound 0 (the Herald paper's baseline). Counting-only.

Contiguous split; per worker and table an LRU cache of ceil(cache_ratio x rows) rows; every update is pushed every
step (pending updates > s = 0), a read pulls when the row is not cached (`miss_pull`) or the PS has a newer version
than the cached copy (`update_pull`). See `schedule.cache` for the exact model.
"""

from __future__ import annotations

import numpy as np

from herald_torchrec.schedule.baselines.cache import WorkerCaches
from herald_torchrec.schedule.directory import home_blocks
from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.plan import Plan, ReadVersions
from herald_torchrec.schedule.policy import CACHE_KINDS, SchedulePolicy, shared_rows, split_gid
from herald_torchrec.schedule.traffic import FAN_IN, FAN_OUT, KindTransfers


class CachePolicyBase(SchedulePolicy):
    """HET's caches. With staleness 0 every read sees the latest value (checked by the checker), so the step is
    exactly BSP and the data plane runs it on its home path: the plan also carries `shared` (owner = home, as
    `static` plans the contiguous split), while its counters and `reads` are HET's cache model (what HET would send).
    Plans with stale reads (het, S > 0) are counting-only."""

    executable = True  # staleness 0 (het_bsp, het with S = 0); see `runs_with`
    kinds = CACHE_KINDS
    push_all = True
    home_path = True  # fresh steps also carry `shared` (home owner); het runs its own caches instead

    @classmethod
    def runs_with(cls, staleness: int = 0, **_: object) -> None:
        """ValueError unless the data plane can run this policy with these settings (S = 0 only)."""
        if staleness:
            raise ValueError(
                f"scheduler.staleness={staleness}: het with staleness > 0 is counting-only for now "
                "(benchmarks/simulate.py); the data plane runs het with staleness 0 (HET-BSP)"
            )

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
        home = (rd.keys - self.layout.offsets[self.table_of[rd.keys]]) // self.block[self.table_of[rd.keys]]
        stale = int((ver != self.caches.V[pg] - 1).sum())  # V already counts this step's update
        shared = None
        if stale == 0 and self.home_path:  # exact BSP step: executable on the home path
            remote = np.bincount(rd.pair_key, weights=rd.pair_rank != home[rd.pair_key], minlength=rd.keys.shape[0]) > 0
            ids, offs, readers = rd.readers_csr(remote)
            shared = shared_rows(self.layout, self.table_of, rd.keys[ids], home[ids], offs, readers)
        plan = Plan(
            step=self.step,
            num_ranks=self.num_ranks,
            batch_per_rank=self.batch_per_rank,
            sample_order=order,
            counters=counters,
            executable=shared is not None or not self.home_path,
            reads=ReadVersions(table=t, row=row, rank=rd.pair_rank.copy(), version=ver),
            stale_reads=stale,
        )
        if shared is not None:
            plan.shared = shared
        self.last_transfers = self._cache_transfers()
        return plan

    PULLS = ("miss_pull", "update_pull")  # PS home -> worker; the other cache kinds are pushes worker -> PS home

    def _cache_transfers(self) -> dict[str, KindTransfers]:
        """What the caches sent in this step, by kind, between each worker and the row's home (the parameter
        server's shard of the row, TorchRec's ROW_WISE placement), for `schedule.traffic`."""
        out = {}
        for kind, chunks in self.caches.sent.items():
            gid = np.concatenate([g for g, _ in chunks])
            rank = np.concatenate([r for _, r in chunks])
            t = self.table_of[gid]
            home = (gid - self.layout.offsets[t]) // self.block[t]
            if kind in self.PULLS:
                out[kind] = KindTransfers(gid, home, rank, FAN_OUT, t)
            else:
                out[kind] = KindTransfers(gid, rank, home, FAN_IN, t)
        return out

    def describe(self) -> dict:
        d = super().describe()
        d["cache_fill"] = self.caches.occupancy()
        return d


class HetBspPolicy(CachePolicyBase):
    name = "het_bsp"
    push_all = True
