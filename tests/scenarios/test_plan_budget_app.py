"""The planning budget in training: `train.py` on 2 gloo ranks with a forced budget (`scheduler.plan_budget_ms`)
makes a full, a reduced, then only static plans while it trains (schedule/herald/budget.py), ends at stock TorchRec
ROW_WISE's model (every table, its row-wise Adagrad state, every dense parameter; eps 1e-2 as in
test_app_exactness.py, which says why), and reports the counts in metrics.json and on the progress line. Where
every rank plans, the two planners agree on every plan's level through the round headers (two plans late: two full,
two reduced, then static plans) and train the same stock model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.ranks import run_ranks

STEPS = 20


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a) if a else 0.0


def test_forced_budget_plans_static_and_trains_stock_model(tmp_path: Path) -> None:
    common = [
        "trainer.embedding_eps=1e-2",
        f"trainer.steps={STEPS}",
        "trainer.log_interval=10",
        "trainer.eval_interval=0",
        "data.val_batches=2",
        "trainer.embedding_optimizer=rowwise_adagrad",
        "trainer.embedding_lr=0.05",
        "trainer.dense_optimizer=sgd",
        "trainer.dense_lr=0.05",
        "trainer.save_final=true",
        "data.locality=0.7",
    ]
    runs = {
        # 1 us per plan: every plan is over it (plan_on=host, one machine: rank 0 makes every plan, so it is used)
        "budget": ["scheduler=herald", "scheduler.plan_budget_ms=0.001", *common],
        # every rank plans: the planners agree on each plan's level (the words published with plan p - 2)
        "every_rank": ["scheduler=herald", "scheduler.plan_budget_ms=0.001", "scheduler.plan_on=every_rank", *common],
        "herald": ["scheduler=herald", *common],
        "torchrec": ["scheduler=torchrec", "sharding.types=[row_wise]", *common],
    }
    run_ranks("tests.helpers.app_ranks:train_configs", tmp_path, world_size=2, timeout=900, runs=runs)
    states = {s: torch.load(tmp_path / s / "final_state.pt") for s in runs}
    ref = states["torchrec"]
    for s in ("budget", "every_rank", "herald"):
        for part in ("tables", "optimizer_state", "dense"):
            assert _max_diff(states[s][part], ref[part]) <= 1e-5, (s, part)
    budget = json.loads((tmp_path / "budget" / "metrics.json").read_text())
    full = json.loads((tmp_path / "herald" / "metrics.json").read_text())
    # one plan per global batch: the first profiles at full, the second tries the reduced level, the rest are static
    assert (budget["plans_reduced"], budget["plans_static"]) == (1, STEPS - 2), budget
    assert (budget["policy"]["plans_full"], budget["policy"]["plan_budget"]) == (1, 0.001)
    assert (full["plans_reduced"], full["plans_static"]) == (0, 0)
    assert full["policy"]["plans_full"] == STEPS and full["policy"]["plan_budget"] == "auto"
    every = json.loads((tmp_path / "every_rank" / "metrics.json").read_text())
    assert (every["plans_reduced"], every["plans_static"], every["policy"]["plans_full"]) == (2, STEPS - 4, 2)
    assert (every["policy"]["plan_budget"], every["policy"]["plan_budget_planners"]) == (0.001, 2)
    assert every["plan_rows_by_kind"]["migrate"] < full["plan_rows_by_kind"]["migrate"]
    assert every["stale_reads"] == 0
    # static plans move no row: only the first two plans migrated any, and fewer reads hit their own rank
    assert budget["plan_rows_by_kind"]["migrate"] < full["plan_rows_by_kind"]["migrate"]
    assert budget["hit_rate"] < full["hit_rate"]
    assert budget["stale_reads"] == 0
    # the progress lines (rank 0) say how many plans since the last line were reduced / static (plans are made a few
    # batches ahead of training: made, not yet trained); over the budget run's lines they add up to the totals
    log = (tmp_path / "rank0.log").read_text()
    assert "is unused" not in log
    lines = log.split("run_dir " + str(tmp_path / "budget"))[1].split("[herald] done")[0].splitlines()
    words = [line.split() for line in lines if line.startswith("step ")]
    assert len(words) == STEPS // 10, lines
    for name, total in (("plans_reduced", 1), ("plans_static", STEPS - 2)):
        assert sum(int(w[w.index(name) + 1]) for w in words) == total, (name, words)
