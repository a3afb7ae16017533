"""Herald's planning budget (schedule/herald/budget.py): a planner over its budget makes cheaper plans (fewer
scheduled tables and no refine rounds, then static ones), each accepted by the checker (0 stale reads) and counted;
with the default nothing changes (the same plans as before the budget existed); several planners plan every batch
at the level they agree on."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from herald_torchrec import _native
from herald_torchrec.schedule import PlanChecker, make_policy, native, runnable_policy
from herald_torchrec.schedule.herald import budget as budget_mod
from herald_torchrec.schedule.herald.budget import FULL, PROBE_EVERY, REDUCED, STATIC, WARMUP_STEPS, PlanBudget
from tests.schedule.test_policies import make_batches, plan_signature, synthetic_trace

R, B, L = 4, 64, 2
# sha256 of the plan signatures of 12 steps on `synthetic_trace(4, 64, 12)` by the default Herald policy, made by the
# code before the planning budget existed: the default must keep these plans
DEFAULT_DIGEST = "5dee3e84d05d5040"


def _trace(steps: int):
    rows, raw = synthetic_trace(R, B, steps)
    return rows, make_batches(rows, raw)


def _run(policy, rows, batches, levels: list | None = None, chk: PlanChecker | None = None):
    """Plan every step, check every plan strictly (with `chk`, a checker that saw the policy's earlier plans);
    returns the plans and the checker. `levels` gets the level of every plan."""
    chk = chk if chk is not None else PlanChecker(rows, R, B, 0.1, strict=True)
    plans = []
    for i in range(len(batches)):
        before = dict(vars(policy.plan_levels()))
        window = batches[i : i + L + 1]
        plan = policy.plan(window)
        chk.check(plan, window[0])
        plans.append(plan)
        if levels is not None:
            after = vars(policy.plan_levels())
            levels.append(next(k for k in after if after[k] != before[k]))
    return plans, chk


def _digest(plans) -> str:
    h = hashlib.sha256()
    for p in plans:
        for part in plan_signature(p):
            h.update(part if isinstance(part, bytes) else repr(part).encode())
    return h.hexdigest()[:16]


@pytest.fixture(params=[True, False], ids=["native", "numpy"])
def kernels(request):
    """Both implementations of the planner (the compiled kernels where built, and numpy)."""
    if request.param and not native.enabled():
        pytest.skip("no C++ compiler here: the numpy path is the only one")
    _native.set_mode(request.param)
    try:
        yield request.param
    finally:
        _native.set_mode(True)


def test_default_makes_the_plans_made_before_the_budget(kernels):
    rows, batches = _trace(12)
    pol = make_policy("herald", rows, R, B, 0.1, L)
    plans, chk = _run(pol, rows, batches)
    assert _digest(plans) == DEFAULT_DIGEST
    assert chk.stale_reads == 0
    d = pol.describe()
    assert (d["plans_full"], d["plans_reduced"], d["plans_static"]) == (12, 0, 0)
    assert d["plan_budget"] == "auto" and d["plan_budget_ms_now"] is None  # no step time measured: no budget
    # steps measured, much longer than a plan: the auto budget applies and never triggers
    pol = make_policy("herald", rows, R, B, 0.1, L)
    for _ in range(WARMUP_STEPS):
        pol.observe_step(60_000.0, 0.0)
    plans, _ = _run(pol, rows, batches)
    assert _digest(plans) == DEFAULT_DIGEST
    assert pol.describe()["plan_budget_ms_now"] == pytest.approx(60_000.0)
    # the stream first pass (the default from 8 ranks): the default budget keeps its plans too
    stream, chk = _run(make_policy("herald", rows, R, B, 0.1, L, first_pass="stream"), rows, batches)
    unbudgeted, _ = _run(
        make_policy("herald", rows, R, B, 0.1, L, first_pass="stream", plan_budget_ms=None), rows, batches
    )
    assert _digest(stream) == _digest(unbudgeted) != DEFAULT_DIGEST
    assert chk.stale_reads == 0


def test_tiny_fixed_budget_degrades_then_plans_static(kernels):
    rows, batches = _trace(12)
    pol = make_policy("herald", rows, R, B, 0.1, L, plan_budget_ms=1e-3)
    levels: list[str] = []
    plans, chk = _run(pol, rows, batches, levels)
    full_tables, full_refine = pol.tables, pol.refine
    # the first plan profiles at full, the second tries the reduced level, both cost more than 1 us: static after
    assert levels == ["full", "reduced"] + ["static"] * 10
    assert chk.stale_reads == 0 and not chk.errors
    d = pol.describe()
    assert (d["plans_full"], d["plans_reduced"], d["plans_static"]) == (1, 1, 10)
    assert d["plan_budget"] == pytest.approx(1e-3)
    # the full selection is kept (restored after the reduced plan); the reduced one has half its tables, no rounds
    assert full_tables == [2, 3, 4] and full_refine == 2
    red = pol._reduced_selection()
    assert red.refine == 0 and red.tables.tolist() == [3, 4]  # the two best by benefit of [2, 3, 4]
    assert red.benefit[3] >= red.benefit[4] >= red.benefit[2]
    # a static plan: every sample on its own rank, no row moves, every remote read shared
    for p in plans[2:]:
        assert np.array_equal(p.sample_order, np.arange(R * B))
        assert p.moves.row.shape[0] == 0
        assert p.counters["migrate"] == p.counters["evict_home"] == p.counters["forward"] == 0
        assert p.counters["shared_value"] > 0
    # the full plans move rows: static plans are a real fallback, not the same plan
    full = make_policy("herald", rows, R, B, 0.1, L)
    fp, _ = _run(full, rows, batches)
    assert sum(p.counters["migrate"] for p in fp[2:]) > 0
    assert sum(p.counters["hit"] for p in fp[2:]) > sum(p.counters["hit"] for p in plans[2:])


def test_auto_budget_follows_the_measured_step():
    rows, batches = _trace(6)
    pol = make_policy("herald", rows, R, B, 0.1, L)
    for _ in range(WARMUP_STEPS - 1):
        pol.observe_step(0.01, 0.0)
    _, chk = _run(pol, rows, batches[:2])  # before the warm-up ends: no budget
    assert vars(pol.plan_levels()) == {"full": 2, "reduced": 0, "static": 0}
    pol.observe_step(0.01, 0.0)  # steps of 10 us: every plan is over budget
    assert pol.describe()["plan_budget_ms_now"] == pytest.approx(0.01)
    levels: list[str] = []
    _run(pol, rows, batches[2:], levels, chk)
    assert chk.stale_reads == 0 and not chk.errors
    assert levels == ["reduced", "static", "static", "static"]


def _run_agreed(policies, rows, batches):
    """Several planners as the input stage drives them: before plan p each one agrees on the level from the words
    every planner published with plan p - 2 (plans 0 and 1: the words before any plan). Returns each one's plans
    and the levels they planned at."""
    published = [[pol.level_word() for pol in policies]] * 2  # the last gathering round's words, twice
    plans, levels = [[] for _ in policies], []
    chk = [PlanChecker(rows, R, B, 0.1, strict=True) for _ in policies]
    for i in range(len(batches)):
        window = batches[i : i + L + 1]
        agreed = {pol.agree_level(published[i]) for pol in policies}
        assert len(agreed) == 1  # the same words: the same level on every planner
        levels.append(budget_mod.LEVEL_NAMES[agreed.pop()])
        for q, pol in enumerate(policies):
            plans[q].append(pol.plan(window))
            chk[q].check(plans[q][-1], window[0])
        published.append([pol.level_word() for pol in policies])
    assert all(c.stale_reads == 0 and not c.errors for c in chk)
    return plans, levels


def test_several_planners_agree_on_every_level():
    """A fast planner (a budget it always meets) and a slow one (1 us): the slow one's words set the level of both,
    two plans late, so both make the same degraded and static plans and count them alike."""
    rows, batches = _trace(12)
    fast = make_policy("herald", rows, R, B, 0.1, L, plan_budget_ms=1e9)
    slow = make_policy("herald", rows, R, B, 0.1, L, plan_budget_ms=1e-3)
    for pol in (fast, slow):
        pol.set_planners(2)
    plans, levels = _run_agreed([fast, slow], rows, batches)
    assert levels == ["full", "full", "reduced", "reduced"] + ["static"] * 8
    assert _digest(plans[0]) == _digest(plans[1])
    assert vars(fast.plan_levels()) == vars(slow.plan_levels()) == {"full": 2, "reduced": 2, "static": 8}
    assert fast.describe()["plan_budget_planners"] == 2
    # the same as one planner alone at those levels: a full, reduced or static plan is what it is wherever made
    assert all(np.array_equal(p.sample_order, np.arange(R * B)) for p in plans[0][4:])
    # both fast: full plans throughout, the plans of no budget at all
    fast2 = [make_policy("herald", rows, R, B, 0.1, L, plan_budget_ms=1e9) for _ in range(2)]
    for pol in fast2:
        pol.set_planners(2)
    plans2, levels2 = _run_agreed(fast2, rows, batches)
    ref, _ = _run(make_policy("herald", rows, R, B, 0.1, L, plan_budget_ms=None), rows, batches)
    assert levels2 == ["full"] * 12 and _digest(plans2[0]) == _digest(plans2[1]) == _digest(ref)
    # several planners but no agreement (a policy used outside the input stage): full plans
    alone = make_policy("herald", rows, R, B, 0.1, L, plan_budget_ms=1e-3)
    alone.set_planners(2)
    got, _ = _run(alone, rows, batches[:4])
    assert vars(alone.plan_levels()) == {"full": 4, "reduced": 0, "static": 0}


def test_agreement_rule_max_probe_and_bad_words():
    b = PlanBudget(2.0, planners=3)
    assert b.wanted() == FULL and b.choose() == FULL  # no words agreed on: FULL
    b.record(FULL, 5.0)
    assert b.wanted() == REDUCED  # its own clock: over the budget
    assert b.choose() == FULL  # but with several planners only the agreed level counts
    assert b.agree([FULL, STATIC, REDUCED]) == STATIC and b.choose() == STATIC
    assert b.choose() == FULL  # consumed by the plan: the next one needs its own agreement
    # the probe counts the agreed degraded plans: the same on every planner
    a = PlanBudget(2.0, planners=2)
    seq = [a.agree([REDUCED, FULL]) for _ in range(PROBE_EVERY + 1)]
    assert seq == [REDUCED] * PROBE_EVERY + [FULL]
    assert a.agree([FULL, FULL]) == FULL and a.agree([STATIC, STATIC]) == STATIC
    for bad in ([], [3], [-1, 0]):
        with pytest.raises(ValueError, match="level words must be 0, 1 or 2"):
            a.agree(bad)
    with pytest.raises(ValueError, match="set_planners needs at least one planner"):
        make_policy("herald", *_trace(1)[:1], R, B, 0.1, L).set_planners(0)


def test_budget_rule_levels_probe_and_late_input():
    b = PlanBudget(2.0)
    assert b.choose() == FULL  # nothing measured: try the full plan
    b.record(FULL, 5.0)
    assert b.choose() == REDUCED
    b.record(REDUCED, 1.5)
    for _ in range(PROBE_EVERY - 1):
        assert b.choose() == REDUCED
        b.record(REDUCED, 1.5)
    assert b.choose() == FULL  # the probe: measure the full plan again
    b.record(FULL, 1.0)  # cheaper now (EWMA 5 -> 3.8): still over
    assert b.cost_ms[FULL] == pytest.approx(5.0 + budget_mod.COST_EWMA * (1.0 - 5.0))
    assert b.choose() == REDUCED
    b.record(REDUCED, 100.0)  # the reduced plan got slow too
    assert b.choose() == STATIC
    assert (b.counts.full, b.counts.reduced, b.counts.static) == (2, PROBE_EVERY + 1, 0)
    b.record(STATIC, 0.1)
    assert b.counts.static == 1 and b.cost_ms[REDUCED] > 2.0  # a static plan measures no level
    # auto: the budget is the step time (without its wait), halved while training waits for input
    a = PlanBudget("auto")
    for _ in range(WARMUP_STEPS):
        a.observe_step(40.0, 1.0)
    assert a.budget_ms == pytest.approx(40.0) and not a.late
    for _ in range(60):
        a.observe_step(40.0, 30.0)
    assert a.late and a.budget_ms == pytest.approx(20.0)
    assert PlanBudget(None).budget_ms is None and PlanBudget(None).choose() == FULL


def test_the_cut_of_a_plan_counts_into_its_level_cost():
    """What the planner's thread does after a plan (cutting its ranks' parts) is part of that plan's cost: a plan of
    1.5 ms cut in 1 ms does not fit a 2 ms budget. The level's EWMA is as if `record` had the sum."""
    b = PlanBudget(2.0)
    b.record(FULL, 1.5)
    b.record_cut(1.0)
    assert b.cost_ms[FULL] == pytest.approx(2.5) and b.choose() == REDUCED
    b.record(REDUCED, 1.0)
    b.record_cut(0.5)
    b.record_cut(9.0)  # counted once per plan
    assert b.cost_ms[REDUCED] == pytest.approx(1.5)
    b.record(REDUCED, 1.0)
    b.record_cut(0.5)
    assert b.cost_ms[REDUCED] == pytest.approx(1.5 + budget_mod.COST_EWMA * (1.5 - 1.5))
    b.record(STATIC, 0.1)
    b.record_cut(50.0)  # STATIC keeps no cost: nothing changes
    assert b.cost_ms == [pytest.approx(2.5), pytest.approx(1.5)]
    pol = make_policy("herald_hier", *_trace(1)[:1], 16, B, 0.1, L, hosts=8)
    pol.budget.record(FULL, 3.0)
    pol.record_cut(1.0)
    assert pol.budget.cost_ms[FULL] == pytest.approx(4.0)


