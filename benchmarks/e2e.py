#!/usr/bin/env python
"""End-to-end comparison: `train.py` per scheduler and rank count, side by side in one run.

    .venv/bin/python benchmarks/e2e.py --ranks 2,4 --schedulers torchrec,static,herald --steps 60

For each (R, scheduler) it runs `torchrun --nproc_per_node R train.py scheduler=S ...` on the same synthetic trace
and reads the run's metrics.json. Prints one JSON object:
{"config": {...}, "runs": {R: {S: {"step_ms": x, "samples_per_s": x, "comm_bytes_per_step": x, "hit_rate": x,
"sched_ms_median": x, "auc": x}}}, "ratios": {R: {"herald_vs_torchrec_bytes": x, ...}}}.
`comm_bytes_per_step` is what every rank together hands to torch.distributed collectives per training step for
embeddings and sample exchange (one counting wrapper for all schedulers). `torchrec` is stock TorchRec ROW_WISE
(the home placement Herald starts from; the issue's baseline), `torchrec_tw` stock TABLE_WISE for context. Step times on a 2-core machine with 4 ranks are dominated by CPU
oversubscription; the byte counts do not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASE_TIMES_ENV, PHASE_TIMES_TAG = "HERALD_PHASE_TIMES", "[herald-phases]"  # as herald_torchrec.distributed.comm
SCHEDULER_ARGS = {
    "torchrec": ["scheduler=torchrec", "sharding.types=[row_wise]"],
    "torchrec_tw": ["scheduler=torchrec", "sharding.types=[table_wise]"],
    "static": ["scheduler=static"],
    "herald": ["scheduler=herald"],
    # Herald with the tables its adaptive policy would not schedule left to TorchRec (ROW_WISE / TABLE_WISE / COLUMN_WISE)
    "herald_auto": ["scheduler=herald", "scheduler.unscheduled=auto"],
}


def run_one(ranks: int, scheduler: str, args: argparse.Namespace, out_dir: Path) -> dict:
    run_dir = out_dir / f"r{ranks}-{scheduler}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), "train.py",
        *SCHEDULER_ARGS[scheduler], f"trainer.steps={args.steps}", f"trainer.batch_size={args.batch}",
        "trainer.eval_interval=0", "trainer.log_interval=1000000", "data.val_batches=2",
        f"data.locality={args.locality}", f"scheduler.cache_ratio={args.cache_ratio}" if not scheduler.startswith("torchrec") else "seed=0",
        f"model={args.model}", f"run_dir={run_dir}", *args.extra,
    ]
    t0 = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.phase_times:
        env[PHASE_TIMES_ENV] = "1"
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    metrics_path = run_dir / "metrics.json"
    if not metrics_path.exists():
        tail = "\n".join((p.stderr or p.stdout).splitlines()[-15:])
        raise SystemExit(f"e2e: {scheduler} on {ranks} ranks failed (exit {p.returncode}):\n{tail}")
    m = json.loads(metrics_path.read_text())
    print(f"[e2e] R={ranks} {scheduler:8s} {time.time() - t0:5.1f}s  bytes/step {m['comm_bytes_per_step']:.3g}", file=sys.stderr)
    global_batch = m["global_batch"]
    phases = {}
    for line in (p.stderr + p.stdout).splitlines():  # one line per rank, printed at exit (herald modules only)
        if PHASE_TIMES_TAG in line:
            rank_field, _, payload = line.split(PHASE_TIMES_TAG, 1)[1].strip().partition(" ")
            phases[rank_field.removeprefix("rank=")] = {
                k: {"ms_per_step": v["ms"] / args.steps, "calls": v["calls"]} for k, v in json.loads(payload).items()
            }
    return ({"phases": phases} if phases else {}) | {
        "step_ms": 1000.0 * global_batch / m["samples_per_s"],
        "samples_per_s": m["samples_per_s"],
        "comm_bytes_per_step": m["comm_bytes_per_step"],
        "hit_rate": m.get("hit_rate"),
        "sched_ms_median": m.get("sched_ms_median"),
        "rows_by_kind_per_step": m.get("rows_by_kind_per_step"),
        "auc": m["auc"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4", help="comma list of rank counts")
    ap.add_argument("--schedulers", default="torchrec,torchrec_tw,static,herald")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=256, help="per-rank batch")
    ap.add_argument("--cache-ratio", type=float, default=0.1)
    ap.add_argument("--locality", type=float, default=0.5)
    ap.add_argument("--model", default="dcn")
    ap.add_argument("--phase-times", action="store_true",
                    help=f"set {PHASE_TIMES_ENV}=1: report Herald's per-phase wall time (ms per training step, per rank)")
    ap.add_argument("--out", type=Path, help="also write the JSON here (atomically)")
    ap.add_argument("extra", nargs="*", help="further Hydra overrides for every run")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    scheds = args.schedulers.split(",")
    bad = [s for s in scheds if s not in SCHEDULER_ARGS]
    if bad or any(r < 1 for r in ranks) or args.steps < 1:
        raise SystemExit(f"e2e: schedulers must be in {sorted(SCHEDULER_ARGS)} (got {bad}), ranks >= 1, steps >= 1")
    runs: dict = {}
    with tempfile.TemporaryDirectory(prefix="herald-e2e-") as tmp:
        for r in ranks:
            runs[str(r)] = {s: run_one(r, s, args, Path(tmp)) for s in scheds}
    ratios = {}
    for r, per in runs.items():
        if "torchrec" in per:
            base = per["torchrec"]
            ratios[r] = {
                f"{s}_vs_torchrec_bytes": per[s]["comm_bytes_per_step"] / base["comm_bytes_per_step"]
                for s in per if s != "torchrec"
            } | {f"{s}_vs_torchrec_step_time": per[s]["step_ms"] / base["step_ms"] for s in per if s != "torchrec"}
    result = {"config": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out) if args.out else None},
              "runs": runs, "ratios": ratios}
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(f".{args.out.name}.tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
