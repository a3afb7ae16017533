#!/usr/bin/env python
"""A projection of one BSP training step on a GPU cluster (R = 8..256 GPUs, 8 per host): a cost model, not a
measurement.

    python benchmarks/projection.py --out benchmarks/results/projection_wdl64_r8-256_2026-11-27.json \\
        --plot benchmarks/results/projection_wdl64_r8-256_2026-11-27.png
    python benchmarks/projection.py --workload dcn --markdown          # the README table only

Why: the measured runs stop at 8 ranks on a 2-core machine and one GPU; the question users ask is the step time
on a cluster. The model is one BSP step

    step = compute(B per GPU) + host work (Herald only) + communication,
    communication = max over links of bytes / bandwidth + a latency per collective,

with every input measured here (compute per sample on an H100, Herald's planner time and its per-step host work,
the rows each policy sends per step at each R from the simulator), derived from a stated formula (stock TorchRec's
TABLE_WISE and ROW_WISE collectives, the dense all-reduce, Herald's ids and sample exchange) or a stated hardware
figure (NVLink per GPU, 100 and 25 Gb/s per host, a latency per collective). Every figure it prints is labelled
"projection". It is validated by predicting this machine's own emulated runs (compute and host work from each run's
CPU, the link at the tc rate) and printing predicted against measured step ms.

Prints one JSON object (also written to --out): label, assumptions (each constant with its source), inputs,
projection[link][R][policy] (step ms and its parts), anchors (the published shares of the step in embedding
communication, beside the model's), validation (per run: predicted and measured step ms and the error), and
table_markdown (R x policy, step ms at 100 / 25 Gb/s).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

LABEL = "projection"
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SIM_SWEEP = RESULTS / "sim_sweep_r8-256_2026-11-28.json"
# herald_hier's planner per host, each replayed alone in its own process (benchmarks/hier_alone.py, one file per R)
HIER_ALONE = str(RESULTS / "hier_alone_r*_2026-11-29.json")
# herald's planner cutting its host's 8 parts from the whole plan, per R (benchmarks/plan_bytes.py --policy herald)
PLAN_CUTS = RESULTS / "plan_bytes_herald_r8-256_2026-11-28.json"
# the simulator's rows for the emulated runs' settings (R / ranks per host), merged: R=2 and 8, then R=16 and 32
SIM_VALIDATION = (RESULTS / "sim_validation_r2-8_2026-11-27.json", RESULTS / "sim_validation_r16-32_2026-11-30.json")
GPU_RUNS = RESULTS / "gpu_h100_2026-11-26.json"
E2E_DEFAULT = [
    str(RESULTS / "e2e_link_sweep_r2_split_cpu2_2026-11-26.json"),
    str(RESULTS / "e2e_200mbit_wdl_r2_split_cpu2_2026-11-26.json"),
    str(RESULTS / "e2e_unshaped_r2_split_cpu2_2026-11-26_run1.json"),
    str(RESULTS / "e2e_r8_*hosts_cpu2_*.json"),  # the 8-rank runs on hosts of several ranks
    str(RESULTS / "e2e_r16_*hosts_cpu2_*.json"),  # 16 and 32 ranks on hosts of 8, herald_hier beside herald
    str(RESULTS / "e2e_r32_*hosts_cpu2_*.json"),
]

# Runs whose stock TABLE_WISE spanned machines before the app gave TorchRec's planner its machines (RESULTS.md,
# "Stock TorchRec's placement across machines"): it balanced tables over ranks, not machines, so those runs measured
# another placement than the model's; the validation leaves their stock TABLE_WISE out (the rest of each stays).
STOCK_PLANNED_AS_ONE_MACHINE = frozenset(
    {
        "e2e_r8_2x4hosts_cpu2_2026-11-27.json",
        "e2e_r8_2x4hosts_hier_balance_cpu2_2026-11-28.json",
        "e2e_r8_2x4hosts_hostplan_cpu2_2026-11-27.json",
        "e2e_r8_2x4hosts_parts_cpu2_2026-11-27.json",
        "e2e_r8_2x4hosts_stream_cpu2_2026-11-28.json",
        "e2e_r8_4x2hosts_cpu2_2026-11-27.json",
        "e2e_r16_2x8hosts_cpu2_2026-11-30.json",
        "e2e_r32_4x8hosts_cpu2_2026-11-30.json",
    }
)
PLACED_BY_TOPOLOGY = ("torchrec_tw", "torchrec_planner")  # stock runs whose placement depends on the machines

FLOAT_BYTES = 4  # FP32 rows, pooled embeddings, gradients and dense parameters
HERALD_ID_BYTES = 4  # Herald's managed ids on the wire: int32 (distributed/train_pipeline/input_layout.py)
KJT_VALUE_BYTES, KJT_LENGTH_BYTES = 8, 4  # TorchRec's input dist: int64 ids, int32 lengths (one per bag)
UNSHAPED_BPS = 13e9  # veth / loopback between namespaces, unshaped: ~13 Gbit/s measured here (docs/REFERENCE.md)
# Herald's input stage besides the planner, per step on the planning rank (RESULTS.md, "End to end, unshaped links":
# the user's iterator 1.1 ms, its round 0.9 ms; measured at R=2 on the 2-core machine). What the planner does with
# its plan next comes per R: where parts travel (several hosts) their cut and encoding, on a second core while the
# next plan is made (the input stage's `cut_thread`, on by default), else the whole plan's encoding on the planner's
# thread (WHOLE_PLAN_ENCODE_MS, measured at R=2).
INPUT_BOOKKEEPING_MS = 1.1 + 0.9
WHOLE_PLAN_ENCODE_MS = 0.2
# The input stage's own collectives across hosts per step, on its thread (ahead of the step, not on its path; the
# bookkeeping above was measured on one machine): herald's round is one all-to-all in steady state (its header rides
# on the round before: distributed/train_pipeline/input_stage.py); herald_hier's planners also meet PLANNER_EXCHANGES
# times per plan (schedule/herald/hierarchy.py `plan_hosts`: demand, owners, reads, arrivals, cancels, parts), each
# exchange its sizes then its bytes (planner_transport.py).
INPUT_ROUND_COLLECTIVES = 1
PLANNER_EXCHANGES = 6
STOCK_POLICIES = ("table_wise", "table_row_wise", "row_wise")
SIM_POLICIES = ("herald", "herald_hier", "static", "het_bsp", "p2res")
HERALDS = ("herald", "herald_hier")  # Herald's two planners: one per host for the whole batch, or per host
POLICIES = SIM_POLICIES + STOCK_POLICIES


@dataclass(frozen=True)
class Workload:
    """A model's shape as the cost model sees it: F features with one table each, rows of `dim` floats, `bag` ids
    per bag, `dense_params` non-embedding parameters (all-reduced every step)."""

    name: str
    features: int
    dim: int
    bag: int
    num_dense: int
    dense_params: int
    source: str

    @property
    def sample_bytes(self) -> int:
        """One sample in Herald's sample exchange: dense floats, the label, its managed ids (int32)."""
        return FLOAT_BYTES * self.num_dense + FLOAT_BYTES + HERALD_ID_BYTES * self.features * self.bag


