"""A checkpoint verifies itself: `train.py` writes a manifest (every file's size and sha256) with each checkpoint and
checks it before loading anything, so flipped or zeroed bytes, a missing or truncated file and a checkpoint without
a manifest are refused in one line, exit 2, before any training step; a checkpoint whose manifest was lost loads
again once the user adopts it, and an intact one still resumes to the model of the run done in one go. A full disk
while writing a checkpoint is one line too (a small tmpfs, where this test may mount one).

Every run is a one-rank CLI run; they share two processes (tests/helpers/app_runs.run_app_many)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.app_runs import run_app_many
from tests.helpers.ranks import REPO_ROOT
from tests.scenarios.test_app_exactness import _max_diff

COMMON = [
    "scheduler=herald",
    "scheduler.unscheduled=[c3]",
    "trainer.eval_interval=0",
    "trainer.log_interval=1",
    "data.val_batches=2",
    "trainer.embedding_eps=1e-3",
    "trainer.save_final=true",
    "trainer.checkpoint_interval=2",
]
BASE_STEPS, FINAL_STEPS = 4, 6
DATA_FILE = "__0_0.distcp"  # the one rank's data file (DCP: __<rank>_<n>.distcp)


def _flip(path: Path, n: int = 4096) -> None:
    """n bytes in the middle of the file inverted."""
    with open(path, "r+b") as f:
        at = max(0, path.stat().st_size // 2 - n // 2)
        f.seek(at)
        data = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


def _zero(path: Path, n: int = 100 * 1024) -> None:
    """100 KB in the middle of the file zeroed (the whole file if it is smaller)."""
    size = path.stat().st_size
    at = max(0, size // 2 - n // 2)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes(min(n, size)))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


# how the copy of a good checkpoint is damaged -> the words of the one error line
DAMAGED = {
    "flipped": (_flip, f"{DATA_FILE} does not match its checksum"),
    "zeroed": (_zero, f"{DATA_FILE} does not match its checksum"),
    "missing": (Path.unlink, f"{DATA_FILE} is missing (the manifest lists"),
    "truncated": (_truncate, f"{DATA_FILE} is truncated: "),
    "no_manifest": (None, "has no manifest.json (written before checkpoints carried one"),
}


def _mount_tiny_tmpfs(path: Path) -> bool:
    """A 12 MiB tmpfs at path (the checkpoint needs ~30), where this process may mount one (root on Linux)."""
    path.mkdir()
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(path)], capture_output=True)
    return p.returncode == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("integrity")
    first = {
        "whole": [*COMMON, f"trainer.steps={FINAL_STEPS}", f"run_dir={root / 'whole'}"],
        "base": [*COMMON, f"trainer.steps={BASE_STEPS}", f"run_dir={root / 'base'}"],
    }
    full = root / "full"
    mounted = _mount_tiny_tmpfs(full)
    try:
        if mounted:
            first["full"] = [*COMMON, f"trainer.steps={BASE_STEPS}", f"run_dir={full / 'run'}"]
        got = dict(zip(first, run_app_many(list(first.values()))))
        if mounted:
            got["full_left"] = sorted(p.name for p in (full / "run").iterdir())
    finally:
        if mounted:
            subprocess.run(["umount", str(full)], check=False)
    assert got["base"].returncode == 0, got["base"].stderr[-3000:]
    for name in [*DAMAGED, "clean", "adopted"]:
        shutil.copytree(root / "base", root / name)
    for name, (harm, _) in DAMAGED.items():
        if harm is not None:
            harm(root / name / "checkpoint" / DATA_FILE)
    for name in ("no_manifest", "adopted"):  # as an earlier version wrote it
        (root / name / "checkpoint" / "manifest.json").unlink(missing_ok=True)
    got["adopt"] = subprocess.run(
        [sys.executable, "-m", "herald_torchrec.app.checkpoint", "adopt", str(root / "adopted" / "checkpoint")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    second = {
        name: [*COMMON, f"trainer.steps={FINAL_STEPS}", "trainer.resume=true", f"run_dir={root / name}"]
        for name in [*DAMAGED, "clean", "adopted"]
    }
    got |= dict(zip(second, run_app_many(list(second.values()))))
    return root, got


def test_a_checkpoint_carries_its_manifest(runs: tuple[Path, dict]) -> None:
    root, _ = runs
    ckpt = root / "base" / "checkpoint"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    on_disk = sorted(p.name for p in ckpt.iterdir() if p.name != "manifest.json")
    assert [f["name"] for f in manifest["files"]] == on_disk and ".metadata" in on_disk and DATA_FILE in on_disk
    for f in manifest["files"]:
        data = (ckpt / f["name"]).read_bytes()
        assert f["size"] == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest(), f["name"]
    assert manifest["step"] == BASE_STEPS and manifest["identity"]["world_size"] == 1
    assert manifest["identity"]["seed"] == 0 and manifest["identity"]["global_batch"] == 256
    assert not (root / "base" / "checkpoint.tmp").exists() and not (root / "base" / "checkpoint.old").exists()


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_checkpoint_is_refused_in_one_line(runs: tuple[Path, dict], case: str) -> None:
    root, got = runs
    p, words = got[case], DAMAGED[case][1]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    assert words in errors[0] and str(root / case / "checkpoint") in errors[0], errors[0]
    assert "Traceback" not in p.stderr and len(p.stderr.splitlines()) <= 3, p.stderr[-3000:]
    assert "resumed from" not in p.stdout and "step " not in p.stdout, p.stdout[-2000:]  # nothing loaded or trained
    if case == "no_manifest":
        assert f"python -m herald_torchrec.app.checkpoint adopt {root / case / 'checkpoint'}" in errors[0]
    else:
        assert "trainer.overwrite=true" in errors[0]
    # the refused run changed nothing: the earlier run's summary and the damaged checkpoint are as they were
    assert json.loads((root / case / "metrics.json").read_text())["steps"] == BASE_STEPS
    assert not (root / case / "checkpoint.tmp").exists() and (root / case / "checkpoint" / ".metadata").exists()


@pytest.mark.parametrize("case", ["clean", "adopted"])
def test_a_verified_checkpoint_resumes_to_the_uninterrupted_model(runs: tuple[Path, dict], case: str) -> None:
    """The intact copy, and the copy without a manifest after `adopt`, end where the run in one go ends."""
    root, got = runs
    if case == "adopted":
        a = got["adopt"]
        assert a.returncode == 0 and f"step {BASE_STEPS}" in a.stdout, (a.stdout, a.stderr[-2000:])
    p = got[case]
    assert p.returncode == 0 and f"resumed from {root / case / 'checkpoint'} at step {BASE_STEPS}" in p.stdout, (
        p.stderr[-3000:]
    )
    whole, resumed = torch.load(root / "whole" / "final_state.pt"), torch.load(root / case / "final_state.pt")
    for part in ("tables", "optimizer_state", "dense"):
        assert _max_diff(whole[part], resumed[part]) <= 1e-5, part
    manifest = json.loads((root / case / "checkpoint" / "manifest.json").read_text())
    assert manifest["step"] == FINAL_STEPS  # the resumed run's own checkpoints carry manifests


def test_a_full_disk_is_one_line(runs: tuple[Path, dict]) -> None:
    root, got = runs
    if "full" not in got:
        pytest.skip("needs root to mount a small tmpfs")
    p = got["full"]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-3000:])
    ckpt = root / "full" / "run" / "checkpoint"
    assert f"cannot write checkpoint {ckpt}: no space left on device" in errors[0], errors[0]
    assert "no checkpoint was written" in errors[0] and "inline_container" not in p.stderr
    assert "checkpoint.tmp" not in got["full_left"] and "checkpoint" not in got["full_left"]  # its space given back
    assert "step      2" in p.stdout and "step      3" not in p.stdout  # it stopped at the first checkpoint
