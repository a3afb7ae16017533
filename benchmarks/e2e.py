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
(the home placement Herald starts from; the issue's baseline), `torchrec_tw` stock TABLE_WISE for context. Step times on a 2-core machine with 4 ranks are dominated by CPU
oversubscription; the byte counts do not depend on the machine. `torchrec_planner` is the planner free to pick any
sharding type (`sharding.types=null`). `herald_normal_priority` / `herald_idle_priority` run Herald's input stage
thread at the training thread's priority / SCHED_IDLE instead of the default nice 19 (`scheduler.input_priority`).

Network mode (`--bandwidth none,1gbit,200mbit --workload wdl64,dcn --rounds 3 --plot f.png`, root + iproute2): every
rank its own host in a network namespace behind a tc-shaped link, launched as a multi-node torchrun; adds the bytes
really on the wire and CPU seconds per step, and per workload the links at which herald beats the best stock config
(`breakeven` in the JSON, one line each at the end). See benchmarks/e2e_net.py and benchmarks/netem.py.
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
    "torchrec_planner": ["scheduler=torchrec", "sharding.types=null"],  # the planner with every type, DP included
    "herald": ["scheduler=herald"],
    "herald_numpy": ["scheduler=herald", "scheduler.native=off"],  # Herald without its compiled kernels (numpy only)
    "herald_every_rank": ["scheduler=herald", "scheduler.plan_on=every_rank"],  # each rank plans (no plan bytes)
    # the input stage 16 batches ahead instead of the default 2 (session 19's A/B: no gain, the stage cannot run ahead
    # on a saturated core at either depth)
    "herald_prefetch16": ["scheduler=herald", "scheduler.prefetch=16"],
    # the input stage's thread at the training thread's CPU priority (the default lowers it: input_priority=low)
    "herald_normal_priority": ["scheduler=herald", "scheduler.input_priority=normal"],
    "herald_idle_priority": ["scheduler=herald", "scheduler.input_priority=idle"],
    # Herald with the tables its adaptive policy would not schedule left to TorchRec (ROW_WISE / TABLE_WISE / COLUMN_WISE)
    "herald_auto": ["scheduler=herald", "scheduler.unscheduled=auto"],
    # the systems Herald answers, trained in Herald's engine (issue 10; benchmarks/compare.py compares them all)
    "het_bsp": ["scheduler=het", "scheduler.staleness=0"],
    "het_s2": ["scheduler=het", "scheduler.staleness=2"],
    "het_s8": ["scheduler=het", "scheduler.staleness=8"],
    "fae": ["scheduler=fae"],
    "p2res": ["scheduler=p2res"],
}


WORKLOADS = {
    # embedding-heavy Wide & Deep: wide rows, a small MLP, so the embedding traffic dominates the step
    "wdl64": ["model=wdl", "model.embedding_dim=64", "model.deep_layers=[64,32]"],
    "dcn": ["model=dcn"],  # the app's default model
}


