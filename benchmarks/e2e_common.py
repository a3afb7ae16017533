"""What benchmarks/e2e.py (loopback runs) and benchmarks/e2e_net.py (emulated networks) both use: the schedulers'
and workloads' Hydra overrides, one run's overrides, and the summary read from a finished run. Kept apart so that
each of the two scripts imports it instead of the other."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
PHASE_TIMES_ENV, PHASE_TIMES_TAG = "HERALD_PHASE_TIMES", "[herald-phases]"  # as herald_torchrec.distributed.comm
SCHEDULER_ARGS = {
    "torchrec": ["scheduler=torchrec", "sharding.types=[row_wise]"],
    "torchrec_tw": ["scheduler=torchrec", "sharding.types=[table_wise]"],
    # TorchRec's sharding across machines: each table on one machine, row-wise over its ranks (LOCAL_WORLD_SIZE)
    "torchrec_twrw": ["scheduler=torchrec", "sharding.types=[table_row_wise]"],
    "static": ["scheduler=static"],
    "torchrec_planner": ["scheduler=torchrec", "sharding.types=null"],  # the planner with every type, DP included
    "herald": ["scheduler=herald"],
    "herald_hier": ["scheduler=herald_hier"],  # planned per machine (schedule/herald/hierarchy.py)
    "herald_bids": ["scheduler=herald", "scheduler.first_pass=bids"],  # LAIA's bidding first pass (no stream)
    "herald_numpy": ["scheduler=herald", "scheduler.native=off"],  # Herald without its compiled kernels (numpy only)
    "herald_every_rank": ["scheduler=herald", "scheduler.plan_on=every_rank"],  # each rank plans (no plan bytes)
    # shared rows sent to and from every reader directly, not once per host (host_relay.py; A/B on shared hosts)
    "herald_no_relay": ["scheduler=herald", "scheduler.host_relay=false"],
    # Herald replicating the rows every host reads (all-reduced), beside the relays
    "herald_replicate": ["scheduler=herald", "scheduler.replicate=true"],
    # the input stage 16 batches ahead instead of the default 2 (measured: no gain, the stage cannot run ahead on a
    # saturated core at either depth)
    "herald_prefetch16": ["scheduler=herald", "scheduler.prefetch=16"],
    # the input stage's thread at the training thread's CPU priority (the default lowers it: input_priority=low)
    "herald_normal_priority": ["scheduler=herald", "scheduler.input_priority=normal"],
    "herald_idle_priority": ["scheduler=herald", "scheduler.input_priority=idle"],
    # Herald with the tables its adaptive policy would not schedule left to TorchRec (ROW_WISE / TABLE_WISE /
    # COLUMN_WISE)
    "herald_auto": ["scheduler=herald", "scheduler.unscheduled=auto"],
    # the systems Herald answers, trained in Herald's engine (benchmarks/compare.py compares them all)
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
    raise ValueError(
        f"--workload entries must be in {sorted(WORKLOADS)} or a model of conf/model {models}, got '{name}'"
    )


@contextlib.contextmanager
def runs_folder(keep: Path | None, prefix: str) -> Iterator[str]:
    """Where the runs' run_dirs go: `keep` (--runs-dir; created, kept afterwards), else a temporary folder."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield tmp
    else:
        keep.mkdir(parents=True, exist_ok=True)
        yield str(keep)


def train_overrides(
    scheduler: str,
    args: argparse.Namespace,
    run_dir: Path,
    model_args: list[str],
    steps: int,
    ranks: int,
    log_interval: int = 1_000_000,
) -> list[str]:
    """Hydra overrides of one run; every run names its scheduler explicitly (the app's default is herald). The
    synthetic log's held-out blocks are one global batch (`data.val_block`), so every rank count trains and evaluates
    the samples its earlier figures were measured on (two held-out global batches)."""
    return [
        *SCHEDULER_ARGS[scheduler],
        f"trainer.steps={steps}",
        f"trainer.batch_size={args.batch}",
        "trainer.eval_interval=0",
        f"trainer.log_interval={log_interval}",
        "data.val_batches=2",
        f"data.val_block={ranks * args.batch}",
        f"data.locality={args.locality}",
        f"scheduler.cache_ratio={args.cache_ratio}" if not scheduler.startswith("torchrec") else "seed=0",
        *model_args,
        f"run_dir={run_dir}",
        *args.extra,
    ]


def phase_records(output: str) -> Iterator[tuple[str, dict]]:
    """(rank, phase times) of every `[herald-phases] rank=N {...}` record in a run's output (one per rank, printed at
    exit by herald modules), also where records of ranks sharing a stream ran into one line; a record cut short is
    skipped with a note on stderr, not the whole run."""
    decoder = json.JSONDecoder()
    for line in output.splitlines():
        for record in line.split(PHASE_TIMES_TAG)[1:]:
            rank_field, _, payload = record.strip().partition(" ")
            try:
                times, _ = decoder.raw_decode(payload)
            except ValueError:
                print(f"[e2e] note: a phase-times record of {rank_field} is cut short; left out", file=sys.stderr)
                continue
            yield rank_field.removeprefix("rank="), times


def read_metrics(run_dir: Path, output: str, steps: int) -> dict:
    """The summary of one finished run from its metrics.json (and Herald's phase times from its output)."""
    m = json.loads((run_dir / "metrics.json").read_text())
    phases = {}
    for rank, times in phase_records(output):
        phases[rank] = {
            k: {"ms_per_step": v["ms"] / steps, "cpu_ms_per_step": v.get("cpu_ms", 0.0) / steps, "calls": v["calls"]}
            for k, v in times.items()
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