@pytest.mark.parametrize("bad", [0, -1.0, "fast", True, float("nan"), float("inf")])
def test_bad_budget_is_one_line_naming_the_setting(bad):
    rows, _ = _trace(1)
    with pytest.raises(ValueError, match="plan_budget_ms must be 'auto', null or a number of ms > 0"):
        make_policy("herald", rows, R, B, 0.1, L, plan_budget_ms=bad)
    with pytest.raises(ValueError, match="plan_budget_ms"):
        runnable_policy("herald", plan_budget_ms=bad)
    assert runnable_policy("herald", plan_budget_ms=0.5, replicate=False) == "herald"


def test_static_plans_keep_replicas_exact():
    """Replicated rows (two emulated hosts of four ranks): static plans still declare the set when it is due, and
    every read stays exact."""
    rows, raw = synthetic_trace(8, 32, 24)
    batches = make_batches(rows, raw)
    opts = {"replicate": True, "hosts": 4, "replica_interval": 5}
    pol = make_policy("herald", rows, 8, 32, 0.1, L, plan_budget_ms=1e-3, **opts)
    chk = PlanChecker(rows, 8, 32, 0.1, strict=True)
    declared = 0
    for i in range(len(batches)):
        window = batches[i : i + L + 1]
        plan = pol.plan(window)
        chk.check(plan, window[0])
        declared += int(i >= 2 and plan.replicas is not None and plan.replicas.replicated_row.shape[0] > 0)
    assert vars(pol.plan_levels()) == {"full": 1, "reduced": 1, "static": 22}
    assert chk.stale_reads == 0 and declared > 0