def workload_args(name: str) -> list[str]:
    """Hydra overrides of a --workload: a named one above, or any model of conf/model/ with its defaults."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    if (REPO / "conf" / "model" / f"{name}.yaml").exists():
        return [f"model={name}"]
    models = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
    raise ValueError(f"--workload entries must be in {sorted(WORKLOADS)} or a model of conf/model {models}, got '{name}'")


def train_overrides(scheduler: str, args: argparse.Namespace, run_dir: Path, model_args: list[str], steps: int,
                    log_interval: int = 1_000_000) -> list[str]:
    """Hydra overrides of one run; every run names its scheduler explicitly (the app's default is herald)."""
    return [
        *SCHEDULER_ARGS[scheduler], f"trainer.steps={steps}", f"trainer.batch_size={args.batch}",
        "trainer.eval_interval=0", f"trainer.log_interval={log_interval}", "data.val_batches=2",
        f"data.locality={args.locality}", f"scheduler.cache_ratio={args.cache_ratio}" if not scheduler.startswith("torchrec") else "seed=0",
        *model_args, f"run_dir={run_dir}", *args.extra,
    ]


def read_metrics(run_dir: Path, output: str, steps: int) -> dict:
    """The summary of one finished run from its metrics.json (and Herald's phase times from its output)."""
    m = json.loads((run_dir / "metrics.json").read_text())
    phases = {}
    for line in output.splitlines():  # one line per rank, printed at exit (herald modules only)
        if PHASE_TIMES_TAG in line:
            rank_field, _, payload = line.split(PHASE_TIMES_TAG, 1)[1].strip().partition(" ")
            phases[rank_field.removeprefix("rank=")] = {
                k: {"ms_per_step": v["ms"] / steps, "cpu_ms_per_step": v.get("cpu_ms", 0.0) / steps, "calls": v["calls"]}
                for k, v in json.loads(payload).items()
            }
    return ({"phases": phases} if phases else {}) | {
        "step_ms": 1000.0 * m["global_batch"] / m["samples_per_s"],
        "samples_per_s": m["samples_per_s"],
        "comm_bytes_per_step": m["comm_bytes_per_step"],
        "hit_rate": m.get("hit_rate"),
        "sched_ms_median": m.get("sched_ms_median"),
        # herald: the training thread's median wait for its batch; well above ~0.1 ms, the input stage lags training
        "input_wait_ms_median": m.get("input_wait_ms_median"),
        "rows_by_kind_per_step": m.get("rows_by_kind_per_step"),
        "auc": m["auc"],
    }


def run_one(ranks: int, scheduler: str, args: argparse.Namespace, out_dir: Path) -> dict:
    """Loopback mode: all ranks on this host's loopback via `torchrun --standalone`."""
    run_dir = out_dir / f"r{ranks}-{scheduler}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), "train.py",
        *train_overrides(scheduler, args, run_dir, [f"model={args.model}"], args.steps),
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
    print(f"[e2e] R={ranks} {scheduler:8s} {time.time() - t0:5.1f}s  bytes/step {rec['comm_bytes_per_step']:.3g}", file=sys.stderr)
    return rec


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4", help="comma list of rank counts")
    ap.add_argument("--schedulers", help="comma list (default: torchrec,torchrec_tw,static,herald; with --bandwidth "
                    "also torchrec_planner)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=256, help="per-rank batch")
    ap.add_argument("--cache-ratio", type=float, default=0.1)
    ap.add_argument("--locality", type=float, default=0.5)
    ap.add_argument("--model", default="dcn")
    ap.add_argument("--phase-times", action="store_true",
                    help=f"set {PHASE_TIMES_ENV}=1: report Herald's per-phase wall and thread CPU time (ms per training step, per rank)")
    ap.add_argument("--out", type=Path, help="also write the JSON here (atomically)")
    net = ap.add_argument_group("network mode (root + iproute2; see benchmarks/e2e_net.py)")
    net.add_argument("--bandwidth", help="comma list of per-rank link rates, e.g. none,1gbit,200mbit: every rank its own "
                     "network namespace, linked through a bridge, shaped with tc tbf (none = same topology, unshaped)")
    net.add_argument("--workload", help=f"comma list of {sorted(WORKLOADS)} or model names (default: --model)")
    net.add_argument("--rounds", type=int, default=1, help="alternating rounds; best and median per config")
    net.add_argument("--warmup-steps", type=int, default=10,
                     help="steps left out of steady_step_ms and the wire/CPU per-step figures (0 = from the start line)")
    net.add_argument("--host-cpus", default="shared", choices=("shared", "split"),
                     help="shared: the emulated hosts share the machine's cores (ranks of one machine); split: each "
                          "host gets its own block of cores, as separate machines have (hosts share a core when there are more)")
    net.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    net.add_argument("--plot", type=Path, help="step time vs bandwidth per scheduler, one panel per workload (PNG)")
    net.add_argument("--replot", type=Path, metavar="JSON",
                     help="run nothing: draw --plot and print the markdown table from a network-mode JSON")
    ap.add_argument("extra", nargs="*", help="further Hydra overrides for every run")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    scheds = (args.schedulers or ("torchrec,torchrec_tw,torchrec_planner,static,herald" if args.bandwidth
                                  else "torchrec,torchrec_tw,static,herald")).split(",")
    bad = [s for s in scheds if s not in SCHEDULER_ARGS]
    if bad or any(r < 1 for r in ranks) or args.steps < 1:
        raise SystemExit(f"e2e: schedulers must be in {sorted(SCHEDULER_ARGS)} (got {bad}), ranks >= 1, steps >= 1")
    if args.replot:
        import e2e_net

        result = json.loads(args.replot.read_text())
        if args.plot:
            e2e_net.plot(result, args.plot)
        print(e2e_net.markdown_table(result) + "\n\n" + e2e_net.pivot_table(result) + "\n\n" + e2e_net.breakeven_lines(result))
        return
    if args.bandwidth:
        main_network(args, ranks, scheds)
        return
    if args.plot or args.workload:
        raise SystemExit("e2e: --plot and --workload need --bandwidth (network mode)")
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
    print(e2e_net.markdown_table(result) + "\n\n" + e2e_net.pivot_table(result) + "\n\n" + e2e_net.breakeven_lines(result),
          file=sys.stderr)
    if result["failures"]:
        raise SystemExit(f"e2e: {len(result['failures'])} run(s) failed (see \"failures\" in the JSON)")


if __name__ == "__main__":
    main()
