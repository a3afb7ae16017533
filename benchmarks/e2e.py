#!/usr/bin/env python
"""End-to-end comparison: `train.py` per scheduler and rank count, side by side in one run.

    .venv/bin/python benchmarks/e2e.py --ranks 2,4 --schedulers torchrec,static,herald --steps 60

For each (R, scheduler) it runs `torchrun --nproc_per_node R train.py scheduler=S ...` on the same synthetic trace
and reads the run's metrics.json. Prints one JSON object:
{"config": {...}, "runs": {R: {S: {"step_ms": x, "samples_per_s": x, "comm_bytes_per_step": x, "hit_rate": x,
"sched_ms_median": x, "input_wait_ms_median": x, "auc": x}}}, "ratios": {R: {"herald_vs_torchrec_bytes": x, ...}}}
(`input_wait_ms_median`, herald only: the training thread's median wait for its batch; well above ~0.1 ms the input
stage does not keep ahead of training).
`comm_bytes_per_step` is what every rank together hands to torch.distributed collectives per training step for
embeddings and sample exchange (one counting wrapper for all schedulers). `torchrec` is stock TorchRec ROW_WISE
(the home placement Herald starts from; the issue's baseline), `torchrec_tw` stock TABLE_WISE for context. Step times on
a 2-core machine with 4 ranks are dominated by CPU oversubscription; the byte counts do not depend on the machine.
`torchrec_planner` is the planner free to pick any sharding type (`sharding.types=null`). `herald_normal_priority` /
`herald_idle_priority` run Herald's input stage thread at the training thread's priority / SCHED_IDLE instead of the
default nice 19 (`scheduler.input_priority`).

Network mode (`--bandwidth none,1gbit,200mbit --workload wdl64,dcn --rounds 3 --plot f.png`, root + iproute2): every
emulated host a network namespace behind a tc-shaped link, launched as a multi-node torchrun (one agent per host);
adds the bytes really on the wire (in total and per host link) and CPU seconds per step, and per workload the links
at which herald beats the best stock config (`breakeven` in the JSON, one line each at the end). Each rank is its own
host unless `--ranks-per-host N` puts N ranks in each (talking over its loopback; `--ranks 8 --ranks-per-host 4`:
2 hosts of 4). See benchmarks/e2e_net.py and benchmarks/netem.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from e2e_common import (  # noqa: F401  (re-exported: benchmarks/compare.py and the tests read them from e2e)
    PHASE_TIMES_ENV,
    PHASE_TIMES_TAG,
    REPO,
    SCHEDULER_ARGS,
    WORKLOADS,
    read_metrics,
    runs_folder,
    train_overrides,
    workload_args,
)


def run_one(ranks: int, scheduler: str, args: argparse.Namespace, out_dir: Path) -> dict:
    """Loopback mode: all ranks on this host's loopback via `torchrun --standalone`."""
    run_dir = out_dir / f"r{ranks}-{scheduler}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(ranks),
        "train.py",
        *train_overrides(scheduler, args, run_dir, [f"model={args.model}"], args.steps, ranks),
    ]
    t0 = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.phase_times:
        env[PHASE_TIMES_ENV] = "1"
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if not (run_dir / "metrics.json").exists():
        tail = "\n".join((p.stderr or p.stdout).splitlines()[-15:])
        raise SystemExit(f"e2e: {scheduler} on {ranks} ranks failed (exit {p.returncode}):\n{tail}")
    rec = read_metrics(run_dir, p.stderr + p.stdout, args.steps)
    print(
        f"[e2e] R={ranks} {scheduler:8s} {time.time() - t0:5.1f}s  bytes/step {rec['comm_bytes_per_step']:.3g}",
        file=sys.stderr,
    )
    return rec


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4", help="comma list of rank counts")
    ap.add_argument(
        "--schedulers",
        help="comma list (default: torchrec,torchrec_tw,static,herald; with --bandwidth also torchrec_planner)",
    )
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=256, help="per-rank batch")
    ap.add_argument("--cache-ratio", type=float, default=0.1)
    ap.add_argument("--locality", type=float, default=0.5)
    ap.add_argument("--model", default="dcn")
    ap.add_argument(
        "--phase-times",
        action="store_true",
        help=f"set {PHASE_TIMES_ENV}=1: report Herald's per-phase wall and thread CPU time "
        "(ms per training step, per rank)",
    )
    ap.add_argument("--out", type=Path, help="also write the JSON here (atomically)")
    net = ap.add_argument_group("network mode (root + iproute2; see benchmarks/e2e_net.py)")
    net.add_argument(
        "--bandwidth",
        help="comma list of per-host link rates, e.g. none,1gbit,200mbit: every emulated host its own "
        "network namespace, linked through a bridge, shaped with tc tbf (none = same topology, unshaped)",
    )
    net.add_argument(
        "--ranks-per-host",
        type=int,
        default=1,
        help="ranks in each emulated host (one torchrun agent per host, its ranks on the host's loopback); must "
        "divide every --ranks entry (default 1: every rank its own host)",
    )
    net.add_argument("--workload", help=f"comma list of {sorted(WORKLOADS)} or model names (default: --model)")
    net.add_argument("--rounds", type=int, default=1, help="alternating rounds; best and median per config")
    net.add_argument(
        "--warmup-steps",
        type=int,
        default=10,
        help="steps left out of steady_step_ms and the wire/CPU per-step figures (0 = from the start line)",
    )
    net.add_argument(
        "--host-cpus",
        default="shared",
        choices=("shared", "split"),
        help="shared: the emulated hosts share the machine's cores (ranks of one machine); split: each "
        "host gets its own block of cores, as separate machines have (hosts share a core when there are more)",
    )
    net.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    net.add_argument("--plot", type=Path, help="step time vs bandwidth per scheduler, one panel per workload (PNG)")
    net.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="run nothing: draw --plot and print the markdown table from a network-mode JSON",
    )
    ap.add_argument(
        "--runs-dir",
        type=Path,
        help="keep every run's run_dir (metrics.json, tb/, final_state.pt with trainer.save_final=true) under this "
        "folder instead of a temporary one",
    )
    ap.add_argument("extra", nargs="*", help="further Hydra overrides for every run")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    scheds = (
        args.schedulers
        or (
            "torchrec,torchrec_tw,torchrec_planner,static,herald"
            if args.bandwidth
            else "torchrec,torchrec_tw,static,herald"
        )
    ).split(",")
    bad = [s for s in scheds if s not in SCHEDULER_ARGS]
    if bad or any(r < 1 for r in ranks) or args.steps < 1:
        raise SystemExit(f"e2e: schedulers must be in {sorted(SCHEDULER_ARGS)} (got {bad}), ranks >= 1, steps >= 1")
    if args.replot:
        import e2e_net

        result = json.loads(args.replot.read_text())
        if args.plot:
            e2e_net.plot(result, args.plot)
        print(
            e2e_net.markdown_table(result)
            + "\n\n"
            + e2e_net.pivot_table(result)
            + "\n\n"
            + e2e_net.breakeven_lines(result)
        )
        return
    if args.bandwidth:
        main_network(args, ranks, scheds)
        return
    if args.plot or args.workload or args.ranks_per_host != 1:
        raise SystemExit("e2e: --plot, --workload and --ranks-per-host need --bandwidth (network mode)")
    runs: dict = {}
    with runs_folder(args.runs_dir, "herald-e2e-") as tmp:
        for r in ranks:
            runs[str(r)] = {s: run_one(r, s, args, Path(tmp)) for s in scheds}
    ratios = {}
    for r, per in runs.items():
        if "torchrec" in per:
            base = per["torchrec"]
            ratios[r] = {
                f"{s}_vs_torchrec_bytes": per[s]["comm_bytes_per_step"] / base["comm_bytes_per_step"]
                for s in per
                if s != "torchrec"
            } | {f"{s}_vs_torchrec_step_time": per[s]["step_ms"] / base["step_ms"] for s in per if s != "torchrec"}
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out) if args.out else None},
        "runs": runs,
        "ratios": ratios,
    }
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        write_atomic(args.out, text + "\n")


def main_network(args: argparse.Namespace, ranks: list[int], scheds: list[str]) -> None:
    """--bandwidth: the sweep on emulated networks; exit 2 if this machine cannot build them."""
    import e2e_net
    import netem

    try:
        save = (lambda partial: write_atomic(args.out, e2e_net.dumps(partial) + "\n")) if args.out else None
        result = e2e_net.main_net(args, ranks, scheds, save=save)
    except netem.NetemUnavailable as err:
        e2e_net.exit_unavailable(err)
    except ValueError as err:
        raise SystemExit(f"e2e: {err}")
    text = e2e_net.dumps(result)
    print(text)
    if args.out:
        write_atomic(args.out, text + "\n")
    if args.plot:
        e2e_net.plot(result, args.plot)
    print(
        e2e_net.markdown_table(result)
        + "\n\n"
        + e2e_net.pivot_table(result)
        + "\n\n"
        + e2e_net.breakeven_lines(result),
        file=sys.stderr,
    )
    if result["failures"]:
        raise SystemExit(f'e2e: {len(result["failures"])} run(s) failed (see "failures" in the JSON)')


if __name__ == "__main__":
    main()
