"""The app refuses to go on where going on would lose or corrupt something, always in one line with exit 2: a
diverged loss stops every rank before anything non-finite reaches a checkpoint, and metrics.json stays strict JSON.

Every case is a one-rank CLI run; they share one process (tests/helpers/app_runs.run_app_many)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.app.test_metrics_json import strict_load
from tests.helpers.app_runs import run_app_many

FAST = ["trainer.steps=20", "data.val_batches=2", "trainer.eval_interval=0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("safeguards")
    cases = {
        # Adam at lr 1e4: the loss is NaN from step 2
        "nan_fast": [*FAST, "trainer.dense_lr=1e4"],
        # SGD at lr 10: finite for a few steps, NaN from step 6; checkpoints at steps 2 and 4 are good
        "nan_late": [*FAST, "trainer.dense_optimizer=sgd", "trainer.dense_lr=10", "trainer.checkpoint_interval=2"],
    }
    got = run_app_many([[*args, f"run_dir={root / name}"] for name, args in cases.items()])
    return root, dict(zip(cases, got))


def _read_checkpoint(ckpt: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / "ckpt.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(out, weights_only=False)
    state["meta"] = json.loads(state["meta"])
    return state


def test_nan_loss_stops_the_run(runs: tuple[Path, dict]) -> None:
    root, got = runs
    p = got["nan_fast"]
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "loss is nan at step 2" in errors[0] and "trainer.dense_lr" in errors[0], errors
    assert "step     20" not in p.stdout  # it stopped: no progress line after the divergence
    m = strict_load((root / "nan_fast" / "metrics.json").read_text())
    assert m["status"] == "diverged" and m["diverged_at_step"] == 2 and m["error"] in errors[0]


def test_the_last_good_checkpoint_is_kept(runs: tuple[Path, dict], tmp_path: Path) -> None:
    root, got = runs
    p = got["nan_late"]
    assert p.returncode == 2 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-2000:])
    ckpt = root / "nan_late" / "checkpoint"
    assert "loss is nan at step 6" in p.stderr and f"last good checkpoint is kept in {ckpt}" in p.stderr, p.stderr
    m = strict_load((root / "nan_late" / "metrics.json").read_text())
    assert m["status"] == "diverged" and m["diverged_at_step"] == 6
    state = _read_checkpoint(ckpt, tmp_path)
    assert state["meta"]["step"] == 4
    tensors = [t for t in state["model"].values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    assert len(tensors) > 26 and all(bool(torch.isfinite(t).all()) for t in tensors)