# Dense parameters counted with sum(p.numel()) over the non-embedding parameters of herald_torchrec.models built for
# 26 features and 13 dense inputs (W&D: embedding_dim=64, deep_layers=[64,32]; DCN: the defaults).
WORKLOADS = {
    "wdl64": Workload("wdl64", 26, 64, 1, 13, 107_855, "WideAndDeep(dim 64, deep [64,32]), synthetic Criteo-like"),
    "dcn": Workload("dcn", 26, 16, 1, 13, 705_697, "DCN(dim 16, 3 cross layers, deep [256,128]), synthetic"),
}


@dataclass(frozen=True)
class Links:
    """Stated hardware figures: per host one NIC of `host_gbit` Gb/s each direction; per GPU `gpu_gbyte` GB/s each
    direction inside a host (NVLink); a latency per collective inside one host and across hosts."""

    name: str
    host_gbit: float
    gpu_gbyte: float = 300.0
    gpus_per_host: int = 8
    latency_intra_ms: float = 0.02
    latency_inter_ms: float = 0.05

    @property
    def host_bytes_per_s(self) -> float:
        return self.host_gbit * 1e9 / 8


CLUSTER_LINKS = (Links("100gbit", 100.0), Links("25gbit", 25.0))


@dataclass(frozen=True)
class Traffic:
    """Bytes one step puts on the busiest link of each kind, per direction, summed over the step's phases; `parts`
    splits the host-link bytes by what they carry."""

    host_bytes: float
    gpu_bytes: float
    collectives: int
    parts: dict = field(default_factory=dict)

    def __add__(self, other: "Traffic") -> "Traffic":
        parts = dict(self.parts)
        for k, v in other.parts.items():
            parts[k] = parts.get(k, 0.0) + v
        return Traffic(
            self.host_bytes + other.host_bytes,
            self.gpu_bytes + other.gpu_bytes,
            self.collectives + other.collectives,
            parts,
        )


def num_hosts(ranks: int, ranks_per_host: int) -> int:
    if ranks < 1 or ranks_per_host < 1:
        raise ValueError(f"ranks and ranks_per_host must be >= 1, got {ranks} and {ranks_per_host}")
    return math.ceil(ranks / ranks_per_host)


def table_wise(ranks: int, ranks_per_host: int, batch: int, wl: Workload) -> Traffic:
    """Stock TABLE_WISE: every table on one rank, tables spread evenly over hosts (and ranks) by count. Forward:
    each sample's ids of feature f go to f's owner (an int64 per id, an int32 length per bag) and one pooled
    embedding (dim floats) per sample and feature comes back; backward: the same pooled gradients go to the owner.
    A host with f_max tables sends f_max x (samples on other hosts) pooled rows; a host with f_min receives
    (its samples) x (F - f_min); a phase takes the larger. Four collectives (lengths, ids, pooled, gradients)."""
    hosts = num_hosts(ranks, ranks_per_host)
    h_pooled, h_ids = _tables_spread(hosts, ranks_per_host, ranks, batch, wl)
    g_pooled, g_ids = _tables_spread(ranks, 1, ranks, batch, wl)
    return Traffic(h_pooled + h_ids, g_pooled + g_ids, 4, {"embedding": h_pooled, "ids": h_ids})


def _tables_spread(units: int, per_unit: int, ranks: int, batch: int, wl: Workload) -> tuple[float, float]:
    """Pooled bytes (forward and backward) and ids bytes on the busiest link of `units` units (hosts or ranks) of
    `per_unit` ranks each holding whole tables, spread evenly by count: a unit with f_max tables sends f_max x
    (samples elsewhere) pooled rows, one with f_min receives (its samples) x (F - f_min); a phase takes the larger."""
    if units == 1:
        return 0.0, 0.0
    row = wl.dim * FLOAT_BYTES
    bag = wl.bag * KJT_VALUE_BYTES + KJT_LENGTH_BYTES
    f_max, f_min = math.ceil(wl.features / units), wl.features // units
    local, remote = per_unit * batch, (ranks - per_unit) * batch
    pooled = 2 * max(f_max * remote * row, local * (wl.features - f_min) * row)
    ids = max(local * (wl.features - f_min) * bag, f_max * remote * bag)
    return pooled, ids


