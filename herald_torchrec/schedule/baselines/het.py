"""`het`: HET's embedding cache with a staleness bound S (HET, VLDB'22). Counting-only, like `het_bsp`.

HET's clocks (REFERENCE), per row k and per cached copy at worker w:
  * the PS counts the updates pushed to it: `C[k]` (one per worker and step whose gradient reached the PS);
  * a copy keeps `base`, the PS clock when it was last pulled, `own`, the worker's own updates applied to the copy
    since then, and `pend`, those of them not yet pushed.
Per step, for every distinct (key, worker) read pair:
  * not cached -> `miss_pull` (the PS value); inserted with the same LRU rules as `het_bsp`;
  * cached and `lag = C[k] - base - (own - pend) > S` (the copy misses more than S updates that other workers
    pushed) -> `update_pull` (PS value + the worker's pending updates); else `hit` (the cached copy, possibly stale).
After compute every reader applies its gradient to its copy (`own += 1`, `pend += 1`) and pushes when `pend > S`
(`update_push`, one row carrying the accumulated update); a reader that could not cache the row pushes at once; an
evicted copy with pending updates is pushed (`evict_push`).

With S = 0 this is exactly `het_bsp` (every update pushed every step, a pull whenever another worker updated the
row): the tests check equal counters on several traces. With S > 0 reads may miss updates: the version reported
to the checker is then the row's true version minus the updates the copy misses (clipped at 0; units are updates,
so it is only a measure of staleness — what the checker needs is that it equals the true version iff the copy has
every update). U[k] counts every update made (pushed or pending), so a copy misses `U - base - own` updates and a
PS value `U - C - pend`.
"""

from __future__ import annotations

import numpy as np

from herald_torchrec.schedule.baselines.cache import WorkerCaches
from herald_torchrec.schedule.baselines.het_bsp import CachePolicyBase
from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.plan import HIT, MISS_PULL, MISS_UNCACHED, UPDATE_PULL, CacheStep, Plan
from herald_torchrec.schedule.policy import split_gid


