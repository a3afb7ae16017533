"""Control-plane building blocks: GlobalBatch (CSR), distinct keys / reader sets, the ownership directory, LAIA."""

from __future__ import annotations

from operator import attrgetter

import numpy as np
import pytest

from herald_torchrec import _native
from herald_torchrec.schedule.directory import GuestSlots, OwnershipDirectory, guest_capacity
from herald_torchrec.schedule.global_batch import GlobalBatch, TableLayout
from herald_torchrec.schedule.herald.eviction import EvictionPool
from herald_torchrec.schedule.herald.laia import balanced_assign
from herald_torchrec.schedule.reads import Scratch, batch_keys, packed_distinct, packed_order, stable_order, step_reads

ROWS = [5, 40, 1000]


def dense_ids(n: int, rows=ROWS, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.integers(0, r, n) for r in rows], axis=1).astype(np.int64)


# ---- GlobalBatch ------------------------------------------------------------------------------------------------
def test_from_dense_is_csr_single_hot():
    ids = dense_ids(12)
    b = GlobalBatch.from_dense(ids, ROWS)
    assert b.num_samples == 12 and b.num_tables == 3 and b.single_hot()
    for t in range(3):
        assert b.offsets[t].dtype == np.int64 and b.values[t].dtype == np.int64
        np.testing.assert_array_equal(b.offsets[t], np.arange(13))
        np.testing.assert_array_equal(b.values[t], ids[:, t])
    smp, tab, gid = b.flat()
    assert smp.dtype == tab.dtype == gid.dtype == np.int64
    off = TableLayout(ROWS).offsets
    np.testing.assert_array_equal(gid, (ids + off[:-1]).ravel())


def test_from_dense_takes_the_callers_columns():
    """`columns`: the caller's contiguous ids per table (no transposed copy), the same batch; malformed ones raise."""
    ids = dense_ids(12)
    cols = [np.ascontiguousarray(ids[:, t]) for t in range(3)]
    b = GlobalBatch.from_dense(ids, ROWS, columns=cols, range_checked=True)
    ref = GlobalBatch.from_dense(ids, ROWS)
    for t in range(3):
        assert b.values[t] is cols[t]
        np.testing.assert_array_equal(b.values[t], ref.values[t])
    np.testing.assert_array_equal(b.flat()[2], ref.flat()[2])
    with pytest.raises(ValueError, match="columns must be 3 int64 arrays of 12 ids"):
        GlobalBatch.from_dense(ids, ROWS, columns=cols[:2])


def test_jagged_batch_flat_and_take():
    offs = [np.array([0, 2, 2, 3], dtype=np.int64), np.array([0, 1, 2, 3], dtype=np.int64)]
    vals = [np.array([1, 4, 0], dtype=np.int64), np.array([7, 7, 39], dtype=np.int64)]
    b = GlobalBatch(offs, vals, [5, 40])
    assert not b.single_hot()
    smp, tab, gid = b.flat()
    np.testing.assert_array_equal(smp, [0, 0, 2, 0, 1, 2])
    np.testing.assert_array_equal(gid, [1, 4, 0, 12, 12, 44])
    sub = b.take(np.array([2, 0]))
    np.testing.assert_array_equal(sub.offsets[0], [0, 1, 3])
    np.testing.assert_array_equal(sub.values[0], [0, 1, 4])


@pytest.mark.parametrize(
    "ids, match",
    [
        (np.array([[0, 1, -1]], dtype=np.int64), "negative id"),
        (np.array([[0, 40, 3]], dtype=np.int64), "out of range"),
        (np.array([[0.0, 1.0, 2.0]]), "int64"),
        (np.array([[0, 1]], dtype=np.int64), "tables"),
        (np.zeros((0, 3), dtype=np.int64), "N >= 1"),
    ],
)
def test_from_dense_rejects_bad_ids(ids, match):
    with pytest.raises(ValueError, match=match):
        GlobalBatch.from_dense(ids, ROWS)


