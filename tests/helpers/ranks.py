"""Multi-process harness for the data-plane tests: N gloo ranks as plain subprocesses.

Why subprocesses rather than torch.multiprocessing.spawn: gloo sometimes aborts at process exit *after* the work is
done; with spawn that abort fails the whole run. Here each rank writes its results to a file and the parent judges
success by those files (a rank that wrote its result file succeeded, whatever its exit status), and shows each
rank's stderr tail when a result is missing. A rank whose worker returned leaves by `os._exit(0)`: tearing down an
interpreter that imported torch, TorchRec and FBGEMM frees every module one by one and takes 1-2 s a rank, checking
nothing (a worker that raised exits normally, with its traceback).

A worker is any importable function `fn(rank: int, world_size: int, out_dir: str, **kwargs)`; it is named as
"module:function" by its dotted module path from the repository root, e.g.
"tests.distributed.test_embeddingbag:module_worker" (each rank puts the repository root first on sys.path).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_BOOT = r"""
import json, os, sys
sys.path[:0] = [{root!r}] + {paths!r}
import importlib
mod_name, fn_name = {target!r}.split(":")
fn = getattr(importlib.import_module(mod_name), fn_name)
import torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
try:
    fn(rank, world, {out_dir!r}, **json.loads({kwargs!r}))
    dist.barrier()
finally:
    dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # the work is done and its files closed: skip the interpreter's teardown (1-2 s a rank)
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_result(out_dir: str | Path, rank: int) -> Path:
    """Where a worker writes its result; the harness counts a rank as done when this file exists."""
    return Path(out_dir) / f"result_rank{rank}.pt"


def rank_env(world_size: int) -> dict[str, str]:
    """The environment of `world_size` local gloo ranks (each process adds its RANK): a fresh port on loopback."""
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME=env.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    return env


def run_ranks(target: str, out_dir: str | Path, world_size: int = 2, timeout: float = 300.0, **kwargs) -> list[Path]:
    """Run `target` on `world_size` gloo ranks; return each rank's result file (raises if one is missing)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    code = _BOOT.format(
        root=str(REPO_ROOT),
        paths=[p for p in sys.path if p],
        target=target,
        out_dir=str(out_dir),
        kwargs=json.dumps(kwargs),
    )
    env = rank_env(world_size)
    procs, logs = [], []
    for r in range(world_size):
        log = open(out_dir / f"rank{r}.log", "w+b")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code], env={**env, "RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT
            )
        )
        logs.append(log)
    try:
        for p in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    results = [rank_result(out_dir, r) for r in range(world_size)]
    missing = [r for r, f in enumerate(results) if not f.exists()]
    if missing:
        tails = []
        for r in range(world_size):
            logs[r].seek(0)
            text = logs[r].read().decode(errors="replace")
            tails.append(f"--- rank {r} (exit {procs[r].returncode}) ---\n{text[-4000:]}")
        for log in logs:
            log.close()
        raise RuntimeError(f"ranks {missing} wrote no result\n" + "\n".join(tails))
    for log in logs:
        log.close()
    return results


def run_ranks_sequence(
    runs: dict[str, tuple[str, dict]], out_dir: str | Path, world_size: int = 2, timeout: float = 300.0
) -> dict[str, Path]:
    """Several workers one after another in ONE set of ranks: run `name` -> (target, kwargs) writes into
    out_dir/name what `run_ranks(target, out_dir/name, world_size, **kwargs)` would. A worker that trains a small
    model for a few steps takes well under a second; the ranks' start-up (Python, torch, TorchRec, FBGEMM imports,
    the process group: ~5 s on 2 cores) is paid once instead of once per run. Returns each run's folder."""
    out_dir = Path(out_dir)
    spec = {name: [target, kwargs] for name, (target, kwargs) in runs.items()}
    run_ranks("tests.helpers.ranks:sequence_worker", out_dir, world_size=world_size, timeout=timeout, runs=spec)
    return {name: out_dir / name for name in runs}


def sequence_worker(rank: int, world_size: int, out_dir: str, runs: dict[str, list]) -> None:
    """`run_ranks_sequence`'s worker: each run's worker in its own folder, in order, every rank at a barrier between
    runs; a run that wrote no result on this rank stops the sequence with its name."""
    import importlib

    import torch
    import torch.distributed as dist

    for name, (target, kwargs) in runs.items():
        run_dir = Path(out_dir) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        mod_name, fn_name = target.split(":")
        getattr(importlib.import_module(mod_name), fn_name)(rank, world_size, str(run_dir), **kwargs)
        if not rank_result(run_dir, rank).exists():
            raise RuntimeError(f"run {name!r} ({target}) wrote no result on rank {rank}")
        dist.barrier()
    torch.save(list(runs), rank_result(out_dir, rank))