def table_row_wise(ranks: int, ranks_per_host: int, batch: int, wl: Workload) -> Traffic:
    """Stock TABLE_ROW_WISE, TorchRec's sharding across machines: every table on one host (tables spread evenly
    over hosts by count), its rows over that host's P ranks. Between hosts it moves what TABLE_WISE moves (the
    same pooled rows and ids per host link), leaving from all P ranks of a host (1/P each). Inside a host, forward,
    every rank's partial pooled sums of its host's f tables for the whole global batch are reduce-scattered over the
    host's ranks, (P-1)/P x R x B x f x dim floats on each GPU's link, and gathered back the same way backward;
    each rank gets 1/P of the ids of its host's tables. Six collectives (lengths, ids; forward reduce-scatter and
    all-to-all; backward all-to-all and all-gather)."""
    hosts = num_hosts(ranks, ranks_per_host)
    p = min(ranks_per_host, ranks)
    f_host = math.ceil(wl.features / hosts)
    h_pooled, h_ids = _tables_spread(hosts, ranks_per_host, ranks, batch, wl)
    intra = 2 * (p - 1) / p * ranks * batch * f_host * wl.dim * FLOAT_BYTES
    ids = ranks * batch * f_host * (wl.bag * KJT_VALUE_BYTES + KJT_LENGTH_BYTES) / p
    g = intra + ids + (h_pooled + h_ids) / p
    return Traffic(h_pooled + h_ids, g, 6, {"embedding": h_pooled, "ids": h_ids})


# Stock shardings that place every table whole on one rank (TABLE_WISE) or one host (TABLE_ROW_WISE)
TABLE_PLACED = {"table_wise": table_wise, "table_row_wise": table_row_wise}


def row_wise(ranks: int, ranks_per_host: int, batch: int, wl: Workload, forward: str = "reduce_scatter") -> Traffic:
    """Stock ROW_WISE: every table's rows spread over all R ranks. Forward, every shard sends a partial pooled sum
    for every sample of the global batch and feature: a reduce-scatter of N = R x B x F x dim floats, a ring moving
    (R-1)/R x N over each ring link (NCCL); gloo runs it as an all-reduce, 2 (R-1)/R x N (`forward="allreduce"`,
    what the wire counters of the emulated runs show). Backward: an all-gather of the gradients, (R-1)/R x N. The
    ring visits each host's ranks in turn, so each host's NIC and each GPU's link carry one ring link. Ids: each id
    to its row's shard, (R - ranks on this host) / R of them leave the host. Four collectives."""
    if forward not in ("reduce_scatter", "allreduce"):
        raise ValueError(f"row_wise: forward must be 'reduce_scatter' or 'allreduce', got {forward!r}")
    hosts = num_hosts(ranks, ranks_per_host)
    n = ranks * batch * wl.features * wl.dim * FLOAT_BYTES
    share = (ranks - 1) / ranks
    pooled = (2 * share if forward == "allreduce" else share) * n + share * n
    bag = wl.bag * KJT_VALUE_BYTES + KJT_LENGTH_BYTES
    h_ids = ranks_per_host * batch * wl.features * bag * (ranks - ranks_per_host) / ranks if hosts > 1 else 0.0
    g_ids = batch * wl.features * bag * share
    h_pooled = pooled if hosts > 1 else 0.0
    return Traffic(h_pooled + h_ids, pooled + g_ids, 4, {"embedding": h_pooled, "ids": h_ids})


def dense_allreduce(ranks: int, ranks_per_host: int, wl: Workload) -> Traffic:
    """The dense parameters' gradient all-reduce (DDP), a ring over every rank: 2 (R-1)/R x P floats on each ring
    link; one ring link leaves each host. Every policy pays it."""
    if ranks == 1:
        return Traffic(0.0, 0.0, 0, {"dense": 0.0})
    b = 2 * (ranks - 1) / ranks * wl.dense_params * FLOAT_BYTES
    h = b if num_hosts(ranks, ranks_per_host) > 1 else 0.0
    return Traffic(h, b, 1, {"dense": h})


def simulated_rows(
    ranks: int,
    ranks_per_host: int,
    batch: int,
    wl: Workload,
    cross_per_sample: float,
    intra_per_sample: float,
    busiest_over_mean: float,
    collectives: int,
) -> Traffic:
    """A scheduled policy's rows from the simulator: cross_per_sample x R x B rows of dim floats cross hosts per step
    (values and gradients, both directions), each leaving one host and entering another, spread over the H hosts
    (the mean host: the simulator reports balance per rank, not per host); a GPU's link carries its share of every
    transfer, times the busiest rank's load over the mean."""
    hosts = num_hosts(ranks, ranks_per_host)
    row = wl.dim * FLOAT_BYTES
    h = cross_per_sample * ranks * batch * row / hosts if hosts > 1 else 0.0
    g = (cross_per_sample + intra_per_sample) * batch * row * busiest_over_mean
    return Traffic(h, g, collectives, {"embedding": h})


def hier_input_stage(ranks: int, ranks_per_host: int, messages_per_rank: float, parts_per_host: float) -> Traffic:
    """herald_hier's input stage across hosts: each rank's ids go to its own host's planner only, samples stay on their
    host, and the planners exchange their messages (the busiest host's bytes per rank, from the simulator) and the
    routed plan parts (bytes a host's planner receives). No collective on the step's path."""
    if num_hosts(ranks, ranks_per_host) == 1:
        return Traffic(0.0, 0.0, 0, {"planners": 0.0})
    b = messages_per_rank * ranks_per_host + parts_per_host
    return Traffic(b, 0.0, 0, {"planners": b})


def herald_input_stage(ranks: int, ranks_per_host: int, batch: int, wl: Workload) -> Traffic:
    """Herald's input stage across hosts (it runs ahead of the step, but its bytes share the link): each rank sends
    its managed ids (int32) to the planner of every other host, B x F x bag x 4 bytes each (the issue's 213 KB per
    rank at R=64); a sample lands on a rank of another host with probability (H-1)/H (LAIA places by cache, not
    origin) and carries its dense floats, label and ids. The plan stays inside each host. No collective on the
    step's path (the stage runs in its own thread)."""
    hosts = num_hosts(ranks, ranks_per_host)
    if hosts == 1:
        return Traffic(0.0, 0.0, 0, {"ids": 0.0, "samples": 0.0})
    ids = ranks_per_host * batch * wl.features * wl.bag * HERALD_ID_BYTES * (hosts - 1)
    samples = ranks_per_host * batch * (hosts - 1) / hosts * wl.sample_bytes
    return Traffic(ids + samples, 0.0, 0, {"ids": ids, "samples": samples})


