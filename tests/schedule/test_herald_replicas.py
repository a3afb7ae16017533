"""Herald's replicated rows (schedule/herald/replicas.py): the cost model's choice on hand-made traces, the plans
(replica reads out of `shared`, all-reduces, declarations when rows join), the checker's replay of them (0 stale reads
as the set changes; a dropped all-reduce or a replicated row left in `shared` is caught), the settings' validation,
and plans without replication unchanged. numpy only, fast."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from herald_torchrec.schedule import GlobalBatch, PlanChecker, make_policy
from tests.schedule.test_policies import jagged_trace, make_batches, plan_signature, run, synthetic_trace

R, B = 4, 8  # two hosts of two ranks


def everyone_reads_table0(steps: int, seed: int = 0) -> tuple[list[int], list[GlobalBatch]]:
    """Table 0 (2 rows) is read by every sample; table 1 (400 rows) by random samples."""
    rng = np.random.default_rng(seed)
    rows = [2, 400]
    out = []
    for _ in range(steps):
        ids = np.stack([rng.integers(0, 2, R * B), rng.integers(0, 400, R * B)], axis=1)
        out.append(GlobalBatch.from_dense(ids, rows))
    return rows, out


def test_rows_every_host_reads_are_replicated_and_read_locally():
    rows, batches = everyone_reads_table0(6)
    plans, chk = run("herald", rows, batches, R, B, cache_ratio=0.2, hosts=2, replicate=True, replica_interval=3)
    assert chk.stale_reads == 0 and not chk.errors
    first = plans[0]
    # both rows of table 0 (read by every rank) join at once, declared with the whole set
    np.testing.assert_array_equal(first.replicas.replicated_table, [0, 0])
    np.testing.assert_array_equal(first.replicas.replicated_row, [0, 1])
    assert first.counters["replica_sync"] == 2 * (R - 1)
    for p in plans:
        np.testing.assert_array_equal(p.replicas.allreduce_table, [0, 0])
        assert p.counters["allreduce"] == 2 * (R - 1) * 2
        assert not (p.shared.table == 0).any()  # never through the shared path
        rep = p.reads.replica
        assert rep[p.reads.table == 0].all() and not rep[p.reads.table == 1].any()
    # the set does not change, so later plans declare nothing and sync nothing
    assert all(p.replicas.replicated_row.shape[0] == 0 and p.counters["replica_sync"] == 0 for p in plans[1:])


def test_no_host_map_replicates_nothing_and_plans_stay_herald():
    """Rank-level, a row's shared rows never exceed its all-reduce: nothing pays for replication, and the plans
    (assignment, moves, shared rows) are plain Herald's."""
    rows, batches = everyone_reads_table0(5)
    plain, _ = run("herald", rows, batches, R, B, cache_ratio=0.2)
    rep, chk = run("herald", rows, batches, R, B, cache_ratio=0.2, replicate=True, replica_interval=2)
    assert chk.stale_reads == 0
    assert all(p.replicas.allreduce_row.shape[0] == 0 for p in rep)
    for a, b in zip(plain, rep):
        assert plan_signature(a)[:-1] == plan_signature(b)[:-1]


@pytest.mark.parametrize("trace", ["synthetic", "jagged"])
def test_random_traces_read_fresh_values(trace):
    R8, B8 = 8, 16
    if trace == "jagged":
        rows, raw = jagged_trace(R8, B8, 30)
    else:
        rows, raw = synthetic_trace(R8, B8, 30, locality=0.6)
    pol_kw = dict(hosts=2, replicate=True, replica_interval=4, replica_row_margin=0.5)
    plans, chk = run("herald", rows, make_batches(rows, raw), R8, B8, cache_ratio=0.2, **pol_kw)
    assert chk.stale_reads == 0 and not chk.errors
    assert sum(p.counters["allreduce"] for p in plans) > 0


