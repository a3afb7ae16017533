#!/usr/bin/env python
"""How few rows an exact schedule can move on a trace: a co-location bound from a hypergraph partitioner.

    pip install kahypar            # this benchmark only (or: pip install -e '.[bound]')
    python benchmarks/colocation_bound.py --workers 8,16,32,64 --steps 4 --warmup 6 --json

Why: under BSP a row read by lambda ranks in a step costs at least 2 (lambda - 1) rows, whoever owns it: every reader
but one needs the step's value and must return its gradient (one owner at a time; a replica all-reduce costs
2 (R - 1) rows, never less). Migrations, evictions and syncs only add. So the sum of 2 (lambda_k - 1) over a step's
keys, at the sample assignment that makes it smallest, bounds every exact policy's rows from below. Making it
smallest with exactly B samples per rank is balanced hypergraph partitioning with the connectivity objective
(samples are vertices, every key read by two or more samples a net): KaHyPar (direct k-way, km1, no imbalance) is
the reference solver for it. Its partition is the best one found, not a proven optimum, so the figure is an estimate
of the bound (a true optimum could be a little lower), made offline at ~1.5 s (R=8) to ~30 s (R=64) per batch.

Per R it prints, per sample and averaged over the partitioned steps: the distinct keys; the extra (key, rank) pairs
(pairs minus keys) under static's contiguous split, herald's assignment (its default first pass, `stream`, and
`bids`: `herald_bids`) and the partitioner's; those policies' and het_bsp's rows as the simulator counts them;
`bound_rows_per_sample` = 2 x the partitioner's extra pairs, with its ratio to het_bsp and its growth from the first
R; and `herald_partitioned_rows_per_sample`: herald given the partitioner's co-location instead of LAIA's (each
block on the rank owning most of its keys; sync and eviction unchanged), what a co-location that good would be
worth. The policies plan the trace from its first batch (`--warmup` steps before the first partitioned one, so that
caches and owners have a history).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulate import Feed, add_trace_arguments, log, open_trace, parse_workers  # noqa: E402

from herald_torchrec.schedule import GlobalBatch, make_policy  # noqa: E402
from herald_torchrec.schedule.herald.planner import HeraldPolicy  # noqa: E402

# KaHyPar's direct k-way connectivity (km1) setting: its multilevel scheme with community-aware coarsening,
# recursive-bisection initial partitions and k-way FM refinement (the SEA'20 km1 preset without flow refinement)
KAHYPAR_KM1 = """mode=direct
objective=km1
seed=-1
cmaxnet=1000
vcycles=0
p-use-sparsifier=true
p-sparsifier-min-median-he-size=28
p-sparsifier-max-hyperedge-size=1200
p-sparsifier-max-cluster-size=10
p-sparsifier-min-cluster-size=2
p-sparsifier-num-hash-func=5
p-sparsifier-combined-num-hash-func=100
p-detect-communities=true
p-detect-communities-in-ip=true
p-reuse-communities=false
p-max-louvain-pass-iterations=100
p-min-eps-improvement=0.0001
p-louvain-edge-weight=hybrid
p-large-he-threshold=1000
p-smallest-maxnet-threshold=50000
p-maxnet-removal-factor=0.01
c-type=ml_style
c-s=1
c-t=160
c-rating-score=heavy_edge
c-rating-use-communities=true
c-rating-heavy_node_penalty=no_penalty
c-rating-acceptance-criterion=best_prefer_unmatched
c-fixed-vertex-acceptance-criterion=fixed_vertex_allowed
i-mode=recursive
i-technique=multi
i-c-type=ml_style
i-c-s=1
i-c-t=150
i-c-rating-score=heavy_edge
i-c-rating-use-communities=true
i-c-rating-heavy_node_penalty=no_penalty
i-c-rating-acceptance-criterion=best_prefer_unmatched
i-c-fixed-vertex-acceptance-criterion=fixed_vertex_allowed
i-algo=pool
i-runs=20
i-bp-algorithm=worst_fit
i-bp-heuristic-prepacking=false
i-bp-early-restart=true
i-bp-late-restart=true
i-r-type=twoway_fm
i-r-runs=-1
i-r-fm-stop=simple
i-r-fm-stop-i=50
r-type=kway_fm_km1
r-runs=-1
r-fm-stop=adaptive_opt
r-fm-stop-alpha=1
r-fm-stop-i=350
"""


def key_pairs(keys: np.ndarray, ranks: np.ndarray, num_ranks: int) -> int:
    """Distinct (key, rank) pairs of a step: `keys` int64 [N, T] global row ids, `ranks` the rank of each sample."""
    return int(np.unique(keys * num_ranks + ranks[:, None]).shape[0])


def partition(keys: np.ndarray, num_ranks: int, seed: int, config: str):
    """The samples of one global batch in `num_ranks` blocks of equal size, fewest extra (key, rank) pairs found."""
    import kahypar

    n = keys.shape[0]
    sample = np.repeat(np.arange(n, dtype=np.int64), keys.shape[1])
    pairs = np.unique(keys.ravel() * n + sample)  # (key, sample), each once, sorted by key
    key, sample = pairs // n, pairs % n
    _, start, count = np.unique(key, return_index=True, return_counts=True)
    nets = count >= 2  # a key one sample reads costs nothing wherever it goes
    first = start[nets]
    size = count[nets]
    members = np.concatenate([sample[s : s + c] for s, c in zip(first.tolist(), size.tolist())])
    bounds = np.concatenate([[0], np.cumsum(size)])
    graph = kahypar.Hypergraph(n, int(nets.sum()), bounds.tolist(), members.tolist(), num_ranks)
    ctx = kahypar.Context()
    ctx.loadINIconfiguration(config)
    ctx.setK(num_ranks)
    ctx.setEpsilon(0.0)
    ctx.setSeed(seed)
    ctx.suppressOutput(True)
    kahypar.partition(graph, ctx)
    ranks = np.array([graph.blockID(i) for i in range(n)], dtype=np.int64)
    if np.bincount(ranks, minlength=num_ranks).max() != n // num_ranks:
        raise SystemExit("colocation_bound: the partitioner returned unequal blocks")
    return ranks


def match_blocks(blocks: np.ndarray, keys: np.ndarray, owner: np.ndarray, num_ranks: int) -> np.ndarray:
    """The rank of every sample when block i of a partition goes to the rank owning most of its samples' keys
    (greedily, the largest (block, rank) count first): the partition's co-location with as little migration as a
    relabelling gives."""
    sample = np.repeat(blocks, keys.shape[1])
    count = np.bincount(sample * num_ranks + owner[keys.ravel()], minlength=num_ranks * num_ranks)
    count = count.reshape(num_ranks, num_ranks).astype(np.int64)
    rank_of = np.empty(num_ranks, dtype=np.int64)
    for _ in range(num_ranks):
        b, r = divmod(int(np.argmax(count)), num_ranks)
        rank_of[b] = r
        count[b, :] = count[:, r] = -1
    return rank_of[blocks]


class PartitionedHerald(HeraldPolicy):
    """herald with the partitioner's co-location in place of LAIA where one is given (`given`: the step's global
    keys [N, T] and blocks), its on-demand sync and eviction unchanged: what rows herald would move if its
    assignment co-located as well as an offline partitioner (an oracle: seconds per batch)."""

    given: tuple[np.ndarray, np.ndarray] | None = None

    def assign(self, b, bk, own_k):
        if self.given is None:
            return super().assign(b, bk, own_k)
        keys, blocks = self.given
        return match_blocks(blocks, keys, self.directory.owner, self.num_ranks)


def run(args, R: int, config: str) -> dict:
    B, L = args.batch, args.lookahead
    table_rows, trace = open_trace(args, R * B)
    offsets = np.concatenate([[0], np.cumsum(table_rows)[:-1]]).astype(np.int64)
    pols = {n: make_policy(n, table_rows, R, B, args.cache_ratio, L) for n in ("herald", "het_bsp")}
    pols["herald_bids"] = make_policy("herald", table_rows, R, B, args.cache_ratio, L, first_pass="bids")
    pols["herald_partitioned"] = oracle = PartitionedHerald(table_rows, R, B, args.cache_ratio, L)
    feed = Feed(trace, R * B)
    static = np.repeat(np.arange(R, dtype=np.int64), B)
    policies = ("herald", "herald_bids", "het_bsp", "herald_partitioned")
    names = ("keys", "static", "herald", "herald_bids", "partition", *(f"{n}_rows" for n in policies))
    acc: dict[str, list] = {k: [] for k in (*names, "seconds")}
    total = args.warmup + args.steps
    for step in range(total):
        ids = [feed.get(i) for i in range(step, step + L + 1)]
        if any(x is None for x in ids):
            log(f"[colocation_bound] R={R}: the trace ended after {step} steps")
            break
        if ids[0].ndim != 2:
            raise SystemExit("colocation_bound: needs one id per sample and table (a dense [N, T] batch)")
        keys = ids[0].astype(np.int64) + offsets[None, :]
        oracle.given = None
        if step >= args.warmup:
            t0 = time.perf_counter()
            best = partition(keys, R, args.seed + step, config)
            acc["seconds"].append(time.perf_counter() - t0)
            oracle.given = (keys, best)
        plans = {  # each policy its own batch objects (they cache per-batch state)
            n: p.plan([GlobalBatch.from_dense(x, table_rows, index=step + j) for j, x in enumerate(ids)])
            for n, p in pols.items()
        }
        feed.release(step + 1)
        if step < args.warmup:
            continue
        acc["keys"].append(np.unique(keys).shape[0])
        acc["static"].append(key_pairs(keys, static, R))
        for n in ("herald", "herald_bids"):
            acc[n].append(key_pairs(keys, plans[n].assignment(), R))
        acc["partition"].append(key_pairs(keys, best, R))
        for n in policies:
            acc[f"{n}_rows"].append(plans[n].transmitted_rows())
        log(f"[colocation_bound] R={R} step {step + 1}/{total}: partitioned in {acc['seconds'][-1]:.1f} s")
    if not acc["keys"]:
        raise SystemExit(
            f"colocation_bound: R={R}: no step partitioned (a trace of fewer than --warmup + L + 1 batches)"
        )
    mean = {k: float(np.mean(v)) / (R * B) for k, v in acc.items() if k != "seconds"}
    extra = {k: mean[k] - mean["keys"] for k in ("static", "herald_bids", "herald", "partition")}
    bound = 2 * extra["partition"]
    return {
        "steps": len(acc["keys"]),
        "keys_per_sample": round(mean["keys"], 3),
        "extra_pairs_per_sample": {k: round(v, 3) for k, v in extra.items()},
        "herald_rows_per_sample": round(mean["herald_rows"], 3),
        "het_bsp_rows_per_sample": round(mean["het_bsp_rows"], 3),
        "bound_rows_per_sample": round(bound, 3),
        "bound_over_het_bsp": round(bound / mean["het_bsp_rows"], 3),
        "herald_over_het_bsp": round(mean["herald_rows"] / mean["het_bsp_rows"], 3),
        "herald_bids_rows_per_sample": round(mean["herald_bids_rows"], 3),
        "herald_partitioned_rows_per_sample": round(mean["herald_partitioned_rows"], 3),
        "partition_seconds_median": round(float(np.median(acc["seconds"])), 2),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_trace_arguments(p, seed_help="synthetic: seed (and the partitioner's, plus the step)")
    p.add_argument("--workers", default="8,64", help="worker counts, a comma list")
    p.add_argument("--batch", type=int, default=256, help="samples per worker (B)")
    p.add_argument("--cache-ratio", type=float, default=0.1)
    p.add_argument("--lookahead", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="steps partitioned (each one offline: seconds to minutes)")
    p.add_argument("--warmup", type=int, default=6, help="steps planned before the first partitioned one")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("colocation_bound: --steps must be >= 1 and --warmup >= 0")
    try:
        import kahypar  # noqa: F401
    except ImportError:
        raise SystemExit("colocation_bound: needs the KaHyPar partitioner: pip install kahypar (this benchmark only)")
    with tempfile.NamedTemporaryFile("w", suffix=".ini", delete=False) as f:
        f.write(KAHYPAR_KM1)
    try:
        out = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "workers": {}}
        for R in parse_workers(args.workers):
            out["workers"][str(R)] = run(args, R, f.name)
    finally:
        os.unlink(f.name)
    first = next(iter(out["workers"].values()))
    for res in out["workers"].values():
        res["bound_growth"] = round(res["bound_rows_per_sample"] / first["bound_rows_per_sample"], 3)
        res["herald_growth"] = round(res["herald_rows_per_sample"] / first["herald_rows_per_sample"], 3)
    if not args.json:
        for R, res in out["workers"].items():
            log(
                f"R={R}: herald {res['herald_rows_per_sample']} rows/sample, bound {res['bound_rows_per_sample']} "
                f"({res['bound_over_het_bsp']}x het_bsp, growth {res['bound_growth']}x)"
            )
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
