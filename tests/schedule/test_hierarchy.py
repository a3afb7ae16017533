"""herald_hier (schedule/herald/hierarchy.py): Herald planned per host. Its plans pass the checker, with one host it
is herald, each host's planner depends only on its own samples' ids, and the message bytes are the docstring's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from herald_torchrec.data.synthetic import SyntheticCTR, SyntheticSpec
from herald_torchrec.schedule import GlobalBatch, PlanChecker, make_policy
from herald_torchrec.schedule.herald import host_messages, host_plans
from herald_torchrec.schedule.herald.hierarchy import HeraldHierPolicy
from herald_torchrec.schedule.herald.host_messages import MESSAGE_KINDS, Transport, outgoing_messages
from herald_torchrec.schedule.plan import MIGRATE
from herald_torchrec.schedule.plan_wire import encode_plan_tree

L = 2


def synthetic_window(R: int, B: int, steps: int) -> tuple[list[int], list[GlobalBatch]]:
    gen = SyntheticCTR(SyntheticSpec(scale=0.002, seed=3))
    rows = list(gen.table_rows)
    return rows, [GlobalBatch.from_dense(gen.train_samples(i * R * B, R * B).ids, rows, i) for i in range(steps + L)]


@pytest.mark.parametrize("R", [16, 32])
def test_plans_pass_the_checker_and_samples_stay_on_their_host(R):
    B, steps = 16, 5
    rows, batches = synthetic_window(R, B, steps)
    pol = make_policy("herald_hier", rows, R, B, 0.1, L, hosts=8)
    checker = PlanChecker(rows, R, B, 0.1)
    moved = 0
    for s in range(steps):
        plan = pol.plan(batches[s : s + L + 1])
        checker.check(plan, batches[s])
        rank = plan.assignment()
        assert np.array_equal(rank // 8, np.arange(R * B) // (8 * B))  # no sample leaves the host that loaded it
        moved += int(plan.counters["migrate"])
        step = pol.last_step
        assert step.host_seconds.shape == (R // 8,) and (step.host_seconds > 0).all()
        assert step.message_bytes["demand"] > 0 and step.message_bytes["reads"] > 0
    assert checker.errors == [] and checker.stale_reads == 0
    assert moved > 0  # rows did change owner, so the capacity and decision paths ran


def test_one_host_is_herald():
    R, B, steps = 8, 16, 4
    rows, batches = synthetic_window(R, B, steps)
    flat = make_policy("herald", rows, R, B, 0.1, L)
    hier = make_policy("herald_hier", rows, R, B, 0.1, L, hosts=8)
    rows2, batches2 = synthetic_window(R, B, steps)  # own batch objects (their caches are the policy's)
    for s in range(steps):
        a = encode_plan_tree(dataclasses.replace(flat.plan(batches[s : s + L + 1]), sched_seconds=0.0))
        b = encode_plan_tree(dataclasses.replace(hier.plan(batches2[s : s + L + 1]), sched_seconds=0.0))
        assert np.array_equal(a, b)
    assert sum(hier.last_step.message_bytes.values()) == 0


def test_a_host_plans_from_its_own_samples_only():
    """Host 1's ids are redrawn (rows host 0 never reads): host 0's sample order and every move of host 0's rows stay
    the same. A host planner that looked at the other host's ids (e.g. global key counts in LAIA's weights, or
    ties broken by the whole batch) would change them."""
    R, B, P, steps = 4, 32, 2, 4
    rows = [200, 120, 60]
    rng = np.random.default_rng(0)
    half = np.array(rows) // 2

    def draw(seed_rng, lo, hi):
        return np.stack([seed_rng.integers(lo[t], hi[t], size=P * B) for t in range(len(rows))], axis=1)

    zipfy = [np.minimum(rng.zipf(1.3, size=(P * B, len(rows))) - 1, half - 1) for _ in range(steps + L)]
    other_a = [draw(np.random.default_rng(10 + i), half, np.array(rows)) for i in range(steps + L)]
    other_b = [draw(np.random.default_rng(99 + i), half, np.array(rows)) for i in range(steps + L)]
    plans = []
    for other in (other_a, other_b):
        pol = HeraldHierPolicy(rows, R, B, 0.5, L, hosts=P)
        bs = [
            GlobalBatch.from_dense(np.concatenate([zipfy[i], other[i]]).astype(np.int64), rows, i)
            for i in range(steps + L)
        ]
        plans.append([pol.plan(bs[s : s + L + 1]) for s in range(steps)])
    changed_other = False
    for pa, pb in zip(*plans):
        assert np.array_equal(pa.sample_order[: P * B], pb.sample_order[: P * B])
        ma = pa.moves.row < half[pa.moves.table]
        mb = pb.moves.row < half[pb.moves.table]
        for f in ("table", "row", "src", "dst", "kind"):
            assert np.array_equal(getattr(pa.moves, f)[ma], getattr(pb.moves, f)[mb])
        changed_other |= not np.array_equal(pa.sample_order[P * B :], pb.sample_order[P * B :])
    assert changed_other  # host 1's part did change: the comparison above can see a difference


def tiny(ids: list[int]) -> tuple[HeraldHierPolicy, object]:
    """The module docstring's worked example: 4 ranks as 2 hosts of 2, B = 1, one table of 8 rows."""
    pol = HeraldHierPolicy([8], 4, 1, 0.25, 0, hosts=2, tables="all", refine=0)
    batch = GlobalBatch.from_dense(np.array(ids, dtype=np.int64)[:, None], [8])
    return pol, pol.plan([batch])


