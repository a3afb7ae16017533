"""Eviction candidates per guest group, kept between steps, so that choosing victims costs O(victims), not O(cache).

A full guest group must give up a few members per step (the step's net arrivals), chosen by a priority (herald: rows
not needed in the lookahead window before rows needed later, least recently used first among equals, the lower
slot first among ties). Computing that priority for every member of every full group each step costs O(cache): on
the default W&D trace at R=2 the plan took 3.1 ms once the caches were full against 1.5 ms before, and with the
tables 5x larger 10.8 ms at step 5,000, still growing. Real tables are 100x larger.

The priority is bounded below by a per-row *floor* that only grows while a row stays in its group (herald: its last
use, `OwnershipDirectory.last_use`, read through each slot's key). For every group g the pool keeps a threshold `tau[g]`
and a list of keys holding **every member whose floor is below tau[g]** (plus stale keys: rows read again or gone since,
dropped when met; a row that left and came back may be listed twice, counted once). Every other member has priority >=
floor >= tau[g], so if the pool holds `need` members of priority < tau[g], the `need` lowest of the group are among
them: the pool alone decides, and the result is exactly a full selection's. A group whose pool cannot decide is rebuilt
from its members (one pass over its slot region: O(members) but rare, after ~`size` victims); a group that still cannot
decide (most of its oldest members pinned or needed soon), and every group of at most `size` slots, takes the full
selection. Rows arriving with a floor below their group's threshold (a forwarded guest keeps its last use) join its
pool (`arrived`); a pool that overflows is emptied with tau = -1, which keeps the invariant.
numpy only (native.py has the same pool, compiled, for HeraldPolicy).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from herald_torchrec.schedule.directory import GuestSlots, concat_ranges

POOL_SIZE = 256  # keys kept per group: a rebuild every ~POOL_SIZE victims of the group (or its rows' reads)


class EvictionPool:
    """The low-floor members of every group of `slots`. `floor[key]` bounds the priority of member `key` from below;
    the array is read as it is at each call (the caller updates it in place)."""

    def __init__(self, slots: GuestSlots, floor: np.ndarray, size: int = POOL_SIZE) -> None:
        if floor.ndim != 1 or floor.shape[0] != slots.pos_of.shape[0]:
            raise ValueError(
                f"EvictionPool: floor needs one value per key ({slots.pos_of.shape[0]}), got shape {floor.shape}"
            )
        self.slots, self.floor, self.size = slots, floor, int(size)
        G = slots.num_groups
        self.tau = np.full(G, -1, dtype=np.int64)  # empty pools: no member has a floor below -1 (floors are >= -1)
        # pools only for groups bigger than a pool (the others take the full selection): at most one key per slot
        big = slots.cap > self.size
        self.row = np.cumsum(big) - 1  # a big group's row of `keys`
        self.keys = np.zeros((int(big.sum()), self.size), dtype=np.int64)
        self.count = np.zeros(G, dtype=np.int64)
        self.rebuilds = 0  # groups rebuilt from their members (a cost counter, for tests and profiling)

    @property
    def group_of_slot(self) -> np.ndarray:
        """The group of every slot (the slots' own map: regions move as they grow)."""
        return self.slots.group_of_slot

    # ---- keeping the invariant -----------------------------------------------------------------------------------
    def arrived(self, pos: np.ndarray, keys: np.ndarray | None = None, groups: np.ndarray | None = None) -> None:
        """Rows just added at slots `pos` (their floor already set): those below their group's threshold join its
        pool; a pool that would overflow is emptied (tau = -1). `keys` and `groups` (aligned with pos): the rows and
        their groups where the caller has them, which saves two random reads per row of the slot arrays."""
        if pos.shape[0] == 0:
            return
        keys = self.slots.slot[pos] if keys is None else keys
        groups = self.group_of_slot[pos] if groups is None else groups
        low = self.floor[keys] < self.tau[groups]
        if not low.any():
            return
        pos = pos[low]
        g = groups[low].astype(np.int64)
        order = np.argsort(g, kind="stable")
        pos, g = pos[order], g[order]
        a = np.bincount(g, minlength=self.tau.shape[0])
        over = self.count + a > self.size
        if over.any():
            self.tau[over], self.count[over] = -1, 0
            keep = ~over[g]
            pos, g = pos[keep], g[keep]
            a[over] = 0
        within = np.arange(g.shape[0]) - (np.cumsum(a) - a)[g]
        self.keys[self.row[g], self.count[g] + within] = self.slots.slot[pos]
        self.count += a

    def _rebuild(self, groups: np.ndarray) -> None:
        """Refill the pools of `groups` from their members: the `size` lowest floors (all, if fewer)."""
        sl = self.slots
        for g in groups.tolist():
            lo, n = int(sl.base[g]), int(sl.fill[g])
            fl = self.floor[sl.slot[lo : lo + n]]
            if n <= self.size:
                tau, take = np.iinfo(np.int64).max, np.arange(n)
            else:
                tau = int(np.partition(fl, self.size)[self.size])  # fewer than `size` members lie below it
                take = np.flatnonzero(fl < tau)
            self.tau[g], self.count[g] = tau, take.shape[0]
            self.keys[self.row[g], : take.shape[0]] = sl.slot[lo + take]
        self.rebuilds += groups.shape[0]

    # ---- choosing ------------------------------------------------------------------------------------------------
    def _candidates(self, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot, index into `groups`) of the live pool members of `groups`; stale keys are dropped for good."""
        sl = self.slots
        col, rows = concat_ranges(np.zeros(groups.shape[0], dtype=np.int64), self.count[groups])
        g = groups[rows]
        keys = self.keys[self.row[g], col]
        pos = sl.pos_of[keys].astype(np.int64)
        live = (pos >= sl.base[g]) & (pos < sl.base[g] + sl.fill[g]) & (self.floor[keys] < self.tau[g])
        at = np.flatnonzero(live)
        p = pos[at]
        o = np.argsort(p, kind="stable")
        live[at[o[1:][p[o[1:]] == p[o[:-1]]]]] = False  # a row that left and came back is listed twice
        if not live.all():  # compact: drop rows read again (their floor only grows) and rows that left
            kept = np.bincount(rows[live], minlength=groups.shape[0])
            within, _ = concat_ranges(np.zeros(groups.shape[0], dtype=np.int64), kept)
            self.keys[self.row[g[live]], within] = keys[live]
            self.count[groups] = kept
        return pos[live], rows[live]

    def pick(self, groups: np.ndarray, need: np.ndarray, priority: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Slots of the `need[i]` lowest-priority members of each `groups[i]`, exactly as
        `GuestSlots.pick_victims(groups, need, priority)` (priority >= floor wherever priority >= 0)."""
        keep = need > 0
        groups, need = groups[keep], need[keep]
        small = self.slots.cap[groups] <= self.size  # no bigger than a pool: a full selection costs as little
        full_g, full_n = [groups[small]], [need[small]]
        groups, need = groups[~small], need[~small]
        out: list[np.ndarray] = []
        for attempt in range(2):  # the pools as they are, then the rebuilt pools of the groups they could not decide
            if groups.shape[0] == 0:
                break
            pos, idx = self._candidates(groups)
            prio = priority(pos)
            ok = (prio >= 0) & (prio < self.tau[groups][idx])
            decided = np.bincount(idx[ok], minlength=groups.shape[0]) >= need
            if decided.any():
                d = np.flatnonzero(decided)
                sel = ok & decided[idx]
                remap = np.cumsum(decided) - 1
                out.append(self.slots.lowest_per_group(pos[sel], remap[idx[sel]], prio[sel], need[d]))
            groups, need = groups[~decided], need[~decided]
            if attempt == 0 and groups.shape[0]:
                self._rebuild(groups)
        # small groups, and groups whose oldest members are pinned or needed soon: a full selection
        full_g.append(groups)
        full_n.append(need)
        out.append(self.slots.pick_victims(np.concatenate(full_g), np.concatenate(full_n), priority))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def cancel_arrivals(
    arrivals: np.ndarray,
    groups: np.ndarray,
    short: np.ndarray,
    keys: np.ndarray,
    single: np.ndarray,
    used_again: Callable[[np.ndarray], np.ndarray],
    own: np.ndarray,
    home: np.ndarray,
    want: np.ndarray,
) -> None:
    """Where a guest group is still `short[g]` slots short after its victims, cancel (`want[i] = own[i]`) that many
    of the arrivals into it, the least valuable first. Kept first: single-reader migrations, then keys used again in
    the lookahead (`used_again(keys)`, bool); among equals those leaving a guest slot (cancelling them would cascade),
    so rows coming from home are dropped first; then by key. `arrivals`: indices into the step's keys; `groups`: the
    guest group each arrival enters."""
    over = short[groups] > 0
    cand, cg = arrivals[over], groups[over]
    val = np.where(single[cand], 2, 0) + used_again(keys[cand])
    from_guest = own[cand] != home[cand]
    o = np.lexsort((keys[cand], ~from_guest, -val, cg))
    cand, cg = cand[o], cg[o]
    n_in = np.bincount(cg, minlength=short.shape[0])
    start = np.cumsum(n_in) - n_in
    within = np.arange(cand.shape[0]) - start[cg]
    drop = within >= n_in[cg] - short[cg]
    want[cand[drop]] = own[cand[drop]]
