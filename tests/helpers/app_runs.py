"""`train.py` as a user runs it, from a test: one run as its own process (torchrun for more than one rank), or many
one-rank runs in one process (app_cli.py), each with its own exit code, stdout and stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.helpers.ranks import REPO_ROOT

APP_CLI = Path(__file__).resolve().parent / "app_cli.py"


def run_app(args: list[str], nproc: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run train.py as a user would (torchrun for >1 rank); returns the finished process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if nproc > 1:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        cmd = [*torchrun, "train.py", *args]
    else:
        cmd = [sys.executable, "train.py", *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_app_many(runs: list[list[str]], timeout: int = 900) -> list[subprocess.CompletedProcess]:
    """`run_app(args)` for every argument list (one rank each), in ONE process (tests/helpers/app_cli.py): each run
    goes through train.py's CLI path as `python train.py ARGS` does, and gets its own exit code, stdout and stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "results.json"
        p = subprocess.run(
            [sys.executable, str(APP_CLI), str(out), json.dumps(runs)],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if not out.exists():
            raise RuntimeError(f"tests/helpers/app_cli.py wrote no results (exit {p.returncode}):\n{p.stderr[-3000:]}")
        got = json.loads(out.read_text())
    return [
        subprocess.CompletedProcess(["train.py", *a], r["returncode"], r["stdout"], r["stderr"])
        for a, r in zip(runs, got)
    ]