def comm_ms(t: Traffic, links: Links, hosts: int) -> float:
    """max over links of bytes / bandwidth, plus a latency per collective (the inter-host one once there are hosts)."""
    host = t.host_bytes / links.host_bytes_per_s if hosts > 1 else 0.0
    gpu = t.gpu_bytes / (links.gpu_gbyte * 1e9)
    lat = links.latency_inter_ms if hosts > 1 else links.latency_intra_ms
    return max(host, gpu) * 1e3 + t.collectives * lat


@dataclass(frozen=True)
class StepEstimate:
    """One projected step: compute + host work + communication (+ the wait for a late plan). `input_stage_ms` is the
    planner's and the input stage's time per step on one host core, running beside the step; when it is longer the
    step waits for it (`stall_ms`, `planner_bound`). `embedding_comm_ms` leaves the dense all-reduce out."""

    compute_ms: float
    host_ms: float
    comm_ms: float
    embedding_comm_ms: float
    input_stage_ms: float
    stall_ms: float
    step_ms: float
    planner_bound: bool
    embedding_comm_share: float


def step_estimate(
    compute_ms: float, host_ms: float, comm: float, embedding_comm: float, input_stage_ms: float = 0.0
) -> StepEstimate:
    busy = compute_ms + host_ms + comm
    stall = max(0.0, input_stage_ms - busy)
    total = busy + stall
    return StepEstimate(
        compute_ms,
        host_ms,
        comm,
        embedding_comm,
        input_stage_ms,
        stall,
        total,
        stall > 0,
        embedding_comm / total if total > 0 else 0.0,
    )


# ---------------------------------------------------------------- inputs


