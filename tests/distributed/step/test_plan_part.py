"""A rank's part of the plan (step/plan_part.py): on its part every rank lays out exactly what it lays out on the whole
plan (every SharedStep field, relays included), for the Herald scheduler's plans on 4 and 8 "ranks" in one process,
with and without host relays; the parts travel through the plan wire and are smaller than the whole plan."""

from __future__ import annotations

import numpy as np
import pytest

from herald_torchrec.distributed.step.host_relay import HostMap
from herald_torchrec.distributed.step.plan_part import owners_before_moves, parts_pay, plan_parts, splittable
from herald_torchrec.distributed.step.prepare import prepare_moves, prepare_shared
from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec
from herald_torchrec.schedule import GlobalBatch, make_policy
from herald_torchrec.schedule.plan import HostPlan, Plan, PlanPart, ReplicaSync, RowMoves, SharedRows, relayed_pairs
from herald_torchrec.schedule.plan_wire import decode_plan, encode_plan
from tests.distributed.step.test_prepare import SHARED_STEP_FIELDS

# every SharedStep field a rank's collectives and lookups use (`marked` differs by design: a part marks its own rows)
FIELDS = tuple(f for f in SHARED_STEP_FIELDS if f != "marked") + (
    "relayed",
    "fwd_idx",
    "fwd_splits",
    "fwd_recv_splits",
    "relay_grad_idx",
    "relay_grad_splits",
    "relay_grad_recv_splits",
    "relay_add_idx",
    "value_links",
    "grad_links",
)


ROWS = (40, 300, 7, 120)


def _stores(R: int, rows: tuple[int, ...] = ROWS) -> list[RowStore]:
    return [
        RowStore([TableSpec(f"t{i}", n, 4) for i, n in enumerate(rows)], r, R, 0.1, "exact_rowwise_adagrad")
        for r in range(R)
    ]


def _plans(R: int, seed: int, steps: int = 9, Bs: int = 8, rows: tuple[int, ...] = ROWS):
    """Herald's plans for R ranks over skewed batches (moves, forwards, fills, owners reading their rows)."""
    L = 2
    pol = make_policy("herald", list(rows), R, Bs, 0.1, L, tables="all")
    rng = np.random.default_rng(seed)
    batches = [
        GlobalBatch.from_dense(
            np.stack([np.minimum(rng.zipf(1.3, R * Bs) - 1, n - 1) for n in rows], axis=1), list(rows), index=i
        )
        for i in range(steps + L)
    ]
    for s in range(steps):
        yield pol.plan(batches[s : s + L + 1])


def _land(st: RowStore, m) -> None:
    """A step's moves applied to one rank's store, as HeraldLookup._land does."""
    st.land_moves(m.table, m.row, m.dst, m.send_idx, m.recv_idx)


def _moved(m, moves) -> list[list[int]]:
    """The rows a MoveStep sends and receives, in all-to-all order, and its split sizes."""
    send, recv = m.send_idx, m.recv_idx
    return [
        moves.table[send].tolist(),
        moves.row[send].tolist(),
        moves.dst[send].tolist(),
        moves.table[recv].tolist(),
        moves.row[recv].tolist(),
        m.send_splits,
        m.recv_splits,
        [m.globally_empty],
    ]