def test_jagged_rejects_bad_offsets():
    with pytest.raises(ValueError, match="offsets"):
        GlobalBatch([np.array([0, 3, 2], dtype=np.int64)], [np.array([0, 1], dtype=np.int64)], [5])
    with pytest.raises(ValueError, match="samples"):
        GlobalBatch(
            [np.array([0, 1], dtype=np.int64), np.array([0, 1, 2], dtype=np.int64)],
            [np.array([0], dtype=np.int64), np.array([0, 1], dtype=np.int64)],
            [5, 5],
        )
    with pytest.raises(ValueError, match="at least one table"):
        TableLayout([])
    with pytest.raises(ValueError, match=">= 1 row"):
        TableLayout([3, 0])


def test_large_ids_stay_exact():
    rows = [2**40]
    ids = np.array([[2**40 - 1], [2**24 + 1]], dtype=np.int64)
    b = GlobalBatch.from_dense(ids, rows)
    bk = batch_keys(b, Scratch(16))  # sparse path (rows >> elements)
    np.testing.assert_array_equal(bk.keys, [2**24 + 1, 2**40 - 1])


# ---- distinct keys and reader sets ---------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [ROWS, [10**7, 3], [2**25, 3]])  # bitmap; hash table, or scratch and packed sort
@pytest.mark.parametrize("compiled", [None, False])  # the kernels where this machine builds them; numpy
def test_batch_keys_and_step_reads_match_bruteforce(rows, compiled):
    R, B = 4, 16
    ids = dense_ids(R * B, rows, seed=3)
    b = GlobalBatch.from_dense(ids, rows)
    _native.set_mode(compiled)
    try:
        bk = batch_keys(b, Scratch(8))
    finally:
        _native.set_mode(None)
    _, _, gid = b.flat()
    np.testing.assert_array_equal(bk.keys, np.unique(gid))
    np.testing.assert_array_equal(bk.keys[bk.cid], gid)
    np.testing.assert_array_equal(bk.count, np.unique(gid, return_counts=True)[1])
    rank = np.random.default_rng(1).permutation(np.repeat(np.arange(R), B))
    rd = step_reads(bk, rank, R)
    smp, _, _ = b.flat()
    codes = np.unique(gid * R + rank[smp])
    np.testing.assert_array_equal(bk.keys[rd.pair_key] * R + rd.pair_rank, codes)
    np.testing.assert_array_equal(rd.count, np.bincount(rd.pair_key, minlength=bk.keys.shape[0]))


@pytest.mark.parametrize("high", [3, 2**15, 2**40])  # radix (int16), packed, packed
def test_stable_order_and_packed_distinct_match_numpy(high):
    v = np.random.default_rng(5).integers(0, high, 5000)
    np.testing.assert_array_equal(stable_order(v), np.argsort(v, kind="stable"))  # ties keep their order
    keys, cid, cnt = packed_distinct(v)
    u, inv, c = np.unique(v, return_inverse=True, return_counts=True)
    np.testing.assert_array_equal(keys, u)
    np.testing.assert_array_equal(cid, inv.reshape(-1))
    np.testing.assert_array_equal(cnt, c)


