#!/usr/bin/env python
"""Resident memory of every rank over a long run: does any rank grow?

    python benchmarks/memory.py --steps 5000 --nproc 2 --out benchmarks/results/rss_r2_5000_cpu2_DATE.json
    python benchmarks/memory.py --steps 5000 -- scheduler.plan_on=every_rank    # Hydra overrides after --

Runs `train.py` under torchrun and reads each worker's VmRSS from /proc whenever rank 0 prints a progress line, so
every sample is tied to a training step. Prints one JSON object: per rank, RSS (MB) by step, and its growth from the
first sample at or after `--from-step` (default 500: start-up, the first evaluations and the kernels' first use are
done by then) to the last. A flat rank grows by well under 5 %. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"^step\s+(\d+)\b")


def worker_pids(agent_pid: int) -> dict[int, int]:
    """torchrun's workers by rank: the direct children of the agent process `agent_pid` that carry a RANK in their
    environment (read from /proc; a worker's own subprocesses, which inherit RANK, are not its children)."""
    workers = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") if ppid == agent_pid else []
        except OSError:
            continue
        rank = next((int(kv[5:]) for kv in env if kv.startswith(b"RANK=")), None)
        if rank is not None:
            workers[rank] = int(entry)
    return workers


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--from-step", type=int, default=500, help="growth is measured from here to the end")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for train.py (after --)")
    args = ap.parse_args()
    if args.steps <= args.from_step:
        raise SystemExit(f"--steps ({args.steps}) must be larger than --from-step ({args.from_step})")
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(args.nproc),
            "train.py",
            f"trainer.steps={args.steps}",
            f"run_dir={run_dir}",
            *args.overrides,
        ]
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        samples: dict[int, list[tuple[int, float]]] = {}
        assert proc.stdout is not None
        for line in proc.stdout:
            m = STEP_LINE.match(line)
            if not m:
                continue
            step = int(m.group(1))
            for rank, pid in worker_pids(proc.pid).items():
                mb = rss_mb(pid)
                if mb is not None:
                    samples.setdefault(rank, []).append((step, round(mb, 1)))
            print(
                f"step {step}: " + ", ".join(f"rank {r} {s[-1][1]:.0f} MB" for r, s in sorted(samples.items())),
                file=sys.stderr,
                flush=True,
            )
        if proc.wait() != 0:
            raise SystemExit(f"train.py failed (exit {proc.returncode})")
    ranks = {}
    for rank, series in sorted(samples.items()):
        start = next(((s, mb) for s, mb in series if s >= args.from_step), None)
        end = series[-1]
        growth = None if start is None else (end[1] - start[1]) / start[1]
        ranks[rank] = {
            "rss_mb_by_step": series,
            "from": start,
            "to": end,
            "growth": None if growth is None else round(growth, 4),
        }
    out = {
        "config": {"steps": args.steps, "nproc": args.nproc, "from_step": args.from_step, "overrides": args.overrides},
        "ranks": ranks,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
