"""scheduler=herald in the app: every model trains; the data plane executes exactly what the scheduler (and the
simulator, replaying the same trace) plans; bad Herald settings are clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.app_runs import run_app, run_app_many
from tests.helpers.ranks import run_ranks


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def test_module_traffic_equals_the_simulated_trace(tmp_path: Path) -> None:
    from herald_torchrec.data.source import SyntheticSource
    from herald_torchrec.data.synthetic import SyntheticSpec
    from herald_torchrec.schedule import GlobalBatch, make_policy

    steps, ranks, batch, lookahead = 30, 2, 256, 4
    p = run_app(
        [
            "scheduler=herald",
            f"scheduler.lookahead={lookahead}",
            f"trainer.steps={steps}",
            "trainer.eval_interval=10",
            "data.val_batches=2",
            f"run_dir={tmp_path}",
        ],
        nproc=ranks,
    )
    assert (tmp_path / "metrics.json").exists(), p.stderr[-3000:]
    m = _metrics(tmp_path)
    # the simulator's way: the same chronological trace, the same policy, windows of L+1 batches
    source = SyntheticSource(SyntheticSpec(), epoch_batches=steps)
    trace = [GlobalBatch.from_dense(s.ids, source.table_rows) for s in source.train_batches(ranks * batch)]
    policy = make_policy("herald", source.table_rows, ranks, batch, cache_ratio=0.1, lookahead=lookahead)
    simulated: dict[str, int] = {}
    for i in range(steps):
        for k, v in policy.plan(trace[i : i + lookahead + 1]).counters.items():
            simulated[k] = simulated.get(k, 0) + int(v)
    executed = {k: v for k, v in m["module_rows_by_kind"].items()}
    assert executed == {k: simulated.get(k, 0) for k in executed}, (executed, simulated)
    assert executed["migrate"] > 0 and executed["shared_value"] > 0 and executed["hit"] > 0
    assert 0.0 < m["hit_rate"] < 1.0 and m["comm_bytes_per_step"] > 0 and m["sched_ms_median"] > 0
    # rank 0 plans (plan_on=host): the planner's own CPU, never more than its wall time
    assert 0 < m["sched_cpu_ms_median"] <= m["sched_ms_median"] * 1.05


MODELS = ["dcn", "wdl", "deepfm", "ncf"]


@pytest.fixture(scope="module")
def herald_model_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every model under scheduler=herald, 2 ranks: all four runs in one pair of gloo ranks
    (tests/helpers/app_ranks.py)."""
    root = tmp_path_factory.mktemp("herald_models")
    runs = {
        m: [
            "scheduler=herald",
            f"model={m}",
            "trainer.steps=20",
            "trainer.eval_interval=0",
            "data.val_batches=2",
            "trainer.log_interval=10",
        ]
        for m in MODELS
    }
    run_ranks("tests.helpers.app_ranks:train_configs", root, world_size=2, timeout=900, runs=runs)
    return root


@pytest.mark.parametrize("model", MODELS)
def test_every_model_trains_under_herald(herald_model_runs: Path, model: str) -> None:
    path = herald_model_runs / model / "metrics.json"
    assert path.exists(), f"no metrics.json (see {herald_model_runs}/rank*.log)"
    m = json.loads(path.read_text())
    assert m["steps"] == 20 and m["config"]["scheduler"]["name"] == "herald" and m["config"]["model"]["name"] == model
    assert m["world_size"] == 2 and 0.5 < m["auc"] <= 1.0 and m["module_rows_by_kind"]["hit"] > 0
    log = (herald_model_runs / "rank0.log").read_text()
    assert (
        "hit_rate" in log and "sched_ms" in log and "sched_cpu_ms" in log
    )  # progress lines carry the scheduler's view
    assert "input_wait_ms" in log and m["input_wait_ms_median"] >= 0.0  # and the training thread's wait for input


