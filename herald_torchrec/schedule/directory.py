"""The ownership directory: which rank owns every row of every managed table, and the per-rank guest caches.

Every row has exactly one owner (docs/ARCHITECTURE.md §2). Initially the owner is the row's *home*: TorchRec's
ROW_WISE block (`block = ceil(rows / R)`, `home = row // block`). Besides its home rows, a rank may own up to
`capacity[t] = ceil(cache_ratio * rows[t])` *guest* rows of table t. Memory is O(rows + guests held): owner, home,
last use, slot position per row, plus slots for the guests held (a row is a guest of at most one rank, so this is
O(rows) at any R; reserving R x sum(capacity) slots up front cost 11.9 GB at R=256 on full Criteo Kaggle tables,
over 97 % of them empty).

`GuestSlots` keeps the guests of every (rank, table) group packed at the front of a region of its own, which grows
by doubling as guests arrive, so that a group's members can be listed without scanning the table; removals are
vectorised swap-removes, insertions appends.
numpy only (the kernels in native.py do the same for HeraldPolicy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from herald_torchrec.schedule.global_batch import TableLayout


def guest_capacity(table_rows: Sequence[int], cache_ratio: float) -> np.ndarray:
    """ceil(cache_ratio * rows) per table, int64 (rounded so that 0.1 * 10 is 1, not 2)."""
    check_cache_ratio(cache_ratio)
    return np.array([math.ceil(round(cache_ratio * r, 9)) for r in table_rows], dtype=np.int64)


def check_cache_ratio(cache_ratio: float) -> None:
    if not isinstance(cache_ratio, (int, float)) or not math.isfinite(cache_ratio) or not 0.0 <= cache_ratio <= 1.0:
        raise ValueError(
            f"cache_ratio must be a number in [0, 1] (share of a table's rows per rank), got {cache_ratio!r}"
        )


def home_blocks(table_rows: Sequence[int], num_ranks: int) -> np.ndarray:
    """ROW_WISE block size per table: ceil(rows / R)."""
    return np.array([-(-int(r) // num_ranks) for r in table_rows], dtype=np.int64)


class GuestSlots:
    """Members of G groups, each packed at the front of its own region: group g lives in
    slot[base[g] : base[g] + fill[g]], with room for alloc[g] >= fill[g] members before its region must grow.

    `pos_of[key]` is the slot of a member key (-1 otherwise); a key belongs to at most one group. `cap[g]` bounds
    a group's members; regions are reserved as members arrive (`reserve`), not for the whole capacity, so memory
    is O(keys + members held): a region that must grow is moved, members in order, to a region twice its size at
    the end of the slot array (the old one is left as garbage), and the array is compacted (every region copied in
    group order) when the end has no room. Members keep their order within a group, which is all that the ties of
    `pick_victims` look at, so where regions lie never changes a choice. `generation` counts the replacements of
    the arrays (the compiled kernels hold their addresses: schedule/native.py).
    """

    MIN_REGION = 8  # slots a group's first region holds (fewer if its capacity is smaller)

    def __init__(self, capacity: np.ndarray, num_keys: int, payload: Sequence[str] = ()) -> None:
        self.cap = np.asarray(capacity, dtype=np.int64)
        G = self.cap.shape[0]
        self.base = np.zeros(G, dtype=np.int64)
        self.alloc = np.zeros(G, dtype=np.int64)
        self.fill = np.zeros(G, dtype=np.int64)
        # slots used by regions, live or garbage: [top, len(slot)) is free (an array: the kernels grow regions too)
        self.top_cell = np.zeros(1, dtype=np.int64)
        self.slot = np.full(0, -1, dtype=np.int64)
        self.group_of_slot = np.full(0, -1, dtype=np.int32)  # the group whose region holds each slot (-1: none)
        # int32 positions where they fit: the per-worker caches of the HET-style policies index R x rows keys
        n_slots = int(self.cap.sum())  # the most slots ever in use: every group full, the array compacted twice
        self.pos_of = np.full(num_keys, -1, dtype=np.int32 if 2 * n_slots < 2**31 - 1 else np.int64)
        # per-slot values that travel with their key (e.g. cached version, last use)
        self.payload = {name: np.zeros(0, dtype=np.int64) for name in payload}
        self.generation = 0

    @property
    def top(self) -> int:
        return int(self.top_cell[0])

    @top.setter
    def top(self, value: int) -> None:
        self.top_cell[0] = value

    @property
    def num_groups(self) -> int:
        return int(self.cap.shape[0])

    def members(self, g: int) -> np.ndarray:
        return self.slot[self.base[g] : self.base[g] + self.fill[g]]

    def ranges(self, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slot positions of all members of `groups` (concatenated) and the group of each."""
        n = self.fill[groups]
        tot = int(n.sum())
        grp = np.repeat(groups, n)
        within = np.arange(tot, dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        return self.base[grp] + within, grp

    def remove(self, keys: np.ndarray, groups: np.ndarray) -> None:
        """Remove member keys (each in the given group) — vectorised swap-remove keeping groups packed: the last
        members of a group fill its holes, in order (holes and movers both listed region by region)."""
        if keys.shape[0] == 0:
            return
        pos = self.pos_of[keys]
        if (pos < 0).any():
            raise RuntimeError("GuestSlots.remove: key is not a member")
        d = np.bincount(groups, minlength=self.num_groups)
        new_fill = self.fill - d
        self.slot[pos] = -1
        self.pos_of[keys] = -1
        holes = np.sort(pos[pos < self.base[groups] + new_fill[groups]])  # regions are disjoint: by region
        ug = np.flatnonzero(d)
        ug = ug[np.argsort(self.base[ug], kind="stable")]  # movers region by region too
        tail_pos, _ = concat_ranges(self.base[ug] + new_fill[ug], d[ug])
        movers = tail_pos[self.slot[tail_pos] >= 0]
        if holes.shape[0] != movers.shape[0]:  # pragma: no cover - invariant
            raise RuntimeError("GuestSlots.remove: hole/mover mismatch")
        if holes.shape[0]:
            moved = self.slot[movers]
            self.slot[holes] = moved
            self.slot[movers] = -1
            self.pos_of[moved] = holes
            for a in self.payload.values():
                a[holes] = a[movers]
        self.fill[:] = new_fill  # in place: the compiled kernels hold its address (schedule/native.py)

    def reserve(self, need: np.ndarray) -> None:
        """Regions with room for need[g] members of every group g (need <= cap): the regions too small move to the
        end of the slot array at max(need, twice their size) slots (at most the capacity); where the end has no
        room, every region is laid out again, in group order, into an array twice the slots they then reserve."""
        grow = np.flatnonzero(need > self.alloc)
        if grow.shape[0] == 0:
            return
        if (need[grow] > self.cap[grow]).any():
            raise RuntimeError("GuestSlots.reserve: group over capacity")
        size = np.minimum(self.cap[grow], np.maximum(need[grow], np.maximum(2 * self.alloc[grow], self.MIN_REGION)))
        total = int(size.sum())
        if self.top + total <= self.slot.shape[0]:
            new_base = self.top + np.cumsum(size) - size
            self._move(grow, new_base, size)
            self.top += total
            return
        alloc = self.alloc.copy()
        alloc[grow] = size
        new_base = np.cumsum(alloc) - alloc
        used = int(alloc.sum())
        old_slot = self.slot
        old_payload = self.payload
        self.slot = np.full(2 * used, -1, dtype=np.int64)
        self.group_of_slot = np.full(2 * used, -1, dtype=np.int32)
        self.group_of_slot[:used] = np.repeat(np.arange(self.num_groups, dtype=np.int32), alloc)
        self.payload = {name: np.zeros(2 * used, dtype=np.int64) for name in old_payload}
        live = np.flatnonzero(self.fill)
        src, _ = concat_ranges(self.base[live], self.fill[live])
        dst, _ = concat_ranges(new_base[live], self.fill[live])
        keys = old_slot[src]
        self.slot[dst] = keys
        self.pos_of[keys] = dst
        for name, a in old_payload.items():
            self.payload[name][dst] = a[src]
        self.base[:] = new_base  # in place: the compiled kernels hold their addresses
        self.alloc[:] = alloc
        self.top = used
        self.generation += 1

    def _move(self, groups: np.ndarray, new_base: np.ndarray, size: np.ndarray) -> None:
        """Move the members of `groups` (in order) to regions of `size` slots at `new_base`, in the array's free
        end; their old regions become garbage (until the next compaction)."""
        n = self.fill[groups]
        src, _ = concat_ranges(self.base[groups], n)
        dst, _ = concat_ranges(new_base, n)
        keys = self.slot[src]
        self.slot[dst] = keys
        self.pos_of[keys] = dst
        for a in self.payload.values():
            a[dst] = a[src]
        old, _ = concat_ranges(self.base[groups], self.alloc[groups])
        self.slot[old] = -1
        self.group_of_slot[old] = -1
        region, idx = concat_ranges(new_base, size)
        self.group_of_slot[region] = groups[idx].astype(np.int32)
        self.base[groups] = new_base
        self.alloc[groups] = size

    def add(self, keys: np.ndarray, groups: np.ndarray) -> np.ndarray:
        """Append keys to their groups (caller guarantees room); returns their slots (in the input order)."""
        if keys.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        order = np.argsort(groups.astype(np.int16) if self.num_groups < 2**15 else groups, kind="stable")  # radix
        k, g = keys[order], groups[order]
        a = np.bincount(g, minlength=self.num_groups)
        if (self.fill + a > self.cap).any():
            raise RuntimeError("GuestSlots.add: group over capacity")
        self.reserve(self.fill + a)
        first = np.cumsum(a) - a
        within = np.arange(k.shape[0], dtype=np.int64) - first[g]
        pos = self.base[g] + self.fill[g] + within
        self.slot[pos] = k
        self.pos_of[k] = pos
        self.fill += a
        out = np.empty_like(pos)
        out[order] = pos
        return out

    def pick_victims(self, groups: np.ndarray, need: np.ndarray, priority: "callable") -> np.ndarray:
        """Slots of the `need[i]` lowest-priority members of each `groups[i]`.

        `priority(pos)` gives an int64 per member slot: lower is evicted first; values < 0 mark members that must
        stay (they are never picked). Ties go to the lower slot. Fewer are returned where a group lacks candidates.
        O(members of the groups); `eviction.EvictionPool` gives the same victims from a few candidates per group.
        """
        keep = need > 0
        groups, need = groups[keep], need[keep]
        if groups.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        pos, idx = self.ranges_idx(groups)
        prio = priority(pos)
        ok = prio >= 0
        pos, idx, prio = pos[ok], idx[ok], prio[ok]
        if pos.shape[0] == 0:
            return pos
        G, P = groups.shape[0], int(prio.max()) + 1
        if G * P <= min(1 << 22, 2 * pos.shape[0]):  # many members per priority level: counting beats sorting
            # counting selection, O(members + G x P): per group, the priority threshold below which every member
            # goes, then members at the threshold in slot order (members are listed in slot order per group)
            cnt = np.bincount(idx * P + prio, minlength=G * P).reshape(G, P)
            cum = np.cumsum(cnt, axis=1)
            enough = cum >= need[:, None]
            thr = np.where(enough.any(axis=1), np.argmax(enough, axis=1), P)
            below = np.where(thr > 0, cum[np.arange(G), np.maximum(thr - 1, 0)], 0)
            t = thr[idx]
            tie = prio == t
            tie_rank = np.cumsum(tie) - 1
            start = np.zeros(G, dtype=np.int64)
            tie_counts = np.bincount(idx[tie], minlength=G)
            start[1:] = np.cumsum(tie_counts)[:-1]
            within = tie_rank - start[idx]
            take = (prio < t) | (tie & (within < (need - below)[idx]))
            return pos[take]
        return self.lowest_per_group(pos, idx, prio, need)

    @staticmethod
    def lowest_per_group(pos: np.ndarray, idx: np.ndarray, prio: np.ndarray, need: np.ndarray) -> np.ndarray:
        """Per group index i, the `need[i]` members of lowest (priority, slot) among (pos, idx, prio >= 0)."""
        G, P, S = need.shape[0], int(prio.max()) + 1, int(pos.max()) + 1
        if G * P * S < 2**62:  # slots are unique: one sort of packed (group, priority, slot) values orders them all
            packed = np.sort((idx * P + prio) * S + pos)
            pos, idx = packed % S, packed // (P * S)
        else:
            order = np.lexsort((pos, prio, idx))
            pos, idx = pos[order], idx[order]
        first = np.searchsorted(idx, np.arange(G))
        within = np.arange(pos.shape[0]) - first[idx]
        return pos[within < need[idx]]

    def ranges_idx(self, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Like `ranges` but returns the index into `groups` of every slot."""
        n = self.fill[groups]
        return concat_ranges(self.base[groups], n)


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenation of arange(s, s+n) for every (s, n), and the index of the range of each element."""
    lengths = np.asarray(lengths, dtype=np.int64)
    tot = int(lengths.sum())
    idx = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), lengths)
    within = np.arange(tot, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + within, idx


@dataclass
class Arrivals:
    """Rows that arrived as guests in one `apply_known_moves`: their slots, keys and groups (aligned, int64)."""

    pos: np.ndarray
    keys: np.ndarray
    groups: np.ndarray


class OwnershipDirectory:
    """Owner rank of every row of every table, home placement, guest capacity and replacement state.

    Rows are addressed by global id (`TableLayout`: gid = offsets[t] + row). `owner`, `home` are int32 [rows],
    `last_use` int32 [rows] (step of the last read, -1 never), `table` int16 [rows]. Guests of rank r in table t form
    group r*T + t of `slots`; `guests()` returns their count [R, T].
    """

    def __init__(self, table_rows: Sequence[int] | TableLayout, num_ranks: int, cache_ratio: float) -> None:
        self.layout = table_rows if isinstance(table_rows, TableLayout) else TableLayout(tuple(table_rows))
        if not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
            raise ValueError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
        self.num_ranks = R = int(num_ranks)
        check_cache_ratio(cache_ratio)
        self.cache_ratio = float(cache_ratio)
        T = self.layout.num_tables
        rows = np.array(self.layout.table_rows, dtype=np.int64)
        self.capacity = guest_capacity(self.layout.table_rows, cache_ratio)  # [T]
        self.block = home_blocks(self.layout.table_rows, R)  # [T]
        n = self.layout.total_rows
        tab = np.repeat(np.arange(T, dtype=np.int64), rows)
        self.table = tab.astype(np.int16 if T < 2**15 else np.int32)  # table of every gid
        local = np.arange(n, dtype=np.int64) - self.layout.offsets[tab]
        self.home = (local // self.block[tab]).astype(np.int32)
        self.owner = self.home.copy()
        self.last_use = np.full(n, -1, dtype=np.int32)  # step of the last read (steps < 2^31)
        self.slots = GuestSlots(np.tile(self.capacity, R), n)

    @property
    def num_tables(self) -> int:
        return self.layout.num_tables

    def group(self, rank: np.ndarray, gid: np.ndarray) -> np.ndarray:
        """guest group (rank * T + table) of rows."""
        return np.asarray(rank, dtype=np.int64) * self.num_tables + self.table[gid]

    def guests(self) -> np.ndarray:
        """Guest rows per (rank, table), int64 [R, T]."""
        return self.slots.fill.reshape(self.num_ranks, self.num_tables).copy()

    def is_guest(self, gid: np.ndarray) -> np.ndarray:
        return self.owner[gid] != self.home[gid]

    def apply_moves(self, gid: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Apply moves simultaneously: every row leaves its owner, then arrives at dst (capacity checked). Returns
        the slots of the rows that arrived as guests."""
        gid = np.asarray(gid, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        if gid.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        src = self.owner[gid].astype(np.int64)
        return self.apply_known_moves(gid, dst, src, self.home[gid], self.table[gid]).pos

    def apply_known_moves(
        self, gid: np.ndarray, dst: np.ndarray, src: np.ndarray, home: np.ndarray, table: np.ndarray
    ) -> "Arrivals":
        """`apply_moves` where the caller already has the rows' current owner `src`, home rank and table (aligned
        with gid), which saves reading them from the arrays over every row (random reads: herald_hier's union of
        the hosts' parts). Returns the guests that arrived: their slots, rows and groups. A herald_hier host that
        keeps its own ranks' guests only applies the two halves with its ranks (`release_guests`, `land_guests`)."""
        self.release_guests(gid, src, home, table, None)
        return self.land_guests(gid, dst, home, table, None)

    def release_guests(
        self, gid: np.ndarray, src: np.ndarray, home: np.ndarray, table: np.ndarray, ranks: tuple[int, int] | None
    ) -> None:
        """The first half of `apply_known_moves`: the moving rows leave their owners' guest groups (those of ranks
        lo..hi-1 only, with `ranks`). Every half of a step's moves must leave before any arrives: several herald_hier
        hosts applying their own moves to one directory (the simulator) call this for every host first."""
        leave = src != home
        if ranks is not None:
            leave &= (src >= ranks[0]) & (src < ranks[1])
        self.slots.remove(gid[leave], src[leave] * self.num_tables + table[leave])

    def land_guests(
        self, gid: np.ndarray, dst: np.ndarray, home: np.ndarray, table: np.ndarray, ranks: tuple[int, int] | None
    ) -> "Arrivals":
        """The second half of `apply_known_moves`: every row's new owner, and the guests' slots in their groups
        (those of ranks lo..hi-1 only, with `ranks`)."""
        arrive = dst != home
        if ranks is not None:
            arrive &= (dst >= ranks[0]) & (dst < ranks[1])
        self.owner[gid] = dst.astype(np.int32)
        keys, groups = gid[arrive], dst[arrive] * self.num_tables + table[arrive]
        return Arrivals(pos=self.slots.add(keys, groups), keys=keys, groups=groups)

    def occupancy(self, ranks: np.ndarray | None = None) -> dict:
        """Guest occupancy summary: guests / capacity over the (rank, table) groups with capacity of `ranks` (default
        every rank; a herald_hier host's replica keeps its own ranks' guests only)."""
        ranks = np.arange(self.num_ranks) if ranks is None else np.asarray(ranks, dtype=np.int64)
        T = self.num_tables
        cap = np.tile(self.capacity, ranks.shape[0])
        used = self.slots.fill.reshape(self.num_ranks, T)[ranks].ravel()
        tot = int(cap.sum())
        return {"guests": int(used.sum()), "capacity": tot, "fill": float(used.sum() / tot) if tot else 0.0}

    def nbytes(self) -> int:
        return int(
            sum(
                a.nbytes for a in (self.table, self.home, self.owner, self.last_use, self.slots.slot, self.slots.pos_of)
            )
        )
