"""The interface every scheduling policy implements, and what they share (validation, plan assembly).

    policy = make_policy("herald", table_rows, num_ranks=8, batch_per_rank=256, cache_ratio=0.1, lookahead=4)
    plan = policy.plan([batch_b, batch_b1, ..., batch_bL])   # current global batch + L lookahead batches

`plan()` advances the policy by one step: it mutates the policy's own state (ownership directory or caches) as if
the plan had been executed. Every policy is exact BSP; the checker (`schedule.checker`) verifies it. numpy only.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from herald_torchrec.schedule.directory import check_cache_ratio
from herald_torchrec.schedule.global_batch import GlobalBatch, TableLayout
from herald_torchrec.schedule.plan import Plan, SharedRows
from herald_torchrec.schedule.reads import BatchKeys, Scratch, StepReads, batch_keys, step_reads

OWNERSHIP_KINDS = ("hit", "migrate", "evict_home", "forward", "shared_value", "shared_grad")
CACHE_KINDS = ("hit", "miss_pull", "update_pull", "update_push", "evict_push")


class SchedulePolicy:
    """Base class. Subclasses implement `_plan(batches) -> Plan` (batches already validated)."""

    name = "base"
    executable = True  # False for counting-only policies (the data plane cannot run their plans)
    kinds: tuple[str, ...] = OWNERSHIP_KINDS

    def __init__(
        self,
        table_rows: Sequence[int] | TableLayout,
        num_ranks: int,
        batch_per_rank: int,
        cache_ratio: float = 0.1,
        lookahead: int = 0,
    ) -> None:
        self.layout = table_rows if isinstance(table_rows, TableLayout) else TableLayout(tuple(table_rows))
        for name, v, lo in (
            ("num_ranks", num_ranks, 1),
            ("batch_per_rank", batch_per_rank, 1),
            ("lookahead", lookahead, 0),
        ):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{self.name}: {name} must be an integer >= {lo}, got {v!r}")
        check_cache_ratio(cache_ratio)
        self.num_ranks = int(num_ranks)
        self.batch_per_rank = int(batch_per_rank)
        self.cache_ratio = float(cache_ratio)
        self.lookahead = int(lookahead)
        self.step = 0
        self.scratch = Scratch(self.layout.total_rows)
        # rows the last plan sent that the plan itself does not locate (counting-only kinds: cache pulls and pushes,
        # replica refreshes), for `schedule.traffic.host_traffic`; the plan's moves and shared rows locate theirs
        self.last_transfers: dict = {}

    @property
    def global_batch(self) -> int:
        return self.num_ranks * self.batch_per_rank

    def plan(self, batches: Sequence[GlobalBatch] | GlobalBatch) -> Plan:
        """Plan the next step. batches[0] is the current global batch, batches[1:] the lookahead (<= L used)."""
        if isinstance(batches, GlobalBatch):
            batches = [batches]
        batches = list(batches)
        if not batches:
            raise ValueError(f"{self.name}: plan() needs at least the current global batch")
        for i, b in enumerate(batches):
            if not isinstance(b, GlobalBatch):
                raise ValueError(f"{self.name}: batches[{i}] is a {type(b).__name__}, expected GlobalBatch")
            if b.layout != self.layout:
                raise ValueError(
                    f"{self.name}: batches[{i}] has tables {b.layout.table_rows}, policy has {self.layout.table_rows}"
                )
        n = batches[0].num_samples
        if n != self.global_batch:
            hint = "" if n % self.batch_per_rank else f" ({n // self.batch_per_rank} ranks' worth)"
            raise ValueError(
                f"{self.name}: global batch has {n} samples, expected num_ranks x batch_per_rank = "
                f"{self.num_ranks} x {self.batch_per_rank} = {self.global_batch}{hint}"
            )
        t0 = time.perf_counter()
        plan = self._plan(batches[: self.lookahead + 1])
        plan.sched_seconds = time.perf_counter() - t0
        self.step += 1
        return plan

    def _plan(self, batches: list[GlobalBatch]) -> Plan:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> dict:
        """Policy settings and state worth logging."""
        return {
            "name": self.name,
            "num_ranks": self.num_ranks,
            "batch_per_rank": self.batch_per_rank,
            "cache_ratio": self.cache_ratio,
            "lookahead": self.lookahead,
            "executable": self.executable,
        }

    # ---- shared helpers ---------------------------------------------------------------------------------
    def contiguous_order(self) -> np.ndarray:
        return np.arange(self.global_batch, dtype=np.int64)

    def keys_of(self, batch: GlobalBatch) -> BatchKeys:
        return batch_keys(batch, self.scratch)

    def reads(self, batch: GlobalBatch, sample_rank: np.ndarray) -> StepReads:
        """Distinct keys / (key, reader) pairs of the step for an assignment (rank of every sample)."""
        return step_reads(self.keys_of(batch), sample_rank, self.num_ranks)


def order_from_assignment(sample_rank: np.ndarray, num_ranks: int) -> np.ndarray:
    """sample_order (rank-major, samples increasing within a rank) from the rank of every sample."""
    return np.argsort(sample_rank.astype(np.int16) if num_ranks < 32768 else sample_rank, kind="stable").astype(
        np.int64
    )


def split_gid(layout: TableLayout, table_of: np.ndarray, gid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = table_of[gid].astype(np.int64)
    return t, gid - layout.offsets[t]


def shared_rows(
    layout: TableLayout,
    table_of: np.ndarray,
    keys: np.ndarray,
    owner: np.ndarray,
    offsets: np.ndarray,
    readers: np.ndarray,
) -> SharedRows:
    """SharedRows from sorted global keys, their owner and reader CSR (readers sorted per key)."""
    t, row = split_gid(layout, table_of, keys)
    return SharedRows(
        table=t,
        row=row,
        owner=np.asarray(owner, dtype=np.int64),
        reader_offsets=np.asarray(offsets, dtype=np.int64),
        readers=np.asarray(readers, dtype=np.int64),
    )
