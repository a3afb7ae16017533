"""scheduler=herald in the app: every model trains; the data plane executes exactly what the scheduler (and the
simulator, replaying the same trace) plans; bad Herald settings are clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_app


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def test_module_traffic_equals_the_simulated_trace(tmp_path: Path) -> None:
    from herald_torchrec.data.source import SyntheticSource
    from herald_torchrec.data.synthetic import SyntheticSpec
    from herald_torchrec.schedule import GlobalBatch, make_policy

    steps, ranks, batch, lookahead = 30, 2, 256, 4
    p = run_app(["scheduler=herald", f"scheduler.lookahead={lookahead}", f"trainer.steps={steps}",
                 "trainer.eval_interval=10", "data.val_batches=2", f"run_dir={tmp_path}"], nproc=ranks)
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


@pytest.mark.parametrize("model", ["dcn", "wdl", "deepfm", "ncf"])
def test_every_model_trains_under_herald(tmp_path: Path, model: str) -> None:
    p = run_app(["scheduler=herald", f"model={model}", "trainer.steps=20", "trainer.eval_interval=0",
                 "data.val_batches=2", "trainer.log_interval=10", f"run_dir={tmp_path}"], nproc=2)
    assert (tmp_path / "metrics.json").exists(), p.stderr[-3000:]
    m = _metrics(tmp_path)
    assert m["steps"] == 20 and m["config"]["scheduler"]["name"] == "herald" and 0.5 < m["auc"] <= 1.0
    assert "hit_rate" in p.stdout and "sched_ms" in p.stdout  # progress lines carry the scheduler's view


def test_auto_leaves_unworthy_tables_to_torchrec(tmp_path: Path) -> None:
    """`scheduler.unscheduled=auto`: the tables the adaptive policy would not schedule (here the tiny ones, read by
    every rank) go to TorchRec's sharding; the rest stay Herald's, and training runs through both."""
    p = run_app(["scheduler=herald", "scheduler.unscheduled=auto", "trainer.steps=20", "trainer.eval_interval=0",
                 "data.val_batches=2", f"run_dir={tmp_path}"], nproc=2)
    assert (tmp_path / "metrics.json").exists(), p.stderr[-3000:]
    m = _metrics(tmp_path)
    left = m["unscheduled_tables"]
    assert "t_c8" in left and "t_c2" not in left and 0 < len(left) < 26, left  # c8: 3 rows; c2: 101,313 rows
    assert m["steps"] == 20 and 0.5 < m["auc"] <= 1.0 and m["module_rows_by_kind"]["hit"] > 0


@pytest.mark.parametrize(
    "args, msg",
    [(["scheduler.cache_ratio=1.5"], "cache_ratio"), (["scheduler.policy=nope"], "unknown scheduling policy"),
     (["scheduler=fae", "scheduler.window=0"], "window must be an integer"), (["scheduler.lookahead=-1"], "lookahead"),
     (["scheduler.unscheduled=[nope]"], "are not features of the model"),
     (["scheduler.unscheduled=[c3]", "sharding.types=[data_parallel]"], "data_parallel is not available")],
)
def test_bad_herald_settings_are_clear_errors(tmp_path: Path, args: list[str], msg: str) -> None:
    p = run_app(["scheduler=herald", *args, f"run_dir={tmp_path}"])
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert msg in p.stderr and "Traceback" not in p.stderr