def test_stable_order_of_a_few_sorted_runs(monkeypatch):
    """Several hosts' sorted messages concatenated (8 runs, ties within and across runs) take numpy's merge sort, not
    the packed sort, and come out as np.argsort(kind="stable") would order them."""
    from herald_torchrec.schedule import reads

    rng = np.random.default_rng(6)
    v = np.concatenate([np.sort(rng.integers(0, 2**40, 700) // 2**30) * 2**30 for _ in range(8)])
    monkeypatch.setattr(reads, "packed_order", lambda values: pytest.fail("sorted runs went to the packed sort"))
    np.testing.assert_array_equal(stable_order(v), np.argsort(v, kind="stable"))
    assert stable_order(np.array([7])).tolist() == [0]


def test_packed_sorts_decline_values_too_wide_to_pack():
    v = np.array([2**61, 5, 2**61, 0], dtype=np.int64)  # 62 value bits + 2 index bits > 62
    assert packed_order(v) is None and packed_distinct(v) is None
    np.testing.assert_array_equal(stable_order(v), [3, 1, 0, 2])  # the merge sort then
    rows = [2**62]
    b = GlobalBatch.from_dense(v[:, None], rows)
    np.testing.assert_array_equal(batch_keys(b, Scratch(16)).keys, [0, 5, 2**61])  # np.unique then


# ---- directory ----------------------------------------------------------------------------------------------------
def test_home_is_torchrec_row_wise_block_and_capacity_rounding():
    d = OwnershipDirectory([10, 7], num_ranks=3, cache_ratio=0.1)
    # block = ceil(10/3) = 4 -> homes 0,0,0,0,1,1,1,1,2,2 ; ceil(7/3) = 3 -> 0,0,0,1,1,1,2
    np.testing.assert_array_equal(d.home, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 0, 0, 0, 1, 1, 1, 2])
    np.testing.assert_array_equal(d.owner, d.home)
    np.testing.assert_array_equal(d.capacity, [1, 1])  # ceil(0.1 * 10) is 1, not 2; ceil(0.7) = 1
    np.testing.assert_array_equal(guest_capacity([10, 100, 3], 0.25), [3, 25, 1])
    assert d.guests().sum() == 0


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan"), "0.1", None])
def test_bad_cache_ratio(ratio):
    with pytest.raises(ValueError, match="cache_ratio"):
        OwnershipDirectory([10], num_ranks=2, cache_ratio=ratio)


def test_directory_moves_respect_capacity():
    d = OwnershipDirectory([20], num_ranks=2, cache_ratio=0.1)  # capacity 2 guests per rank
    d.apply_moves(np.array([0, 1]), np.array([1, 1]))  # rows 0, 1 (home 0) become guests of rank 1
    assert d.guests()[1, 0] == 2 and d.owner[0] == 1
    with pytest.raises(RuntimeError, match="capacity"):
        d.apply_moves(np.array([2]), np.array([1]))
    # simultaneous: row 0 goes home while row 3 arrives -> fits
    d.apply_moves(np.array([0, 3]), np.array([0, 1]))
    assert d.guests()[1, 0] == 2 and d.owner[0] == 0 and d.owner[3] == 1


def test_a_host_keeps_its_own_ranks_guests_and_the_owners_it_is_given():
    """`release_guests` / `land_guests` with ranks (lo, hi) (a herald_hier host's replica): the rows given all change
    owner, but only the guest groups of ranks lo..hi-1 change, exactly as the whole update leaves them; two hosts
    applying their halves to one directory (every release first) leave it as the whole update does."""
    rows, R = [40, 24], 4  # blocks of 10 and 6 rows: homes 0..3
    rng = np.random.default_rng(2)
    whole, mine, both = (OwnershipDirectory(rows, num_ranks=R, cache_ratio=0.5) for _ in range(3))
    T = 2
    for _ in range(6):
        gid = np.sort(rng.choice(64, 12, replace=False))
        dst = rng.integers(0, R, 12)
        src, home, table = whole.owner[gid].astype(np.int64), whole.home[gid].astype(np.int64), whole.table[gid]
        table = table.astype(np.int64)
        whole.apply_known_moves(gid, dst, src, home, table)
        mine.release_guests(gid, src, home, table, (0, 2))
        mine.land_guests(gid, dst, home, table, (0, 2))
        for lo_hi in ((0, 2), (2, 4)):
            both.release_guests(gid, src, home, table, lo_hi)
        for lo_hi in ((0, 2), (2, 4)):
            both.land_guests(gid, dst, home, table, lo_hi)
        assert np.array_equal(mine.owner, whole.owner) and np.array_equal(both.owner, whole.owner)
        for g in range(R * T):
            assert np.array_equal(both.slots.members(g), whole.slots.members(g))
            if g < 2 * T:  # ranks 0 and 1
                assert np.array_equal(mine.slots.members(g), whole.slots.members(g))
    assert whole.slots.fill[2 * T :].sum() > 0 and mine.slots.fill[2 * T :].sum() == 0  # the others' guests: not kept


def test_guest_slots_random_ops_keep_groups_packed():
    rng = np.random.default_rng(0)
    cap = np.array([5, 0, 8, 3])
    gs = GuestSlots(cap, 100, payload=("last",))
    member = {}
    for _ in range(200):
        if member and rng.random() < 0.5:
            ks = rng.choice(sorted(member), size=min(len(member), int(rng.integers(1, 4))), replace=False)
            gs.remove(ks, np.array([member[k] for k in ks]))
            for k in ks:
                del member[k]
        else:
            g = int(rng.integers(0, 4))
            free = [k for k in range(100) if k not in member]
            n = min(int(cap[g] - gs.fill[g]), int(rng.integers(0, 3)), len(free))
            ks = rng.choice(free, size=n, replace=False)
            pos = gs.add(ks, np.full(n, g))
            gs.payload["last"][pos] = ks * 10
            for k in ks:
                member[k] = g
        for g in range(4):
            m = gs.members(g)
            assert (m >= 0).all() and len(m) == gs.fill[g] <= cap[g]
            assert sorted(m.tolist()) == sorted(k for k, gg in member.items() if gg == g)
            np.testing.assert_array_equal(gs.payload["last"][gs.pos_of[m]], m * 10)  # payload moved with keys


def test_guest_slots_hold_memory_for_the_guests_held_not_the_capacity():
    """At R=256 a directory reserved one slot per rank per cacheable row (R x sum(capacity), here 5.1 M slots, 41 MB
    of int64 plus the eviction pool's 20 MB group map) though a row is a guest of one rank at most: the slots now
    grow with the guests held."""
    R, rows = 256, [50_000] * 4
    d = OwnershipDirectory(rows, R, cache_ratio=0.1)
    pool = EvictionPool(d.slots, d.last_use)
    G = d.slots.num_groups
    rng = np.random.default_rng(0)
    gid = rng.choice(d.layout.total_rows, 3000, replace=False)
    dst = (d.home[gid].astype(np.int64) + 1 + rng.integers(0, R - 1, 3000)) % R  # never home: 3000 guests
    pool.arrived(d.apply_moves(gid, dst))
    held = int(d.slots.fill.sum())
    assert held == 3000
    bound = 2 * (2 * held + 8 * G)  # regions at most twice their members (or MIN_REGION = 8), the array twice those
    assert d.slots.slot.shape[0] <= bound and pool.group_of_slot.shape[0] <= bound
    assert d.nbytes() < 5_000_000  # 18 bytes per row (3.6 MB) + the slots held; reserving them all: 45 MB
    np.testing.assert_array_equal(d.slots.slot[d.slots.pos_of[gid]], gid)
    np.testing.assert_array_equal(d.slots.group_of_slot[d.slots.pos_of[gid]], d.group(dst, gid))


@pytest.mark.parametrize("seed", [0, 1])
def test_guest_slots_grow_and_compact_keeping_member_order(seed):
    """Regions move as they grow (and the array compacts): members stay packed, keep their payload, their group's
    slot map and their order within the group (the ties of pick_victims go to the lower slot)."""
    rng = np.random.default_rng(seed)
    cap = np.array([0, 3, 40, 200, 1000, 17])
    G, n_keys = cap.shape[0], 5000
    gs = GuestSlots(cap, n_keys, payload=("last",))
    order = {g: [] for g in range(G)}  # members of every group in slot order, as a reference
    group_of = np.full(n_keys, -1)
    generations = set()
    for _ in range(120):
        ks = np.flatnonzero(group_of >= 0)
        if ks.shape[0] and rng.random() < 0.4:
            out = rng.choice(ks, size=min(ks.shape[0], int(rng.integers(1, 60))), replace=False)
            gs.remove(out, group_of[out])
            for g in set(group_of[out].tolist()):  # swap-remove: the last members fill the holes, in order
                mem = gs.members(g).tolist()
                assert sorted(mem) == sorted(set(order[g]) - set(out.tolist()))
                order[g] = mem
            group_of[out] = -1
        else:
            free = np.flatnonzero(group_of < 0)
            g = rng.integers(0, G, int(rng.integers(1, 120)))
            room = cap - gs.fill
            take = np.zeros(g.shape[0], dtype=bool)
            for i, x in enumerate(g.tolist()):
                if room[x] > 0:
                    take[i], room[x] = True, room[x] - 1
            g = g[take]
            ks = rng.choice(free, g.shape[0], replace=False)
            before = {x: gs.members(x).tolist() for x in range(G)}
            pos = gs.add(ks, g)
            gs.payload["last"][pos] = ks * 10
            for x in range(G):  # old members first, in their order, then the arrivals in input order
                assert gs.members(x).tolist() == before[x] + ks[g == x].tolist()
                order[x] = gs.members(x).tolist()
            group_of[ks] = g
        generations.add(gs.generation)
        for x in range(G):
            m = gs.members(x)
            assert m.tolist() == order[x] and gs.fill[x] <= gs.alloc[x] <= cap[x]
            np.testing.assert_array_equal(gs.payload["last"][gs.pos_of[m]], m * 10)
            np.testing.assert_array_equal(gs.group_of_slot[gs.base[x] : gs.base[x] + gs.alloc[x]], x)
        assert (gs.pos_of[group_of < 0] == -1).all()
        reg = np.stack([gs.base, gs.base + gs.alloc], axis=1)[np.argsort(gs.base)]  # disjoint, below `top`
        assert (reg[1:, 0] >= reg[:-1, 1]).all() and reg[-1, 1] <= gs.top <= gs.slot.shape[0]
    assert len(generations) > 2  # the array was replaced (compacted) several times


def test_pick_victims_lowest_priority_first():
    gs = GuestSlots(np.array([4, 4]), 20)
    gs.add(np.array([1, 2, 3, 4, 5, 6]), np.array([0, 0, 0, 0, 1, 1]))
    prio = {1: 5, 2: -1, 3: 0, 4: 5, 5: 2, 6: 1}
    pos = gs.pick_victims(np.array([0, 1]), np.array([2, 5]), lambda p: np.array([prio[int(k)] for k in gs.slot[p]]))
    got = sorted(gs.slot[pos].tolist())
    assert got == [1, 3, 5, 6]  # group 0: prio 0 then the first of the two 5s (lower slot); 2 is pinned


@pytest.mark.parametrize("top", [6, 10**7, 10**17])  # counting selection / one packed sort / lexsort (no room to pack)
def test_pick_victims_matches_a_sort(top):
    rng = np.random.default_rng(5)
    cap = rng.integers(0, 30, 12)
    gs = GuestSlots(cap, 1000)
    keys = rng.permutation(1000)
    k = 0
    for g in range(12):
        n = int(rng.integers(0, cap[g] + 1))
        gs.add(keys[k : k + n], np.full(n, g))
        k += n
    pr = rng.integers(-1, top, 1000)
    groups = np.arange(12)
    need = rng.integers(0, 12, 12)
    got = set(gs.slot[gs.pick_victims(groups, need, lambda p: pr[gs.slot[p]])].tolist())
    want = set()
    for g in range(12):
        m = [int(x) for x in gs.members(g) if pr[x] >= 0]
        m.sort(key=lambda x: (pr[x], gs.pos_of[x]))
        want |= set(m[: need[g]])
    assert got == want


@pytest.mark.parametrize("seed,pushed_share", [(0, 0.2), (1, 0.2), (2, 0.9), (3, 0.9)])
def test_eviction_pool_picks_what_a_full_selection_picks(seed, pushed_share):
    """Over a run of steps (reads raise floors, rows leave and come back with old floors, victims leave), the pool's
    victims equal a full selection's, with ties, pinned members, priorities far above their floor, groups smaller
    than a pool and groups that cannot fill `need`; small pools make rebuilds and overflows frequent."""
    rng = np.random.default_rng(seed)
    G, n_keys = 6, 3000
    cap = np.array([40, 3, 200, 90, 0, 120])
    gs = GuestSlots(cap, n_keys)
    group_of = np.full(n_keys, -1)
    floor = np.full(n_keys, -1, dtype=np.int64)  # the row's last use, wherever it is
    pool = EvictionPool(gs, floor, size=16)  # reads `floor` as it is at each call
    pushed = rng.random(n_keys) < pushed_share  # e.g. read again in the lookahead window

    def arrive(keys, g):
        pos = gs.add(keys, np.full(keys.shape[0], g))
        group_of[keys] = g
        pool.arrived(pos)

    for g in range(G):  # fill
        free = np.flatnonzero(group_of < 0)
        arrive(rng.choice(free, int(cap[g]), replace=False), g)
    for step in range(1, 60):
        read = rng.choice(n_keys, 150, replace=False)  # reads: the floor only grows
        floor[read] = step
        pinned = rng.random(n_keys) < 0.05

        def prio(p):
            key = gs.slot[p]
            return np.where((floor[key] == step) | pinned[key], -1, floor[key] + 1 + pushed[key] * 10_000)

        groups = np.arange(G)
        need = rng.integers(0, 25, G)
        need[step % G] = cap[step % G] + 2  # more than the group holds
        want = np.sort(gs.slot[gs.pick_victims(groups, need, prio)])
        got = gs.slot[pool.pick(groups, need, prio)]
        np.testing.assert_array_equal(np.sort(got), want)
        # the victims leave; as many rows arrive, some with old floors (a forwarded guest keeps its last use)
        left = group_of[want]
        gs.remove(want, left)
        group_of[want] = -1
        for g in range(G):
            room = int(gs.cap[g] - gs.fill[g])
            back = want[left == g][:room] if step % 3 == 0 else want[:0]  # rows that left and come back at once
            if back.shape[0]:
                arrive(back, g)
            room -= back.shape[0]
            if room:
                free = np.flatnonzero(group_of < 0)
                arrive(rng.choice(free, room, replace=False), g)
    assert pool.rebuilds > 0


def test_apply_moves_returns_the_slots_of_arriving_guests():
    d = OwnershipDirectory([300, 50, 7], num_ranks=3, cache_ratio=0.2)
    gid = np.array(
        [5, 120, 299, 310, 200]
    )  # table 0 rows 5, 120, 299 (homes 0, 1, 2), table 1 row 10 (home 0), row 200
    dst = np.array([1, 0, 2, 2, 1])  # row 299 stays at its home: not a guest; the other four arrive as guests
    pos = d.apply_moves(gid, dst)
    arrived = gid[[0, 1, 3, 4]]
    np.testing.assert_array_equal(d.slots.slot[pos], arrived)  # in input order
    np.testing.assert_array_equal(pos, d.slots.pos_of[arrived])
    assert d.apply_moves(np.zeros(0, np.int64), np.zeros(0, np.int64)).shape == (0,)


@pytest.mark.parametrize("seed", [0, 1])
def test_apply_known_moves_leaves_the_directory_apply_moves_leaves(seed):
    """The union's directory update (owner, home and table given, not read from the per-row arrays) makes the same
    owners, slots and pools as apply_moves, and reports the arriving guests' keys and groups."""
    rng = np.random.default_rng(seed)
    rows, R = [300, 50, 7], 3
    a, b = (OwnershipDirectory(rows, num_ranks=R, cache_ratio=0.2) for _ in range(2))
    pa, pb = (EvictionPool(d.slots, d.last_use, size=4) for d in (a, b))
    for p in (pa, pb):  # empty pools that every arrival joins (until one overflows)
        p.tau[:] = np.iinfo(np.int64).max
    for step in range(6):
        gid = np.sort(rng.choice(357, size=25, replace=False))
        dst = rng.integers(0, R, size=25)
        fits = np.bincount(a.group(dst, gid), minlength=R * 3) + a.slots.fill <= a.slots.cap  # room: the test's
        gid, dst = gid[fits[a.group(dst, gid)]], dst[fits[a.group(dst, gid)]]  # moves, not the capacity's
        a.last_use[gid] = b.last_use[gid] = step
        pa.arrived(a.apply_moves(gid, dst))
        got = b.apply_known_moves(gid, dst, b.owner[gid].astype(np.int64), b.home[gid], b.table[gid].astype(np.int64))
        pb.arrived(got.pos, got.keys, got.groups)
        np.testing.assert_array_equal(b.slots.slot[got.pos], got.keys)
        np.testing.assert_array_equal(got.groups, b.group(b.owner[got.keys], got.keys))
        for name in ("owner", "slots.slot", "slots.pos_of", "slots.fill"):
            np.testing.assert_array_equal(attrgetter(name)(a), attrgetter(name)(b), err_msg=name)
        for name in ("keys", "count", "tau"):
            np.testing.assert_array_equal(getattr(pa, name), getattr(pb, name), err_msg=name)
    assert a.slots.fill.sum() > 0 and pa.count.sum() > 0


# ---- LAIA -------------------------------------------------------------------------------------------------------
def test_balanced_assign_exact_sizes_and_optimum_when_obvious():
    R, B = 4, 8
    pref = np.repeat(np.arange(R), B)
    np.random.default_rng(0).shuffle(pref)
    score = np.zeros((R * B, R))
    score[np.arange(R * B), pref] = 3.0
    a = balanced_assign(score, B, first=2)
    np.testing.assert_array_equal(a, pref)
    # everyone prefers rank 0: still exactly B each, and the B with the largest regret win rank 0
    score = np.zeros((R * B, R))
    score[:, 0] = np.arange(R * B)
    a = balanced_assign(score, B)
    assert (np.bincount(a, minlength=R) == B).all()
    assert set(np.flatnonzero(a == 0)) == set(range(R * B - B, R * B))
    with pytest.raises(ValueError, match="cannot fill"):
        balanced_assign(np.zeros((10, 4)), 3)


@pytest.mark.parametrize("first", [0, 1])
def test_two_ranks_take_the_one_pass_with_the_rounds_answer(first):
    """At R=2 balanced_assign skips the general rounds (laia._two_ranks); on scores with many ties, all-equal rows,
    one-sided preferences, negative and float scores it assigns exactly what the rounds assign."""
    from herald_torchrec.schedule.herald import laia

    rng = np.random.default_rng(first)
    rot = np.array([first, 1 - first])
    for trial in range(300):
        B = int(rng.integers(1, 40))
        kind = trial % 4
        if kind == 0:  # small integers: ties everywhere
            score = rng.integers(-3, 4, (2 * B, 2)).astype(np.float64)
        elif kind == 1:  # one column preferred by most
            score = np.stack([rng.integers(0, 5, 2 * B), rng.integers(2, 9, 2 * B)], axis=1).astype(np.float64)
        elif kind == 2:  # floats of both signs
            score = rng.normal(0, 10, (2 * B, 2))
        else:  # rows of equal scores, some exactly balanced
            score = np.repeat(rng.integers(0, 3, (2 * B, 1)), 2, axis=1).astype(np.float64)
        got = balanced_assign(score, B, first=first)
        sc = np.roll(score.astype(np.float32), -first, axis=1)
        np.testing.assert_array_equal(got, laia._rounds(sc, B, rot))
        assert (np.bincount(got, minlength=2) == B).all()


def test_balanced_assign_ties_follow_the_rotation():
    a0 = balanced_assign(np.zeros((4, 2)), 2, first=0)
    a1 = balanced_assign(np.zeros((4, 2)), 2, first=1)
    np.testing.assert_array_equal(a0, [0, 0, 1, 1])
    np.testing.assert_array_equal(a1, [1, 1, 0, 0])


def test_stream_assign_gathers_samples_that_share_a_key():
    """A worked example of laia.stream_assign (3 ranks x 2 samples; weights 1 unless given):
    sample 0 reads key 0 (owned by rank 2) -> rank 2; sample 1 reads key 1 (no owner here) and scores nowhere -> the
    least loaded rank, the lowest: 0; sample 2 reads keys 1 and 2 -> rank 0, where sample 1 read key 1; sample 3 reads
    key 0 (at rank 2, owner) and key 1 (at rank 0: full) -> rank 2; sample 4 reads key 3 owned by rank 0 (full), so it
    scores at no open rank -> rank 1, the only one with room; so does sample 5."""
    from herald_torchrec.schedule.herald.laia import stream_assign

    es = np.array([0, 1, 2, 2, 3, 3, 4, 5])
    ec = np.array([0, 1, 1, 2, 0, 1, 3, 3])
    own = np.array([2, -1, -1, 0])
    a = stream_assign(6, 3, 2, es, ec, np.ones(8), own)
    np.testing.assert_array_equal(a, [2, 0, 0, 2, 1, 1])
    # elements of one sample may come in any order among the others' (jagged batches): the same assignment
    order = np.array([7, 0, 6, 2, 1, 4, 3, 5])
    np.testing.assert_array_equal(stream_assign(6, 3, 2, es[order], ec[order], np.ones(8), own), a)
    with pytest.raises(ValueError, match="cannot fill"):
        stream_assign(5, 3, 2, es[:7], ec[:7], np.ones(7), own)


def test_stream_assign_weights_ties_and_saturated_keys():
    from herald_torchrec.schedule.herald.laia import stream_assign

    # key 0 owned by rank 1 weighs 0.5, key 1 owned by rank 0 weighs 0.7: rank 0 wins; equal weights: the lower rank
    es, ec, own = np.array([0, 0, 1, 2, 3]), np.array([0, 1, 2, 2, 2]), np.array([1, 0, -1])
    assert stream_assign(4, 2, 2, es, ec, np.array([0.5, 0.7, 1, 1, 1]), own)[0] == 0
    assert stream_assign(4, 2, 2, es, ec, np.array([0.7, 0.7, 1, 1, 1]), own)[0] == 0
    assert stream_assign(4, 2, 2, es, ec, np.array([0.7, 0.5, 1, 1, 1]), own)[0] == 1
    # a key read at more than `cap` ranks is everywhere and scores nowhere. 3 ranks x 3: sample 0 reads key 0 -> rank 0,
    # sample 1 key 1 -> rank 1 (least loaded), sample 2 keys 1 and 0 -> a tie, rank 0 (key 1 now read at ranks 1 and
    # 0); sample 3 reads key 1: with cap 1 it is everywhere -> the least loaded rank, 2; with cap 2, rank 0 (a tie)
    es = np.array([0, 1, 2, 2, 3, 4, 5, 6, 7, 8])
    ec = np.array([0, 1, 1, 0, 1, 2, 2, 2, 2, 2])
    one = stream_assign(9, 3, 3, es, ec, np.ones(10), np.full(3, -1), cap=1)
    two = stream_assign(9, 3, 3, es, ec, np.ones(10), np.full(3, -1), cap=2)
    np.testing.assert_array_equal(one[:4], [0, 1, 0, 2])
    np.testing.assert_array_equal(two[:4], [0, 1, 0, 0])
    assert (np.bincount(one, minlength=3) == 3).all() and (np.bincount(two, minlength=3) == 3).all()


def test_host_aware_stream_prefers_the_owners_host_when_the_owner_is_full():
    """4 ranks on 2 hosts ([0, 0, 1, 1]), B = 2, a row inside a host at 0.2 of one crossing hosts. Samples 0-2 read key
    0, owned by rank 3 (host 1): it scores 0.2 x 1 + 0.8 x 1 at rank 3, 0.8 at its host mate rank 2, nothing on host
    0. Rank 3 takes two; the third goes to rank 2 host-aware, and to the least loaded rank (0) rank-level. The other
    samples read keys nobody else reads, owned by no rank: the least loaded rank each, the lowest first."""
    from herald_torchrec.schedule.herald.laia import stream_assign

    hosts = np.array([0, 0, 1, 1])
    es, ec = np.arange(8), np.array([0, 0, 0, 1, 2, 3, 4, 5])
    own = np.array([3, -1, -1, -1, -1, -1])
    host_aware = stream_assign(8, 4, 2, es, ec, np.ones(8), own, hosts=hosts, intra=0.2)
    np.testing.assert_array_equal(host_aware, [3, 3, 2, 0, 1, 0, 1, 2])
    rank_level = stream_assign(8, 4, 2, es, ec, np.ones(8), own)
    np.testing.assert_array_equal(rank_level, [3, 3, 0, 1, 2, 0, 1, 2])