@pytest.mark.parametrize(
    "R, hosts",
    [(4, None), (4, HostMap(np.array([0, 0, 1, 1]))), (8, HostMap(np.repeat([0, 1], 4))), (8, HostMap(np.arange(8)))],
    ids=["4-no-hosts", "4-as-2x2", "8-as-2x4", "8-one-per-host"],
)
def test_every_rank_lays_out_the_same_step_from_its_part(R, hosts) -> None:
    """Each rank runs only its parts, its directory learning only the moves in them, beside the same rank running the
    whole plans: every step's moves and shared exchange are laid out identically, each rank holds the same rows in
    the same slots after every step, and the maps rebuilt from every rank's guests are the whole plans' maps."""
    relayed = fills = partial = 0
    for relay in (True, False) if hosts is not None else (True,):
        hm = None if hosts is None else HostMap(hosts.host, relay=relay)
        whole_st, part_st = _stores(R), _stores(R)
        for plan in _plans(R, seed=R):
            parts = {}  # cut per host, as each host's planner cuts its own ranks' parts
            for h in np.unique(hosts.host) if hosts is not None else [0]:
                parts.update(plan_parts(plan, np.flatnonzero(hosts.host == h) if hosts is not None else range(R), hm))
            steps = []
            for r in range(R):
                part = decode_plan(encode_plan(parts[r]))  # as it travels
                assert isinstance(part, PlanPart) and part.rank == r
                partial += len(part.moves) < len(plan.moves)
                np.testing.assert_array_equal(part.local_samples(r), plan.local_samples(r))
                np.testing.assert_array_equal(part.slice_destinations(r), plan.slice_destinations(r))
                mw, mp = prepare_moves(plan, whole_st[r]), prepare_moves(part, part_st[r])
                assert _moved(mp, part.moves) == _moved(mw, plan.moves), f"step {plan.step} rank {r}"
                whole, got = prepare_shared(plan, whole_st[r], mw, hm), prepare_shared(part, part_st[r], mp, hm)
                for f in FIELDS:  # (the compiled layout leaves the relays' splits empty: all zero in numpy's)
                    want, have = getattr(whole, f), getattr(got, f)
                    if isinstance(want, list) and not want and not whole.relayed:
                        want = [0] * R
                    np.testing.assert_array_equal(have, want, err_msg=f"step {plan.step} rank {r} relay {relay}: {f}")
                assert np.isin(got.marked, whole.marked).all()
                relayed += got.relayed
                fills += got.n_fill
                steps.append((mw, mp))
            for r, (mw, mp) in enumerate(steps):
                _land(whole_st[r], mw)
                _land(part_st[r], mp)
                np.testing.assert_array_equal(part_st[r].slot_of_all, whole_st[r].slot_of_all)
                mine = whole_st[r].owner_all == r
                np.testing.assert_array_equal(part_st[r].owner_all == r, mine)
                np.testing.assert_array_equal(part_st[r].guest_count_all[:, r], whole_st[r].guest_count_all[:, r])
        guests = [s.guest_gkeys() for s in part_st]  # what sync_directory all-gathers
        for r in range(R):  # rebuilt from every rank's guests, each rank's map is every rank's exact map again
            part_st[r].rebuild_directory(guests)
            np.testing.assert_array_equal(part_st[r].owner_all, whole_st[r].owner_all)
            np.testing.assert_array_equal(part_st[r].guest_count_all, whole_st[r].guest_count_all)
            assert part_st[r].directory_exact
    assert fills > 0 and partial > 0  # parts that hold some of the step's moves only
    if hosts is not None and hosts.shares_hosts:
        assert relayed > 0  # relays were exercised, and their parts kept what the relays need


@pytest.mark.parametrize(
    "host",
    [np.repeat([0, 1], 4), np.array([0, 1, 0, 1, 2, 2, 3, 3]), np.array([1, 0, 0, 0, 0, 1, 1, 1])],
    ids=["2x4", "interleaved-4-hosts", "interleaved-2-hosts"],
)
def test_compiled_relay_groups_cut_the_numpy_parts(host) -> None:
    """The compiled passes (host_kernels.relay_groups: the relayed tables and the wanted hosts' pairs;
    host_kernels.part_pairs: the pairs each part needs) give the numpy code's parts byte for byte, also where a host's
    ranks are not consecutive."""
    from herald_torchrec import _native

    hm = HostMap(host, relay=True)
    relayed = 0
    try:
        for plan in list(_plans(8, seed=11, steps=6)):  # planned before the switch is turned
            got = {}
            for compiled in (True, False):
                _native.set_mode(compiled)
                got[compiled] = {
                    r: encode_plan(part).tobytes()
                    for h in np.unique(host)
                    for r, part in plan_parts(plan, np.flatnonzero(host == h), hm).items()
                }
            assert got[True] == got[False], f"step {plan.step}"
            relayed += len(plan_parts(plan, [0], hm)[0].relayed_tables)
    finally:
        _native.set_mode(None)
    assert relayed > 0


def test_parts_cut_by_sorting_equal_the_marked_ones(monkeypatch) -> None:
    """Past MARK_LIMIT (many parts at once) numpy sorts the parts' pairs instead of marking them: the same parts, and
    the compiled pass's."""
    from herald_torchrec import _native
    from herald_torchrec.distributed.step import plan_part

    hm = HostMap(np.repeat([0, 1], 4))
    for plan in list(_plans(8, seed=3, steps=4)):  # planned before the switch is turned
        compiled = plan_parts(plan, range(8), hm)
        try:
            _native.set_mode(False)
            marked = plan_parts(plan, range(8), hm)
            monkeypatch.setattr(plan_part, "MARK_LIMIT", 0)
            sorted_ = plan_parts(plan, range(8), hm)
            monkeypatch.undo()
        finally:
            _native.set_mode(None)
        for r in range(8):
            want = encode_plan(marked[r]).tobytes()
            assert encode_plan(sorted_[r]).tobytes() == want and encode_plan(compiled[r]).tobytes() == want, r