def test_auto_leaves_unworthy_tables_to_torchrec(tmp_path: Path) -> None:
    """`scheduler.unscheduled=auto`: the tables the adaptive policy would not schedule (here the tiny ones, read by
    every rank) go to TorchRec's sharding; the rest stay Herald's, and training runs through both."""
    p = run_app(
        [
            "scheduler=herald",
            "scheduler.unscheduled=auto",
            "trainer.steps=20",
            "trainer.eval_interval=0",
            "data.val_batches=2",
            f"run_dir={tmp_path}",
        ],
        nproc=2,
    )
    assert (tmp_path / "metrics.json").exists(), p.stderr[-3000:]
    m = _metrics(tmp_path)
    left = m["unscheduled_tables"]
    assert "t_c8" in left and "t_c2" not in left and 0 < len(left) < 26, left  # c8: 3 rows; c2: 101,313 rows
    assert m["steps"] == 20 and 0.5 < m["auc"] <= 1.0 and m["module_rows_by_kind"]["hit"] > 0


BAD_SETTINGS = [
    (["scheduler.cache_ratio=1.5"], "cache_ratio"),
    (["scheduler.policy=nope"], "unknown scheduling policy"),
    (["scheduler=fae", "scheduler.window=0"], "window must be an integer"),
    (["scheduler.lookahead=-1"], "lookahead"),
    (["scheduler.unscheduled=[nope]"], "are not features of the model"),
    (["scheduler.unscheduled=[c3]", "sharding.types=[data_parallel]"], "data_parallel is not available"),
    (["scheduler.plan_on=everyone"], "scheduler.plan_on must be one of"),
    (["scheduler.input_priority=high"], "scheduler.input_priority must be one of"),
    (["scheduler.prefetch=-1"], "scheduler.prefetch must be an integer >= 0"),
    (["scheduler.native=maybe"], "scheduler.native must be one of"),
    # dist_backend=gloo: a CPU run even where a GPU is visible (there, auto would train this valid setting on CUDA)
    (["dist_backend=gloo", "scheduler=torchrec", "+sharding.compute_kernel=fused_uvm_caching"], "needs a GPU"),
    (["scheduler=torchrec", "+sharding.compute_kernel=bogus"], "sharding.compute_kernel: unknown 'bogus'"),
    (["+sharding.cache_load_factor=0"], "sharding.cache_load_factor must be a number in (0, 1]"),
    (["+sharding.cache_load_factor=lots"], "got 'lots'"),
]


@pytest.fixture(scope="module")
def bad_setting_runs(tmp_path_factory: pytest.TempPathFactory) -> list:
    """Every bad setting through train.py's CLI path, in one process (helpers.app_runs.run_app_many)."""
    root = tmp_path_factory.mktemp("bad_settings")
    return run_app_many(
        [["scheduler=herald", *args, f"run_dir={root / str(i)}"] for i, (args, _) in enumerate(BAD_SETTINGS)]
    )


@pytest.mark.parametrize("case", range(len(BAD_SETTINGS)), ids=[s[1] for s in BAD_SETTINGS])
def test_bad_herald_settings_are_clear_errors(bad_setting_runs: list, case: int) -> None:
    p, msg = bad_setting_runs[case], BAD_SETTINGS[case][1]
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert msg in p.stderr and "Traceback" not in p.stderr


def test_hbm_cache_summary_of_all_rank_totals() -> None:
    """metrics.json's hbm_cache_* come from totals summed over ranks (sharding.hbm_cache_stats all-reduces them):
    the hit rate is over every rank's unique ids, the lines are all ranks' lines; no cache, no keys; a cache without
    counters reports its lines and no hit rate."""
    import torch

    from herald_torchrec.app.metrics import cache_summary

    two_ranks = torch.tensor([2.0, 2.0, 39104 + 28448, 1000.0 + 600.0, 100.0 + 300.0], dtype=torch.float64)
    assert cache_summary(two_ranks) == {
        "hbm_cache_hit_rate": 0.75,
        "hbm_cache_lines": 67552,
        "hbm_cache_unique_ids": 1600,
        "hbm_cache_unique_misses": 400,
    }
    assert cache_summary(torch.zeros(5, dtype=torch.float64)) == {}
    no_counters = torch.tensor([2.0, 1.0, 500.0, 10.0, 1.0], dtype=torch.float64)
    assert cache_summary(no_counters) == {"hbm_cache_lines": 500, "hbm_cache_hit_rate": None}