class StaleCaches(WorkerCaches):
    """Per-worker LRU caches with HET's per-row clocks and a staleness bound (see the module docstring)."""

    payload = ("ver", "last", "own", "pend")  # "ver" is the copy's base (PS clock at its last pull)

    def __init__(self, *args, staleness: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.staleness = staleness
        self.C = np.zeros(self.n, dtype=np.int64)  # PS clock: updates pushed
        self.U = np.zeros(self.n, dtype=np.int64)  # updates made (pushed or pending)
        # what the last `execute` did, for the data plane (Plan.cache): per pair action / push, evicted copies
        self.action = np.zeros(0, dtype=np.int8)
        self.push = np.zeros(0, dtype=bool)
        self.evicted: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (rank, gid, dirty) per eviction batch

    def execute(
        self,
        pair_gid: np.ndarray,
        pair_rank: np.ndarray,
        count: np.ndarray,
        keys: np.ndarray,
        pair_key: np.ndarray,
        step: int,
        push_all: bool,
    ) -> tuple[dict, np.ndarray]:
        """One step of reads and updates; returns (counters, version read by every pair). `push_all` is unused:
        pushes follow the staleness bound."""
        S, C, U, V, sl = self.staleness, self.C, self.U, self.V, self.slots
        base_p, last_p, own_p, pend_p = (sl.payload[k] for k in ("ver", "last", "own", "pend"))
        c = {"hit": 0, "miss_pull": 0, "update_pull": 0, "update_push": 0, "evict_push": 0}
        self.sent = {}
        # ---- reads ----
        pos, base = self.lookup(pair_rank, pair_gid)
        miss = pos < 0
        if own_p.shape[0]:
            p = np.maximum(pos, 0)
            own, pend = np.where(miss, 0, own_p[p]), np.where(miss, 0, pend_p[p])
        else:  # no cache at all: every read misses
            own = pend = np.zeros(pos.shape[0], dtype=np.int64)
        Cg, Ug = C[pair_gid], U[pair_gid]
        pull = ~miss & (Cg - base - (own - pend) > S)
        hit = ~miss & ~pull
        missing = np.where(hit, Ug - base - own, Ug - Cg - pend)
        Vg = V[pair_gid]
        read_ver = np.where(missing > 0, np.maximum(Vg - missing, 0), Vg)
        c["miss_pull"], c["update_pull"], c["hit"] = int(miss.sum()), int(pull.sum()), int(hit.sum())
        self._sent("miss_pull", pair_gid[miss], pair_rank[miss])
        self._sent("update_pull", pair_gid[pull], pair_rank[pull])
        last_p[pos[~miss]] = step
        base_p[pos[pull]] = Cg[pull]
        own_p[pos[pull]] = pend[pull]
        self.evicted = []
        new = self._insert(pair_rank[miss], pair_gid[miss], Cg[miss], step, c)
        own_p, pend_p = sl.payload["own"], sl.payload["pend"]  # replaced where the cache's slots grew
        action = np.where(pull, UPDATE_PULL, HIT).astype(np.int8)
        action[miss] = np.where(new >= 0, MISS_PULL, MISS_UNCACHED)
        new = new[new >= 0]
        own_p[new] = 0
        pend_p[new] = 0
        # ---- updates ----
        V[keys] += 1
        U[keys] += np.bincount(pair_key, minlength=keys.shape[0])
        mpos, _ = self.lookup(pair_rank, pair_gid)  # slots moved during the evictions (swap-remove)
        held = mpos >= 0
        hp = mpos[held]
        own_p[hp] += 1
        pend_p[hp] += 1
        push = pend_p[hp] > S
        pushes = ~held
        pushes[np.flatnonzero(held)[push]] = True
        self.action, self.push = action, pushes
        np.add.at(C, pair_gid[held][push], pend_p[hp[push]])
        pend_p[hp[push]] = 0
        np.add.at(C, pair_gid[~held], 1)
        c["update_push"] += int(push.sum()) + int((~held).sum())
        self._sent("update_push", pair_gid[pushes], pair_rank[pushes])
        return c, read_ver

    def _evict(self, pos: np.ndarray, rank: np.ndarray, gid: np.ndarray, c: dict) -> None:
        """An evicted copy with pending updates pushes them (`evict_push`)."""
        pend = self.slots.payload["pend"][pos]
        dirty = pend > 0
        self.evicted.append((rank.copy(), gid.copy(), dirty))
        c["evict_push"] += int(dirty.sum())
        self._sent("evict_push", gid[dirty], rank[dirty])
        np.add.at(self.C, gid[dirty], pend[dirty])


class HetPolicy(CachePolicyBase):
    """HET with staleness bound `staleness` (S >= 0); S = 0 gives `het_bsp`'s counts exactly.

    Its plans are executable for any S: they carry the caches' actions (`Plan.cache`), which the data plane runs
    with a real cache per rank (distributed/comparison/het_cache.py); no row goes through the home path (`shared` is
    empty). With S = 0 every read sees the latest value, so the run is exact BSP."""

    name = "het"
    home_path = False

    @classmethod
    def runs_with(cls, staleness: int = 0, **_: object) -> None:  # every S runs (see the class docstring)
        return None

    def _plan(self, batches: list[GlobalBatch]) -> Plan:
        plan = super()._plan(batches)  # no `shared`: every read goes through the caches
        cs = self.caches
        t, row = plan.reads.table, plan.reads.row
        ev = cs.evicted
        er = np.concatenate([e[0] for e in ev]) if ev else np.zeros(0, dtype=np.int64)
        eg = np.concatenate([e[1] for e in ev]) if ev else np.zeros(0, dtype=np.int64)
        ed = np.concatenate([e[2] for e in ev]) if ev else np.zeros(0, dtype=bool)
        et, erow = split_gid(self.layout, self.table_of, eg)
        plan.cache = CacheStep(
            table=t,
            row=row,
            rank=plan.reads.rank,
            action=cs.action.copy(),
            push=cs.push.copy(),
            evict_table=et,
            evict_row=erow,
            evict_rank=er.astype(np.int64),
            evict_push=ed,
        )
        return plan

    def __init__(self, *args, staleness: int = 0, **kwargs) -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, (int, np.integer)) or staleness < 0:
            raise ValueError(
                f"het: staleness must be an integer >= 0 (updates a cached copy may miss), got {staleness!r}"
            )
        self.staleness = int(staleness)
        super().__init__(*args, **kwargs)

    def _make_caches(self) -> StaleCaches:
        return StaleCaches(self.layout, self.num_ranks, self.cache_ratio, self.table_of, staleness=self.staleness)

    def describe(self) -> dict:
        d = super().describe()
        d["staleness"] = self.staleness
        return d
