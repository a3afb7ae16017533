"""Shared part of the replica-based baselines `fae` and `p2res` (counting-only, exact BSP).

Both keep every row at its TorchRec ROW_WISE home (`home = row // ceil(rows / R)`) and, in addition, a set of rows
replicated on every rank. Samples are split contiguously (rank r trains samples r*B .. (r+1)*B-1). Per step a row
is read either through the replicas (every reader reads its local replica: `hit`; the gradients are summed by a
ring all-reduce: `allreduce` = 2 (R-1) rows per replicated row touched, the total volume of a ring all-reduce) or
through its home (the home rank reads locally: `hit`; every other reader gets the value and returns a gradient:
`shared_value` + `shared_grad`, one row each per distinct (key, reader) pair, the convention of every policy here).
`fae` also copies home rows to the replicas when it switches from cold to hot batches (`replica_sync`, R-1 rows
each, with optimizer state).

The plans carry `ReadVersions` with `replica` set and a `ReplicaSync`, from which the checker replays the home
copies and the replicas independently (schedule/checker.py). They are executable (distributed/step/replicas.py):
keys read through their home go through the data plane's shared path (`Plan.shared`: owner = home, as `static` plans
them; a key read only by its home rank is exclusive), keys read through replicas are left out of `shared` and read
from every rank's replica region; the first plan after `profile()` names the whole replicated set
(`ReplicaSync.replicated_*`) so that the data plane can build that region. numpy only.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from herald_torchrec.schedule.directory import guest_capacity, home_blocks
from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.plan import Plan, ReadVersions, ReplicaSync
from herald_torchrec.schedule.policy import SchedulePolicy, shared_rows, split_gid
from herald_torchrec.schedule.traffic import FAN_OUT, KindTransfers

REPLICA_KINDS = ("hit", "shared_value", "shared_grad", "allreduce", "replica_sync")


class ReplicaPolicyBase(SchedulePolicy):
    """Home placement + rows replicated on every rank. Subclasses choose the replicated rows (`profile`) and which
    keys of a step are read through replicas (`_replica_keys`)."""

    executable = True  # the data plane runs them (replica region: distributed/step/replicas.py)
    kinds = REPLICA_KINDS

    def __init__(self, *args, hot_budget: int | None = None, profile_fraction: float = 0.05, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if hot_budget is None:  # the memory the caching policies get: ceil(cache_ratio x rows) per table, per rank
            hot_budget = int(guest_capacity(self.layout.table_rows, self.cache_ratio).sum())
        if isinstance(hot_budget, bool) or not isinstance(hot_budget, (int, np.integer)) or hot_budget < 0:
            raise ValueError(
                f"{self.name}: hot_budget must be an integer >= 0 (replicated rows per rank), got {hot_budget!r}"
            )
        if not isinstance(profile_fraction, (int, float)) or not 0.0 < profile_fraction <= 1.0:
            raise ValueError(
                f"{self.name}: profile_fraction must be in (0, 1] (share of the stream profiled), "
                f"got {profile_fraction!r}"
            )
        self.hot_budget = int(hot_budget)
        self.profile_fraction = float(profile_fraction)
        n = self.layout.total_rows
        rows = np.array(self.layout.table_rows, dtype=np.int64)
        self.table_of = np.repeat(np.arange(rows.shape[0], dtype=np.int64), rows)
        block = home_blocks(self.layout.table_rows, self.num_ranks)
        self.home = (np.arange(n, dtype=np.int64) - self.layout.offsets[self.table_of]) // block[self.table_of]
        self.replicated = np.zeros(n, dtype=bool)
        self.V = np.zeros(n, dtype=np.int64)  # true version of every row (steps that updated it)
        self.profiled = False
        self.declared = False

    # ---- profiling --------------------------------------------------------------------------------------------
    @staticmethod
    def profile_steps(total_steps: int, fraction: float) -> int:
        """Global batches in the profiled prefix of a stream of `total_steps` batches (at least 1)."""
        return max(1, math.ceil(fraction * total_steps))

    def profile(self, batches: Sequence[GlobalBatch]) -> np.ndarray:
        """Choose the replicated rows from a prefix of the stream; returns their global rows (sorted)."""
        batches = list(batches)
        if not batches:
            raise ValueError(f"{self.name}: profile() needs at least one global batch")
        self.replicated[:] = False
        chosen = self._choose(batches)
        self.replicated[chosen] = True
        self.profiled = True
        self.declared = False  # the next plan names the replicated set
        return np.sort(chosen)

    def _choose(self, batches: list[GlobalBatch]) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def top_rows(score: np.ndarray, k: int) -> np.ndarray:
        """The k rows of largest positive score, ties to the lower global row (deterministic)."""
        cand = np.flatnonzero(score > 0)
        order = np.lexsort((cand, -score[cand]))
        return cand[order[:k]]

    # ---- per step ---------------------------------------------------------------------------------------------
    def _plan(self, batches: list[GlobalBatch]) -> Plan:
        if not self.profiled:  # no profile() call: profile the window we have (as HeraldPolicy does)
            self.profile(batches)
        b = batches[0]
        sample_rank = np.repeat(np.arange(self.num_ranks, dtype=np.int64), self.batch_per_rank)
        rd = self.reads(b, sample_rank)
        rep_key, sync, extra = self._replica_keys(b, rd.keys)
        pg = rd.keys[rd.pair_key]
        rep = rep_key[rd.pair_key]
        remote = int((~rep & (rd.pair_rank != self.home[pg])).sum())
        ar = rd.keys[rep_key]
        at, arow = split_gid(self.layout, self.table_of, ar)
        sync.allreduce_table, sync.allreduce_row = at, arow
        if not self.declared:
            sync.replicated_table, sync.replicated_row = self.rowset(np.flatnonzero(self.replicated))
            self.declared = True
        # keys read through their home: the shared path unless only the home rank reads them (exclusive)
        pair_remote = ~rep & (rd.pair_rank != self.home[pg])
        via_home = ~rep_key & (np.bincount(rd.pair_key, weights=pair_remote, minlength=rd.keys.shape[0]) > 0)
        ids, offs, readers = rd.readers_csr(via_home)
        shared = shared_rows(self.layout, self.table_of, rd.keys[ids], self.home[rd.keys[ids]], offs, readers)
        counters = {
            "hit": rd.num_pairs - remote,
            "shared_value": remote,
            "shared_grad": remote,
            "allreduce": 2 * (self.num_ranks - 1) * int(ar.shape[0]),
            "replica_sync": 0,
        }
        counters.update(extra)
        self.last_transfers = self._sync_transfers(sync)
        t, row = split_gid(self.layout, self.table_of, pg)
        reads = ReadVersions(table=t, row=row, rank=rd.pair_rank.copy(), version=self.V[pg].copy(), replica=rep)
        self.V[rd.keys] += 1
        return Plan(
            step=self.step,
            num_ranks=self.num_ranks,
            batch_per_rank=self.batch_per_rank,
            sample_order=self.contiguous_order(),
            shared=shared,
            counters=counters,
            executable=True,
            reads=reads,
            replicas=sync,
        )

    def _sync_transfers(self, sync: ReplicaSync) -> dict[str, KindTransfers]:
        """`replica_sync` rows (for `schedule.traffic`): each refreshed row from its home to every other rank."""
        t, row = sync.to_replicas_table, sync.to_replicas_row
        if t.shape[0] == 0:
            return {}
        gid = self.layout.offsets[t] + row
        R = self.num_ranks
        src = np.repeat(self.home[gid], R)
        dst = np.tile(np.arange(R, dtype=np.int64), gid.shape[0])
        keep = src != dst
        key, tab = np.repeat(gid, R)[keep], np.repeat(t, R)[keep]
        return {"replica_sync": KindTransfers(key, src[keep], dst[keep], FAN_OUT, tab)}

    def _replica_keys(self, batch: GlobalBatch, keys: np.ndarray) -> tuple[np.ndarray, ReplicaSync, dict]:
        """(bool [K]: key read through replicas, syncs before the step, extra counters)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def rowset(self, gid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return split_gid(self.layout, self.table_of, gid)

    def describe(self) -> dict:
        d = super().describe()
        d.update(
            {
                "hot_budget": self.hot_budget,
                "profile_fraction": self.profile_fraction,
                "replicated_rows": int(self.replicated.sum()),
            }
        )
        return d
