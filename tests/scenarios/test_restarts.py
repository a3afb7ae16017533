"""Automatic restarts recover: `torchrun --max-restarts 2 train.py trainer.resume=true`, one rank killed (SIGKILL)
after a checkpoint, restarts both ranks, resumes from the checkpoint and ends at the model of the run never
interrupted (tables, optimizer state, dense parameters). torchrun's agent keeps its rendezvous store across the
restart, which made restarted ranks hang in process-group set-up or fail to connect (pytorch/pytorch#135712); the
app keeps each attempt's store keys apart (herald_torchrec/app/runtime.py), so this holds without
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 as well as with it (what `make train` sets). Five kills in a row, alternating
the rank killed, each bounded in time: a hang fails the test instead of stalling it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.memory import worker_pids
from tests.helpers.app_runs import run_app
from tests.helpers.ranks import REPO_ROOT
from tests.scenarios.test_app_exactness import _max_diff

pytestmark = pytest.mark.slow  # ~5 minutes on 2 cores: six 2-rank torchrun jobs

STEPS, CHECKPOINT_EVERY = 120, 20
ARGS = [
    "scheduler=herald",
    "trainer.eval_interval=0",
    "data.val_batches=2",
    "trainer.embedding_eps=1e-3",
    "trainer.save_final=true",
    f"trainer.checkpoint_interval={CHECKPOINT_EVERY}",
    f"trainer.steps={STEPS}",
    "trainer.log_interval=20",
    "trainer.resume=true",
]
TRY_TIMEOUT_S = 240  # one killed-and-restarted job; it takes ~45 s, a hang takes forever
SHARE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def run_and_kill(run_dir: Path, kill_rank: int, share_store: bool) -> tuple[int, str, bool]:
    """Start the job under `torchrun --max-restarts 2`, SIGKILL worker `kill_rank` once the first checkpoint is
    complete, and wait for the job to end (at most TRY_TIMEOUT_S: then every process is killed and the log shows
    where it hung). Returns (exit status or None on a hang, the combined log, whether a rank was killed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop(SHARE_VAR, None)
    if not share_store:
        env[SHARE_VAR] = "1"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = [*torchrun, "--max-restarts", "2", "train.py", *ARGS, f"run_dir={run_dir}"]
    log_path = run_dir.parent / f"{run_dir.name}.log"
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        killed, t0 = False, time.time()
        while p.poll() is None and time.time() - t0 < TRY_TIMEOUT_S:
            if not killed and (run_dir / "checkpoint" / ".metadata").exists():
                worker = worker_pids(p.pid).get(kill_rank)
                if worker is not None:
                    os.kill(worker, signal.SIGKILL)
                    killed = True
            time.sleep(0.05)
        rc = p.poll()
        if rc is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return rc, log_path.read_text(), killed


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("restarts") / "whole"
    p = run_app([*ARGS, f"run_dir={run_dir}"], nproc=2)
    assert p.returncode == 0 and (run_dir / "final_state.pt").exists(), p.stderr[-3000:]
    return torch.load(run_dir / "final_state.pt")


@pytest.mark.parametrize(
    "attempt, share_store",
    [(0, True), (1, True), (2, True), (3, True), (4, True), (5, False)],
    ids=["shared-store-1", "shared-store-2", "shared-store-3", "shared-store-4", "shared-store-5", "store-per-run"],
)
def test_a_killed_rank_restarts_and_ends_at_the_uninterrupted_model(
    tmp_path: Path, uninterrupted: dict, attempt: int, share_store: bool
) -> None:
    run_dir = tmp_path / "killed"
    rc, log, killed = run_and_kill(run_dir, kill_rank=attempt % 2, share_store=share_store)
    assert killed, f"the job ended before its first checkpoint was complete:\n{log[-3000:]}"
    assert rc is not None, f"hung for {TRY_TIMEOUT_S} s after the kill:\n{log[-6000:]}"
    assert rc == 0 and f"resumed from {run_dir / 'checkpoint'} at step" in log, log[-6000:]
    resumed = torch.load(run_dir / "final_state.pt")
    for part in ("tables", "optimizer_state", "dense"):
        assert _max_diff(uninterrupted[part], resumed[part]) <= 1e-5, part
