"""schedule/traffic.py: a plan's rows split into cross-host and intra-host rows, today and host-aggregated.

Hand-made plans with answers worked out by hand, then every policy on a synthetic trace: the split of every kind
adds up to the plan's own counter in both modes. Also: a finished GlobalBatch is freed without the cyclic GC."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from herald_torchrec.data.synthetic import SyntheticCTR, SyntheticSpec
from herald_torchrec.schedule import GlobalBatch, make_policy
from herald_torchrec.schedule.plan import EVICT_HOME, FORWARD, MIGRATE, Plan, ReplicaSync, RowMoves, SharedRows
from herald_torchrec.schedule.reads import Scratch, batch_keys
from herald_torchrec.schedule.traffic import FAN_IN, FAN_OUT, KindTransfers, host_traffic


def i64(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def shared_plan(R: int, owners: list[int], readers: list[list[int]], tables: list[int] | None = None) -> Plan:
    """A plan whose only traffic is shared rows (row i: owner owners[i], readers readers[i], owner included)."""
    remote = sum(sum(r != o for r in rd) for o, rd in zip(owners, readers))
    shared = SharedRows(
        table=i64(*(tables or [0] * len(owners))),
        row=np.arange(len(owners), dtype=np.int64),
        owner=i64(*owners),
        reader_offsets=np.concatenate([[0], np.cumsum([len(r) for r in readers])]).astype(np.int64),
        readers=i64(*[x for r in readers for x in sorted(r)]),
    )
    return Plan(
        step=0,
        num_ranks=R,
        batch_per_rank=1,
        sample_order=np.arange(R, dtype=np.int64),
        shared=shared,
        counters={"hit": 0, "shared_value": remote, "shared_grad": remote},
    )


def test_shared_row_read_by_every_rank_of_two_hosts():
    # R=4, 2 hosts {0,1} {2,3}; row owned by 0, read by all four
    ht = host_traffic(shared_plan(4, [0], [[0, 1, 2, 3]]), ranks_per_host=2)
    assert ht.num_hosts == 2
    # today: values to 1 (inside host 0), 2 and 3 (across); the three gradients come back the same ways
    assert ht.cross == {"shared_value": 2, "shared_grad": 2}
    assert ht.intra == {"shared_value": 1, "shared_grad": 1}
    # aggregated: one value crosses to host 1 and is handed on to its other reader; host 1's two gradients are
    # summed there and one sum crosses back
    assert ht.cross_aggregated == {"shared_value": 1, "shared_grad": 1}
    assert ht.intra_aggregated == {"shared_value": 2, "shared_grad": 2}
    assert (ht.cross_rows, ht.intra_rows, ht.cross_rows_aggregated, ht.intra_rows_aggregated) == (4, 2, 2, 4)
    # rank 0 sends 3 values and receives 3 gradients, every reader 1 + 1: busiest 6 over a mean of 3
    np.testing.assert_array_equal(ht.rank_rows, [6, 2, 2, 2])
    assert ht.balance() == pytest.approx(2.0)
    assert ht.cross_by_table == {("shared_value", 0): 2.0, ("shared_grad", 0): 2.0}
    assert ht.cross_by_table_aggregated == {("shared_value", 0): 1.0, ("shared_grad", 0): 1.0}
    assert ht.unattributed == {}


def test_rows_are_merged_per_row_not_across_rows_and_owners():
    # two rows of different owners, each read by both ranks of host 1: one crossing per row and direction
    plan = shared_plan(4, [0, 1, 3], [[2, 3], [2, 3], [2, 3]], tables=[0, 1, 1])
    ht = host_traffic(plan, ranks_per_host=2)
    assert ht.cross == {"shared_value": 4, "shared_grad": 4}  # rows 0, 1: 2 readers each across; row 2: inside
    assert ht.intra == {"shared_value": 1, "shared_grad": 1}
    assert ht.cross_aggregated == {"shared_value": 2, "shared_grad": 2}
    assert ht.intra_aggregated == {"shared_value": 3, "shared_grad": 3}
    per_table = {(kind, t): 2.0 for kind in ("shared_value", "shared_grad") for t in (0, 1)}
    assert ht.cross_by_table == per_table


def test_partial_last_host_and_one_host_for_all():
    # R=5, H=2: hosts {0,1} {2,3} {4}; row owned by 4 (alone on its host), read by 0, 1 and 4
    plan = shared_plan(5, [4], [[0, 1, 4]])
    ht = host_traffic(plan, ranks_per_host=2)
    assert ht.num_hosts == 3
    assert ht.cross == {"shared_value": 2, "shared_grad": 2} and ht.intra == {"shared_value": 0, "shared_grad": 0}
    assert ht.cross_aggregated == {"shared_value": 1, "shared_grad": 1}
    assert ht.intra_aggregated == {"shared_value": 1, "shared_grad": 1}
    # every rank on one host: nothing crosses in either mode
    one = host_traffic(plan, ranks_per_host=8)
    assert one.num_hosts == 1 and one.cross_rows == 0 and one.cross_rows_aggregated == 0
    assert one.intra_rows == one.intra_rows_aggregated == 4


def test_row_moves_are_point_to_point():
    plan = shared_plan(4, [], [])
    plan.moves = RowMoves(
        table=i64(0, 0, 1, 1),
        row=i64(5, 5, 7, 8),
        src=i64(0, 1, 2, 1),
        dst=i64(3, 0, 3, 2),
        kind=np.array([MIGRATE, EVICT_HOME, FORWARD, MIGRATE], dtype=np.int8),
    )
    plan.counters.update({"migrate": 2, "evict_home": 1, "forward": 1})
    ht = host_traffic(plan, ranks_per_host=2)
    for mode in (ht.cross, ht.cross_aggregated):
        assert (mode["migrate"], mode["evict_home"], mode["forward"]) == (2, 0, 0)  # 0->3 and 1->2 cross
    for mode in (ht.intra, ht.intra_aggregated):
        assert (mode["migrate"], mode["evict_home"], mode["forward"]) == (0, 1, 1)
    np.testing.assert_array_equal(ht.rank_rows, [2, 2, 2, 2])
    assert ht.balance() == 1.0


def test_allreduce_flat_ring_today_hierarchical_aggregated():
    plan = shared_plan(4, [], [])
    plan.replicas = ReplicaSync(allreduce_table=i64(0, 0, 1), allreduce_row=i64(1, 2, 3))
    plan.counters["allreduce"] = 2 * 3 * 3  # 2 rows per reduced row, as the replica policies count it
    ht = host_traffic(plan, ranks_per_host=2)
    # a ring over 0-1-2-3-0: 2 of its 4 links cross hosts, each carries 2 (R-1) / R = 1.5 rows per reduced row
    assert ht.cross["allreduce"] == pytest.approx(9.0) and ht.intra["allreduce"] == pytest.approx(9.0)
    # hierarchical: 2 (hosts - 1) = 2 crossing rows per reduced row
    assert ht.cross_aggregated["allreduce"] == pytest.approx(6.0)
    assert ht.intra_aggregated["allreduce"] == pytest.approx(12.0)
    np.testing.assert_allclose(ht.rank_rows, [9.0] * 4)  # each rank sends and receives 1.5 x 3 rows
    one = host_traffic(plan, ranks_per_host=4)
    assert one.cross["allreduce"] == 0 and one.cross_aggregated["allreduce"] == 0


def test_policy_transfers_fan_out_and_in_and_unattributed_kinds():
    plan = shared_plan(4, [], [])
    plan.counters = {"hit": 3, "miss_pull": 4, "update_push": 3, "mystery": 2}
    pulls = KindTransfers(key=i64(9, 9, 9, 4), src=i64(0, 0, 0, 1), dst=i64(0, 2, 3, 3), fan=FAN_OUT)
    pushes = KindTransfers(key=i64(9, 9, 9), src=i64(2, 3, 1), dst=i64(0, 0, 0), fan=FAN_IN)
    ht = host_traffic(plan, 2, {"miss_pull": pulls, "update_push": pushes})
    # pulls: 0->0 stays in a rank (intra), 0->2 and 0->3 cross (one crossing aggregated), 1->3 crosses
    assert (ht.cross["miss_pull"], ht.intra["miss_pull"]) == (3, 1)
    assert (ht.cross_aggregated["miss_pull"], ht.intra_aggregated["miss_pull"]) == (2, 2)
    # pushes of row 9 to 0 from 2 and 3 are summed on host 1; 1 -> 0 stays inside host 0
    assert (ht.cross["update_push"], ht.cross_aggregated["update_push"]) == (2, 1)
    assert ht.unattributed == {"mystery": 2}
    # a transfer inside one rank is not network traffic of that rank
    np.testing.assert_array_equal(ht.rank_rows, [5, 2, 2, 3])


def test_bad_arguments():
    plan = shared_plan(4, [0], [[0, 1]])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="ranks_per_host"):
            host_traffic(plan, bad)
    with pytest.raises(ValueError, match="fan"):
        KindTransfers(fan="sideways")
    with pytest.raises(ValueError, match="one entry per transfer"):
        KindTransfers(key=i64(1), src=i64(0, 1), dst=i64(1))


POLICY_NAMES = ("static", "het_bsp", "het", "fae", "p2res", "herald_greedy", "herald")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_split_adds_up_to_its_counters(name):
    """Every transmitted row of every policy is located (nothing unattributed), and in both modes cross + intra of
    each kind equals the plan's counter; aggregation never adds crossings."""
    R, B, L = 12, 32, 2
    gen = SyntheticCTR(SyntheticSpec(scale=0.002))
    rows = list(gen.table_rows)
    ids = [gen.global_batch(i, R * B).ids for i in range(10)]
    pol = make_policy(name, rows, R, B, 0.1, L)
    if hasattr(pol, "profile_fraction"):
        pol.profile([GlobalBatch.from_dense(x, rows) for x in ids[:2]])
    crossed = 0.0
    for s in range(7):
        plan = pol.plan([GlobalBatch.from_dense(x, rows, index=s + j) for j, x in enumerate(ids[s : s + L + 1])])
        ht = host_traffic(plan, 4, pol.last_transfers)
        assert ht.unattributed == {}
        for kind, v in plan.counters.items():
            if kind == "hit":
                continue
            assert ht.cross.get(kind, 0) + ht.intra.get(kind, 0) == pytest.approx(v), kind
            assert ht.cross_aggregated.get(kind, 0) + ht.intra_aggregated.get(kind, 0) == pytest.approx(v), kind
            assert ht.cross_aggregated.get(kind, 0) <= ht.cross.get(kind, 0) + 1e-9
        crossed += ht.cross_rows
    assert crossed > 0


def test_finished_global_batch_is_freed_without_the_cyclic_gc():
    """The batch caches its BatchKeys; BatchKeys must not hold the batch strongly (a cycle only gc.collect frees)."""
    gen = SyntheticCTR(SyntheticSpec(scale=0.002))
    rows = list(gen.table_rows)
    pol = make_policy("herald", rows, 4, 16, 0.1, 1)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        window = [GlobalBatch.from_dense(gen.global_batch(i, 64).ids, rows, index=i) for i in range(2)]
        bk = batch_keys(window[0], Scratch())
        assert bk.batch is window[0] and bk.smp.shape[0] == 64 * len(rows)
        pol.plan(window)  # the planner caches its own per-batch state on the batches too
        refs = [weakref.ref(b) for b in window]
        del window
        assert refs[0]() is None  # planned: nobody needs it
        assert refs[1]() is not None  # still the policy's lookahead
        del pol
        assert refs[1]() is None
        with pytest.raises(RuntimeError, match="GlobalBatch was freed"):
            bk.batch
    finally:
        if was_enabled:
            gc.enable()
