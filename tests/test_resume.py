"""Nothing lost on interruption: a run stopped after a checkpoint and resumed ends at the same model — every table,
optimizer state (fused and dense Adam) and dense parameter — as the same run done in one go. Herald with one table
left to TorchRec covers both ways tables are loaded back (owners' rows, TorchRec shards)."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import run_app
from test_app_exactness import _max_diff

COMMON = ["scheduler=herald", "scheduler.unscheduled=[c3]", "trainer.eval_interval=0", "data.val_batches=2",
          "trainer.embedding_eps=1e-3", "trainer.save_final=true", "trainer.checkpoint_interval=10"]


def test_resumed_run_equals_uninterrupted_run(tmp_path: Path) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    p = run_app([*COMMON, "trainer.steps=20", f"run_dir={whole}"], nproc=2)
    assert (whole / "final_state.pt").exists(), p.stderr[-3000:]
    p = run_app([*COMMON, "trainer.steps=10", f"run_dir={split}"], nproc=2)  # "interrupted" after step 10
    assert (split / "checkpoint.pt").exists(), p.stderr[-3000:]
    assert torch.load(split / "checkpoint.pt", weights_only=False)["step"] == 10
    p = run_app([*COMMON, "trainer.steps=20", "trainer.resume=true", f"run_dir={split}"], nproc=2)
    assert "resumed from" in p.stdout and (split / "final_state.pt").exists(), p.stderr[-3000:]
    a, b = torch.load(whole / "final_state.pt"), torch.load(split / "final_state.pt")
    for part in ("tables", "optimizer_state", "dense"):
        assert _max_diff(a[part], b[part]) <= 1e-5, part
    first = torch.load(whole / "checkpoint.pt", weights_only=False)  # step 20's checkpoint of the whole run
    assert _max_diff(first["tables"], torch.load(split / "checkpoint.pt", weights_only=False)["tables"]) <= 1e-5


def test_resume_refuses_a_different_run(tmp_path: Path) -> None:
    p = run_app([*COMMON, "trainer.steps=10", f"run_dir={tmp_path}"], nproc=1)
    assert (tmp_path / "checkpoint.pt").exists(), p.stderr[-3000:]
    p = run_app([*COMMON, "trainer.steps=20", "trainer.resume=true", "trainer.batch_size=128", f"run_dir={tmp_path}"], nproc=1)
    assert p.returncode == 2 and "is from a different run" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