def test_rows_move_between_replicated_and_owned_as_readership_changes():
    """Every sample reads row 0 or 1 of table 0 for 6 steps, then rows 2 or 3, while a few samples keep reading row
    0: rows 0 and 1 leave the set (row 0 read from its owner after, fresh, without a sync), rows 2 and 3 join it."""
    rng = np.random.default_rng(1)
    rows = [4, 400]
    batches = []
    for s in range(14):
        hot = rng.integers(0, 2, R * B) + (0 if s < 6 else 2)
        if s >= 6:
            hot[:2] = 0  # two samples (one rank) still read row 0
        batches.append(GlobalBatch.from_dense(np.stack([hot, rng.integers(0, 400, R * B)], axis=1), rows))
    plans, chk = run("herald", rows, batches, R, B, cache_ratio=0.2, hosts=2, replicate=True, replica_interval=4)
    assert chk.stale_reads == 0 and not chk.errors
    declared = {p.step: p.replicas.replicated_row.tolist() for p in plans if p.replicas.replicated_row.shape[0]}
    assert declared[0] == [0, 1] and declared[8] == [1, 2, 3]  # at step 8 row 0 leaves, rows 2 and 3 join
    assert 12 not in declared  # row 1 leaves at step 12: no sync, nothing to declare
    assert not plans[12].reads.replica[plans[12].reads.table == 0].all()
    last = plans[-1]
    assert not last.reads.replica[(last.reads.table == 0) & (last.reads.row == 0)].any()  # row 0: owned again
    assert last.reads.replica[(last.reads.table == 0) & (last.reads.row >= 2)].all()


def test_budget_caps_the_set():
    rows, batches = everyone_reads_table0(4)
    plans, chk = run("herald", rows, batches, R, B, cache_ratio=0.2, hosts=2, replicate=True, replica_budget=1)
    assert chk.stale_reads == 0
    assert plans[0].replicas.replicated_row.shape[0] == 1


def test_checker_catches_a_dropped_allreduce_and_a_replica_in_shared():
    rows, batches = everyone_reads_table0(3)
    pol = make_policy("herald", rows, R, B, 0.2, 0, hosts=2, replicate=True)
    plans = [pol.plan([b]) for b in batches]
    # the first step's gradient of row (0, 0) is not all-reduced: every later read of its replicas is stale
    bad = copy.deepcopy(plans)
    bad[0].replicas.allreduce_table, bad[0].replicas.allreduce_row = np.array([0]), np.array([1])
    chk = PlanChecker(rows, R, B, 0.2)
    res = [chk.check(p, b) for p, b in zip(bad, batches)]
    assert res[0].errors and res[1].stale_reads == R  # every rank reads row 0 in step 1
    # a replicated row also sent through the shared path
    leak = copy.deepcopy(plans[1])
    leak.shared.table = np.concatenate([leak.shared.table, [0]])
    leak.shared.row = np.concatenate([leak.shared.row, [0]])
    leak.shared.owner = np.concatenate([leak.shared.owner, [0]])
    leak.shared.readers = np.concatenate([leak.shared.readers, [1]])
    leak.shared.reader_offsets = np.concatenate([leak.shared.reader_offsets, [leak.shared.readers.shape[0]]])
    chk = PlanChecker(rows, R, B, 0.2)
    chk.check(plans[0], batches[0])
    assert chk.check(leak, batches[1]).errors


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"replicate": "yes"}, "replicate"),
        ({"replicate": True, "replica_budget": -1}, "replica_budget"),
        ({"replicate": True, "replica_interval": 0}, "replica_interval"),
        ({"replicate": True, "replica_row_margin": 2.0}, "replica_row_margin"),
        ({"host_laia": 1}, "host_laia"),
    ],
)
def test_bad_replica_settings_are_named(kw, name):
    with pytest.raises(ValueError, match=name):
        make_policy("herald", [10, 20], 4, 2, **kw)


def test_herald_replica_plans_are_executable():
    """The data plane runs Herald's replicas (distributed/step/replicas.py): the policy is runnable with them and
    its plans are executable, the declared set included."""
    from herald_torchrec.schedule import runnable_policy

    assert runnable_policy("herald", replicate=False) == "herald"
    assert runnable_policy("herald", replicate=True) == "herald"
    rows, batches = everyone_reads_table0(1)
    plan = make_policy("herald", rows, R, B, 0.2, 0, hosts=2, replicate=True).plan([batches[0]])
    assert plan.executable and plan.replicas.replicated_row.shape[0] > 0