def test_message_bytes_of_the_worked_example():
    pol, plan = tiny([0, 4, 4, 6])
    assert np.array_equal(plan.assignment(), [0, 1, 2, 3])
    st = pol.last_step
    expect = dict.fromkeys(MESSAGE_KINDS, 0)
    expect.update(demand=8, owners=2, reads=8, decisions=2)
    assert st.message_bytes == expect
    assert st.host_message_bytes.tolist() == [20, 20]
    assert st.plan_part_bytes.tolist() == [4, 14, 16, 4]
    assert st.ids_bytes.tolist() == [8, 8, 8, 8]
    assert plan.counters["hit"] == 3 and plan.counters["shared_value"] == 1 and len(plan.moves) == 0


def test_message_bytes_with_migrations_both_ways():
    """Row 2 (home rank 1, host 0) is read by rank 2 only and row 4 (home rank 2, host 1) by rank 1 only: each
    migrates to its reader; the arrivals go from each home host to the other."""
    pol, plan = tiny([0, 4, 2, 6])
    assert len(plan.moves) == 2 and (plan.moves.kind == MIGRATE).all()
    assert sorted(zip(plan.moves.row.tolist(), plan.moves.src.tolist(), plan.moves.dst.tolist())) == [
        (2, 1, 2),
        (4, 2, 1),
    ]
    st = pol.last_step
    expect = dict.fromkeys(MESSAGE_KINDS, 0)
    expect.update(demand=16, owners=4, reads=16, decisions=4, arrivals=24)
    assert st.message_bytes == expect
    assert st.plan_part_bytes.tolist() == [4, 26, 26, 4]


def test_bad_host_map_is_a_clear_error():
    with pytest.raises(ValueError, match="consecutive groups of equal size"):
        HeraldHierPolicy([100], 6, 4, hosts=4)
    with pytest.raises(ValueError, match="apply with one host only"):
        HeraldHierPolicy([100], 8, 4, hosts=4, replicate=True)


def test_ranks_per_host_without_a_host_map_and_its_check():
    """Without a host map the policy groups `ranks_per_host` ranks; a host map (the pipeline's) wins; a bad setting
    is one clear error, from the app's check (runnable_policy) and the constructor alike."""
    from herald_torchrec.schedule import runnable_policy

    assert HeraldHierPolicy([100], 8, 4, ranks_per_host=2).num_hosts == 4
    assert HeraldHierPolicy([100], 8, 4).num_hosts == 1  # default: 8 ranks per host
    assert HeraldHierPolicy([100], 8, 4, hosts=[7, 7, 7, 7, 9, 9, 9, 9], ranks_per_host=2).num_hosts == 2
    assert runnable_policy("herald_hier", ranks_per_host=4) == "herald_hier"
    for bad in (0, 2.5, True, "8"):
        with pytest.raises(ValueError, match="ranks_per_host must be an integer >= 1"):
            runnable_policy("herald_hier", ranks_per_host=bad)
        with pytest.raises(ValueError, match="ranks_per_host must be an integer >= 1"):
            HeraldHierPolicy([100], 8, 4, ranks_per_host=bad)


def test_swapped_samples_and_their_bytes():
    """move_samples: in the second worked example sample 1 (row 4, homed on host 1) and sample 2 (row 2,
    homed on host 0) each offer to go where their row is; the coordinator (host 0) swaps them, so every read is a
    hit and no row moves. Bytes between hosts: demand 2 x (key + count), owners 2 x (rank + top other host + its
    count), host 1's offer, the swap to host 1, each sample's id and owner + its dense part and label, and the
    decisions of the first demand."""
    pol = HeraldHierPolicy([8], 4, 1, 0.25, 0, hosts=2, tables="all", refine=0, move_samples="swap")
    plan = pol.plan([GlobalBatch.from_dense(np.array([[0], [4], [2], [6]]), [8])])
    assert plan.assignment().tolist() == [0, 2, 1, 3]
    assert len(plan.moves) == 0 and plan.counters["hit"] == 4 and pol.last_step.swapped_samples == 2
    expect = dict.fromkeys(MESSAGE_KINDS, 0)
    expect.update(demand=20, owners=12, offers=8, swaps=4, samples=2 * (8 + 2 + 56), decisions=4)
    assert pol.last_step.message_bytes == expect
    off = HeraldHierPolicy([8], 4, 1, 0.25, 0, hosts=2, tables="all", refine=0)  # default: samples stay
    assert off.plan([GlobalBatch.from_dense(np.array([[0], [4], [2], [6]]), [8])]).assignment().tolist() == [0, 1, 2, 3]


