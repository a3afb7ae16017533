"""The app refuses to go on where going on would lose or corrupt something, always in one line with exit 2: a
diverged loss stops every rank before anything non-finite reaches a checkpoint, and metrics.json stays strict JSON;
every configuration mistake is found before the first training step (unknown keys included); a run_dir holding a
checkpoint, or in use by a running job, is refused and left untouched.

Every case is a one-rank CLI run; they share one process (tests/helpers/app_runs.run_app_many)."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import pytest
import torch

from tests.app.test_metrics_json import strict_load
from tests.helpers.app_runs import run_app_many

FAST = ["trainer.steps=20", "data.val_batches=2", "trainer.eval_interval=0"]
# (overrides, the error line's text); each must stop before the first step. {root} is this module's temporary folder.
BEFORE_TRAINING = {
    "typo": (["+trainer.stepz=10"], "unknown configuration key trainer.stepz"),
    "top_typo": (["+sead=1"], "unknown configuration key sead"),
    "eval_negative": (["trainer.eval_interval=-5"], "trainer.eval_interval must be an integer >= 0"),
    "log_zero": (["trainer.log_interval=0"], "trainer.log_interval must be an integer >= 1"),
    "steps_text": (["trainer.steps=abc"], "trainer.steps must be an integer >= 1, got 'abc'"),
    "lr_text": (["trainer.dense_lr=fast"], "trainer.dense_lr must be a number > 0, got 'fast'"),
    "data_dir": (["data=criteo", "data.path={root}"], "data.path must be a file, got the directory"),
    "run_dir_file": (["run_dir={root}/a_file"], "is a file; run_dir must be a directory"),
    "small_val": (
        ["data=criteo", "data.path={root}/tiny.tsv", "trainer.batch_size=8"],
        "the validation split has no complete global batch of 8 samples",
    ),
}


def _tiny_criteo(path: Path, rows: int = 60) -> None:
    """A Criteo-format file (label, 13 integers, 26 hex ids) whose validation split (5 %) is a few rows."""
    lines = []
    for i in range(rows):
        ints = [str((i * 7 + j) % 10) for j in range(13)]
        ids = [f"{(i * 31 + j * 17) % 50:08x}" for j in range(26)]
        lines.append("\t".join([str(i % 2), *ints, *ids]))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("safeguards")
    cases = {
        # Adam at lr 1e4: the loss is NaN from step 2
        "nan_fast": [*FAST, "trainer.dense_lr=1e4"],
        # SGD at lr 10: finite for a few steps, NaN from step 6; checkpoints at steps 2 and 4 are good
        "nan_late": [*FAST, "trainer.dense_optimizer=sgd", "trainer.dense_lr=10", "trainer.checkpoint_interval=2"],
    }
    _tiny_criteo(root / "tiny.tsv")
    (root / "a_file").write_text("not a directory\n")
    for name, (args, _) in BEFORE_TRAINING.items():
        args = [a.format(root=root) for a in args]
        own = [] if any(a.startswith("run_dir=") for a in args) else [f"run_dir={root / name}"]
        cases[name] = [*args, "trainer.log_interval=1" if name != "log_zero" else "trainer.steps=5", *own]
    for name in ("nan_fast", "nan_late"):
        cases[name].append(f"run_dir={root / name}")
    # outputs never lost: a run with checkpoints, then a rerun of it without resume (refused), and a run_dir whose
    # earlier run is replaced on purpose (overwrite), in order
    ckpt = [*FAST, "trainer.checkpoint_interval=5"]
    cases["kept"] = [*ckpt, "trainer.steps=10", f"run_dir={root / 'kept'}"]
    cases["rerun"] = [*ckpt, "trainer.steps=5", f"run_dir={root / 'kept'}"]
    cases["replaced_first"] = [*ckpt, "trainer.steps=10", f"run_dir={root / 'replaced'}"]
    cases["replaced"] = [*ckpt, "trainer.steps=5", "trainer.overwrite=true", f"run_dir={root / 'replaced'}"]
    # a job already running in run_dir: this test holds its lock, as a running job's rank 0 does
    busy = root / "busy"
    busy.mkdir()
    (busy / "metrics.json").write_text('{"first job": true}\n')
    cases["busy"] = [*FAST, f"run_dir={busy}"]
    with open(busy / ".lock", "w") as held:
        held.write("testhost pid 4242\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        got = run_app_many(list(cases.values()))
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


@pytest.mark.parametrize("case", list(BEFORE_TRAINING))
def test_mistakes_are_found_before_training(runs: tuple[Path, dict], case: str) -> None:
    root, got = runs
    p, msg = got[case], BEFORE_TRAINING[case][1]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and msg in errors[0], (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr
    assert "step " not in p.stdout and "[herald]" not in p.stdout, p.stdout[-2000:]  # no step, not even set-up
    assert not (root / case / "metrics.json").exists() and not (root / case / "tb").exists()


def _events(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "tb").glob("events.out.tfevents.*"))


def test_a_run_dir_with_a_checkpoint_is_not_overwritten(runs: tuple[Path, dict], tmp_path: Path) -> None:
    root, got = runs
    assert got["kept"].returncode == 0, got["kept"].stderr[-2000:]
    p = got["rerun"]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-2000:])
    assert "already holds a checkpoint" in errors[0] and "trainer.resume=true" in errors[0], errors
    assert "trainer.overwrite=true" in errors[0] and "step " not in p.stdout
    kept = root / "kept"  # the first run's outputs, untouched
    assert _read_checkpoint(kept / "checkpoint", tmp_path)["meta"]["step"] == 10
    assert strict_load((kept / "metrics.json").read_text())["steps"] == 10 and len(_events(kept)) == 1


def test_overwrite_replaces_the_earlier_run(runs: tuple[Path, dict], tmp_path: Path) -> None:
    root, got = runs
    assert got["replaced_first"].returncode == 0 and got["replaced"].returncode == 0, got["replaced"].stderr[-2000:]
    replaced = root / "replaced"  # only the second run's outputs: its checkpoint, metrics and one events file
    assert _read_checkpoint(replaced / "checkpoint", tmp_path)["meta"]["step"] == 5
    assert strict_load((replaced / "metrics.json").read_text())["steps"] == 5 and len(_events(replaced)) == 1


def test_a_second_job_on_a_busy_run_dir_is_refused(runs: tuple[Path, dict]) -> None:
    root, got = runs
    p = got["busy"]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-2000:])
    assert "is in use by a running job (testhost pid 4242 holds" in errors[0], errors
    busy = root / "busy"
    assert (busy / "metrics.json").read_text() == '{"first job": true}\n' and not (busy / "tb").exists()
