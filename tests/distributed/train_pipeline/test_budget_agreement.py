"""The planning budget with several planners (schedule/herald/budget.py): four gloo ranks on two "machines" (each rank
reports the host name of its pair, as the host-relay test does), `plan_on="host"`: ranks 0 and 2 each plan every
global batch from their own copy of the ownership directory. With a budget no plan meets (1 us), both planners
make the same degraded plans, at the levels they agree on through the round headers: full plans, two reduced, then
static ones (the words published with plan p - 2 set plan p's level; p - 3 where each plan's parts are cut on the
cut thread, its plans made a round earlier: `cut_thread`, both run here), counted alike on both; every rank
executes its part of the same plans, and the trained model is the one-process model on the global batches (SGD,
<= 1e-5). Each rank's ownership map, exact for its own rows while it trains on parts, is one exact map on every rank
after an eval forward (`sync_directory`).
Before the agreement, the budget was unused with several planners: every plan full. Sizes: the header words go by
an all-to-all of exactly what each rank needs, counted in the stage's "control" bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from herald_torchrec.distributed.train_pipeline.input_round import PAY_WORDS, TRAILER_BYTES
from herald_torchrec.distributed.train_pipeline.pipeline import herald_modules
from tests.distributed.train_pipeline.test_pipeline_edges import batches, build, one_process_reference
from tests.helpers.machines import on_machine
from tests.helpers.ranks import rank_result, run_ranks

STEPS = 12
WORLD = 4


def plan_digest(plan) -> str:
    """A digest of what every rank's part of a step's plan holds alike (each rank receives its own part:
    step/plan_part.py): the step, the whole step's counters and its tables with moves, shared rows and relays."""
    h = hashlib.sha256(str(plan.step).encode())
    for name in ("moved_tables", "shared_tables", "relayed_tables"):
        h.update(f"{name}|{getattr(plan, name).tolist()}".encode())
    h.update(repr(sorted(plan.counters.items())).encode())
    return h.hexdigest()[:16]


def agreement_worker(rank: int, world: int, out_dir: str, cut_thread: bool = True) -> None:
    """STEPS steps of Herald with a 1 us planning budget, two planners; a DCP checkpoint, the digest of every plan
    this rank trained with, and (on the planners) the plan counts by level."""

    import torch.distributed.checkpoint as dcp

    from herald_torchrec import HeraldOptions

    with on_machine(f"machine-{rank // 2}"):
        options = HeraldOptions(
            cache_ratio=0.05, lookahead=2, policy_options={"plan_budget_ms": 1e-3}, cut_thread=cut_thread
        )
        digests: list[str] = []
        dmp, pipeline = build("herald", options=options, on_plan=lambda p: digests.append(plan_digest(p)))
        it = iter(batches(rank, STEPS))
        for _ in range(STEPS):
            pipeline.progress(it)
        m = herald_modules(dmp)[0]
        stale = not m.store.directory_exact  # this rank applied only its parts' moves
        model = pipeline.detach()  # an eval forward: its static plan reads every rank's rows, so it syncs the map
        model.eval()
        with torch.no_grad():
            model(batches(rank, 1)[0])
        exact_after_eval = m.store.directory_exact
        model.train()
        dcp.save({"model": dmp.state_dict()}, checkpoint_id=str(Path(out_dir) / "ckpt"))
        directory = {
            "stale_before": stale,
            "exact_after": m.store.directory_exact and exact_after_eval,
            "owner": m.store.owner_all.copy(),
            "held_here": m.store.slot_of_all >= 0,
            "home": np.concatenate([np.arange(n) // b for n, b in zip(m.store.rows, m.store.home_block_arr)]),
        }
        policy = pipeline.policy
        levels = vars(policy.plan_levels()) if policy is not None else None
        described = policy.describe() if policy is not None else None
        counter = pipeline.input_stage.comm.counter
        control = (counter.bytes["control"], counter.calls["control"])
        pipeline.close()
    torch.save(
        {"digests": digests, "levels": levels, "policy": described, "control": control, "directory": directory},
        rank_result(out_dir, rank),
    )


@pytest.mark.parametrize("cut_thread", [True, False])
def test_two_planners_agree_on_degraded_plans_and_train_the_one_process_model(tmp_path: Path, cut_thread: bool) -> None:
    from tests.scenarios.test_dropin import full_checkpoint

    run_ranks(
        "tests.distributed.train_pipeline.test_budget_agreement:agreement_worker",
        tmp_path,
        world_size=WORLD,
        cut_thread=cut_thread,
    )
    ahead = 2 if cut_thread else 1  # plans made and not yet sent, after each round's (input_stage.py)
    res = [torch.load(rank_result(tmp_path, q), weights_only=False) for q in range(WORLD)]
    # ranks 0 and 2 plan (the lowest rank of each machine), 1 and 3 receive their plans
    assert [r["levels"] is not None for r in res] == [True, False, True, False]
    # both planners made the same plans at the same levels: degraded, then static
    full = 1 + ahead  # the plans made before the words of the first degraded one reach the planners
    assert res[0]["levels"] == res[2]["levels"] == {"full": full, "reduced": 2, "static": STEPS - full - 2}, res
    for q in (0, 2):
        assert res[q]["policy"]["plan_budget"] == 1e-3 and res[q]["policy"]["plan_budget_planners"] == 2
    # every rank trained with its part of the same plans, whichever machine's planner made them
    assert len(res[0]["digests"]) == STEPS
    assert all(r["digests"] == res[0]["digests"] for r in res)
    assert len(set(res[0]["digests"])) == STEPS
    # the header words: bags of several lengths, so every round exchanges them first, by an all-to-all of
    # PAY_WORDS + 1 words per pair of ranks (never all-gathered: PAY_WORDS + R words from every rank); the setup's
    # all-gather of 5 words, and a trailer of PAY_WORDS words per pair on every round after the first L + 1 + ahead
    for r in res:
        sent, calls = r["control"]
        exchanges, trailers = calls - 1, calls - 1 - (2 + 1 + ahead)
        assert sent == 5 * 8 * (WORLD - 1) + exchanges * (PAY_WORDS + 1) * 8 * (
            WORLD - 1
        ) + trailers * TRAILER_BYTES * (WORLD - 1), (sent, calls)
        assert exchanges >= STEPS + 4, calls
    # each rank trained on its parts (its map exact for its own rows only); the eval forward rebuilt every rank's map
    # from every rank's guests: one map, the same everywhere, and each rank owns exactly the rows it holds
    owner = res[0]["directory"]["owner"]
    assert (owner != res[0]["directory"]["home"]).sum() > 0  # rows live away from home: there was a map to rebuild
    for q, r in enumerate(res):
        d = r["directory"]
        assert d["stale_before"] and d["exact_after"], q
        np.testing.assert_array_equal(d["owner"], owner)
        np.testing.assert_array_equal(d["owner"] == q, d["held_here"])
    # exact at every level: the model of one process on the global batches
    ref = one_process_reference(WORLD, STEPS)
    got = full_checkpoint(tmp_path / "ckpt")
    assert sum(".embedding_bags." in k for k in got) == 3 and all(k in ref for k in got)
    worst = max(float((ref[k] - got[k]).abs().max()) for k in got)
    assert worst < 1e-5, worst