def test_swaps_keep_every_rank_at_B_and_pass_the_checker():
    R, B, steps = 16, 16, 4
    rows, batches = synthetic_window(R, B, steps)
    pol = make_policy("herald_hier", rows, R, B, 0.1, L, hosts=8, move_samples="swap")
    checker = PlanChecker(rows, R, B, 0.1)
    swapped = 0
    for s in range(steps):
        plan = pol.plan(batches[s : s + L + 1])
        checker.check(plan, batches[s])
        rank = plan.assignment()
        assert np.array_equal(np.bincount(rank, minlength=R), np.full(R, B))
        crossed = int((rank // 8 != np.arange(R * B) // (8 * B)).sum())
        assert crossed == pol.last_step.swapped_samples
        swapped += crossed
        assert (pol.last_step.message_bytes["samples"] > 0) == (crossed > 0)
    assert checker.errors == [] and checker.stale_reads == 0
    assert swapped > 0


def test_several_hosts_refine_once_per_host_with_the_global_batch_budget():
    """With several hosts each host's LAIA gets one best-response round (HOST_MAX_REFINE) within the wall budget of
    the whole global batch (hosts plan in parallel); max_refine and budget_ms still override it. With one host the
    settings are herald's own (max_refine 2)."""
    from herald_torchrec.schedule.herald.tables import default_budget_ms

    R, B, steps = 16, 64, 1
    rows, batches = synthetic_window(R, B, steps)
    pol = make_policy("herald_hier", rows, R, B, 0.1, L, hosts=8)
    pol.plan(batches[: L + 1])
    assert pol.refine == 1 and pol.selection.budget_ms == default_budget_ms(R * B)
    two = make_policy("herald_hier", rows, R, B, 0.1, L, hosts=8, max_refine=2)
    two.plan(batches[: L + 1])
    assert two.refine == 2
    none = make_policy("herald_hier", rows, R, B, 0.1, L, hosts=8, budget_ms=1.0)
    none.plan(batches[: L + 1])
    assert none.refine == 0
    flat = make_policy("herald_hier", rows, 8, B, 0.1, L, hosts=8)
    assert flat._flat is not None and flat._flat.max_refine == 2


def plan_digest(plans) -> str:
    import hashlib

    h = hashlib.sha1()
    for p in plans:
        h.update(encode_plan_tree(dataclasses.replace(p, sched_seconds=0.0)).tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize(("R", "P", "digest"), [(8, 2, "d4ed9c01ae55cb74"), (16, 4, "ebb56bf8cfc4e6fa")])
def test_in_process_transport_makes_the_single_object_plans(R, P, digest):
    """The per-host planners driven through the in-process transport make, step by step, the plans the policy made
    when it was one object computing every host's part (digests recorded from that code on this window, which had
    no owner balancing), with every message encoded and decoded."""
    rows, batches = synthetic_window(R, 16, 6)
    pol = HeraldHierPolicy(rows, R, 16, 0.1, L, hosts=P, owner_balance=None)
    assert plan_digest([pol.plan(batches[s : s + L + 1]) for s in range(6)]) == digest


def test_both_wire_forms_make_the_same_plans_and_the_compact_one_fewer_bytes():
    """`planner_wire`: the in-process transport encodes every message between hosts and hands its receiver the
    decoded one, so the plans go through the wire form; both forms give the same plans, the compact one in under
    half the bytes. A form that does not exist is refused."""
    R, P = 16, 4
    rows, batches = synthetic_window(R, 16, 6)
    wire, digests = {}, set()
    for form in ("compact", "raw"):
        pol = HeraldHierPolicy(rows, R, 16, 0.1, L, hosts=P, planner_wire=form)
        plans, nbytes = [], 0
        for s in range(6):
            plans.append(pol.plan(batches[s : s + L + 1]))
            nbytes += sum(pol.last_step.wire_bytes.values())
        digests.add(plan_digest(plans))
        wire[form] = nbytes
    assert len(digests) == 1
    assert 0 < wire["compact"] < wire["raw"] / 2, wire
    with pytest.raises(ValueError, match="planner_wire must be one of"):
        HeraldHierPolicy(rows, R, 16, 0.1, L, hosts=P, planner_wire="zip")


class ThreadTransport(Transport):
    """One host per thread, as one planner per machine: each exchange posts this host's messages, waits for every
    host, then reads what was sent to it."""

    def __init__(self, h: int, board: dict, barrier) -> None:
        super().__init__()
        self.h, self.board, self.barrier = h, board, barrier

    def exchange(self, kind, out):
        mine = outgoing_messages(out.get(self.h, {}))
        for dst, m in mine.items():
            self.board[(kind, self.h, dst)] = m
        self.barrier.wait()
        inbox = {s: m for (k, s, dst), m in list(self.board.items()) if k == kind and dst == self.h}
        self.barrier.wait()
        self.board.pop((kind, self.h, self.h), None)
        for dst in mine:
            self.board.pop((kind, self.h, dst), None)
        self.barrier.wait()
        return {self.h: inbox}


@pytest.mark.parametrize(("R", "P", "cache", "steps"), [(8, 2, 0.1, 5), (12, 4, 0.03, 8), (16, 4, 0.02, 10)])
def test_each_host_plans_from_its_own_samples_in_its_own_replica(R, P, cache, steps):
    """Every host in its own thread with its own policy replica, given only its own ranks' samples (plan_host), makes
    its own ranks' plan (`HostPlan`), from which each of its ranks gets the part it gets from the in-process run's
    whole plan, byte for byte, relays on and off: what a host learns of the others comes through the transport, and
    its replica keeps all it reads (its home rows' owners, its ranks' guests). A replica handed the whole global
    batch is refused."""
    import threading

    from herald_torchrec.distributed.step.host_relay import HostMap
    from herald_torchrec.distributed.step.plan_part import plan_parts
    from herald_torchrec.schedule.plan import HostPlan
    from herald_torchrec.schedule.plan_wire import encode_plan

    B = 16
    H = R // P
    rows, batches = synthetic_window(R, B, steps)
    ref = HeraldHierPolicy(rows, R, B, cache, L, hosts=P)
    want = [ref.plan(batches[s : s + L + 1]) for s in range(steps)]
    assert sum(w.counters["evict_home"] for w in want) > 0 and sum(w.counters["migrate"] for w in want) > 0
    _, fresh = synthetic_window(R, B, steps)
    n = P * B
    own = [[b.take(np.arange(h * n, (h + 1) * n)) for b in fresh] for h in range(H)]
    board, barrier = {}, threading.Barrier(H)
    got, errors = [[] for _ in range(H)], []

    pols = {}

    def host(h: int) -> None:
        try:
            pol = pols[h] = HeraldHierPolicy(rows, R, B, cache, L, hosts=P)
            tr = ThreadTransport(h, board, barrier)
            for s in range(steps):
                got[h].append(pol.plan_host(h, own[h][s : s + L + 1], tr))
                assert pol.last_step.ids_bytes[: h * P].sum() == 0 and pol.last_step.ids_bytes[(h + 1) * P :].sum() == 0
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=host, args=(h,)) for h in range(H)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    relayed = 0
    for relay in (True, False):
        hosts = HostMap(np.arange(R) // P, relay=relay)
        for h in range(H):
            ranks = list(range(h * P, (h + 1) * P))
            for s in range(steps):
                mine = got[h][s]
                assert isinstance(mine, HostPlan) and mine.counters == want[s].counters
                a, b = plan_parts(want[s], ranks, hosts), plan_parts(mine, ranks, hosts)
                for r in ranks:
                    x, y = (encode_plan(dataclasses.replace(p[r], sched_seconds=0.0)) for p in (a, b))
                    assert np.array_equal(x, y), (h, s, r)
                relayed += int(b[ranks[0]].relayed_tables.shape[0])
    assert relayed > 0  # some step relayed rows within a host
    T = len(rows)
    for h, pol in pols.items():  # its own ranks' guests as the one-process run's; describe counts those alone
        fill = pol.directory.slots.fill.reshape(R, T)
        assert np.array_equal(fill[h * P : (h + 1) * P], ref.directory.slots.fill.reshape(R, T)[h * P : (h + 1) * P])
        guests = pol.describe()["guests"]
        assert guests["guests"] == fill[h * P : (h + 1) * P].sum() > 0
        assert guests["capacity"] == P * int(ref.directory.capacity.sum())
    with pytest.raises(ValueError, match="plan_host takes host 0..3's batches"):
        HeraldHierPolicy(rows, 8, B, 0.1, L, hosts=2).plan_host(0, fresh[: L + 1], ThreadTransport(0, {}, barrier))


def test_home_and_table_from_the_key_match_the_directory():
    rows = [5, 7, 3, 1, 16]  # a one-row table among them; ROW_WISE blocks of 1, 1, 1, 1, 2 rows at R=8
    pol = HeraldHierPolicy(rows, 8, 2, 0.25, 1, hosts=4)
    keys = np.arange(sum(rows), dtype=np.int64)
    np.testing.assert_array_equal(pol.table_of(keys), pol.directory.table)
    np.testing.assert_array_equal(pol.home_of(keys), pol.directory.home)
    np.testing.assert_array_equal(pol.home_of(keys[[2, 15, 20, 31]]), [2, 0, 2, 7])  # rows 2, 0, 4, 15 of t0, t3, t4
    # the union's tables of sorted keys (every key, a subset that skips tables, none)
    for sub in (keys, keys[[0, 4, 5, 15, 16, 31]], keys[[12, 13]], keys[:0]):
        np.testing.assert_array_equal(pol.sorted_tables(sub), pol.directory.table[sub])
    # a key's directory host: its home host shifted by its table, so the tables' first rows go to 4 different hosts
    want = (pol.directory.home // 4 + pol.directory.table.astype(np.int64)) % 2
    np.testing.assert_array_equal(pol.directory_host_of(keys), want)
    four = HeraldHierPolicy(rows, 8, 2, 0.25, 1, hosts=2)
    first_rows = np.array([0, 5, 12, 15, 16])
    np.testing.assert_array_equal(four.directory_host_of(first_rows), [0, 1, 2, 3, 0])
    one_table = HeraldHierPolicy([8], 4, 1, 0.25, 1, hosts=2)  # the module docstring's example: the home hosts
    np.testing.assert_array_equal(one_table.directory_host_of(np.arange(8)), np.arange(8) // 4)


@pytest.mark.parametrize("compiled", [None, False])  # the kernels where this machine builds them; numpy
def test_a_hosts_demand_by_directory_host(compiled):
    """A host batch's keys by directory host (the demand's order), each key's index in its host's demand and the
    keys per host, from the key alone (tables skipped, a one-row table, the last row): directory_host_of's."""
    from herald_torchrec import _native
    from herald_torchrec.schedule.herald.host_messages import MessageBytes
    from herald_torchrec.schedule.herald.host_planner import HostPlanner

    rows = [5, 7, 3, 1, 16]
    pol = HeraldHierPolicy(rows, 8, 2, 0.25, 1, hosts=2)
    keys = np.array([0, 4, 5, 11, 15, 16, 17, 30, 31], dtype=np.int64)
    ids = np.zeros((16, 5), dtype=np.int64)  # 16 samples of 5 tables whose distinct keys are `keys`
    for j, k in enumerate(keys):
        t = int(pol.table_of(k[None])[0])
        ids[j, t] = k - pol.layout.offsets[t]
    batch = GlobalBatch.from_dense(ids, rows)
    _native.set_mode(compiled)
    try:
        hp = HostPlanner(pol, 0, [batch], MessageBytes(4, on=False))
    finally:
        _native.set_mode(None)
    dh = pol.directory_host_of(hp.bk.keys)
    np.testing.assert_array_equal(hp.dir_host, dh)
    np.testing.assert_array_equal(hp.demand_order, np.argsort(dh, kind="stable"))
    np.testing.assert_array_equal(hp.demand_counts, np.bincount(dh, minlength=4))
    for h in range(4):
        np.testing.assert_array_equal(hp.demand_index[dh == h], np.arange((dh == h).sum()))
    assert hp.demand_counts.min() > 0  # every host demanded something
    from herald_torchrec.schedule import native

    if compiled is None and native.enabled():  # a key past the last table is an error, not a read past the layout
        block = pol.directory.block
        with pytest.raises(ValueError, match="outside the layout"):
            native.demand(np.array([0, 32], dtype=np.int64), pol.layout.offsets, block, 2, 4)
        assert native.demand(np.array([0, 31], dtype=np.int64), pol.layout.offsets, block, 2, 4)[3].sum() == 2


def test_the_per_host_settings_planner_holds_no_per_row_state():
    rows = [4000, 3000, 50]
    pol = HeraldHierPolicy(rows, 8, 4, 0.1, 2, hosts=4)
    loc = pol._local  # a HeraldPolicy of P ranks, kept for its settings and table selection only
    assert (loc.directory, loc.eviction, loc.next_use, loc._picked, loc._native) == (None,) * 5
    held = sum(v.nbytes for v in vars(loc).values() if isinstance(v, np.ndarray))
    assert held < sum(rows)  # under a byte per row (a directory is ~20 bytes per row)


def _random_part(pol, rng, K, shared_frac, moved_frac, n_vic, h):
    """A directory host's final decisions and part (`HostPlanner.part`) on random keys of `pol`'s layout: owners,
    migrations to ranks of any host, shared rows (some migrating, some a fill: moved to one of their readers) with
    readers in rank order, victims."""
    from herald_torchrec.schedule.herald.host_planner import HostPlanner, _HostDecisions

    R, rk = pol.num_ranks, pol.rank_dtype
    off = pol.layout.offsets

    def some_keys(n):  # distinct keys of every table, small ones included (a table picked, then a key in it)
        t = rng.integers(0, off.shape[0] - 1, 4 * n)
        pool = np.unique(off[t] + (rng.random(4 * n) * (off[t + 1] - off[t])).astype(np.int64))
        return np.sort(rng.choice(pool, min(n, pool.shape[0]), replace=False)).astype(np.int64)

    keys = some_keys(K)
    K = keys.shape[0]
    own = rng.integers(0, R, K)
    want = np.where(rng.random(K) < moved_frac, rng.integers(0, R, K), own)
    shared = np.flatnonzero(rng.random(K) < shared_frac)
    count = rng.integers(1, 7, shared.shape[0])
    readers = np.concatenate([np.sort(rng.choice(R, c, replace=False)) for c in count] + [np.zeros(0, np.int64)])
    fill = rng.random(shared.shape[0]) < 0.2
    want[shared[fill]] = readers[np.cumsum(count) - 1][fill]
    mig = np.flatnonzero(want != own)
    victims = some_keys(n_vic)
    n_vic = victims.shape[0]
    hp = HostPlanner.__new__(HostPlanner)
    hp.pol, hp.h, hp.keys, hp.k_own = pol, h, keys, own
    hp.final = _HostDecisions(
        mig=mig, shared=shared, shared_pair_row=np.repeat(np.arange(shared.shape[0]), count), readers=readers,
        counts=rng.integers(0, 100, 2),
    )  # fmt: skip
    part = [
        keys[mig], own[mig].astype(rk), want[mig].astype(rk), keys[shared], want[shared].astype(rk),
        count.astype(rk), readers.astype(rk), victims, rng.integers(0, R, n_vic).astype(rk),
    ]  # fmt: skip
    return hp, part


def test_compiled_part_routing_equals_numpy(monkeypatch):
    """A directory host's part routed to the hosts that need it (`HostPlanner.routed`): the compiled pass gives
    numpy's Outbox, every field (values, dtype) and every host's bounds, on random parts: moves between several
    hosts, shared rows with and without migrations, victims, empty parts; and rows whose readers are not in rank
    order go to numpy."""
    from herald_torchrec.schedule import native

    if not native.enabled():
        pytest.skip("compiled kernels unavailable (HERALD_NATIVE=0 or no C++ compiler)")
    rows, _ = synthetic_window(24, 16, 0)
    pol = HeraldHierPolicy(rows, 24, 16, 0.1, L, hosts=4)  # 6 hosts of 4 ranks
    assert (pol.num_hosts, pol.ranks_per_host) == (6, 4)
    rng = np.random.default_rng(11)
    cases = [(600, 0.3, 0.3, 40, 2), (300, 0.9, 0.6, 0, 0), (300, 0.0, 0.5, 25, 5), (200, 0.5, 0.0, 10, 3)]
    cases += [(0, 0.0, 0.0, 0, 1), (50, 0.0, 0.0, 0, 4)]
    for K, shared_frac, moved_frac, n_vic, h in cases:
        hp, part = _random_part(pol, rng, K, shared_frac, moved_frac, n_vic, h)
        with monkeypatch.context() as m:
            m.setattr(native, "enabled", lambda: False)
            (want,) = hp.routed(part).values()
        (got,) = hp.routed(part).values()
        assert got.dests == want.dests == list(range(pol.num_hosts))
        assert len(got.fields) == len(want.fields) == 11
        for i, (a, b) in enumerate(zip(got.fields, want.fields)):
            assert a.dtype == b.dtype and np.array_equal(a, b), (K, i)
        assert np.array_equal(got.starts, want.starts) and np.array_equal(got.stops, want.stops)
        assert got.messages().keys() == want.messages().keys()
        # ranks of 4 bytes (R >= 2**15) route alike
        wide = [x.astype(np.int32) if x.dtype == np.int16 else x for x in part]
        fin = hp.final
        args = (h, pol.ranks_per_host, pol.num_hosts, pol.layout.offsets, pol.directory.block, hp.k_own, fin.mig)
        got32 = native.route_part(*args, fin.shared, fin.readers, fin.counts, wide)
        assert np.array_equal(got32.starts, want.starts) and np.array_equal(got32.stops, want.stops)
        for a, b in zip(got32.fields, want.fields):
            assert np.array_equal(a, b) and a.dtype == (np.int32 if b.dtype == np.int16 else b.dtype)
    # the first case reaches the branches: migrations within a host and between hosts, shared rows migrating and
    # relayed, victims to three hosts; every host gets some migrations
    hp, part = _random_part(pol, np.random.default_rng(11), *cases[0])
    (got,) = hp.routed(part).values()
    src_h, dst_h = part[1] // pol.ranks_per_host, part[2] // pol.ranks_per_host
    assert (src_h == dst_h).any() and (src_h != dst_h).any() and np.intersect1d(hp.final.mig, hp.final.shared).size
    assert got.fields[10].max() & host_messages.RELAYED and (np.diff(got.starts[:, 0]) > 0).all()
    v_home, v_dir = pol.home_of(part[7]) // pol.ranks_per_host, pol.directory_host_of(part[7])
    assert ((v_home != hp.h) & (v_dir != hp.h) & (v_home != v_dir)).any() and (
        (v_home == v_dir) & (v_dir != hp.h)
    ).any()
    # a shared row whose readers are not in rank order (hosts 1 then 0): the numpy path
    P = pol.ranks_per_host
    hp, part = _random_part(pol, np.random.default_rng(5), 40, 0.5, 0.3, 5, 1)
    count = part[5].astype(np.int64)
    at = int(np.cumsum(count)[np.flatnonzero(count >= 2)[0]] - count[count >= 2][0])  # a row of 2 readers or more
    hp.final.readers[at : at + 2] = part[6][at : at + 2] = [P, 0]
    args = (hp.h, P, pol.num_hosts, pol.layout.offsets, pol.directory.block, hp.k_own, hp.final.mig, hp.final.shared)
    assert native.route_part(*args, hp.final.readers, hp.final.counts, part) is None
    (got,) = hp.routed(part).values()  # numpy's routing all the same
    assert got.fields[6].shape[0] >= count.sum()


def _directory_host_phases(pol, h: int, seed: int, rank_dtype, native_on: bool, disorder: str, monkeypatch):
    """Directory host h's phases 5-6 and 8 (`HostPlanner.decide`, `part`) on random reads, cancellations and victims,
    compiled or numpy: (the decision's Outbox, the keys' arrays, the part, its final decisions, the bytes counted).
    `disorder`: host 0's reads out of their order, which the compiled pass sorts another way: "permuted", or
    "swapped" (two keys read by one rank each swapped: their (key, rank) pairs still ascend)."""
    from herald_torchrec.schedule import native
    from herald_torchrec.schedule.herald.host_messages import MessageBytes
    from herald_torchrec.schedule.herald.host_planner import HostPlanner

    monkeypatch.setattr(native, "enabled", (lambda: True) if native_on else (lambda: False))
    rng = np.random.default_rng(seed)
    P, H = pol.ranks_per_host, pol.num_hosts
    rows = pol.layout.total_rows
    hp = object.__new__(HostPlanner)
    hp.pol, hp.h, hp.msg = pol, h, MessageBytes(H)
    pool = np.sort(rng.choice(rows, 300, replace=False))  # h's keys: read by several hosts, rows of every table
    demand, reads = [], {}
    for s in range(H):  # the first 4 keys read by every rank (rows too heavy for owner balancing's threshold)
        keys = np.union1d(rng.choice(pool, int(rng.integers(0 if s == 1 else 10, 40)), replace=False), pool[:4])
        demand.append(keys)
        i = np.repeat(np.arange(keys.shape[0]), P)  # (index, rank) pairs in that order, up to 3 of P ranks a key
        r = np.sort(rng.integers(0, P, (keys.shape[0], P)), axis=1)
        r[:, 3:] = r[:, 2:3]
        hot = np.isin(keys, pool[:4])
        r[hot] = np.arange(P)
        j = np.flatnonzero(~hot[:-1] & ~hot[1:])[0]  # two keys read by one rank each, for "swapped"
        r[j : j + 2] = r[j : j + 2, :1]
        r = s * P + r.ravel()
        first = np.r_[True, (i[1:] != i[:-1]) | (r[1:] != r[:-1])]
        i, r = i[first], r[first]
        o = np.arange(i.shape[0])
        if s == 0 and disorder == "permuted":
            o = rng.permutation(i.shape[0])
        elif s == 0 and disorder == "swapped":
            a = np.searchsorted(i, j)
            o[[a, a + 1]] = o[[a + 1, a]]
        reads[s] = [i[o].astype(np.int32), r[o].astype(rank_dtype), rng.integers(1, 4, i.shape[0]).astype(np.int32)]
    hp.demanded = np.concatenate(demand)
    hp.demand_owner = pol.directory.owner[hp.demanded]  # as phase 2 (`owners`) keeps them
    hp.demand_start = dict(enumerate(np.cumsum([0] + [d.shape[0] for d in demand[:-1]]).tolist()))
    out = hp.decide(reads)
    keys = (hp.keys, hp.k_own, hp.want.copy(), hp.single, hp.sole, hp.pk, hp.pr)
    arriving = out.fields[0]
    cancelled = np.sort(rng.choice(arriving, arriving.shape[0] // 3, replace=False))
    hp.victims = np.sort(rng.choice(rows, 20, replace=False))
    hp.local_rank, hp.members = rng.integers(0, P, 64), np.arange(64) + h * 64
    part = hp.part({t: [cancelled[t::H]] for t in range(H)})
    return out, keys, part, hp.final, hp.want, (hp.msg.kind, hp.msg.host), pol._balanced


@pytest.mark.parametrize("level, balance, rank_dtype, disorder", [
    ("full", 1.15, np.int16, None), ("full", None, np.int16, None), ("full", 1.15, np.int32, None),
    ("static", 1.15, np.int16, None), ("full", 1.15, np.int16, "permuted"), ("full", None, np.int16, "swapped"),
])  # fmt: skip
def test_compiled_decision_and_part_equal_numpy(monkeypatch, level, balance, rank_dtype, disorder):
    """A directory host's decision (phases 5-6: sorted pairs, herald's decision, owner balancing, STATIC, arrivals and
    pins by host) and its part (phase 8: cancellations, migrations, shared rows, counts) in one compiled pass each
    give numpy's arrays, dtypes, messages and byte counts; owners include guests, pairs come from several hosts."""
    from herald_torchrec.schedule import native
    from herald_torchrec.schedule.herald.budget import STATIC

    if not native.enabled():
        pytest.skip("compiled kernels unavailable (HERALD_NATIVE=0 or no C++ compiler)")
    R, h = 32, 2
    got = []
    for native_on in (True, False):
        pol = HeraldHierPolicy([900, 40, 3000, 7, 500], R, 4, 0.1, L, hosts=8, owner_balance=balance)
        pol.rank_dtype = rank_dtype
        if level == "static":
            pol._level = STATIC
        rng = np.random.default_rng(5)
        owner = pol.directory.owner
        guests = rng.choice(owner.shape[0], owner.shape[0] // 3, replace=False)
        owner[guests] = rng.integers(0, R, guests.shape[0])  # guests, some on the directory host's own ranks
        owner[rng.choice(owner.shape[0], owner.shape[0] // 4, replace=False)] = 3  # an overloaded owner to balance
        got.append(_directory_host_phases(pol, h, 11, rank_dtype, native_on, disorder, monkeypatch))
    (o1, k1, p1, f1, w1, m1, b1), (o2, k2, p2, f2, w2, m2, b2) = got
    assert o1.dests == o2.dests and np.array_equal(o1.starts, o2.starts) and np.array_equal(o1.stops, o2.stops)
    for a, b in zip(o1.fields + list(k1) + p1 + [w1], o2.fields + list(k2) + p2 + [w2]):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    for f in dataclasses.fields(f1):
        assert np.array_equal(getattr(f1, f.name), getattr(f2, f.name)), f.name
    assert m1[0] == m2[0] and np.array_equal(m1[1], m2[1]) and b1 == b2
    # the branches reached: arrivals, pins, several senders, cancellations, shared and exclusive rows, hits
    moving = level != "static"
    assert (o1.fields[0].shape[0] > 0) == moving and o1.fields[4].shape[0] > 0 and (w1 != k1[2]).any() == moving
    assert len(o1.dests) > 1 and (np.diff(k1[0]) > 0).all() and 0 < f1.shared.shape[0] <= k1[0].shape[0]
    assert f1.shared.shape[0] < k1[0].shape[0] or not moving  # exclusive rows: a sole reader the row moves to
    assert f1.counts.min() > 0
    assert (b1 > 0) == (balance is not None and level != "static")


def _same_arrays(a, b, path: str = "") -> None:
    """Every field of two records (dataclasses, nested) equal, arrays in value and dtype."""
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _same_arrays(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    else:
        assert a == b, path


@pytest.mark.parametrize("rank_dtype", [np.int16, np.int32])
def test_compiled_host_plan_equals_numpy(monkeypatch, rank_dtype):
    """A host's plan and replica moves from random routed inboxes (`host_plans.host_plan`: migrations, victims for
    the host or for their directory entry only, shared rows, empty parts, the host's own migrations routed back or
    not, its samples in order or swapped in) and the whole plan's rows (`part_rows`): the compiled pass gives numpy's
    arrays, dtypes included; keys out of sorted order too (the host's own migrations as well: a key walk that goes
    back)."""
    from types import SimpleNamespace

    from herald_torchrec.schedule import native

    if not native.enabled():
        pytest.skip("compiled kernels unavailable (HERALD_NATIVE=0 or no C++ compiler)")
    R, B, P = 32, 4, 8
    rows, _ = synthetic_window(R, B, 1)
    pol = HeraldHierPolicy(rows, R, B, 0.1, L, hosts=P)
    pol.rank_dtype = rank_dtype
    n_rows, T, H = int(pol.layout.offsets[-1]), pol.layout.num_tables, R // P
    rng = np.random.default_rng(5)
    seen = {"filtered": 0, "extra": 0, "empty": 0, "victims": 0, "own_unsorted": 0}

    def sort(k, in_order):
        return np.sort(k) if in_order else k

    for trial in range(40):
        h, in_order = int(rng.integers(H)), trial % 4 != 3
        pool = rng.permutation(n_rows)[:900]
        keys = np.sort(pool[:200])  # h's directory keys: some migrate, some of those come back to it
        mig = np.flatnonzero(rng.random(200) < 0.4)
        back = keys[mig][rng.random(mig.shape[0]) < 0.5]
        if trial % 8 == 5:  # the host's own migrations out of key order: its walk along their keys goes back
            mig = rng.permutation(mig)
            seen["own_unsorted"] += 1
        chunks = np.array_split(pool[200:], 2 * H)
        inbox = {}
        for s in range(H):
            if rng.random() < 0.25:  # an empty part: only the summary and the table bits
                seen["empty"] += 1
                m_key, v_key, s_key = (np.zeros(0, dtype=np.int64),) * 3
            else:
                m_key = sort(np.concatenate([chunks[2 * s][:40], back if s == h else []]).astype(np.int64), in_order)
                v_key = sort(chunks[2 * s][40:][: int(rng.integers(0, 8))], in_order)
                s_key = sort(rng.choice(pool, int(rng.integers(0, 60)), replace=False), in_order)
            count = rng.integers(1, 7, s_key.shape[0])
            readers = np.concatenate([np.sort(rng.choice(R, c, replace=False)) for c in count] + [np.zeros(0)])
            ranks = (rng.integers(0, R, size=(4, m_key.shape[0] + v_key.shape[0] + s_key.shape[0]))).astype(rank_dtype)
            n_m, n_v = m_key.shape[0], v_key.shape[0]
            inbox[s] = [
                m_key, ranks[0, :n_m], ranks[1, :n_m],
                s_key, ranks[2, n_m + n_v :], count.astype(rank_dtype), readers.astype(rank_dtype),
                v_key, ranks[3, n_m : n_m + n_v],
                rng.integers(0, 50, 4), rng.integers(0, 8, T).astype(np.uint8),
            ]  # fmt: skip
            seen["victims"] += n_v
        members = np.arange(h * P * B, (h + 1) * P * B, dtype=np.int64)
        if trial % 2:  # samples swapped in from other hosts: not in order
            members = rng.choice(R * B, P * B, replace=False).astype(np.int64)
        part = [None] * 9 + [members, (h * P + rng.integers(0, P, P * B)).astype(rank_dtype)]
        want, own = rng.integers(0, R, 200), rng.integers(0, R, 200)
        hp = SimpleNamespace(h=h, keys=keys, want=want, k_own=own, final=SimpleNamespace(mig=mig))
        fields = host_plans.part_dtypes(rank_dtype)[:9]
        compiled = host_plans.host_plan(pol, hp, part, inbox)
        rows_compiled = host_plans.part_rows(pol, host_messages.concatenated(inbox, fields))
        with monkeypatch.context() as m:
            m.setattr(native, "enabled", lambda: False)
            numpy_ = host_plans.host_plan(pol, hp, part, inbox)
            rows_numpy = host_plans.part_rows(pol, host_messages.concatenated(inbox, fields))
        _same_arrays(compiled[0], numpy_[0], "HostPlan")
        _same_arrays(compiled[1], numpy_[1], "HostMoves")
        _same_arrays(rows_compiled, rows_numpy, "PartRows")
        seen["filtered"] += len(rows_numpy.moves) - len(numpy_[0].moves)
        seen["extra"] += numpy_[1].gid.shape[0] - rows_numpy.gid.shape[0]
    assert all(v > 0 for v in seen.values()), seen  # every branch ran


def test_several_hosts_degrade_together_under_the_planning_budget():
    """With several hosts the planning budget (schedule/herald/budget.py) holds for herald_hier too: under a budget no
    plan fits, the first plan is FULL (it chooses the per-host tables), the next REDUCED (tried once), then STATIC:
    every sample on its own rank and no move; every plan passes the checker. Several planners plan at the level they
    agree on (`agree_level`), and the counts say how many plans each level made."""
    from herald_torchrec.schedule.herald.budget import FULL, STATIC

    R, B, steps = 16, 16, 6
    rows, batches = synthetic_window(R, B, steps)
    pol = HeraldHierPolicy(rows, R, B, 0.1, L, hosts=8, plan_budget_ms=1e-6)
    checker = PlanChecker(rows, R, B, 0.1)
    plans = []
    for s in range(steps):
        plans.append(pol.plan(batches[s : s + L + 1]))
        checker.check(plans[-1], batches[s])
    assert checker.errors == [] and checker.stale_reads == 0
    levels = pol.plan_levels()
    assert (levels.full, levels.reduced, levels.static) == (1, 1, steps - 2)
    assert pol.refine == 1 and len(pol.tables) > 0  # the FULL selection is kept for later FULL plans
    for p in plans[2:]:
        assert len(p.moves) == 0 and np.array_equal(p.assignment(), np.repeat(np.arange(R), B))
        assert p.counters["shared_value"] > 0
    assert len(plans[0].moves) > 0
    described = pol.describe()
    assert described["plans_static"] == steps - 2 and described["plan_budget"] == 1e-6
    # several planners: the level is the agreed one, not a planner's own
    many = HeraldHierPolicy(rows, R, B, 0.1, L, hosts=8, plan_budget_ms=1e-6)
    many.set_planners(2)
    many.plan(batches[: L + 1])
    assert many.level_word() == 1  # its own measurement asks for REDUCED (untried)
    assert many.agree_level([FULL, STATIC]) == STATIC
    plan = many.plan(batches[1 : L + 2])
    assert len(plan.moves) == 0 and many.plan_levels().static == 1
    with pytest.raises(ValueError, match="plan_budget_ms"):
        HeraldHierPolicy(rows, R, B, 0.1, L, hosts=8, plan_budget_ms=-1)
