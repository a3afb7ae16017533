"""Network mode of benchmarks/e2e.py: emulated hosts behind shaped links, each of H ranks (see netem.py).

    .venv/bin/python benchmarks/e2e.py --bandwidth none,1gbit,200mbit --workload wdl64,dcn --ranks 2 --rounds 3 \\
        --steps 60 --out benchmarks/results/e2e_net.json --plot benchmarks/results/e2e_net.png
    .venv/bin/python benchmarks/e2e.py --bandwidth none,1gbit --ranks 8 --ranks-per-host 4 ...  # 2 hosts of 4

For every (workload, bandwidth, R, scheduler) -- a "config" -- each round runs, for every host h of the R / H at once,
`ip netns exec <host ns> torchrun --nnodes R/H --node_rank h --nproc_per_node H --rdzv-backend c10d
--rdzv-endpoint <host 0 addr>:port train.py ...` (GLOO_SOCKET_IFNAME = the host's veth; H = `--ranks-per-host`,
default 1: every rank its own host), as one torchrun agent per machine runs on a real cluster: its workers get
LOCAL_WORLD_SIZE=H and GROUP_RANK=h, which is how Herald tells the hosts apart. The ranks of a host talk over the
namespace's loopback, unshaped and uncounted. It records the app's numbers (step ms, samples/s, AUC,
`comm_bytes_per_step`) with the bytes the hosts really put on the wire (bridge-side veth counters, headers included;
in total and per host link, sent and received) and the CPU seconds of all processes.

`step_ms` / `samples_per_s` are the app's (metrics.json: the whole training loop, first steps' warm-up included).
`steady_step_ms`, `wire_bytes_per_step` and `cpu_s_per_step` cover steps `--warmup-steps`+1 .. `--steps` only:
the veth counters, the clock and the rank processes' CPU times are read when the app prints its log line of step
W and of the last step (log_interval = gcd(W, steps); output polled every 20 ms). They include DDP's dense
all-reduce, Herald's scheduling and sample exchange, TCP/IP headers; not rendezvous, set-up, warm-up or the final
evaluation. `*_per_step_raw` divide the whole run (interpreter start to exit) by the steps, for context.
Rounds alternate: each runs every config once, the order rotated from round to round; best (lowest step time) and
median per config are reported.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import e2e_common
import netem

from herald_torchrec.app.runtime import cpu_blocks

RDZV_PORT = 29400  # inside the rank namespaces: no other process there can hold it
START_MARK = r"^\[herald\] \S+ on "  # app/trainer.py: printed after sharding, before the first step
STEP_MARK = r"^step\s+{step}\s+loss"  # app/trainer.py's log line of step `step` (every log_interval steps)
NUMERIC = (
    "step_ms",
    "samples_per_s",
    "auc",
    "comm_bytes_per_step",
    "wire_bytes_per_step",
    "wire_bytes_per_step_raw",
    "cpu_s_per_step",
    "cpu_s_per_step_raw",
    "steady_step_ms",
    "hit_rate",
    "input_wait_ms_median",
    *(f"cpu_ms_per_step_{k}" for k in netem.THREAD_KINDS),
)
PER_HOST = ("wire_bytes_per_step_by_host", "wire_rx_bytes_per_step_by_host")  # one number per host link


def host_commands(
    net: netem.Network,
    scheduler: str,
    model_args: list[str],
    steps: int,
    run_dir: Path,
    args: argparse.Namespace,
    rdzv_id: str,
) -> list[list[str]]:
    """One command per host: torchrun of one node with the host's ranks inside its namespace, gloo bound to its veth.

    Node 0 hosts the rendezvous store (`is_host`): torchrun's own guess compares the endpoint with the machine's
    hostname addresses, which the namespace addresses are not. The rendezvous numbers the agents by address, which
    netem plans in host order, so host h runs ranks h*H .. h*H+H-1.
    """
    plan = net.plan
    hosts = plan.hosts
    log_every = math.gcd(args.warmup_steps, steps)  # both step W and the last step print a STEP_MARK line
    overrides = e2e_common.train_overrides(
        scheduler, args, run_dir, model_args, steps, plan.ranks, log_interval=log_every
    )
    env_vars = [f"{e2e_common.PHASE_TIMES_ENV}=1"] if args.phase_times else []
    cpus = host_cpus(getattr(args, "host_cpus", None) or "shared", hosts)  # compare.py's options lack it
    return [
        [
            *net.exec_prefix(h),
            *(["taskset", "-c", ",".join(map(str, cpus[h]))] if cpus else []),
            "env",
            f"GLOO_SOCKET_IFNAME={plan.host_eth[h]}",
            *env_vars,
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(hosts),
            "--node_rank",
            str(h),
            "--nproc_per_node",
            str(plan.ranks_per_host),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{plan.addrs[0]}:{RDZV_PORT}",
            "--rdzv-id",
            rdzv_id,
            "--rdzv-conf",
            f"is_host={int(h == 0)}",
            "--local-addr",
            plan.addrs[h],
            "--max-restarts",
            "0",
            "train.py",
            *overrides,
        ]
        for h in range(hosts)
    ]


def host_cpus(mode: str, hosts: int) -> list[list[int]] | None:
    """The cores of each emulated host: "shared" (None: every host may use every core, as ranks of one machine do),
    or "split" (a block each, disjoint when there are at least as many cores as hosts, as separate machines have;
    herald_torchrec.app.runtime.cpu_blocks). Inside a host, the app's `cpu_affinity` (auto) splits the host's cores
    among its local ranks, as on a real machine; with one rank per host it binds nothing."""
    if mode == "shared":
        return None
    if mode != "split":
        raise ValueError(f"--host-cpus must be shared or split, got '{mode}'")
    return cpu_blocks(list(os.sched_getaffinity(0)), hosts)


def run_config(
    net: netem.Network,
    workload: str,
    bandwidth: str,
    scheduler: str,
    steps: int,
    args: argparse.Namespace,
    tmp: Path,
    tag: str,
) -> dict:
    """One run of one config on `net`: the app's numbers plus wire bytes and CPU seconds, per training step."""
    plan = net.plan
    ranks = plan.ranks
    run_dir = tmp / tag
    net.shape(netem.parse_rate(bandwidth))
    cmds = host_commands(
        net, scheduler, e2e_common.workload_args(workload), steps, run_dir, args, f"{net.plan.run_id}-{tag}"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # as torchrun --standalone sets for >1 proc
    before, t0 = net.counters(), time.time()
    res = netem.run_ranks(
        cmds,
        env,
        str(e2e_common.REPO),
        args.timeout,
        stop=net.kill_processes,
        marks=loop_marks(args.warmup_steps, steps),
        pids=net.pids,
        probe=net.counters,
    )
    wall, after = time.time() - t0, net.counters()
    if not (run_dir / "metrics.json").exists():
        detail = "\n".join(f"--- host {h} (exit {c}):\n{t}" for h, (c, t) in enumerate(zip(res.codes, res.tails)))
        raise RuntimeError(f"e2e: {workload} {bandwidth} R={ranks} {scheduler} failed:\n{detail}")
    rec = e2e_common.read_metrics(run_dir, "\n".join(res.tails), steps)
    whole = netem.wire_delta(before, after, plan.bridge_port)
    rec |= {
        "ranks": ranks,
        "ranks_per_host": plan.ranks_per_host,
        "hosts": plan.hosts,
        "steps": steps,
        "wire_bytes_per_step_raw": whole.total / steps,
        "cpu_s_per_step_raw": res.cpu_s / steps,
        "wall_s": wall,
        "exit_codes": res.codes,
    }
    rec |= loop_figures(res.marks, plan.bridge_port, steps - args.warmup_steps)
    loop_wire = rec.get("wire_bytes_per_step", float("nan"))
    print(
        f"[e2e-net] {workload:6s} {bandwidth:8s} R={ranks}{rph_label(plan.ranks_per_host)} {scheduler:16s} "
        f"{wall:5.1f}s  step {rec['step_ms']:7.1f} ms"
        f" (steady {rec.get('steady_step_ms', float('nan')):7.1f})"
        f"  app {rec['comm_bytes_per_step']:.3g} B/step  wire {loop_wire:.3g} B/step"
        f"  cpu {rec.get('cpu_s_per_step', float('nan')):.3f} s/step"
        + (f"  input wait {rec['input_wait_ms_median']:.2f} ms" if rec.get("input_wait_ms_median") is not None else ""),
        file=sys.stderr,
    )
    return rec


def loop_marks(warmup_steps: int, steps: int) -> dict[str, str]:
    """Output lines to snapshot at: "start" = step `warmup_steps` done (the app's start line if 0), "end" = the last."""
    start = STEP_MARK.format(step=warmup_steps) if warmup_steps else START_MARK
    return {"start": start, "end": STEP_MARK.format(step=steps)}


def rph_label(ranks_per_host: int) -> str:
    """ "" for one rank per host (every rank its own host), else " (H/host)"."""
    return "" if ranks_per_host == 1 else f" ({ranks_per_host}/host)"


def loop_figures(marks: dict[str, netem.Snapshot], bridge_port: tuple[str, ...], steps: int) -> dict:
    """Wire bytes (total, and per host link sent and received), CPU seconds and wall ms per step over the `steps`
    between the two marks."""
    if "start" not in marks or "end" not in marks:
        print(
            f"[e2e-net] warning: the training-loop marks were not both seen ({sorted(marks)}); only whole-run figures",
            file=sys.stderr,
        )
        return {}
    a, b = marks["start"], marks["end"]
    wire = netem.wire_delta(a.extra, b.extra, bridge_port)
    return {
        "wire_bytes_per_step": wire.total / steps,
        "wire_bytes_per_step_by_host": [x / steps for x in wire.sent],  # what each host sends over its link
        "wire_rx_bytes_per_step_by_host": [x / steps for x in wire.received],  # and what it receives
        "cpu_s_per_step": (b.cpu_s - a.cpu_s) / steps,
        "steady_step_ms": 1000.0 * (b.t - a.t) / steps,
        # the same CPU by kind of thread, all ranks: training threads, Herald's input threads, the rest (gloo, agents)
        **(
            {
                f"cpu_ms_per_step_{k}": 1000.0 * v / steps
                for k, v in netem.thread_cpu_delta(a.threads, b.threads).items()
            }
            if b.threads
            else {}
        ),
    }


def step_of(rec: dict) -> float:
    """The step time compared: steady state where measured, else the app's (warm-up included)."""
    return rec.get("steady_step_ms") or rec["step_ms"]


def summarize(records: list[dict]) -> dict:
    """Best (the run with the lowest step time) and median of every numeric field over a config's rounds; the
    per-host-link lists (PER_HOST) host by host."""
    best = min(records, key=step_of)
    median = {
        k: statistics.median(r[k] for r in records) for k in NUMERIC if all(r.get(k) is not None for r in records)
    }
    for k in PER_HOST:
        if all(r.get(k) for r in records):
            median[k] = [statistics.median(col) for col in zip(*(r[k] for r in records))]
    keep = (*NUMERIC, *PER_HOST)
    return {"best": {k: best[k] for k in keep if best.get(k) is not None}, "median": median, "rounds": records}


def rotated(configs: list, round_index: int, rounds: int) -> list:
    """Round k runs the configs starting k/rounds of the way in, so no config always runs first or last."""
    if not configs:
        return []
    k = (round_index * max(1, len(configs) // max(rounds, 1))) % len(configs)
    return configs[k:] + configs[:k]


LABELS = {
    "torchrec": "TorchRec row_wise",
    "torchrec_tw": "TorchRec table_wise",
    "torchrec_twrw": "TorchRec table_row_wise",
    "torchrec_planner": "TorchRec planner, any type",
    "static": "Herald data plane, static",
    "herald": "Herald",
    "herald_every_rank": "Herald, every rank plans",
    "herald_normal_priority": "Herald, input thread at normal priority",
    "herald_idle_priority": "Herald, input thread SCHED_IDLE",
}


def plot(result: dict, path: Path) -> None:
    """Steady step time (best of rounds) vs bandwidth: one line per scheduler (and R), one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    workloads = list(result["runs"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    bws = result["config"]["bandwidth"]
    for ax, w in zip(axes[0], workloads):
        for r in result["config"]["ranks"]:
            for s in result["config"]["schedulers"]:
                cells = [result["runs"][w].get(b, {}).get(str(r), {}).get(s) for b in bws]
                ys = [step_of(c["best"]) if c else float("nan") for c in cells]
                label = LABELS.get(s, s) + ("" if len(result["config"]["ranks"]) == 1 else f" R={r}")
                ax.plot(range(len(bws)), ys, marker="o", label=label, lw=2.5 if s.startswith("herald") else 1.2)
        ax.set_xticks(range(len(bws)), ["unshaped" if b == "none" else b for b in bws])
        ax.set_xlabel("link rate per host (tbf, both directions)")
        ax.set_ylabel("steady step time, ms (best of rounds)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_title(w)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    c = result["config"]
    cores = {"split": "each host on cores of its own", "shared": "the hosts sharing the machine's cores"}.get(
        c.get("host_cpus") or "shared", ""
    )
    rph = int(c.get("ranks_per_host") or 1)
    hosts = "one network namespace per rank" if rph == 1 else f"one network namespace per host of {rph} ranks"
    title = (
        f"herald_torchrec e2e: {hosts}, {cores}, gloo on CPU; {c.get('steps')} steps x "
        f"{c.get('batch')} per rank, best of {c.get('rounds')} round(s), after {c.get('warmup_steps')} warm-up"
    )
    fig.suptitle(textwrap.fill(title, width=int(70 * len(workloads))), fontsize=10)  # one panel: two lines
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def main_net(
    args: argparse.Namespace, ranks: list[int], scheds: list[str], save: Callable[[dict], None] | None = None
) -> dict:
    """Run the sweep on emulated networks (one per rank count, `args.ranks_per_host` ranks per host: 1 where the
    caller's options lack it); returns the result object.

    `save(result)` gets the results so far after every run, so a sweep cut short still leaves its rounds behind. A
    run that fails is reported and recorded under "failures"; the sweep goes on.
    """
    bandwidths = netem.parse_bandwidths(args.bandwidth)
    workloads = [w.strip() for w in (args.workload or "").split(",") if w.strip()] or [args.model]
    for w in workloads:
        e2e_common.workload_args(w)  # ValueError naming --workload
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if not 0 <= args.warmup_steps < args.steps:
        raise ValueError(f"--warmup-steps must be in [0, --steps), got {args.warmup_steps} with --steps {args.steps}")
    per_host = ranks_per_host(args)
    bad = [r for r in ranks if r % per_host]
    if per_host < 1 or bad:
        raise ValueError(f"--ranks-per-host must be >= 1 and divide every --ranks entry, got {per_host} for {bad}")
    netem.check_prerequisites()
    left = netem.leftover_namespaces()
    if left:
        print(
            f"[e2e-net] note: namespaces of another run, or left by a killed one, exist: {left} "
            "(`ip netns del` those that are stale)",
            file=sys.stderr,
        )
    configs = list(itertools.product(workloads, bandwidths, ranks, scheds))
    records: dict[tuple, list[dict]] = {c: [] for c in configs}
    failures: list[dict] = []
    # (--runs-dir: benchmarks/compare.py's options lack it)
    with (
        contextlib.ExitStack() as stack,
        e2e_common.runs_folder(getattr(args, "runs_dir", None), "herald-e2e-net-") as tmp,
    ):
        nets = {r: stack.enter_context(netem.Network(r, per_host)) for r in ranks}
        for r, net in nets.items():
            p = net.plan
            print(
                f"[e2e-net] R={r}: {p.hosts} host(s) of {p.ranks_per_host} rank(s), namespaces "
                f"{', '.join(p.host_ns)} on {p.addrs[0]}/{p.prefixlen}.., bridge in {p.bridge_ns}",
                file=sys.stderr,
            )
        for k in range(args.rounds):
            for c in rotated(configs, k, args.rounds):
                w, b, r, s = c
                try:
                    rec = run_config(nets[r], w, b, s, args.steps, args, Path(tmp), f"{k}-{w}-{b}-{r}-{s}")
                    records[c].append(rec | {"round": k})
                except RuntimeError as err:
                    print(f"[e2e-net] {err}", file=sys.stderr)
                    failures.append(
                        {
                            "round": k,
                            "workload": w,
                            "bandwidth": b,
                            "ranks": r,
                            "scheduler": s,
                            "error": str(err)[-4000:],
                        }
                    )
                if save is not None:
                    save(assemble(records, failures, args, bandwidths, workloads, ranks, scheds))
    return assemble(records, failures, args, bandwidths, workloads, ranks, scheds)


def ranks_per_host(args: argparse.Namespace) -> int:
    """`--ranks-per-host`; 1 (every rank its own host) for callers whose options lack it (benchmarks/compare.py)."""
    return int(getattr(args, "ranks_per_host", None) or 1)


def assemble(
    records: dict[tuple, list[dict]],
    failures: list[dict],
    args: argparse.Namespace,
    bandwidths: list[str],
    workloads: list[str],
    ranks: list[int],
    scheds: list[str],
) -> dict:
    """The result object from the runs so far (configs without a successful run are left out)."""
    runs: dict = {}
    for (w, b, r, s), recs in records.items():
        if recs:
            runs.setdefault(w, {}).setdefault(b, {}).setdefault(str(r), {})[s] = summarize(recs)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "plot")} | {
        "bandwidth": bandwidths,
        "workloads": workloads,
        "ranks": ranks,
        "ranks_per_host": ranks_per_host(args),
        "schedulers": scheds,
        "out": str(args.out) if args.out else None,
        "workload_overrides": {w: e2e_common.workload_args(w) for w in workloads},
        "thread_figures": "cpu_ms_per_step_{training,input,other}: the steady CPU by kind of thread, all ranks "
        "(training = each rank's main thread, input = Herald's input stage, other = gloo, torchrun)",
        "steady_figures": "steady_step_ms, wire/cpu *_per_step: steps warmup_steps+1..steps (log lines of both)",
        "wire_bytes": "sum over hosts of bytes sent onto their link (Ethernet/IP/TCP headers, DDP all-reduce "
        "included; a host's ranks talk over its loopback, not counted); *_by_host: per host link, sent and received",
        "cores": os.cpu_count(),
        "cpu_floor": "cpu_s_per_step / cores: the step time if every core were busy with this run's work; a steady "
        "step near it means the run is bound by the machine's CPU, not by waits or the link",
    }
    return {"config": config, "runs": runs, "ratios": ratios(runs), "breakeven": breakeven(runs), "failures": failures}


def round_ratios(per_s: dict, scheduler: str) -> list[float]:
    """`scheduler`'s step time over the best stock config's of the same round, round by round: the pairs ran minutes
    apart, so a machine whose speed drifts during a long run (10-15 % here) moves both sides of each ratio alike,
    where best against best can pair rounds far apart. Rounds without that scheduler or any stock run are left out;
    records without a round number (older result files) count in the order they ran."""
    by_round: dict[int, dict[str, float]] = {}
    for name, v in per_s.items():
        for i, rec in enumerate(v["rounds"]):
            by_round.setdefault(int(rec.get("round", i)), {})[name] = step_of(rec)
    out = []
    for k in sorted(by_round):
        got = by_round[k]
        stock = [t for n, t in got.items() if n.startswith("torchrec")]
        if scheduler in got and stock:
            out.append(got[scheduler] / min(stock))
    return out


def ratios(runs: dict) -> dict:
    """herald (and static) best step time over the best stock TorchRec config, per workload / bandwidth / R; and the
    same ratio round by round (`round_ratios`) with its median."""
    out: dict = {}
    for w, per_bw in runs.items():
        for b, per_r in per_bw.items():
            for r, per_s in per_r.items():
                stock = {s: step_of(v["best"]) for s, v in per_s.items() if s.startswith("torchrec")}
                if not stock:
                    continue
                best_stock = min(stock, key=stock.get)
                row = {"best_stock": best_stock, "best_stock_step_ms": stock[best_stock]}  # steady where measured
                for s, v in per_s.items():
                    if not s.startswith("torchrec"):
                        row[f"{s}_vs_best_stock_step_time"] = step_of(v["best"]) / stock[best_stock]
                        row[f"{s}_vs_best_stock_app_bytes"] = (
                            v["best"]["comm_bytes_per_step"] / per_s[best_stock]["best"]["comm_bytes_per_step"]
                        )
                        by_round = round_ratios(per_s, s)
                        row[f"{s}_vs_best_stock_by_round"] = by_round
                        row[f"{s}_vs_best_stock_median_round"] = statistics.median(by_round) if by_round else None
                out.setdefault(w, {}).setdefault(b, {})[r] = row
    return out


def breakeven(runs: dict, scheduler: str = "herald", tie: float = 0.02) -> dict:
    """Per workload and R: how `scheduler`'s best steady step compares with the best stock TorchRec config at each
    link, fastest first (unshaped counts as the fastest): "win" below 1 - `tie` of stock's, "loss" above 1 + `tie`,
    else "even" (within one run's noise at best). The verdict names the crossover where the links split into
    non-wins then wins; "mixed" where they do not (noise, or no single crossover)."""

    def rate(link: str) -> float:
        bits = netem.parse_rate(link)
        return float("inf") if bits is None else float(bits)

    out: dict = {}
    for w, per_bw in runs.items():
        by_r: dict = {}
        for b, per_r in per_bw.items():
            for r, per_s in per_r.items():
                stock = [step_of(v["best"]) for s, v in per_s.items() if s.startswith("torchrec")]
                if stock and scheduler in per_s:
                    x = step_of(per_s[scheduler]["best"]) / min(stock)
                    status = "win" if x < 1 - tie else "loss" if x > 1 + tie else "even"
                    by_r.setdefault(r, []).append((rate(b), b, status, x))
        for r, links in by_r.items():
            links.sort(key=lambda x: -x[0])
            won = [st == "win" for _, _, st, _ in links]
            k = won.index(True) if any(won) else len(won)  # first win, fastest first
            if not any(won):
                verdict = f"no win at any link tested (down to {links[-1][1]})"
            elif all(won[k:]) and k == 0:
                verdict = f"wins at every link tested (up to {links[0][1]})"
            elif all(won[k:]):
                verdict = f"wins at <= {links[k][1]}, not at >= {links[k - 1][1]}"
            else:
                verdict = "mixed"
            out.setdefault(w, {})[r] = {
                "links": {b: {"status": st, "ratio": x} for _, b, st, x in links},
                "verdict": verdict,
            }
    return out


def breakeven_lines(result: dict) -> str:
    """One line per workload and R: where herald starts to beat the best stock config."""
    found = breakeven(result["runs"])
    return "\n".join(
        f"herald vs best stock, {w}, R={r}: {v['verdict']}" for w, per_r in found.items() for r, v in per_r.items()
    )


def by_thread(rec: dict) -> str:
    """ "training / input / other" CPU ms per step (all ranks), or "-" where the run did not measure threads."""
    vals = [rec.get(f"cpu_ms_per_step_{k}") for k in netem.THREAD_KINDS]
    return " / ".join(f"{v:.1f}" for v in vals) if all(v is not None for v in vals) else "-"


def busiest_link(rec: dict) -> str:
    """ "sent / received" MB per step of the busiest host link (each direction's own busiest), or "-" where the run
    did not read them per host."""
    sent, received = rec.get("wire_bytes_per_step_by_host"), rec.get("wire_rx_bytes_per_step_by_host")
    return f"{max(sent) / 1e6:.2f} / {max(received) / 1e6:.2f}" if sent and received else "-"


def markdown_table(result: dict) -> str:
    """A README-ready table: per workload, bandwidth, R and scheduler the best step time, its ratio to the best stock
    config, the app's and the wire's bytes per step (all hosts, and the busiest host link), AUC and CPU seconds per
    step (median over rounds). R reads "8 (4/host)" where hosts hold several ranks."""
    cores = result["config"].get("cores") or os.cpu_count() or 1
    per_host = rph_label(int(result["config"].get("ranks_per_host") or 1))
    lines = [
        "| workload | link | R | scheduler | step ms (app, best) | steady step ms (best) | vs best stock (steady) | "
        "app MB/step | wire MB/step | busiest host link MB/step: sent / received | AUC | CPU s/step (median) | "
        f"CPU floor ms (CPU / {cores} cores) | CPU ms/step by thread: training / input / other (median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, per_bw in result["runs"].items():
        for b, per_r in per_bw.items():
            for r, per_s in per_r.items():
                stock = min((step_of(v["best"]) for s, v in per_s.items() if s.startswith("torchrec")), default=None)
                for s, v in per_s.items():
                    best, med = v["best"], v["median"]
                    ratio = f"{step_of(best) / stock:.2f}x" if stock else "-"
                    wire = best.get("wire_bytes_per_step", best["wire_bytes_per_step_raw"]) / 1e6
                    cpu = med.get("cpu_s_per_step", med.get("cpu_s_per_step_raw", float("nan")))
                    lines.append(
                        f"| {w} | {b} | {r}{per_host} | {s} | {best['step_ms']:.1f} | {step_of(best):.1f} | {ratio} | "
                        f"{best['comm_bytes_per_step'] / 1e6:.2f} | {wire:.2f} | {busiest_link(best)} | "
                        f"{best['auc']:.4f} | {cpu:.3f} | {1e3 * cpu / cores:.1f} | {by_thread(med)} |"
                    )
    return "\n".join(lines)


def pivot_table(result: dict) -> str:
    """The compact README table: steady step ms (best of rounds) per scheduler in columns, one row per workload,
    link and R, with herald's ratio to the best stock config, plus bytes per step (app / wire) per scheduler."""
    scheds = result["config"]["schedulers"]
    per_host = rph_label(int(result["config"].get("ranks_per_host") or 1))
    head = " | ".join(f"{s} ms" for s in scheds)
    lines = [
        f"| workload | link | R | {head} | herald / best stock: best of rounds (each round) | MB/step app (wire): "
        + ", ".join(scheds)
        + " |",
        "|---" * (5 + len(scheds)) + "|",
    ]
    for w, per_bw in result["runs"].items():
        for b, per_r in per_bw.items():
            for r, per_s in per_r.items():
                cells = [f"{step_of(per_s[s]['best']):.1f}" if s in per_s else "-" for s in scheds]
                stock = [step_of(v["best"]) for s, v in per_s.items() if s.startswith("torchrec")]
                ratio = "-"
                if stock and "herald" in per_s:
                    ratio = f"{step_of(per_s['herald']['best']) / min(stock):.2f}x"
                    each = round_ratios(per_s, "herald")
                    if len(each) > 1:
                        ratio += " (" + ", ".join(f"{x:.2f}" for x in each) + ")"
                mb = ", ".join(
                    f"{per_s[s]['best']['comm_bytes_per_step'] / 1e6:.2f} "
                    f"({per_s[s]['best'].get('wire_bytes_per_step', float('nan')) / 1e6:.2f})"
                    if s in per_s
                    else "-"
                    for s in scheds
                )
                lines.append(f"| {w} | {b} | {r}{per_host} | {' | '.join(cells)} | {ratio} | {mb} |")
    return "\n".join(lines)


def exit_unavailable(err: Exception) -> None:
    print(f"e2e: --bandwidth needs an emulated network, which this machine cannot build: {err}", file=sys.stderr)
    raise SystemExit(2)


def dumps(result: dict) -> str:
    return json.dumps(result, indent=2, default=str)