def test_parts_are_smaller_than_the_whole_plan() -> None:
    """16 ranks as 2 hosts of 8, 128 samples per rank: a part is on average under 0.7x the whole plan, the largest
    under the whole (every part repeats every move: the directories apply them all)."""
    hm = HostMap(np.repeat([0, 1], 8))
    for plan in _plans(16, seed=1, steps=4, Bs=128, rows=(2000, 50000, 7, 120, 10000, 300)):
        whole = encode_plan(plan).shape[0]
        sizes = np.array([encode_plan(p).shape[0] for p in plan_parts(plan, range(16), hm).values()])
        assert sizes.mean() < 0.7 * whole and sizes.max() < whole, (whole, sizes.tolist())


def test_a_rank_without_pairs_still_runs_the_step_exchange() -> None:
    """The owner before a move is its source, and that owner's part lists the row; a rank with no pair in a step
    that has shared rows joins the exchange with zero splits, as it does with the whole plan."""
    st = [RowStore([TableSpec("a", 10, 4)], r, 3, 0.3, "exact_rowwise_adagrad") for r in range(3)]
    move = RowMoves(np.array([0]), np.array([5]), np.array([1]), np.array([2]), np.array([0], dtype=np.int8))
    # row 2 (home rank 0) read by 0 and 1; row 5 (home rank 1) moves to rank 2, read by 0 and 2
    shared = SharedRows(
        np.array([0, 0]), np.array([2, 5]), np.array([0, 2]), np.array([0, 2, 4]), np.array([0, 1, 0, 2])
    )
    plan = Plan(3, 3, 1, np.arange(3), move, shared)
    np.testing.assert_array_equal(owners_before_moves(plan), [0, 1])
    parts = plan_parts(plan, [0, 1, 2], None)
    assert parts[1].shared.row.tolist() == [2, 5]  # rank 1 reads row 2 and sends row 5's value before it moves
    assert parts[2].shared.row.tolist() == [5]
    alone = SharedRows(np.array([0]), np.array([2]), np.array([0]), np.array([0, 2]), np.array([0, 1]))
    part = plan_parts(Plan(3, 3, 1, np.arange(3), RowMoves(), alone), [2], None)[2]
    assert len(part.shared) == 0 and part.shared_tables.tolist() == [0]
    got = prepare_shared(part, st[2], prepare_moves(part, st[2]))
    assert not got.globally_empty and got.value_splits == [0, 0, 0] and got.grad_splits == [0, 0, 0]


def test_parts_refuse_what_they_cannot_carry() -> None:
    plan = Plan(0, 2, 1, np.arange(2), replicas=ReplicaSync())
    assert not splittable(plan)
    with pytest.raises(ValueError, match="travel whole"):
        plan_parts(plan, [0], None)
    part = plan_parts(Plan(0, 2, 1, np.arange(2)), [1], None)[1]
    with pytest.raises(ValueError, match="part of rank 1 was given to rank 0"):
        part.local_samples(0)
    with pytest.raises(ValueError, match="every sample's rank"):
        part.assignment()
    st = RowStore([TableSpec("a", 10, 4)], 0, 2, 0.3, "exact_rowwise_adagrad")
    with pytest.raises(ValueError, match="part of rank 1 was given to rank 0"):
        prepare_shared(part, st, prepare_moves(part, st))


