"""Nothing lost on interruption: a run stopped after a checkpoint and resumed ends at the same model — every table,
optimizer state (fused and dense Adam) and dense parameter — as the same run done in one go. Herald with one table
left to TorchRec covers both ways tables are loaded back (owners' rows, TorchRec shards)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.app_runs import run_app, run_app_many
from tests.helpers.ranks import run_ranks
from tests.scenarios.test_app_exactness import _max_diff

COMMON = [
    "scheduler=herald",
    "scheduler.unscheduled=[c3]",
    "trainer.eval_interval=0",
    "data.val_batches=2",
    "trainer.embedding_eps=1e-3",
    "trainer.save_final=true",
    "trainer.checkpoint_interval=10",
]


def _read_checkpoint(ckpt: Path, tmp: Path) -> dict:
    """A DCP checkpoint directory as full tensors (one process), meta decoded."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt.parent.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(out, weights_only=False)
    state["meta"] = json.loads(state["meta"])
    return state


def test_resumed_run_equals_uninterrupted_run(tmp_path: Path) -> None:
    """The run in one go and the run stopped after step 10 share one pair of gloo ranks (tests/helpers/app_ranks.py);
    the resume is a fresh `torchrun train.py` launch, as after a real interruption."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    runs = {
        "whole": [*COMMON, "trainer.steps=20", f"run_dir={whole}"],
        "split": [*COMMON, "trainer.steps=10", f"run_dir={split}"],
    }  # "interrupted" after step 10
    run_ranks("tests.helpers.app_ranks:train_configs", tmp_path, world_size=2, timeout=900, runs=runs)
    assert (whole / "final_state.pt").exists(), f"see {tmp_path}/rank*.log"
    assert (split / "checkpoint" / ".metadata").exists(), f"see {tmp_path}/rank*.log"
    assert not (split / "checkpoint.tmp").exists() and not (split / "checkpoint.old").exists()
    at10 = _read_checkpoint(split / "checkpoint", tmp_path)
    assert at10["meta"]["step"] == 10 and at10["meta"]["identity"]["world_size"] == 2
    tables = {k for k in at10["model"] if ".embedding_bags." in k}  # TorchRec's keys, Herald and stock tables alike
    assert len(tables) >= 2 and all(k.endswith(".weight") for k in tables), sorted(at10["model"])
    assert at10["optim"]["fused"]["state"] and at10["optim"]["dense"]["state"]
    p = run_app([*COMMON, "trainer.steps=20", "trainer.resume=true", f"run_dir={split}"], nproc=2)
    assert "resumed from" in p.stdout and (split / "final_state.pt").exists(), p.stderr[-3000:]
    a, b = torch.load(whole / "final_state.pt"), torch.load(split / "final_state.pt")
    for part in ("tables", "optimizer_state", "dense"):
        assert _max_diff(a[part], b[part]) <= 1e-5, part
    first, second = _read_checkpoint(whole / "checkpoint", tmp_path), _read_checkpoint(split / "checkpoint", tmp_path)
    assert first["meta"]["step"] == second["meta"]["step"] == 20  # step 20's checkpoints of both runs
    assert _max_diff({k: first["model"][k] for k in tables}, {k: second["model"][k] for k in tables}) <= 1e-5


def test_resume_refuses_a_different_run(tmp_path: Path) -> None:
    old = tmp_path / "old"  # a run_dir with only the unsharded checkpoint of earlier versions: refused, not ignored
    old.mkdir()
    torch.save({"step": 10}, old / "checkpoint.pt")
    run = tmp_path / "run"
    first, other, from_old = run_app_many(
        [  # in order, in one process, each through train.py's CLI path
            [*COMMON, "trainer.steps=10", f"run_dir={run}"],
            [*COMMON, "trainer.steps=20", "trainer.resume=true", "trainer.batch_size=128", f"run_dir={run}"],
            [*COMMON, "trainer.steps=20", "trainer.resume=true", f"run_dir={old}"],
        ]
    )
    assert first.returncode == 0 and (run / "checkpoint" / ".metadata").exists(), first.stderr[-3000:]
    p = other
    assert p.returncode == 2 and "is from a different run" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    p = from_old
    assert p.returncode == 2 and "old-format checkpoint" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