def load_json(path: str | Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot read {path}: {e}") from None


def gpu_inputs(workload: str, path: Path = GPU_RUNS) -> dict:
    """Compute per step at B=256 on one H100: stock TorchRec's one-rank steady step (no communication at one rank);
    Herald's extra host work per step: its one-rank steady step minus stock's (clamped at 0 when Herald was faster)."""
    runs = load_json(path)["runs"]
    stock, herald = runs.get(f"{workload}_torchrec_uvm"), runs.get(f"{workload}_herald")
    if stock is None or herald is None:
        raise SystemExit(f"error: {path} has no one-rank GPU runs for workload {workload!r}")
    extra = herald["steady_step_ms"] - stock["steady_step_ms"]
    return {
        "batch": stock["global_batch"],
        "compute_ms": stock["steady_step_ms"],
        "herald_extra_ms_measured": extra,
        "herald_host_ms": max(0.0, extra),
        "source": f"{path.name}: runs {workload}_torchrec_uvm and {workload}_herald, steady_step_ms (one H100)",
    }


def sim_inputs(path: Path = SIM_SWEEP, hier_alone: str = HIER_ALONE, cuts: Path = PLAN_CUTS) -> dict:
    """Per R and simulated policy: rows crossing hosts / inside hosts per sample (direct and host-aggregated), the
    busiest rank over the mean and the planner's CPU ms per step (`planner_cpu_ms`) with the cut of its host's parts
    (`cut_ms`, on the cut thread): herald's plan of the global batch (the simulator) and its cut from it
    (`plan_cut_ms`); herald_hier's slowest replayed host alone in its own process as in training, with the wire's
    encoding and decoding of its messages, and the cut of its ranks' parts from its own plan (`hier_alone_ms`; with
    one host herald_hier is herald). With one host the whole plan travels (no cut): WHOLE_PLAN_ENCODE_MS on the
    planner's thread."""
    d = load_json(path)
    rph = d["config"].get("ranks_per_host")
    if rph != 8:
        raise SystemExit(f"error: {path} was not simulated with 8 ranks per host")
    alone = hier_alone_ms(hier_alone, d["config"])
    cut = plan_cut_ms(cuts, d["config"])
    out = {}
    for r, v in d["sweep"].items():
        R = int(r)
        out[R] = {p: _sim_row(x) for p, x in v["policies"].items()}
        several = R > rph
        if several and R not in cut:
            raise SystemExit(f"error: no herald cut for R={r} in {cuts}")
        for p in HERALDS:
            if p in out[R]:
                out[R][p]["planner_cpu_ms"] += 0.0 if several else WHOLE_PLAN_ENCODE_MS
                out[R][p]["cut_ms"] = cut[R] if several else 0.0
        hier = out[R].get("herald_hier")
        if hier is not None and several:  # several hosts (one: plain herald)
            if R not in alone:
                raise SystemExit(f"error: no hier_alone run for R={r} in {hier_alone}")
            hier["planner_cpu_ms"], hier["cut_ms"] = alone[R]
    return {"batch": d["config"]["batch"], "by_r": out, "source": path.name}


def plan_cut_ms(path: Path, sweep_config: dict) -> dict[int, float]:
    """R -> herald's planner's CPU ms cutting and encoding its host's parts from the whole plan, from
    benchmarks/plan_bytes.py's JSON run with the sweep's tables, batch, cache, lookahead and ranks per host."""
    d = load_json(path)
    cfg = d["config"]
    keys = ("scale", "batch", "cache_ratio", "lookahead", "ranks_per_host")
    if cfg.get("policy") != "herald" or any(cfg[k] != sweep_config[k] for k in keys):
        raise SystemExit(f"error: {path} is not plan_bytes.py --policy herald with the sweep's settings ({keys})")
    return {int(r): float(v["cut_cpu_ms_per_host"]) for r, v in d["by_workers"].items()}


def hier_alone_ms(pattern: str, sweep_config: dict) -> dict[int, tuple[float, float]]:
    """R -> (the slowest replayed host's planning ms per step alone: `alone_ms` + `codec_raw_ms`; its `cut_ms`), from
    benchmarks/hier_alone.py's JSON files run with the sweep's tables, batch, cache and lookahead."""
    out = {}
    for f in sorted(glob.glob(pattern)):
        c = load_json(f)
        cfg = c["config"]
        same = all(cfg[k] == sweep_config[k] for k in ("scale", "batch", "cache_ratio", "lookahead", "ranks_per_host"))
        same = same and cfg.get("refine", "auto") == "auto"  # the policy's own rounds, as the sweep ran it
        if same:
            slowest = max(c["hosts"], key=lambda h: h["alone_ms"] + h["codec_raw_ms"])
            out[int(cfg["workers"])] = (slowest["alone_ms"] + slowest["codec_raw_ms"], slowest["cut_ms"])
    return out


def planner_thread_ms(s: dict, wire_ms: float = 0.0) -> float:
    """The input stage's time per step on a planning host: its planner's plan, the stage's other work and its
    messages across hosts (`wire_ms`, `input_wire_ms`), or the cut of its ranks' parts on the cut thread where that is
    longer (measured overlapped: hier_alone.py's `planner_thread_cut_thread_ms`)."""
    return max(s["planner_cpu_ms"] + INPUT_BOOKKEEPING_MS + wire_ms, s.get("cut_ms", 0.0))


def input_wire_ms(policy: str, ranks: int, rph: int, batch: int, wl: Workload, sim: dict, links: Links) -> float:
    """What a Herald's input stage waits for on the wire per step across hosts: the bytes it sends besides the rows
    (`planner_inputs`: herald's ids and samples, herald_hier's planners' messages and parts) at the host link's rate,
    and an inter-host latency per collective: the round's, plus herald_hier's planner exchanges (sizes, then bytes).
    The planners' phases wait for each other's messages; the time a slower planner makes them wait is not in it."""
    if num_hosts(ranks, rph) == 1:
        return 0.0
    collectives = INPUT_ROUND_COLLECTIVES + (2 * PLANNER_EXCHANGES if policy == "herald_hier" else 0)
    sent = planner_inputs(policy, ranks, rph, batch, wl, sim).host_bytes
    return sent / links.host_bytes_per_s * 1e3 + collectives * links.latency_inter_ms


def _sim_row(x: dict) -> dict:
    proto = x.get("protocol_bytes_per_rank", {})
    return {
        "cross_direct": x["cross_host_rows_per_sample"],
        "intra_direct": x["intra_host_rows_per_sample"],
        "cross_aggregated": x["cross_host_rows_per_sample_host_aggregated"],
        "intra_aggregated": x["intra_host_rows_per_sample_host_aggregated"],
        "busiest_over_mean": x["busiest_rank_over_mean"],
        "planner_cpu_ms": x["sched_cpu_ms_median"],
        "planner_messages_per_rank": proto.get("between_hosts_busiest_host", 0.0),
        "plan_parts_per_host": x.get("parts_bytes_per_host", {}).get("routed", 0.0),
    }


# How each simulated policy's rows travel as its system delivers them, and its collectives per step: Herald's data
# plane (herald, static: one all-to-all of values and moves + a relay inside hosts, and back for gradients) relays
# shared rows once per host; HET-BSP's pulls and pushes and P²RES's shared rows + flat all-reduce go rank to rank.
DELIVERY = {
    "herald": ("aggregated", 4),
    "herald_hier": ("aggregated", 4),
    "static": ("aggregated", 4),
    "het_bsp": ("direct", 2),
    "p2res": ("direct", 3),
}


def policy_traffic(policy: str, ranks: int, rph: int, batch: int, wl: Workload, sim: dict | None) -> Traffic:
    if policy in TABLE_PLACED:
        t = TABLE_PLACED[policy](ranks, rph, batch, wl)
    elif policy == "row_wise":
        t = row_wise(ranks, rph, batch, wl)
    else:
        mode, coll = DELIVERY[policy]
        s = sim[policy]
        t = simulated_rows(ranks, rph, batch, wl, s[f"cross_{mode}"], s[f"intra_{mode}"], s["busiest_over_mean"], coll)
        t = t + planner_inputs(policy, ranks, rph, batch, wl, s)
    return t


def planner_inputs(policy: str, ranks: int, rph: int, batch: int, wl: Workload, sim: dict) -> Traffic:
    """What a Herald's input stage sends across hosts besides the rows (`sim`: the policy's simulated run): herald
    every rank's ids to every planner and the samples, herald_hier its planners' messages and routed plan parts (none
    where the run has one host and no such figures); nothing for the other policies."""
    if policy == "herald":
        return herald_input_stage(ranks, rph, batch, wl)
    if policy == "herald_hier":
        messages, parts = sim.get("planner_messages_per_rank", 0.0), sim.get("plan_parts_per_host", 0.0)
        return hier_input_stage(ranks, rph, messages, parts)
    return Traffic(0.0, 0.0, 0)


def project(workload: str, links: tuple[Links, ...] = CLUSTER_LINKS) -> dict:
    wl = WORKLOADS[workload]
    gpu = gpu_inputs(workload)
    sim = sim_inputs()
    batch = sim["batch"]
    if batch != gpu["batch"]:
        raise SystemExit(f"error: the simulator ran B={batch} per rank, the GPU runs B={gpu['batch']}")
    out: dict = {}
    for ln in links:
        rows: dict = {}
        for r in sorted(sim["by_r"]):
            rph = ln.gpus_per_host
            hosts = num_hosts(r, rph)
            dense = dense_allreduce(r, rph, wl)
            per: dict = {}
            for p in POLICIES:
                s = sim["by_r"][r] if p in SIM_POLICIES else None
                if s is not None and p not in s:
                    continue
                emb = policy_traffic(p, r, rph, batch, wl, s)
                total = emb + dense
                c = comm_ms(total, ln, hosts)
                ce = comm_ms(emb, ln, hosts)
                herald = p in HERALDS
                wire = input_wire_ms(p, r, rph, batch, wl, s[p], ln) if herald else 0.0
                input_ms = planner_thread_ms(s[p], wire) if herald else 0.0
                est = step_estimate(gpu["compute_ms"], gpu["herald_host_ms"] if herald else 0.0, c, ce, input_ms)
                per[p] = asdict(est) | {
                    "input_wire_ms": wire,
                    "host_link_mb": total.host_bytes / 1e6,
                    "gpu_link_mb": total.gpu_bytes / 1e6,
                    "host_link_mb_by_part": {k: v / 1e6 for k, v in total.parts.items()},
                }
            rows[str(r)] = {"hosts": hosts, "policies": per}
        out[ln.name] = rows
    return out


# ---------------------------------------------------------------- anchors


def anchors(proj: dict) -> dict:
    """The model's share of the step in embedding communication for stock (8 and 128 GPUs) and the growth of stock's
    embedding communication from one host to two, beside the published figures (docs/REFERENCE.md)."""
    out: dict = {
        "published": {
            "embedding_comm_share_8_gpus": 0.25,
            "embedding_comm_share_128_gpus": 0.51,
            "source_share": "NVIDIA EMBark write-up (docs/REFERENCE.md, peer systems)",
            "all_to_all_ms_1_to_2_nodes": [28, 246],
            "source_all_to_all": "facebookresearch/dlrm#356: 2 nodes x 8 A100, 100 Gb/s",
        },
        "model": {},
    }
    for ln, rows in proj.items():
        m = {}
        for p in STOCK_POLICIES:
            s8, s16, s128 = (rows[str(r)]["policies"][p] for r in (8, 16, 128))
            m[p] = {
                "embedding_comm_share_8_gpus": round(s8["embedding_comm_share"], 4),
                "embedding_comm_share_128_gpus": round(s128["embedding_comm_share"], 4),
                "embedding_comm_ms_8_to_16": [round(s8["embedding_comm_ms"], 3), round(s16["embedding_comm_ms"], 3)],
                "growth_8_to_16": round(s16["embedding_comm_ms"] / s8["embedding_comm_ms"], 2),
            }
        out["model"][ln] = m
    return out


# ---------------------------------------------------------------- validation


E2E_POLICY = {
    "torchrec_tw": "table_wise",
    "torchrec_twrw": "table_row_wise",
    "torchrec": "row_wise",
    "herald": "herald",
    "herald_no_relay": "herald",
    "herald_hier": "herald_hier",
}


def sim_validation(paths: Sequence[Path] = SIM_VALIDATION) -> dict:
    """Per "R/ranks per host", each policy's simulated rows (`_sim_row`), merged over the files."""
    runs: dict = {}
    for path in paths:
        runs.update(load_json(path)["runs"])
    return runs


def collect_validation(sim_paths: list[str]) -> dict:
    """A validation file's body from simulate.py JSON files of one R each (`--json`): per "R/ranks per host" each
    policy's rows as the projection reads them, and the command that reproduces each file."""
    runs, commands = {}, []
    for f in sim_paths:
        d = load_json(f)
        cfg = d["config"]
        if len(cfg["workers"]) != 1:
            raise SystemExit(f"error: {f} is a sweep; give one simulate.py run per R")
        runs[f"{cfg['workers'][0]}/{cfg['ranks_per_host']}"] = {p: _sim_row(x) for p, x in d["policies"].items()}
        commands.append(
            f"OMP_NUM_THREADS=1 python benchmarks/simulate.py --workers {cfg['workers'][0]} --ranks-per-host "
            f"{cfg['ranks_per_host']} --steps {cfg['steps']} --warmup {cfg['warmup']} --policies "
            f"{','.join(cfg['policies'])} --dim {cfg['dim']} --hier-clock {cfg['hier_clock']} --json"
        )
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    return {
        "label": "simulator runs for the projection's validation (benchmarks/projection.py)",
        "date": datetime.date.today().isoformat(),
        "commit": git.stdout.strip() or None,
        "machine": f"CPU, {os.cpu_count()} cores",
        "commands": commands,
        "runs": runs,
        "note": "rows per sample as the data plane delivers them (direct = host_relay off, aggregated = host relays);"
        " herald_host: the host-aware LAIA training runs on several machines use; herald_hier: planned per host, with"
        " its planners' messages per rank (the busiest host's) and the plan parts routed to a host; rows do not"
        " depend on --dim",
    }


def validation_sim(by_policy: dict, policy: str, hosts: int) -> dict | None:
    """The simulated run an emulated scheduler is checked against: herald across machines plans host-aware
    (`herald_host`); herald_hier on one machine is herald."""
    if hosts == 1:
        return by_policy.get("herald")
    if policy == "herald":
        return by_policy.get("herald_host", by_policy.get("herald"))
    return by_policy.get(policy)


def rate_bps(bw: str) -> float:
    sys.path.insert(0, str(HERE))
    from netem import parse_rate

    r = parse_rate(bw)
    return UNSHAPED_BPS if r is None else float(r)


def validation_point(
    wl: Workload, policy: str, ranks: int, rph: int, batch: int, sim: dict | None, relay: bool
) -> Traffic:
    """The bytes one emulated run puts on its busiest host link per step: the same formulas as the projection, with
    gloo's all-reduce for ROW_WISE's forward and the run's own relay setting for Herald."""
    if policy == "row_wise":
        t = row_wise(ranks, rph, batch, wl, forward="allreduce")
    elif policy in TABLE_PLACED:
        t = TABLE_PLACED[policy](ranks, rph, batch, wl)
    else:
        mode = "aggregated" if relay else "direct"
        t = simulated_rows(ranks, rph, batch, wl, sim[f"cross_{mode}"], sim[f"intra_{mode}"], 1.0, 4 if relay else 2)
        t = t + planner_inputs(policy, ranks, rph, batch, wl, sim)
    return t + dense_allreduce(ranks, rph, wl)


def validate(paths: list[str], sim_paths: Sequence[Path] = SIM_VALIDATION) -> dict:
    """Predict each emulated run's steady step: its own CPU per step / cores (compute + host work as measured there)
    + its busiest host link's bytes at the tc rate (no latency term: it is inside the measured CPU). `lower_ms` is the
    same with communication fully overlapped (max instead of sum): the measured step should lie between."""
    sims = sim_validation(sim_paths)
    files = sorted({f for p in paths for f in (glob.glob(p) if any(c in p for c in "*?[") else [p])})
    rows = []
    for f in files:
        d = load_json(f)
        cfg = d.get("config", {})
        if "runs" not in d or "cores" not in cfg:
            continue
        rph_cfg = cfg.get("ranks_per_host") or 1
        batch = cfg.get("batch", 256)
        for wname, by_bw in d["runs"].items():
            if wname not in WORKLOADS:
                continue
            wl = WORKLOADS[wname]
            for bw, by_r in by_bw.items():
                bps = rate_bps(bw)
                for r_text, by_s in by_r.items():
                    ranks = int(r_text)
                    rph = min(rph_cfg, ranks)
                    hosts = num_hosts(ranks, rph)
                    by_policy = sims.get(f"{ranks}/{rph}", {})
                    for sched, res in by_s.items():
                        if sched in PLACED_BY_TOPOLOGY and hosts > 1 and Path(f).name in STOCK_PLANNED_AS_ONE_MACHINE:
                            continue
                        policy = E2E_POLICY.get(sched)
                        sim = validation_sim(by_policy, policy, hosts) if policy in HERALDS else None
                        if policy is None or (policy in HERALDS and sim is None):
                            continue
                        m = res["median"]
                        t = validation_point(wl, policy, ranks, rph, batch, sim, sched != "herald_no_relay")
                        cpu = m["cpu_s_per_step"] * 1e3 / cfg["cores"]
                        link = t.host_bytes * 8 / bps * 1e3
                        pred, measured = cpu + link, m["steady_step_ms"]
                        wire = m.get("wire_bytes_per_step_by_host")
                        wire_host = max(wire) if wire else m["wire_bytes_per_step"] / hosts
                        rows.append(
                            {
                                "file": _shown(f),
                                "workload": wname,
                                "link": bw,
                                "ranks": ranks,
                                "hosts": hosts,
                                "scheduler": sched,
                                "cpu_floor_ms": round(cpu, 2),
                                "link_ms": round(link, 2),
                                "predicted_ms": round(pred, 2),
                                "lower_ms": round(max(cpu, link), 2),
                                "measured_ms": round(measured, 2),
                                "error": round(pred / measured - 1, 4),
                                "predicted_host_link_mb": round(t.host_bytes / 1e6, 4),
                                "measured_wire_mb_busiest_host": round(wire_host / 1e6, 4),
                            }
                        )
    errs = [abs(x["error"]) for x in rows]
    shaped = [abs(x["error"]) for x in rows if x["link"] != "none"]
    summary = {
        "runs": len(rows),
        "median_abs_error": _median(errs),
        "max_abs_error": max(errs) if errs else None,
        "median_abs_error_shaped": _median(shaped),
        "inside_bounds": sum(1 for x in rows if x["lower_ms"] <= x["measured_ms"] <= x["predicted_ms"]),
    }
    return {"rows": rows, "summary": summary}


def _shown(path: str) -> str:
    """A results file relative to the repository, any other by its full path."""
    p = Path(path).resolve()
    return str(p.relative_to(HERE.parent)) if p.is_relative_to(HERE.parent) else str(p)


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    n = len(s)
    return round(s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2, 4)


# ---------------------------------------------------------------- output


NAMES = {
    "herald": "Herald",
    "herald_hier": "Herald per host",
    "static": "static",
    "het_bsp": "HET-BSP",
    "p2res": "P²RES",
    "table_wise": "TorchRec TW",
    "table_row_wise": "TorchRec TWRW",
    "row_wise": "TorchRec RW",
}


def markdown(proj: dict, workload: str) -> str:
    fast, slow = CLUSTER_LINKS[0].name, CLUSTER_LINKS[1].name
    head = (
        "| R (hosts) | " + " | ".join(NAMES[p] for p in POLICIES) + " | planner + input stage, ms: Herald · per host |"
    )
    lines = [
        f"Projection ({workload}, B=256 per GPU, 8 GPUs per host): step ms at 100 / 25 Gb/s per host; "
        "* = the step waits for Herald's planner.",
        "",
        head,
        "|" + "---|" * (len(POLICIES) + 2),
    ]
    for r in proj[fast]:
        a, b = proj[fast][r], proj[slow][r]
        cells = []
        for p in POLICIES:
            x, y = a["policies"].get(p), b["policies"].get(p)
            if x is None:
                cells.append("–")
                continue
            star = "*" if x["planner_bound"] or y["planner_bound"] else ""
            cells.append(f"{x['step_ms']:.1f} / {y['step_ms']:.1f}{star}")
        planner = " · ".join(f"{a['policies'][p]['input_stage_ms']:.1f}" for p in HERALDS if p in a["policies"])
        lines.append(f"| {r} ({a['hosts']}) | " + " | ".join(cells) + f" | {planner} |")
    return "\n".join(lines)


def validation_markdown(v: dict) -> str:
    """One line per emulated run: predicted (fully overlapped lower bound) against measured steady step ms."""
    lines = [
        "| run | workload | link | R (hosts) | scheduler | CPU floor | link | predicted (lower) | measured | error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in v["rows"]:
        lines.append(
            f"| {Path(x['file']).name} | {x['workload']} | {x['link']} | {x['ranks']} ({x['hosts']}) | "
            f"{x['scheduler']} | "
            f"{x['cpu_floor_ms']:.1f} | {x['link_ms']:.1f} | {x['predicted_ms']:.1f} ({x['lower_ms']:.1f}) | "
            f"{x['measured_ms']:.1f} | {100 * x['error']:+.0f} % |"
        )
    return "\n".join(lines)


def plot(proj: dict, workload: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(proj), figsize=(11, 4.2), squeeze=False, sharey=True)
    for ax, (ln, rows) in zip(axes[0], proj.items()):
        rs = [int(r) for r in rows]
        for p in POLICIES:
            ys = [rows[str(r)]["policies"].get(p, {}).get("step_ms") for r in rs]
            ax.plot(rs, ys, marker="o", label=NAMES[p], lw=2.2 if p in HERALDS else 1.2)
            if p in HERALDS:
                kept_up = [rows[str(r)]["policies"][p]["step_ms"] - rows[str(r)]["policies"][p]["stall_ms"] for r in rs]
                ax.plot(
                    rs, kept_up, ls="--", color=ax.lines[-1].get_color(), label=f"{NAMES[p]} if its planner kept up"
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(rs, [str(r) for r in rs])
        ax.set_xlabel("GPUs (8 per host)")
        ax.set_title(f"{ln} per host")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("step ms (projection)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Projection, not a measurement: BSP step time of {workload} at B=256 per GPU (cost model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def assumptions(workload: str) -> dict:
    wl = WORKLOADS[workload]
    gpu = gpu_inputs(workload)
    return {
        "workload": asdict(wl) | {"sample_bytes": wl.sample_bytes},
        "compute": gpu,
        "links": [asdict(x) for x in CLUSTER_LINKS],
        "links_source": "stated figures, not measured: NVLink 300 GB/s per GPU each direction, one NIC per host, "
        "20 us / 50 us per collective inside / across hosts",
        "herald_input_stage_ms": "herald: the simulator's planner CPU ms per global batch at each R "
        f"({SIM_SWEEP.name}, one thread, this 2-core machine) + the cut and encoding of its host's 8 parts from the "
        f"whole plan ({PLAN_CUTS.name}); herald_hier: its slowest replayed host's planner alone in its own process "
        "with the messages' raw wire form, and the cut of its 8 parts from its own plan (benchmarks/hier_alone.py, "
        "CPU ms, scale 0.01 as the sweep; herald's from one host); the plan + "
        f"{INPUT_BOOKKEEPING_MS:.1f} ms bookkeeping (RESULTS.md, R=2) on one host core, the cut on a second (the "
        "input stage's cut thread): the longer of the two; with one host the whole plan travels "
        f"(+{WHOLE_PLAN_ENCODE_MS} ms encoding on the planner's core, R=2); across hosts + its wire time "
        f"(input_wire_ms: its bytes besides the rows at the host link's rate, {INPUT_ROUND_COLLECTIVES} collective "
        f"for the round, herald_hier + 2 x {PLANNER_EXCHANGES} for its planners' exchanges, at the inter-host "
        "latency); the step waits when it is longer",
        "herald_hier_input_stage": "ids to the rank's own host's planner only, samples stay on their host; the "
        "planners' messages (the busiest host's) and the routed plan parts cross hosts (the sweep's protocol bytes)",
        "herald_host_ms": "on the step's path: Herald's one-rank H100 step minus stock's, clamped at 0",
        "rows": f"{SIM_SWEEP.name}: rows per sample crossing hosts / inside hosts; herald and static host-aggregated "
        "(the data plane's relays), het_bsp and p2res direct (their own collectives); the mean host, not the busiest",
        "stock": "TABLE_WISE, TABLE_ROW_WISE and ROW_WISE from their collectives (formulas in table_wise() / "
        "table_row_wise() / row_wise()); ROW_WISE's "
        "forward as NCCL's ring reduce-scatter",
        "dense": "every policy: a ring all-reduce of the dense parameters, 2 (R-1)/R x P floats per ring link",
        "not_modelled": "overlap of communication with compute (the sum is an upper bound), lookup and optimizer "
        "cost growing with TABLE_WISE's imbalance (or TABLE_ROW_WISE's: hosts without a table from 32 hosts), the "
        "busiest host under LAIA, TorchRec's GRID (2D) sharding, "
        "faster host CPUs than this machine's",
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="wdl64", choices=sorted(WORKLOADS))
    p.add_argument("--e2e", nargs="*", default=E2E_DEFAULT, help="e2e.py JSON files (globs) to validate against")
    p.add_argument("--out", help="write the JSON here too")
    p.add_argument("--plot", help="PNG: projected step ms against GPUs per policy, one panel per link")
    p.add_argument("--markdown", action="store_true", help="print only the README table")
    p.add_argument(
        "--collect-validation",
        nargs="+",
        metavar=("OUT", "SIM_JSON"),
        help="write OUT (the simulator's rows for validation) from simulate.py --json runs, one R each; then stop",
    )
    args = p.parse_args(argv)
    if args.collect_validation:
        out, *sims = args.collect_validation
        if not sims:
            p.error("--collect-validation needs OUT and at least one simulate.py JSON file")
        body = collect_validation(sims)
        Path(out).write_text(json.dumps(body, indent=1) + "\n")
        print(json.dumps(body, indent=1))
        return body
    proj = project(args.workload)
    result = {
        "label": LABEL,
        "note": "a projection from a cost model calibrated on this machine's measurements, not a measured result",
        "workload": args.workload,
        "assumptions": assumptions(args.workload),
        "projection": proj,
        "anchors": anchors(proj),
        "validation": validate(args.e2e),
        "table_markdown": markdown(proj, args.workload),
    }
    result["validation_markdown"] = validation_markdown(result["validation"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(proj, args.workload, args.plot)
    print(result["table_markdown"] if args.markdown else json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