@pytest.mark.parametrize("R", [3, 256, 1000])
def test_parts_travel_exactly_at_any_rank_count(R) -> None:
    """A part through the wire and back, field for field and dtype for dtype, with ranks up to R - 1; up to 256
    ranks a rank takes one byte on the wire (ranks travel centred)."""
    rng = np.random.default_rng(R)

    def part(readers: np.ndarray) -> PlanPart:
        n = readers.shape[0] // 4
        moves = RowMoves(
            rng.integers(0, 5, 9), rng.integers(0, 10**6, 9), rng.integers(0, R, 9), rng.integers(0, R, 9),
            rng.integers(0, 3, 9).astype(np.int8),
        )  # fmt: skip
        shared = SharedRows(
            rng.integers(0, 5, n), rng.integers(0, 10**6, n), rng.integers(0, R, n), np.arange(n + 1) * 4, readers
        )
        return PlanPart(
            3, R, 16, np.sort(rng.choice(16 * R, 16, replace=False)), moves, shared, {"hit": 5}, rank=R - 1,
            slice_ranks=rng.integers(0, R, 16), moved_tables=np.array([0, 2]), shared_tables=np.array([1]),
        )  # fmt: skip

    p = part(rng.integers(0, R, 4000))
    got = decode_plan(encode_plan(p))
    assert type(got) is PlanPart and got.rank == R - 1 and got.counters == {"hit": 5}
    for a, b in (
        (got.sample_order, p.sample_order),
        (got.slice_ranks, p.slice_ranks),
        *((getattr(got.moves, f), getattr(p.moves, f)) for f in ("table", "row", "src", "dst", "kind")),
        *(
            (getattr(got.shared, f), getattr(p.shared, f))
            for f in ("table", "row", "owner", "reader_offsets", "readers")
        ),
        *((getattr(got, f), getattr(p, f)) for f in ("moved_tables", "shared_tables", "relayed_tables")),
    ):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    if R <= 256:  # 4,000 readers in one byte each: 4,000 bytes fewer than as two
        wide = encode_plan(part(np.full(4000, 300)))  # (the other arrays: the same sizes)
        assert encode_plan(p).shape[0] <= wide.shape[0] - 4000 + 64


def test_parts_go_where_they_pay() -> None:
    """Several machines, or 9+ ranks on one: parts; up to 8 ranks on one machine the whole plan is smaller or as small
    and its compiled layout faster (benchmarks/plan_bytes.py)."""
    assert [parts_pay(R, 1) for R in (1, 2, 4, 8, 9, 64)] == [False, False, False, False, True, True]
    assert parts_pay(2, 2) and parts_pay(4, 2) and parts_pay(256, 32)


def test_a_host_plan_is_cut_only_for_its_ranks_and_its_host_map() -> None:
    """A host's plan (`HostPlan`) holds its own ranks' samples: another rank's part, every sample's rank or a table
    split is refused; and its relayed tables were counted under its planners' host map, so ranks relaying within
    other hosts cannot cut it (the same hosts under other ids can; without relays nothing is relayed)."""
    plan = HostPlan(0, 4, 1, np.array([1, 0]), host=0, ranks=np.array([0, 1]), hosts=np.array([0, 0, 1, 1]),
                    slice_ranks=np.array([1, 0]), relayed_tables=np.array([0]))  # fmt: skip
    assert splittable(plan)
    assert plan.local_samples(1).tolist() == [0] and plan.slice_destinations(0).tolist() == [1]
    with pytest.raises(ValueError, match=r"holds ranks \[0, 1\], not 2"):
        plan_parts(plan, [2], None)
    with pytest.raises(ValueError, match="every sample's rank"):
        plan.assignment()
    with pytest.raises(ValueError, match="cut into its ranks' parts"):
        plan.for_tables(0, 1)
    same = plan_parts(plan, [0, 1], HostMap(np.array([1, 1, 0, 0])))
    assert same[0].relayed_tables.tolist() == [0] and same[1].sample_order.tolist() == [0]
    assert plan_parts(plan, [0], HostMap(np.array([0, 0, 1, 1]), relay=False))[0].relayed_tables.tolist() == []
    with pytest.raises(ValueError, match=r"made for hosts \[0, 0, 1, 1\], but the ranks relay"):
        plan_parts(plan, [0], HostMap(np.array([0, 1, 0, 1])))


@pytest.mark.parametrize("interleaved", [False, True])
def test_the_relay_rule_counts_groups_alike_in_runs_and_by_count(interleaved) -> None:
    """`relayed_pairs` on pairs whose (row, host) groups come together (runs) and on an interleaved host map (a count
    per group) equals a direct count of every group's readers that do not receive the row."""
    rng = np.random.default_rng(5)
    R, n = 8, 300
    host = np.array([0, 1, 0, 1, 2, 3, 2, 3]) if interleaved else np.arange(R) // 2
    counts = rng.integers(1, 6, n)
    pair_row = np.repeat(np.arange(n), counts)
    readers = np.concatenate([np.sort(rng.choice(R, c, replace=False)) for c in counts])
    before, after = rng.integers(0, R, n), rng.integers(0, R, n)
    got = relayed_pairs(pair_row, readers, before, after, host)
    want = np.zeros(readers.shape[0], dtype=bool)
    for i, (r, q) in enumerate(zip(pair_row, readers)):
        same = (pair_row == r) & (host[readers] == host[q])
        fill = (readers == after[r]) & (before[r] != after[r])
        live = int((same & ~fill).sum())
        want[i] = live >= 2 and (host[q] != host[before[r]] or host[q] != host[after[r]])
    assert want.any() and np.array_equal(got, want)
