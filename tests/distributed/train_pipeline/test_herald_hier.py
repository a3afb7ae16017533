"""herald_hier (schedule/herald/hierarchy.py) trained end to end: four gloo ranks on two "machines" of two ranks (each
rank reports the host name of its pair, as the replica and host-relay tests do), so the pipeline's host map makes
two per-host planners, each planning its own machine's part (its ranks' ids only) with the other through a gloo group
of the planners (their messages in the compact wire form, `planner_wire: compact`; the budget case in the default raw
form). The trained model equals the one-process model on the global batches (SGD, <= 1e-5); rows really changed
owner, some between the machines; every sample trained on a rank of the machine that loaded it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.distributed.train_pipeline.test_pipeline_edges import batches, build, one_process_reference
from tests.helpers.machines import on_machine
from tests.helpers.ranks import rank_result, run_ranks

STEPS = 10
WORLD = 4
PER_HOST = 2


def hier_worker(rank: int, world: int, out_dir: str, budget_ms: float | None = None, wire: str | None = None) -> None:
    """STEPS steps of herald_hier on two "machines"; a DCP checkpoint, this rank's rows by kind, the policy's
    description and, of every plan it trained, where its slice's samples went and the moves. `budget_ms`: a fixed
    planning budget (none by default); `wire`: the planners' wire form (the policy's default)."""

    import torch.distributed.checkpoint as dcp

    from herald_torchrec import HeraldOptions

    plans = []
    with on_machine(f"machine-{rank // PER_HOST}"):
        budget = {} if budget_ms is None else {"plan_budget_ms": budget_ms}
        budget |= {} if wire is None else {"planner_wire": wire}
        options = HeraldOptions(policy="herald_hier", cache_ratio=0.05, lookahead=2, policy_options=budget)

        def keep(plan) -> None:
            moves = plan.moves
            plans.append({"slice": plan.slice_destinations(rank), "src": moves.src.copy(), "dst": moves.dst.copy()})

        dmp, pipeline = build("herald", options=options, on_plan=keep)
        from herald_torchrec.schedule.herald.hierarchy import HeraldHierPolicy

        cuts: list[float] = []  # the CPU ms of each plan's cut the input stage gives the planning budget
        record_cut = HeraldHierPolicy.record_cut  # (the policy is made at the first batch: its class is wrapped)
        HeraldHierPolicy.record_cut = lambda pol, ms: (cuts.append(ms), record_cut(pol, ms))[1]
        it = iter(batches(rank, STEPS))
        for _ in range(STEPS):
            pipeline.progress(it)
        dcp.save({"model": dmp.state_dict()}, checkpoint_id=str(Path(out_dir) / "ckpt"))
        policy = pipeline.policy.describe() if pipeline.policy is not None else None
        stage = pipeline.input_stage
        planned = None
        if pipeline.policy is not None:
            planned = {"ids_bytes": pipeline.policy.last_step.ids_bytes.tolist(), "host": stage.host_index,
                       "wire": dict(pipeline.policy.last_step.wire_bytes), "sent": stage.host_transport.sent_total,
                       "sched_ms": list(stage.sched_ms), "compact": stage.host_transport.compact,
                       "cuts": cuts, "cost_ms": list(pipeline.policy.budget.cost_ms)}  # fmt: skip
        ids_sent = stage.ids_sent_bytes
        pipeline.close()
    torch.save(
        {
            "counters": dict(pipeline.trained_counters),
            "policy": policy,
            "plans": plans,
            "planned": planned,
            "ids_sent": ids_sent,
        },
        rank_result(out_dir, rank),
    )


def test_herald_hier_trains_the_one_process_model(tmp_path: Path) -> None:
    from tests.scenarios.test_dropin import full_checkpoint

    run_ranks(
        "tests.distributed.train_pipeline.test_herald_hier:hier_worker",
        tmp_path,
        world_size=WORLD,
        wire="compact",
    )
    ref = one_process_reference(WORLD, STEPS)
    got = full_checkpoint(tmp_path / "ckpt")
    assert sum(".embedding_bags." in k for k in got) == 3 and all(k in ref for k in got)
    worst = max(float((ref[k] - got[k]).abs().max()) for k in got)
    assert worst < 1e-5, worst
    res = [torch.load(rank_result(tmp_path, q), weights_only=False) for q in range(WORLD)]
    planner = res[0]["policy"]
    assert planner["name"] == "herald_hier" and planner["hosts"] == 2 and planner["ranks_per_host"] == PER_HOST
    plans = res[0]["plans"]
    assert len(plans) == STEPS
    for q, r in enumerate(res):  # no sample leaves the machine that loaded it (each rank's part says where its go)
        assert all((np.asarray(p["slice"]) // PER_HOST == q // PER_HOST).all() for p in r["plans"])
    # rows changed owner, some between the machines, and the data plane moved them
    cross = sum(int((p["src"] // PER_HOST != p["dst"] // PER_HOST).sum()) for r in res for p in r["plans"])
    assert cross > 0, cross
    assert sum(r["counters"].get("migrate", 0) for r in res) > 0, res[0]["counters"]
    # planned per machine: each rank's ids went to its own machine's planner only (the planners to themselves: no
    # bytes), and each planner's policy planned its machine's samples only (ids bytes of its own ranks, none of the
    # others'), exchanging every phase's messages and the plan parts with the other machine's planner
    for q, r in enumerate(res):
        if q % PER_HOST:
            assert r["planned"] is None and r["ids_sent"] > 0
            continue
        h = q // PER_HOST
        assert r["ids_sent"] == 0 and r["planned"]["host"] == h
        ids = np.asarray(r["planned"]["ids_bytes"])
        mine = np.arange(WORLD) // PER_HOST == h
        assert (ids[mine] > 0).all() and (ids[~mine] == 0).all(), ids
        assert {"demand", "owners", "reads", "arrivals", "cancels", "parts"} <= set(r["planned"]["wire"])
        assert r["planned"]["sent"] > 0 and r["planned"]["compact"]  # planner_wire: compact reached the transport
        # every plan made here was cut into its ranks' parts, and the budget got that CPU time
        cuts, sched = r["planned"]["cuts"], r["planned"]["sched_ms"]
        assert len(sched) <= len(cuts) <= len(sched) + 2 and min(cuts) > 0, (cuts, sched)


def test_herald_hier_planners_degrade_together_and_train_the_same_model(tmp_path: Path) -> None:
    """Under a planning budget no plan fits (`plan_budget_ms` 0.001), the two machines' planners plan every batch at
    the level they agree on from each other's words (schedule/herald/budget.py): both make the same numbers of full,
    reduced and static plans, static plans move no row, and the model is still the one-process model."""
    from tests.scenarios.test_dropin import full_checkpoint

    run_ranks(
        "tests.distributed.train_pipeline.test_herald_hier:hier_worker", tmp_path, world_size=WORLD, budget_ms=0.001
    )
    ref = one_process_reference(WORLD, STEPS)
    got = full_checkpoint(tmp_path / "ckpt")
    worst = max(float((ref[k] - got[k]).abs().max()) for k in got)
    assert worst < 1e-5, worst
    res = [torch.load(rank_result(tmp_path, q), weights_only=False) for q in range(WORLD)]
    a, b = (res[q]["policy"] for q in (0, PER_HOST))  # the two planners
    counts = [(p["plans_full"], p["plans_reduced"], p["plans_static"]) for p in (a, b)]
    assert counts[0] == counts[1] and counts[0][2] > 0 and sum(counts[0]) >= STEPS, counts
    assert a["plan_budget"] == 0.001 and a["plan_budget_planners"] == 2
    static = [p for p in res[0]["plans"] if p["src"].shape[0] == 0]
    assert len(static) >= counts[0][2] - 2  # (the last plans made may not have trained)
