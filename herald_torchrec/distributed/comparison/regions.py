"""`BaselineRegions`: what the comparison systems' plans add to a step of the Herald data plane.

Issue 10 trains the systems Herald answers in Herald's own engine, so their plans run through the same sharded
module: rows replicated on every rank (`fae` / `p2res` plans, `Plan.replicas`: replicas.py) and HET's per-worker
cache (`het` plans, `Plan.cache`: het_cache.py). Each region takes the ids it serves out of the step's local input
before the ordinary path (moves, shared rows) sees them, adds their pooled values to the output, and applies its own
updates after the backward. Herald's own plans name neither region and pay nothing here. Kept apart from
embeddingbag.py, which orders the step, because it is one concern: the baselines' extra state and collectives.

Collectives (every rank, in the same order, driven by the plan alone): `begin` (replica syncs, HET's evictions and
pulls), `finish` (the replicas' gradient all-reduce, HET's pushes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from herald_torchrec.distributed.comm import PlanComm, phase
from herald_torchrec.distributed.comparison.het_cache import CacheReads, WorkerCache
from herald_torchrec.distributed.step.prepare import LocalInput
from herald_torchrec.distributed.comparison.replicas import ReplicaRegion, ReplicaStep
from herald_torchrec.distributed.storage.row_store import RowStore
from herald_torchrec.schedule.plan import Plan


@dataclass
class BaselineStep:
    """One step's reads through the regions on this rank (None where the plan names no such region)."""

    full_local: LocalInput | None  # the step's ids before the regions took theirs
    replicas: ReplicaStep | None = None
    cache: CacheReads | None = None
    plan_cache: Any = None  # the plan's HET cache part, which `finish` follows

    @property
    def empty(self) -> bool:
        return self.replicas is None and self.cache is None


class BaselineRegions:
    """The replica region (built at once: it is empty until a plan declares rows) and HET's worker cache (built by
    the first plan that needs it, and again after a checkpoint load moved every row home)."""

    def __init__(self, store: RowStore, comm: PlanComm, device: torch.device, optimizer: Any, learning_rate: float,
                 eps: float, settings: dict[str, Any]) -> None:
        self._store, self._comm, self._device = store, comm, device
        self._optimizer, self._lr, self._eps, self._settings = optimizer, learning_rate, eps, settings
        self.replicas = ReplicaRegion(store, comm, device, optimizer, learning_rate, eps, settings)
        self.cache: WorkerCache | None = None
        self._cache_version = 0  # the ownership version the cache was built at

    def begin(self, plan: Plan, local: LocalInput | None, ownership_version: int,
              step: BaselineStep) -> LocalInput | None:
        """The regions' collectives of the step, then `local` without the ids they serve (recorded in `step`). A
        ValueError (the plan does not match the batch) propagates after the collectives every rank runs."""
        if plan.replicas is not None:
            local, step.replicas = self.replicas.begin(plan, local)
        if plan.cache is not None:
            if self.cache is None or self._cache_version != ownership_version:  # new, or rows reloaded
                self.cache = WorkerCache(self._store, self._comm, self._device, self._optimizer, self._lr, self._eps,
                                         self._settings)
                self._cache_version = ownership_version
            step.plan_cache = plan.cache
            local, step.cache = self.cache.begin(plan, local)
        return local

    def pooled(self, step: BaselineStep, out: torch.Tensor, training: bool) -> torch.Tensor:
        """`out` plus the pooled values of the ids the regions serve."""
        if step.replicas is not None:
            out = self.replicas.pooled(step.full_local, step.replicas, out, training)
        if step.cache is not None:
            out = self.cache.pooled(step.cache, out, training)  # type: ignore[union-attr]
        return out

    def count(self, step: BaselineStep, hits: np.ndarray, reads: np.ndarray,
              counters: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """(hits, distinct keys read) per table with the regions' reads added; their own counters into `counters`:
        replica reads are local reads (and `allreduce` the rows this rank all-reduces), HET's hits are reads of a
        cached copy without a pull."""
        if step.replicas is not None:
            rh = self.replicas.hits(step.replicas)
            hits, reads = hits + rh, reads + rh
            counters["allreduce"] = int(step.replicas.table.shape[0])
        if step.cache is not None:
            ch, cr = self.cache.hits(step.cache)  # type: ignore[union-attr]
            hits, reads = hits + ch, reads + cr
            counters.update(step.cache.counts)
        return hits, reads

    def finish(self, step: BaselineStep) -> None:
        """The regions' updates of a trained step (collective)."""
        if step.replicas is not None:
            with phase("finish_step.replicas"):
                self.replicas.finish(step.replicas)
        if step.cache is not None:
            with phase("finish_step.het_cache"):
                self.cache.finish(step.cache, step.plan_cache)  # type: ignore[union-attr]

    def set_learning_rate(self, lr: float) -> None:
        self._lr = float(lr)
        self.replicas.set_learning_rate(self._lr)
        if self.cache is not None:
            self.cache.set_learning_rate(self._lr)
