"""The comparison systems as step extensions (distributed/step/extension.py) of the sharded module.

Why: the systems Herald answers train in Herald's own engine, so their plans run through the same module, but
beside Herald's step rather than inside it. Rows replicated on every rank (`fae` / `p2res` plans, `Plan.replicas`:
the replica region of step/replicas.py, which Herald's own replicated rows use too) and HET's per-worker cache
(`het` plans, `Plan.cache`: het_cache.py) each take the ids they serve out of the step's local input before Herald's
path (moves, shared rows) sees them, add their pooled values to the output, and apply their own updates after the
backward. A module gets the extension of its policy when it is built (`comparison_extensions`); Herald's modules get
none of these (only the replica region, when their policy replicates).

Collectives (every rank, in the same order, driven by the plan alone): `begin` (replica syncs, HET's evictions and
pulls), `finish` (the replicas' gradient all-reduce, HET's pushes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from herald_torchrec.distributed.comm import phase
from herald_torchrec.distributed.comparison.het_cache import CacheReads, WorkerCache
from herald_torchrec.distributed.step.extension import ExtensionResources, StepExtension
from herald_torchrec.distributed.step.prepare import LocalInput
from herald_torchrec.distributed.step.replicas import ReplicaExtension
from herald_torchrec.schedule.plan import Plan


# ---------------------------------------------------------------------------------------------- HET's cache
@dataclass
class CachePart:
    """One step's reads through HET's cache on this rank (`reads` None: the plan has no cache actions)."""

    cache: WorkerCache | None
    remaining: LocalInput | None
    reads: CacheReads | None
    plan_cache: Any = None  # the plan's cache actions, which `finish` follows

    def pooled(self, out: torch.Tensor, training: bool) -> torch.Tensor:
        if self.reads is None:
            return out
        return self.cache.pooled(self.reads, out, training)  # type: ignore[union-attr]

    def count(self, hits: np.ndarray, reads: np.ndarray, counters: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """HET's hits are reads of a cached copy without a pull; its pulls and pushes go into `counters`."""
        if self.reads is None:
            return hits, reads
        ch, cr = self.cache.hits(self.reads)  # type: ignore[union-attr]
        counters.update(self.reads.counts)
        return hits + ch, reads + cr

    @property
    def pending(self) -> bool:
        return self.reads is not None

    def finish(self) -> None:
        if self.reads is not None:
            with phase("finish_step.het_cache"):
                self.cache.finish(self.reads, self.plan_cache)  # type: ignore[union-attr]


class HetCacheExtension:
    """HET's worker cache (het), built by the first plan that needs it, and again after a checkpoint load moved
    every row home."""

    plan_part = "cache"

    def __init__(self, res: ExtensionResources) -> None:
        self._res, self._lr = res, float(res.learning_rate)
        self.cache: WorkerCache | None = None
        self._cache_version = 0  # the ownership version the cache was built at

    def begin(self, plan: Plan, local: LocalInput | None, ownership_version: int) -> CachePart:
        if plan.cache is None:
            return CachePart(self.cache, local, None)
        if self.cache is None or self._cache_version != ownership_version:  # new, or rows reloaded
            r = self._res
            self.cache = WorkerCache(r.store, r.comm, r.device, r.optimizer, self._lr, r.eps, r.tbe_settings)
            self._cache_version = ownership_version
        remaining, reads = self.cache.begin(plan, local)
        return CachePart(self.cache, remaining, reads, plan.cache)

    def set_learning_rate(self, lr: float) -> None:
        self._lr = float(lr)
        if self.cache is not None:
            self.cache.set_learning_rate(self._lr)


EXTENSION_BY_POLICY: dict[str, type] = {"fae": ReplicaExtension, "p2res": ReplicaExtension, "het": HetCacheExtension}


def comparison_extensions(policy: str, res: ExtensionResources) -> tuple[StepExtension, ...]:
    """The comparison system a module built for `policy` runs beside Herald's step; none for Herald and the other
    policies, whose plans only use Herald's path."""
    extension = EXTENSION_BY_POLICY.get(policy)
    return () if extension is None else (extension(res),)
