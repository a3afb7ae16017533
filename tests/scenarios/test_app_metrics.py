"""What the app reports is what happened: the logged training loss is the mean over every rank's samples (a 2-rank
run logs the losses of a 1-rank run over the same global batches); a run resumed from a checkpoint leaves no step
twice in TensorBoard and a metrics.json with the whole run's history; a user mistake under torchrun ends with its
one error line, last, and exit 2 (scripts/launch.py, as `make train` runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.app_runs import run_app, run_app_many
from tests.helpers.ranks import REPO_ROOT

# well-conditioned (Adagrad eps 1e-2, dense SGD): a global batch's update does not depend on how it is split between
# ranks, so the 2-rank and 1-rank runs train the same model and their losses agree to float rounding
SETTINGS = [
    "scheduler=herald",
    "data.val_batches=2",
    "trainer.embedding_eps=1e-2",
    "trainer.dense_optimizer=sgd",
    "trainer.dense_lr=0.05",
    "trainer.log_interval=5",
    "trainer.eval_interval=10",
]
ONE_RANK, TWO_RANKS = ["trainer.batch_size=256"], ["trainer.batch_size=128"]  # the same global batch
STEPS = [5, 10, 15, 20]  # the progress lines of a 20-step run


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's scalars as TensorBoard shows them ((step, value) per tag, purged events left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """20 steps in one go on 1 rank; the same on 2 ranks (torchrun); on 1 rank, a run "interrupted" after step 15
    whose last checkpoint is step 10, resumed to step 20 (steps 11-15 are trained and logged a second time)."""
    root = tmp_path_factory.mktemp("metrics")
    d = {name: root / name for name in ("one", "two", "split")}
    one, first, resumed = run_app_many(
        [
            [*SETTINGS, *ONE_RANK, "trainer.steps=20", f"run_dir={d['one']}"],
            [*SETTINGS, *ONE_RANK, "trainer.steps=15", "trainer.checkpoint_interval=10", f"run_dir={d['split']}"],
            [*SETTINGS, *ONE_RANK, "trainer.steps=20", "trainer.resume=true", f"run_dir={d['split']}"],
        ]
    )
    for p in (one, first, resumed):
        assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 10" in resumed.stdout, resumed.stdout[-2000:]
    two = run_app([*SETTINGS, *TWO_RANKS, "trainer.steps=20", f"run_dir={d['two']}"], nproc=2)
    assert two.returncode == 0, f"a finished run exits 0; got {two.returncode}\n{two.stderr[-3000:]}"
    return d


def test_logged_loss_is_the_mean_over_all_ranks(runs: dict[str, Path]) -> None:
    """Rank 0's share alone differs from the 1-rank run's loss by 3.7e-4 in the first window; the global mean
    agrees to float rounding, in the progress lines' record (metrics.json) and in TensorBoard."""
    one, two = _metrics(runs["one"]), _metrics(runs["two"])
    assert two["world_size"] == 2 and one["world_size"] == 1 and one["global_batch"] == two["global_batch"] == 256
    for key in ("first_loss", "last_loss"):
        assert abs(two[key] - one[key]) <= 1e-5, (key, one[key], two[key])
    assert [h["step"] for h in two["loss_history"]] == [h["step"] for h in one["loss_history"]] == STEPS
    for a, b in zip(one["loss_history"], two["loss_history"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)
    tb_one, tb_two = _scalars(runs["one"])["train/loss"], _scalars(runs["two"])["train/loss"]
    assert [s for s, _ in tb_two] == STEPS and max(abs(a[1] - b[1]) for a, b in zip(tb_one, tb_two)) <= 1e-5


def test_resume_keeps_tensorboard_and_metrics_history(runs: dict[str, Path]) -> None:
    """The interrupted run logged steps 5-15 and evaluated at 10 and 15; resumed from step 10, TensorBoard shows each
    step once (the earlier run's steps after 10 purged) and metrics.json holds steps 5-20: what the run in one go
    logged, to float rounding (the resume is exact)."""
    split, one = runs["split"], runs["one"]
    scalars = _scalars(split)
    for tag, points in scalars.items():
        steps = [s for s, _ in points]
        assert len(steps) == len(set(steps)), (tag, steps)
    assert [s for s, _ in scalars["train/loss"]] == STEPS, scalars["train/loss"]
    assert [s for s, _ in scalars["eval/auc"]] == [10, 20], scalars["eval/auc"]
    want = {s: v for s, v in _scalars(one)["train/loss"]}
    assert all(abs(v - want[s]) <= 1e-5 for s, v in scalars["train/loss"]), (scalars["train/loss"], want)
    m, whole = _metrics(split), _metrics(one)
    assert m["status"] == "finished" and m["resumed_from_step"] == 10 and m["steps"] == 20
    assert [h["step"] for h in m["loss_history"]] == STEPS, m["loss_history"]
    assert [h["step"] for h in m["eval_history"]] == [10, 20], m["eval_history"]
    for got, ref in zip(m["loss_history"] + m["eval_history"], whole["loss_history"] + whole["eval_history"]):
        assert all(abs(got[k] - ref[k]) <= 1e-5 for k in ref if k != "step"), (got, ref)
    assert abs(m["first_loss"] - whole["first_loss"]) <= 1e-5


def test_user_error_under_torchrun_is_the_last_line_and_exit_2(tmp_path: Path) -> None:
    """2 ranks, a bad setting: torchrun alone exits 1 and ends with its ~35-line failure report; scripts/launch.py
    (`make train`) prints the error line last and exits 2."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "scripts/launch.py", "--standalone", "--nproc_per_node", "2", "train.py"]
    args = ["trainer.batch_size=0", f"run_dir={tmp_path / 'bad'}"]
    p = subprocess.run([*cmd, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    line = "error: trainer.batch_size must be an integer >= 1, got 0"
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert p.stderr.strip().splitlines()[-1] == line, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "FAILED" not in p.stderr, p.stderr[-3000:]
    assert len(p.stderr.strip().splitlines()) <= 6, p.stderr  # the ranks' lines, torchrun's two, the last line
