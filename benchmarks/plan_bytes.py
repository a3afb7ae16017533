#!/usr/bin/env python
"""Bytes each rank receives of a step's plan: the whole plan against its own part, as the input stage sends them.

    python benchmarks/plan_bytes.py --workers 8,16,32,64,128,256 --steps 30 --warmup 10

A planner sends each rank it plans for only that rank's part of the plan (distributed/step/plan_part.py, encoded by
schedule/plan_wire.py as the wire sends it). This runs the scheduler over the synthetic default trace at each R (8
ranks per host, host relays on, as the data plane runs them) and prints, per R, over the steps after `--warmup`
(bytes: their mean; CPU times: their median): the whole plan's bytes, each rank's part (mean and largest; rank 0's
without its shared rows: its moves, samples and framing), the part the protocol model of
schedule/herald/hierarchy.py counts (`plan_part_bytes`), the ids each rank sends its planner, the CPU ms one host's
planner spends cutting and encoding its ranks' parts, and the CPU ms one rank (rank 1) spends decoding and laying
out its step from the whole plan against from its part (two RowStores of that rank kept in step, one by each). With
`--policy herald_hier` each host cuts from its own plan (`HostPlan`, as in training), and host 0's cut from the
whole plan is timed beside it, with the slowest host's time to assemble its plan and update its replica
(`host_plan_ms_max`, wall). One JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from herald_torchrec.data.synthetic import SyntheticCTR, SyntheticSpec  # noqa: E402
from herald_torchrec.distributed.step.host_relay import HostMap  # noqa: E402
from herald_torchrec.distributed.step.plan_part import plan_parts  # noqa: E402
from herald_torchrec.distributed.step.prepare import prepare_moves, prepare_shared  # noqa: E402
from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec  # noqa: E402
from herald_torchrec.schedule import GlobalBatch, make_policy  # noqa: E402
from herald_torchrec.schedule.herald.host_messages import ids_bytes, plan_part_bytes  # noqa: E402
from herald_torchrec.schedule.plan import SharedRows  # noqa: E402
from herald_torchrec.schedule.plan_wire import decode_plan, encode_plan  # noqa: E402


def measure(args: argparse.Namespace, R: int) -> dict:
    B, P, L = args.batch, args.ranks_per_host, args.lookahead
    gen = SyntheticCTR(SyntheticSpec(scale=args.scale, val_block=R * B))
    rows = list(gen.table_rows)
    kwargs = {"hosts": P} if args.policy == "herald_hier" else {}
    pol = make_policy(args.policy, rows, R, B, args.cache_ratio, L, **kwargs)
    hosts = HostMap(np.arange(R, dtype=np.int64) // P, relay=True)

    def batch(i: int) -> GlobalBatch:
        return GlobalBatch.from_dense(gen.train_samples(i * R * B, R * B).ids, rows, index=i)

    window = [batch(i) for i in range(L)]
    kinds = (
        "whole",
        "mean",
        "max",
        "moves",
        "model",
        "ids",
        "cut_ms",
        "whole_ms",
        "part_ms",
        "cut_whole_ms",
        "host_plan_ms",
    )
    out: dict[str, list[float]] = {k: [] for k in kinds}
    # one rank (the second of host 0) executing the whole plans, and the same rank executing its parts
    q = min(1, R - 1)
    stores = [RowStore([TableSpec(f"t{t}", n, 4) for t, n in enumerate(rows)], q, R, args.cache_ratio) for _ in "wp"]

    def execute(st: RowStore, wire: np.ndarray) -> float:
        """What rank q does with what it receives: decode it and lay out the step (CPU ms); then the moves land."""
        t = time.process_time()
        got = decode_plan(wire)
        ms = prepare_moves(got, st)
        prepare_shared(got, st, ms, hosts)
        spent = (time.process_time() - t) * 1e3
        st.land_moves(ms.table, ms.row, ms.dst, ms.send_idx, ms.recv_idx)  # as HeraldLookup._land (no values here)
        return spent

    for i in range(args.steps):
        window.append(batch(i + L))
        plan = pol.plan(window)
        window.pop(0)
        measured = i >= args.warmup
        sizes = np.zeros(R, dtype=np.int64)
        host_plans = getattr(pol, "last_host_plans", {})  # herald_hier: each host's own plan, as in training
        for h in range(0, R, P) if measured else [0]:  # as each host's planner cuts and encodes its ranks' parts
            t = time.process_time()
            parts = plan_parts(host_plans.get(h // P, plan), range(h, min(h + P, R)), hosts)
            wires = {r: encode_plan(part) for r, part in parts.items()}
            sizes[list(wires)] = [w.shape[0] for w in wires.values()]
            if h == 0:
                cut_ms = (time.process_time() - t) * 1e3
                first, mine, mine_part = parts[0], wires[q], parts[q]
        if host_plans and measured:  # the same host's parts cut from the whole plan: the same bytes, its time
            t = time.process_time()
            whole_parts = plan_parts(plan, range(min(P, R)), hosts)
            for part in whole_parts.values():  # encoded too, as the cut above
                encode_plan(part)
            out["cut_whole_ms"].append((time.process_time() - t) * 1e3)
            same = (encode_plan(dataclasses.replace(x, sched_seconds=0.0)) for x in (whole_parts[q], mine_part))
            if not np.array_equal(*same):
                raise RuntimeError(f"R={R} step {i}: rank {q}'s part differs cut from its host's plan")
            out["host_plan_ms"].append(float(np.max(pol.last_step.host_plan_seconds)) * 1e3)
        whole = encode_plan(plan)
        times = {"whole_ms": execute(stores[0], whole), "part_ms": execute(stores[1], mine)}
        if not measured:
            continue
        for k, v in times.items():
            out[k].append(v)
        out["cut_ms"].append(cut_ms)
        out["moves"].append(encode_plan(dataclasses.replace(first, shared=SharedRows())).shape[0])  # no shared row
        out["whole"].append(whole.shape[0])
        out["mean"].append(float(sizes.mean()))
        out["max"].append(float(sizes.max()))
        out["model"].append(float(plan_part_bytes(plan).mean()))
        out["ids"].append(float(ids_bytes(window[0], R, B).mean()))
        print(f"R={R} step {i}: whole {whole.shape[0]} B, part mean {sizes.mean():.0f} B", file=sys.stderr)
    # bytes averaged over the steps; times their median (one step's cut can take a garbage collection of 100+ ms)
    mid = {k: np.median if k.endswith("_ms") else np.mean for k in out}
    avg = {k: round(float(mid[k](v)), 2) if v else None for k, v in out.items()}
    hier = {"cut_cpu_ms_per_host_whole_plan": avg["cut_whole_ms"], "host_plan_ms_max": avg["host_plan_ms"]}
    return {
        **({} if avg["cut_whole_ms"] is None else hier),
        "whole_plan_bytes": avg["whole"],
        "part_bytes_mean": avg["mean"],
        "part_bytes_max": avg["max"],
        "part_without_shared_bytes": avg["moves"],
        "part_bytes_protocol_model": avg["model"],
        "ids_bytes_per_rank": avg["ids"],
        "cut_cpu_ms_per_host": avg["cut_ms"],
        "rank_cpu_ms_whole_plan": avg["whole_ms"],
        "rank_cpu_ms_part": avg["part_ms"],
        "steps_measured": len(out["whole"]),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="8,16,32,64", help="comma list of R")
    p.add_argument("--ranks-per-host", type=int, default=8)
    p.add_argument("--policy", choices=["herald", "herald_hier"], default="herald")
    p.add_argument("--batch", type=int, default=256, help="samples per rank (B)")
    p.add_argument("--scale", type=float, default=SyntheticSpec.scale, help="synthetic: table size scale")
    p.add_argument("--cache-ratio", type=float, default=0.1)
    p.add_argument("--lookahead", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args(argv)
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    try:
        workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        raise SystemExit(f"--workers: a comma list of integers, got {args.workers!r}") from None
    result = {"config": vars(args), "by_workers": {str(R): measure(args, R) for R in workers}}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
