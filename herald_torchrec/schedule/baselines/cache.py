"""Per-worker embedding caches of the parameter-server policies (`het_bsp`, `herald_greedy`): counting-only.

Model (REFERENCE: HET's per-row clocks, Herald's transmission kinds). A parameter server (PS) holds every row.
Per row k: `V[k]` the true latest version (number of BSP steps that updated it), `P[k]` the version the PS holds,
`D[k]` the worker holding unpushed updates that make up the latest version (-1 none). Per worker w an LRU cache per
table (capacity ceil(cache_ratio x rows)) keeps, per cached row, the version of its copy and its last use.

Per step, for every distinct (key, worker) read pair:
  * if the row is not cached -> `miss_pull` (the PS value, version P[k]); inserted, evicting the least recently
    used rows not read this step; evicting a dirty row (D[k] == w) costs an `evict_push`;
  * if cached and older than V[k] -> `update_pull` (version P[k]); otherwise a `hit` (the cached copy).
The version used is reported in `Plan.reads`: the checker flags any read older than the truth, e.g. a pull from a
PS that missed a push.
After compute: V[k] += 1. A key read by a single worker leaves that worker's copy at the latest version; read by
several, every reader pushes its gradient (`update_push` each), the PS aggregates (P = V) and the readers' copies
are outdated. What happens to single-reader updates is the policy's choice (`push_all`): HET-BSP (staleness 0)
pushes every update every step; Herald pushes a dirty row only when another worker reads it (or it is evicted).
"""

from __future__ import annotations

import numpy as np

from herald_torchrec.schedule.directory import GuestSlots, guest_capacity
from herald_torchrec.schedule.global_batch import TableLayout


