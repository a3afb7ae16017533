"""conf/scheduler/herald_hier.yaml reaches the policy through the app's Herald options."""

from __future__ import annotations

import numpy as np
import pytest

from herald_torchrec.schedule import GlobalBatch


def test_app_config_builds_herald_hier_options():
    """conf/scheduler/herald_hier.yaml: the app's Herald options name the policy and pass ranks_per_host, the
    planning budget, the planners' wire form, LAIA's first pass and its refine rounds where set (and only them) to
    it, and the policy plans with those rounds; a bad value is the policy's one-line error; the app lists the
    scheduler."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from herald_torchrec.app.model_setup import SCHEDULERS, herald_options

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=["scheduler=herald_hier", "scheduler.ranks_per_host=4"])
        bad = compose("config", overrides=["scheduler=herald_hier", "scheduler.ranks_per_host=0"])
        bad_budget = compose("config", overrides=["scheduler=herald_hier", "scheduler.plan_budget_ms=-1"])
        bad_wire = compose("config", overrides=["scheduler=herald_hier", "scheduler.planner_wire=zip"])
        bad_pass = compose("config", overrides=["scheduler=herald_hier", "scheduler.first_pass=greedy"])
        bad_refine = compose("config", overrides=["scheduler=herald_hier", "scheduler.refine=-1"])
        no_round = compose("config", overrides=["scheduler=herald_hier", "scheduler.refine=0"])
        herald = compose("config", overrides=["scheduler=herald", "scheduler.first_pass=bids", "scheduler.refine=2"])
    options = herald_options(cfg.scheduler)
    assert options.policy == "herald_hier"
    assert dict(options.policy_options) == {
        "ranks_per_host": 4,
        "plan_budget_ms": "auto",
        "planner_wire": "raw",
        "first_pass": "auto",
    }
    assert options.runnable_policy() == "herald_hier" and "herald_hier" in SCHEDULERS
    with pytest.raises(ValueError, match="ranks_per_host must be an integer >= 1"):
        herald_options(bad.scheduler).runnable_policy()
    with pytest.raises(ValueError, match="plan_budget_ms must be 'auto', null or a number"):
        herald_options(bad_budget.scheduler).runnable_policy()
    with pytest.raises(ValueError, match="planner_wire must be one of"):
        herald_options(bad_wire.scheduler).runnable_policy()
    with pytest.raises(ValueError, match="first_pass must be one of auto, stream, bids, got 'greedy'"):
        herald_options(bad_pass.scheduler).runnable_policy()
    with pytest.raises(ValueError, match="refine must be an integer >= 0, got -1"):
        herald_options(bad_refine.scheduler).runnable_policy()
    # refine: 0 reaches the per-machine planner (two machines of 4 ranks), which then plans without a round
    from herald_torchrec.schedule import make_policy

    opts = herald_options(no_round.scheduler).policy_options
    assert opts["refine"] == 0
    pol = make_policy(
        "herald_hier", [1000] * 4, 8, 16, 0.1, 2, hosts=4, **{k: v for k, v in opts.items() if k != "ranks_per_host"}
    )
    default = make_policy("herald_hier", [1000] * 4, 8, 16, 0.1, 2, hosts=4)
    batches = [
        GlobalBatch.from_dense(np.random.default_rng(i).integers(0, 1000, (128, 4)), [1000] * 4, index=i)
        for i in range(3)
    ]
    pol.plan(batches)
    default.plan(batches)
    assert pol.refine == 0 and default.refine == 1
    # herald takes the first pass and the rounds too
    assert herald_options(herald.scheduler).policy_options["first_pass"] == "bids"
    assert herald_options(herald.scheduler).policy_options["refine"] == 2


def test_herald_on_several_machines_from_16_ranks_gets_a_note(monkeypatch):
    """`scheduler=herald` on two machines or more from 32 ranks: the app notes that herald_hier plans per machine;
    not on one machine, below 32 ranks, or for herald_hier. Machines come from torchrun's LOCAL_WORLD_SIZE."""
    from herald_torchrec.app.model_setup import machines_from_env, planner_scale_note

    note = planner_scale_note("herald", 32, 4)
    assert note is not None and "scheduler=herald_hier" in note and "4 machines (32 ranks)" in note
    assert planner_scale_note("herald", 64, 1) is None
    assert planner_scale_note("herald", 16, 2) is None
    assert planner_scale_note("herald_hier", 64, 8) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert machines_from_env(32) == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert machines_from_env(4) == 1 and machines_from_env(1) == 1  # TorchRec's reading: 8 a machine where it divides
    assert machines_from_env(32) == 4
