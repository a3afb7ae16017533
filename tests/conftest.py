from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def run_app(args: list[str], nproc: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run train.py as a user would (torchrun for >1 rank); returns the finished process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "train.py", *args]
    else:
        cmd = [sys.executable, "train.py", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_app_many(runs: list[list[str]], timeout: int = 900) -> list[subprocess.CompletedProcess]:
    """`run_app(args)` for every argument list (one rank each), in ONE process (tests/_app_cli.py): each run goes
    through train.py's CLI path as `python train.py ARGS` does, and gets its own exit code, stdout and stderr."""
    import json
    import tempfile

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "results.json"
        p = subprocess.run([sys.executable, str(REPO / "tests" / "_app_cli.py"), str(out), json.dumps(runs)], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=timeout)
        if not out.exists():
            raise RuntimeError(f"tests/_app_cli.py wrote no results (exit {p.returncode}):\n{p.stderr[-3000:]}")
        got = json.loads(out.read_text())
    return [subprocess.CompletedProcess(["train.py", *a], r["returncode"], r["stdout"], r["stderr"])
            for a, r in zip(runs, got)]


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real-format samples not found at {SHARED_DATA} (../shared beside the repo)")
    return SHARED_DATA


_deselected_cuda: list[str] = []


def pytest_deselected(items) -> None:
    """Remember `cuda`-marked tests that `-m` deselected, so the run says so instead of dropping them silently."""
    _deselected_cuda.extend(i.nodeid for i in items if i.get_closest_marker("cuda") is not None)


def pytest_terminal_summary(terminalreporter) -> None:
    if _deselected_cuda:
        terminalreporter.write_line(
            f"{len(_deselected_cuda)} cuda-marked tests deselected: they need a CUDA GPU (run `make test-gpu` there)"
        )