class WorkerCaches:
    payload: tuple[str, ...] = ("ver", "last")  # per cached copy; subclasses add their own clocks

    def __init__(self, layout: TableLayout, num_ranks: int, cache_ratio: float, table_of: np.ndarray) -> None:
        self.layout = layout
        self.R = num_ranks
        self.T = layout.num_tables
        self.n = layout.total_rows
        self.table_of = table_of
        self.capacity = guest_capacity(layout.table_rows, cache_ratio)
        self.slots = GuestSlots(np.tile(self.capacity, num_ranks), num_ranks * self.n, payload=self.payload)
        self.V = np.zeros(self.n, dtype=np.int64)
        self.P = np.zeros(self.n, dtype=np.int64)
        self.D = np.full(self.n, -1, dtype=np.int64)
        # what the last `execute` sent, per kind: (global rows, worker) chunks, pulls to the worker, pushes from it
        self.sent: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def _sent(self, kind: str, gid: np.ndarray, rank: np.ndarray) -> None:
        """Record rows of `kind` exchanged between workers `rank` and the rows' parameter-server home."""
        if gid.shape[0]:
            self.sent.setdefault(kind, []).append((gid.copy(), rank.astype(np.int64, copy=True)))

    def lookup(self, rank: np.ndarray, gid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot or -1, cached version or -1) of rows at workers."""
        pos = self.slots.pos_of[rank * self.n + gid].astype(np.int64)
        if self.slots.slot.shape[0] == 0:  # nothing cached yet (slots are reserved as rows arrive)
            return pos, np.full(pos.shape[0], -1, dtype=np.int64)
        ver = np.where(pos >= 0, self.slots.payload["ver"][np.maximum(pos, 0)], -1)
        return pos, ver

    def valid(self, rank: np.ndarray, gid: np.ndarray) -> np.ndarray:
        """True where the worker holds the latest version of the row (Herald's valid bit)."""
        _, ver = self.lookup(rank, gid)
        return ver == self.V[gid]

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
        """Run one step of reads and updates; returns (counters, version read by every pair)."""
        V, P, D, sl = self.V, self.P, self.D, self.slots
        ver_p, last_p = sl.payload["ver"], sl.payload["last"]
        c = {"hit": 0, "miss_pull": 0, "update_pull": 0, "update_push": 0, "evict_push": 0}
        self.sent = {}
        multi = count >= 2
        # lazy pushes: a dirty row another worker reads this step is pushed before the step
        dk = D[keys]
        sole = np.full(keys.shape[0], -1, dtype=np.int64)
        sole[pair_key] = pair_rank  # the reader, for single-reader keys
        need_push = (dk >= 0) & (multi | (sole != dk))
        c["update_push"] += int(need_push.sum())
        self._sent("update_push", keys[need_push], dk[need_push])
        P[keys[need_push]] = V[keys[need_push]]
        D[keys[need_push]] = -1
        # reads
        pos, ver = self.lookup(pair_rank, pair_gid)
        Vp = V[pair_gid]
        miss = pos < 0
        stale = ~miss & (ver < Vp)
        c["miss_pull"] = int(miss.sum())
        c["update_pull"] = int(stale.sum())
        c["hit"] = int((~miss & ~stale).sum())
        self._sent("miss_pull", pair_gid[miss], pair_rank[miss])
        self._sent("update_pull", pair_gid[stale], pair_rank[stale])
        read_ver = np.where(miss | stale, P[pair_gid], ver)
        hitpos = pos[~miss]
        last_p[hitpos] = step
        ver_p[pos[stale]] = P[pair_gid[stale]]
        # insert misses (LRU victims among rows not read this step)
        self._insert(pair_rank[miss], pair_gid[miss], P[pair_gid[miss]], step, c)
        ver_p = sl.payload["ver"]  # replaced where the cache's slots grew
        # updates
        uk = keys
        V[uk] += 1
        newV = V[pair_gid]
        single = ~multi[pair_key]
        # slots moved during the evictions (swap-remove): look the pairs up again
        mpos, _ = self.lookup(pair_rank, pair_gid)
        held = mpos >= 0
        # single reader: its copy is the latest
        sp = single & held
        ver_p[mpos[sp]] = newV[sp]
        if push_all:
            c["update_push"] += int(pair_gid.shape[0])
            self._sent("update_push", pair_gid, pair_rank)
            P[uk] = V[uk]
            D[uk] = -1
        else:
            # several readers: every reader pushes its gradient; the PS aggregates
            c["update_push"] += int((~single).sum())
            self._sent("update_push", pair_gid[~single], pair_rank[~single])
            mk = uk[multi]
            P[mk] = V[mk]
            D[mk] = -1
            # a single reader that could not cache the row pushes at once, otherwise it keeps the update dirty
            lone = single & ~held
            c["update_push"] += int(lone.sum())
            self._sent("update_push", pair_gid[lone], pair_rank[lone])
            P[pair_gid[lone]] = newV[lone]
            D[pair_gid[lone]] = -1
            D[pair_gid[sp]] = pair_rank[sp]
        return c, read_ver

    def _insert(self, rank: np.ndarray, gid: np.ndarray, ver: np.ndarray, step: int, c: dict) -> np.ndarray:
        """Cache missed rows at their workers, evicting LRU rows not read this step; slot per row or -1."""
        sl = self.slots
        out = np.full(gid.shape[0], -1, dtype=np.int64)
        if gid.shape[0] == 0:
            return out
        grp = rank * self.T + self.table_of[gid]
        want = np.bincount(grp, minlength=sl.num_groups)
        free = sl.cap - sl.fill
        need = want - free
        gneed = np.flatnonzero(need > 0)
        if gneed.shape[0]:
            last = sl.payload["last"]
            victims = sl.pick_victims(gneed, need[gneed], lambda p: np.where(last[p] < step, last[p], -1))
            if victims.shape[0]:
                vkey = sl.slot[victims]
                vr, vg = vkey // self.n, vkey % self.n
                self._evict(victims, vr, vg, c)
                sl.remove(vkey, vr * self.T + self.table_of[vg])
        room = sl.cap - sl.fill
        # rows beyond the room are read without being cached (the group's working set exceeds the cache)
        order = np.argsort(grp, kind="stable")
        g_s = grp[order]
        first = np.searchsorted(g_s, g_s, side="left")
        within = np.arange(g_s.shape[0]) - first
        fits = np.zeros(gid.shape[0], dtype=bool)
        fits[order] = within < room[g_s]
        keys = rank[fits] * self.n + gid[fits]
        pos = sl.add(keys, grp[fits])
        sl.payload["ver"][pos] = ver[fits]
        sl.payload["last"][pos] = step
        out[fits] = pos
        return out

    def _evict(self, pos: np.ndarray, rank: np.ndarray, gid: np.ndarray, c: dict) -> None:
        """Copies at slots `pos` (rank, gid) are about to be evicted: a dirty one is pushed (`evict_push`)."""
        dirty = self.D[gid] == rank
        c["evict_push"] += int(dirty.sum())
        self._sent("evict_push", gid[dirty], rank[dirty])
        self.P[gid[dirty]] = self.V[gid[dirty]]
        self.D[gid[dirty]] = -1

    def occupancy(self) -> float:
        tot = int(self.slots.cap.sum())
        return float(self.slots.fill.sum() / tot) if tot else 0.0
