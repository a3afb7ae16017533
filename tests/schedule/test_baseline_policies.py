"""The baselines HET (staleness S), FAE and P²RES as simulator policies: hand-made traces with known answers, the
checker's replica replay (and that it catches a missing sync), and the simulator CLI flags. numpy only, fast."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from herald_torchrec.schedule import GlobalBatch, PlanChecker, make_policy
from herald_torchrec.schedule.baselines.fae import FaePolicy
from tests.helpers.benchmarks import load_benchmark
from tests.schedule.test_policies import jagged_trace, make_batches, run, synthetic_trace


def dense(ids, rows) -> GlobalBatch:
    return GlobalBatch.from_dense(np.array(ids, dtype=np.int64), rows)


def step_all(pol, chk, batches):
    """Plan and check each batch alone (no lookahead); returns (plans, step checks)."""
    plans, checks = [], []
    for b in batches:
        p = pol.plan([b])
        plans.append(p)
        checks.append(chk.check(p, b))
    return plans, checks


# ---- het --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("trace", ["synthetic", "iid", "jagged"])
@pytest.mark.parametrize("cache_ratio", [0.0, 0.1, 0.3])
def test_het_staleness_zero_is_het_bsp(trace, cache_ratio):
    R, B, steps = 4, 8, 16
    if trace == "jagged":
        rows, raw = jagged_trace(R, B, steps)
    else:
        rows, raw = synthetic_trace(R, B, steps, locality=0.0 if trace == "iid" else 0.6)
    bsp, _ = run("het_bsp", rows, make_batches(rows, raw), R, B, cache_ratio=cache_ratio)
    het, chk = run("het", rows, make_batches(rows, raw), R, B, cache_ratio=cache_ratio, staleness=0)
    assert chk.stale_reads == 0
    assert [p.counters for p in het] == [p.counters for p in bsp]
    for a, b in zip(het, bsp):
        np.testing.assert_array_equal(a.reads.version, b.reads.version)
    assert sum(p.transmitted_rows() for p in het) > 0


@pytest.mark.parametrize("trace", ["synthetic", "jagged"])
def test_het_staleness_trades_stale_reads_for_rows(trace):
    R, B, steps = 4, 8, 16
    rows, raw = jagged_trace(R, B, steps) if trace == "jagged" else synthetic_trace(R, B, steps, locality=0.6)
    moved, stale = [], []
    for s in (0, 2, 8):
        plans, chk = run("het", rows, make_batches(rows, raw), R, B, cache_ratio=0.2, staleness=s)
        moved.append(sum(p.transmitted_rows() for p in plans))
        stale.append(chk.stale_reads)
    assert stale[0] == 0 and 0 < stale[1] <= stale[2]
    assert moved[0] > moved[1] > moved[2]


def test_het_shared_row_by_hand():
    # R=2, B=1, one table of 4 rows, capacity 2: both ranks read row 0 every step; S=1
    rows = [4]
    batches = [dense([[0], [0]], rows) for _ in range(4)]
    pol = make_policy("het", rows, 2, 1, 0.5, 0, staleness=1)
    chk = PlanChecker(rows, 2, 1, 0.5)
    plans, checks = step_all(pol, chk, batches)
    kinds = [{k: v for k, v in p.counters.items() if v} for p in plans]
    # step 0: both miss, nothing pushed (1 pending <= S); step 1: both hit a copy missing the other's update (stale),
    # 2 pending > S -> both push; step 2: lag 2 > S -> both pull (fresh); step 3: hit, stale again, push
    assert kinds == [{"miss_pull": 2}, {"hit": 2, "update_push": 2}, {"update_pull": 2}, {"hit": 2, "update_push": 2}]
    assert [c.stale_reads for c in checks] == [0, 2, 0, 2]
    assert not chk.errors
    np.testing.assert_array_equal(plans[1].reads.version, [0, 0])  # true version 1, each copy misses 1 update
    bsp = make_policy("het_bsp", rows, 2, 1, 0.5, 0)
    assert sum(bsp.plan([b]).transmitted_rows() for b in batches) == 16 > 8 == sum(p.transmitted_rows() for p in plans)


def test_het_single_reader_pushes_every_S_plus_1_and_on_eviction():
    rows = [4]  # capacity 1 per rank (cache 0.25): rank 0 reads row 0 three times, then row 1
    ids = [[[0], [3]], [[0], [3]], [[0], [3]], [[1], [3]]]
    pol = make_policy("het", rows, 2, 1, 0.25, 0, staleness=2)
    chk = PlanChecker(rows, 2, 1, 0.25)
    plans, checks = step_all(pol, chk, [dense(i, rows) for i in ids])
    assert [p.counters["update_push"] for p in plans] == [0, 0, 2, 0]  # 3 pending > 2 at step 2, at both ranks
    assert [p.counters["evict_push"] for p in plans] == [0, 0, 0, 0]  # nothing pending when row 0 leaves
    ids2 = [[[0], [3]], [[1], [3]]]
    pol = make_policy("het", rows, 2, 1, 0.25, 0, staleness=2)
    plans, _ = step_all(pol, PlanChecker(rows, 2, 1, 0.25), [dense(i, rows) for i in ids2])
    assert plans[1].counters["evict_push"] == 1 and plans[1].counters["miss_pull"] == 1
    assert sum(c.stale_reads for c in checks) == 0  # nobody else reads the rows: never stale


def test_het_rejects_bad_staleness():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="staleness"):
            make_policy("het", [4], 2, 1, 0.5, 0, staleness=bad)


# ---- fae --------------------------------------------------------------------------------------------------------
FAE_ROWS = [4, 4]  # R=2: rows 0-1 of each table live on rank 0, rows 2-3 on rank 1; gid = 4 t + row


def fae_policy(**kw) -> FaePolicy:
    pol = make_policy("fae", FAE_ROWS, 2, 2, 0.5, 0, hot_budget=3, **kw)
    # accesses: gid 0 x3, gid 4 x3, gids 1, 2, 7 x1 -> top 3 (ties to the lower row): {0, 1, 4}
    hot = pol.profile([dense([[0, 0], [0, 0], [1, 0], [2, 3]], FAE_ROWS)])
    np.testing.assert_array_equal(hot, [0, 1, 4])
    return pol


def test_fae_partition_and_reorder():
    pol = fae_policy()
    b0 = dense([[2, 3], [0, 0], [3, 1], [1, 0]], FAE_ROWS)
    b1 = dense([[0, 0], [2, 2], [1, 0], [3, 3]], FAE_ROWS)
    np.testing.assert_array_equal(pol.sample_hot(b0), [False, True, False, True])  # hot iff every id is hot
    np.testing.assert_array_equal(pol.sample_hot(b1), [True, False, True, False])
    r0, r1 = pol.reorder([b0, b1])
    np.testing.assert_array_equal(
        np.stack(r0.values, 1), [[0, 0], [1, 0], [0, 0], [1, 0]]
    )  # the four hot samples, in stream order
    np.testing.assert_array_equal(np.stack(r1.values, 1), [[2, 3], [3, 1], [2, 2], [3, 3]])
    chk = PlanChecker(FAE_ROWS, 2, 2, 0.5)
    # a cold batch reading the hot rows 0 and 4 at home, then a hot batch: the switch copies them to the replicas
    b2 = dense([[0, 0], [2, 2], [0, 0], [3, 3]], FAE_ROWS)
    b3 = dense([[0, 0], [1, 0], [0, 0], [1, 0]], FAE_ROWS)
    plans, checks = step_all(pol, chk, [r0, r1, b2, b3])
    c = [{k: v for k, v in p.counters.items() if v} for p in plans]
    assert c[0] == {"hit": 6, "allreduce": 2 * 1 * 3}  # both ranks read {0, 1, 4} from replicas
    # cold: rank 0 reads gids {2, 3, 5, 7}, rank 1 {2, 3, 6, 7}; homes 2, 3, 6, 7 -> 1, 5 -> 0
    assert c[1] == {"hit": 5, "shared_value": 3, "shared_grad": 3}
    np.testing.assert_array_equal(plans[1].replicas.to_home_row, [0, 1, 0])  # hot -> cold writes {0, 1, 4} home
    assert plans[3].counters["replica_sync"] == 1 * 2  # rows 0 and 4 changed at home: R-1 copies each
    np.testing.assert_array_equal(plans[3].replicas.to_replicas_table, [0, 1])
    assert [p.replicas.allreduce_row.shape[0] for p in plans] == [3, 0, 0, 3]
    assert chk.stale_reads == 0 and not chk.errors and pol.hot_batches == 2


def test_checker_catches_a_missing_fae_sync():
    pol = fae_policy()
    chk = PlanChecker(FAE_ROWS, 2, 2, 0.5)
    cold = dense([[0, 0], [2, 2], [0, 0], [3, 3]], FAE_ROWS)
    hot = dense([[0, 0], [1, 0], [0, 0], [1, 0]], FAE_ROWS)
    chk.check(pol.plan([cold]), cold)
    plan = pol.plan([hot])
    bad = copy.deepcopy(plan)
    bad.replicas.to_replicas_table = bad.replicas.to_replicas_row = np.zeros(0, dtype=np.int64)
    res = chk.check(bad, hot)
    assert res.stale_reads == 4  # rows 0 and 4 read by both ranks from replicas that missed the cold update
    assert any("reported versions" in e for e in res.errors)


def test_fae_reorder_keeps_the_samples_on_a_stream():
    R, B = 4, 8
    rows, raw = synthetic_trace(R, B, 16, locality=0.6)
    batches = make_batches(rows, raw)
    pol = make_policy("fae", rows, R, B, 0.1, 0, window=4, hot_budget=300)
    pol.profile(batches[:8])
    out = [nb for i in range(0, 16, 4) for nb in pol.reorder(batches[i : i + 4])]

    def key(bs):
        return sorted(map(tuple, np.concatenate([np.stack(b.values, 1) for b in bs]).tolist()))

    assert key(out) == key(batches)
    hot = [bool(pol.sample_hot(b).all()) for b in out]
    per_window = [sum(int(pol.sample_hot(b).sum()) for b in batches[i : i + 4]) for i in range(0, 16, 4)]
    assert sum(hot) == sum(h // (R * B) for h in per_window) >= 4  # floor(H / N) purely hot batches per window
    assert all(hot[i] or not any(hot[i : (i // 4 + 1) * 4]) for i in range(16))
    chk = PlanChecker(rows, R, B, 0.1)
    for b in out:
        assert not chk.check(pol.plan([b]), b).errors
    assert chk.stale_reads == 0 and pol.hot_batches == sum(hot)


def test_replica_policies_reject_bad_settings():
    with pytest.raises(ValueError, match="hot_budget"):
        make_policy("fae", [4], 2, 1, 0.5, 0, hot_budget=-1)
    with pytest.raises(ValueError, match="window"):
        make_policy("fae", [4], 2, 1, 0.5, 0, window=0)
    with pytest.raises(ValueError, match="profile_fraction"):
        make_policy("p2res", [4], 2, 1, 0.5, 0, profile_fraction=0.0)
    with pytest.raises(ValueError, match="profile"):
        make_policy("fae", [4], 2, 1, 0.5, 0).reorder([dense([[0], [1]], [4])])


# ---- p2res ------------------------------------------------------------------------------------------------------
P2_ROWS = [8, 8]  # R=2: rows 0-3 home 0, rows 4-7 home 1; gid = 8 t + row
P2_BATCH = [[0, 5], [0, 5], [0, 4], [0, 1], [0, 6], [0, 6], [0, 6], [0, 7]]  # samples 0-3 on rank 0, 4-7 on rank 1


def test_p2res_model_picks_the_replicated_rows():
    b = dense(P2_BATCH, P2_ROWS)
    pol = make_policy("p2res", P2_ROWS, 2, 4, 0.5, 0, hot_budget=10)
    a2a, ar = pol.model([b])
    # gid 0: 4 lookups from rank 1 -> 8 > 2; gid 13 (t1 r5): 2 from rank 0 -> 4 > 2; gid 12: 1 -> 2 = 2, not more
    np.testing.assert_allclose(a2a[[0, 9, 12, 13, 14, 15]], [8, 0, 2, 4, 0, 0])
    np.testing.assert_allclose(ar[[0, 9, 12, 13, 14, 15, 1]], [2, 2, 2, 2, 2, 2, 0])
    np.testing.assert_array_equal(pol.profile([b]), [0, 13])
    small = make_policy("p2res", P2_ROWS, 2, 4, 0.5, 0, hot_budget=1)
    np.testing.assert_array_equal(small.profile([b]), [0])  # largest benefit first
    chk = PlanChecker(P2_ROWS, 2, 4, 0.5)
    plans, _ = step_all(pol, chk, [b, b])
    c = {k: v for k, v in plans[0].counters.items() if v}
    # replicated: (0, r0), (0, r1), (13, r0) local; home: 9 at r0, 14/15 at r1 local, 12 read by r0 from rank 1
    assert c == {"hit": 6, "shared_value": 1, "shared_grad": 1, "allreduce": 2 * 1 * 2}
    assert chk.stale_reads == 0 and not chk.errors


def test_checker_catches_a_missing_allreduce():
    b = dense(P2_BATCH, P2_ROWS)
    pol = make_policy("p2res", P2_ROWS, 2, 4, 0.5, 0, hot_budget=10)
    pol.profile([b])
    chk = PlanChecker(P2_ROWS, 2, 4, 0.5)
    bad = copy.deepcopy(pol.plan([b]))
    bad.replicas.allreduce_table, bad.replicas.allreduce_row = np.array([1]), np.array([5])  # row 0's is dropped
    bad.counters["allreduce"] = 2
    res = chk.check(bad, b)
    assert any("no all-reduce" in e for e in res.errors)
    res = chk.check(pol.plan([b]), b)
    assert res.stale_reads == 2  # both ranks read replicas of row 0 that lost the first step's gradient


@pytest.mark.parametrize("name", ["fae", "p2res"])
def test_replica_policies_are_exact_on_random_traces(name):
    R, B = 4, 8
    for rows, raw in (synthetic_trace(R, B, 12, locality=0.6), jagged_trace(R, B, 12)):
        plans, chk = run(name, rows, make_batches(rows, raw), R, B, cache_ratio=0.2)
        assert chk.stale_reads == 0 and not chk.errors
        assert any(p.counters["allreduce"] for p in plans)


# ---- simulator CLI ----------------------------------------------------------------------------------------------
def load_simulate():
    return load_benchmark("simulate")


SMALL = [
    "--scale",
    "0.0005",
    "--batch",
    "8",
    "--steps",
    "8",
    "--lookahead",
    "2",
    "--cache-ratio",
    "0.2",
    "--workers",
    "4",
    "--json",
]


def test_simulate_baselines(capsys):
    sim = load_simulate()
    sim.main(
        [
            "--policies",
            "het_bsp,het,fae,p2res,herald",
            "--staleness",
            "2",
            "--hot-budget",
            "40",
            "--fae-window",
            "4",
            "--profile-fraction",
            "0.25",
            *SMALL,
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["staleness"] == 2 and out["config"]["hot_budget"] == 40
    pol = out["policies"]
    assert list(pol) == ["het_bsp", "het", "fae", "p2res", "herald"]
    for name, st in pol.items():
        assert "check_errors" not in st and st["steps"] == 8
        assert abs(st["rows_per_step"] - sum(v for k, v in st["by_kind"].items() if k != "hit")) < 0.05
        assert (st["stale_reads"] > 0) == (name == "het"), name
    assert pol["het"]["staleness"] == 2 and pol["het"]["rows_per_step"] < pol["het_bsp"]["rows_per_step"]
    assert (
        set(pol["fae"]["by_kind"])
        == set(pol["p2res"]["by_kind"])
        == {"hit", "shared_value", "shared_grad", "allreduce", "replica_sync"}
    )
    assert pol["fae"]["replicated_rows"] == 40 and 0 < pol["p2res"]["replicated_rows"] <= 40
    assert pol["p2res"]["by_kind"]["allreduce"] > 0


def test_simulate_het_zero_matches_het_bsp(capsys):
    sim = load_simulate()
    sim.main(["--policies", "het_bsp,het", "--staleness", "0", *SMALL])
    pol = json.loads(capsys.readouterr().out)["policies"]
    assert pol["het"]["by_kind"] == pol["het_bsp"]["by_kind"]


def test_simulate_rejects_bad_flags():
    sim = load_simulate()
    for flags in (["--staleness", "-1"], ["--hot-budget", "-2"], ["--fae-window", "0"], ["--profile-fraction", "0"]):
        with pytest.raises(SystemExit):
            sim.main(["--policies", "het,fae", *flags, *SMALL])
