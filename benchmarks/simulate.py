#!/usr/bin/env python
"""Trace simulator: run scheduling policies over the same chronological trace and compare their traffic.

    python benchmarks/simulate.py --data synthetic --workers 8 --batch 256 --cache-ratio 0.1 --steps 200 \\
        --policies static,het_bsp,herald_greedy,herald --lookahead 4 --dim 512 --json
    python benchmarks/simulate.py --workers 8,16,32,64 --steps 200 --policies herald --json --plot rows.png
    python benchmarks/simulate.py --workers 8 --steps 50 --policies het_bsp,het,fae,p2res,herald --staleness 2 \
        [--hot-budget ROWS] [--profile-fraction 0.05] [--fae-window 8] --json    # the comparison systems
    python benchmarks/simulate.py --workers 64 --ranks-per-host 8 --policies herald,herald_rep --json  # replicas
    python benchmarks/simulate.py --workers 16,64 --ranks-per-host 8 --policies herald,herald_hier --json  # per host
    python benchmarks/simulate.py --merge r8.json r16.json r32.json --json --plot sweep.png  # runs made one R each

Prints one JSON object: {"config": {...}, "policies": {NAME: {...}}} for one worker count, or
{"config": {...}, "sweep": {R: {"policies": {...}, "ratios": {...}}}} for a comma list. Per policy:
rows_per_step (transmitted rows, both directions), bytes_per_step (dim floats per value / gradient, dim +
state_width floats per row move), by_kind (rows per step by kind), hit_rate (reads served locally / distinct
(key, reader) pairs), stale_reads (from the independent checker, must be 0), sched_ms_median / sched_ms_p90
(wall time of policy.plan per global batch, this process; sched_cpu_ms_median: its CPU time, which other
processes on a shared machine disturb less; sched_cpu_ms_last_quarter: the median over the last quarter of the steps,
where a cost that grows as the caches fill shows), rows_per_sample, plan_digest (a hash of every plan in its wire
encoding: two runs with the same digest made the same plans, so a scheduler change that should not alter the plans
can be checked with its speed in one command; herald_hier also host_plans_digest, of every host's own plan as
training makes it, where plan_digest hashes their union). With ranks r..r+H-1 on one host (--ranks-per-host H,
schedule/traffic.py): cross_host_rows_per_sample and intra_host_rows_per_sample (each row to and from every reader
directly: the data plane with host_relay off), the same with the suffix _host_aggregated (each shared value crossing
once per reading host, gradients summed inside a host before they cross: the data plane's host relays, its
default), cross_host_by_kind[_host_aggregated] (crossing rows per step) and
cross_host_by_kind_table_class[_host_aggregated] (per kind / table size: tiny < 1,000 rows, mid < 20,000, large),
busiest_rank_over_mean (rows the busiest rank sends + receives over the mean rank's, median over the steps).
herald and herald_hier (planned per host, schedule/herald/hierarchy.py) also get plan_ms_per_host and
protocol_bytes_per_rank (`ProtocolTotals`: herald's for today's protocol, every rank's ids to every host's planner
and the whole plan back; --hier-clock cpu: herald_hier's per-host times in CPU time). peak_rss_mib: the whole process's
peak resident memory (every policy, the trace and the checker included). Progress goes to stderr.
Every policy gets its own batch objects (their caches are part of its scheduling time) built from the same ids.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import itertools
import json
import os
import resource
import sys
import time
from collections import deque
from pathlib import Path
from typing import Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from herald_torchrec.data.synthetic import SyntheticCTR, SyntheticSpec  # noqa: E402
from herald_torchrec.schedule import POLICIES, GlobalBatch, PlanChecker, make_policy  # noqa: E402
from herald_torchrec.schedule.herald import hierarchy  # noqa: E402
from herald_torchrec.schedule.herald.host_messages import DEFAULT_PLANNER_WIRE, ids_bytes  # noqa: E402
from herald_torchrec.schedule.herald.planner import FIRST_PASSES, INTRA_HOST_COST  # noqa: E402
from herald_torchrec.schedule.message_wire import WIRE_FORMS  # noqa: E402
from herald_torchrec.schedule.plan_wire import encode_plan, encode_plan_tree  # noqa: E402
from herald_torchrec.schedule.traffic import host_traffic  # noqa: E402

LOADERS = {
    "criteo": ("herald_torchrec.data.criteo", "CriteoSource"),
    "avazu": ("herald_torchrec.data.avazu", "AvazuSource"),
    "movielens": ("herald_torchrec.data.movielens", "MovieLensSource"),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_workers(text: str) -> list[int]:
    try:
        ws = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--workers: expected an integer or a comma list of integers, got {text!r}")
    if not ws or min(ws) < 1:
        raise SystemExit(f"--workers: need worker counts >= 1, got {text!r}")
    return ws


def open_trace(args, global_batch: int) -> tuple[list[int], Iterator[np.ndarray]]:
    """(table_rows, iterator of int64 id arrays [global_batch, T]) in log order."""
    if args.data == "synthetic":
        # held-out blocks of one global batch each: every R replays the trace its figures were measured on (a
        # trainer run at this global batch with data.val_block set to it sees the same samples)
        spec = SyntheticSpec(
            locality=args.locality, zipf=args.zipf, scale=args.scale, seed=args.seed, val_block=global_batch
        )
        gen = SyntheticCTR(spec)

        def it() -> Iterator[np.ndarray]:  # the training stream (held-out blocks skipped), as the trainer cuts it
            for first in itertools.count(0, global_batch):
                yield gen.train_samples(first, global_batch).ids

        return list(gen.table_rows), it()
    module, cls = LOADERS[args.data]
    if not args.path:
        raise SystemExit(f"--data {args.data} needs --path to the data file")
    try:
        src_cls = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"--data {args.data}: the loader {module}.{cls} is not available ({e})")
    src = src_cls(args.path)
    return list(src.table_rows), (s.ids for s in src.train_batches(global_batch))


class Feed:
    """The trace's global batches, read once and shared: each policy keeps its own cursor and its own GlobalBatch
    objects (their caches count in its own time). `fae` takes `window` batches at a time and reorders them
    (FaePolicy.reorder: hot-only batches first, then cold) before planning them, as FAE reorders its input."""

    def __init__(self, trace: Iterator[np.ndarray], n: int) -> None:
        self.trace, self.n = trace, n
        self.buf: deque = deque()
        self.base = 0  # index of buf[0]
        self.done = False

    def get(self, i: int) -> np.ndarray | None:
        while not self.done and i >= self.base + len(self.buf):
            ids = next(self.trace, None)
            if ids is None or ids.shape[0] != self.n:
                self.done = True
            else:
                self.buf.append(ids)
        return self.buf[i - self.base] if i < self.base + len(self.buf) else None

    def release(self, below: int) -> None:
        while self.buf and self.base < below:
            self.buf.popleft()
            self.base += 1


def owner_balance_kwargs(value) -> dict:
    """herald's, its variants' and herald_hier's owner_balance from --owner-balance (none: the default, 1.15)."""
    if value is None:
        return {}
    return {"owner_balance": None if value == "off" else value}


# simulator names for a policy run with settings of its own: name -> (policy, settings from the command line)
VARIANTS = {
    "herald_bids": ("herald", lambda args: {"first_pass": "bids"}),  # LAIA's first pass on owner scores alone
    "herald_host": (
        "herald",
        lambda args: {"hosts": args.ranks_per_host, "intra_host_cost": args.intra_host_cost},
    ),  # host-aware LAIA over the --ranks-per-host layout
    "herald_rep": (
        "herald",
        lambda args: {
            "hosts": args.ranks_per_host,
            "intra_host_cost": args.intra_host_cost,
            "replicate": True,
            "host_laia": False,
            **({} if args.replica_budget is None else {"replica_budget": args.replica_budget}),
        },
    ),  # herald (rank-level LAIA) + the rows every host reads replicated, host-aware (schedule/herald/replicas.py),
    # + owner balancing (on with replicas by default; schedule/herald/balance.py)
}


def owner_balance_arg(text: str):
    """--owner-balance: 'off' (None to the policy) or a factor >= 1."""
    if text == "off":
        return "off"
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'off' or a number >= 1, got {text!r}")
    if not v >= 1.0:
        raise argparse.ArgumentTypeError(f"expected 'off' or a number >= 1, got {text!r}")
    return v


def policy_kwargs(args, name: str) -> dict:
    """Settings from the command line for one policy (only those given)."""
    kw: dict = {}
    if name in VARIANTS:
        base, extra = VARIANTS[name]
        return {**policy_kwargs(args, base), **extra(args)}
    if name == "herald":
        kw.update(owner_balance_kwargs(args.owner_balance))
        if args.refine is not None:
            kw["refine"] = args.refine
        if args.budget_ms is not None:
            kw["budget_ms"] = args.budget_ms
        if getattr(args, "plan_budget_ms", None) is not None:
            kw["plan_budget_ms"] = args.plan_budget_ms
        if getattr(args, "first_pass", None) is not None:
            kw["first_pass"] = args.first_pass
    if name == "herald_hier":
        kw["hosts"] = args.ranks_per_host
        kw.update(owner_balance_kwargs(args.owner_balance))
        if getattr(args, "first_pass", None) is not None:
            kw["first_pass"] = args.first_pass
        kw["planner_wire"] = getattr(args, "planner_wire", DEFAULT_PLANNER_WIRE)
        if args.refine is not None:
            kw["refine"] = args.refine
    if name == "het" and args.staleness is not None:
        kw["staleness"] = args.staleness
    if name in ("fae", "p2res"):
        if args.hot_budget is not None:
            kw["hot_budget"] = args.hot_budget
        kw["profile_fraction"] = args.profile_fraction
    if name == "fae":
        kw["window"] = args.fae_window
    return kw


def run_policies(args, R: int) -> dict:
    B = args.batch
    table_rows, trace = open_trace(args, R * B)
    names = args.policies
    L = args.lookahead
    pols = {
        n: make_policy(VARIANTS.get(n, (n,))[0], table_rows, R, B, args.cache_ratio, L, **policy_kwargs(args, n))
        for n in names
    }
    checkers = {n: PlanChecker(table_rows, R, B, args.cache_ratio) for n in names} if args.check else {}
    feed = Feed(trace, R * B)
    windows: dict[str, deque] = {n: deque() for n in names}
    cursor = {n: 0 for n in names}
    stats = {n: {"rows": [], "bytes": [], "kinds": {}, "hits": 0, "pairs": 0, "ms": [], "cpu_ms": []} for n in names}
    protocol = {n: ProtocolTotals() for n in names if n in ("herald", "herald_hier")}
    hosts = {n: HostTotals() for n in names}
    table_class = [size_class(r) for r in table_rows]
    digests = {n: hashlib.sha1() for n in names}  # of every plan as the wire encodes it (arrays, dtypes, counters)
    host_digests = {n: hashlib.sha1() for n in names}  # herald_hier: of every host's own plan, as training makes it
    step = 0
    t_start = time.perf_counter()
    # fae / p2res choose their replicated rows from a prefix of the stream (profile_fraction of --steps)
    for n, pol in pols.items():
        if hasattr(pol, "profile_fraction"):
            k = pol.profile_steps(args.steps, pol.profile_fraction)
            prefix = [GlobalBatch.from_dense(ids, table_rows) for ids in map(feed.get, range(k)) if ids is not None]
            if prefix:  # an empty trace: nothing to plan either
                pol.profile(prefix)

    def fill(n: str) -> None:
        pol = pols[n]
        while len(windows[n]) < L + 1:
            take = pol.window if n == "fae" else 1
            got = []
            for i in range(cursor[n], cursor[n] + take):
                ids = feed.get(i)
                if ids is None:
                    break
                got.append(GlobalBatch.from_dense(ids, table_rows, index=i))
            if not got:
                return
            cursor[n] += len(got)
            windows[n].extend(pol.reorder(got) if n == "fae" else got)

    while step < args.steps:
        for n in names:
            fill(n)
        feed.release(min(cursor.values()))
        if any(not windows[n] for n in names):
            break
        for n in names:
            c0 = time.process_time()
            plan = pols[n].plan(list(windows[n]))
            stats[n]["cpu_ms"].append((time.process_time() - c0) * 1e3)
            digests[n].update(
                encode_plan_tree(dataclasses.replace(plan, sched_seconds=0.0)).tobytes()
            )  # not its timing
            for _, hp in sorted(getattr(pols[n], "last_host_plans", {}).items()):
                host_digests[n].update(encode_plan_tree(dataclasses.replace(hp, sched_seconds=0.0)).tobytes())
            if args.check:
                checkers[n].check(plan, windows[n][0])
            if step >= args.warmup:
                st = stats[n]
                st["rows"].append(plan.transmitted_rows())
                st["bytes"].append(plan.transmitted_bytes(args.dim, args.state_width))
                for k, v in plan.counters.items():
                    st["kinds"][k] = st["kinds"].get(k, 0) + int(v)
                st["hits"] += int(plan.counters.get("hit", 0))
                st["pairs"] += plan.read_pairs()
                hosts[n].add(host_traffic(plan, args.ranks_per_host, pols[n].last_transfers), table_class)
                if n in protocol:
                    protocol[n].add(pols[n], plan, windows[n][0], args.ranks_per_host)
            stats[n]["ms"].append(plan.sched_seconds * 1e3)
            windows[n].popleft()
        step += 1
        if step % max(1, args.steps // 10) == 0:
            log(f"[simulate] R={R} step {step}/{args.steps} ({time.perf_counter() - t_start:.1f} s)")
    if step < args.steps:
        log(f"[simulate] R={R}: the trace ended after {step} steps")
    out = {}
    n_meas = max(step - args.warmup, 1)
    for n in names:
        st = stats[n]
        rows = float(np.mean(st["rows"])) if st["rows"] else 0.0
        entry = {
            "rows_per_step": round(rows, 2),
            "bytes_per_step": round(float(np.mean(st["bytes"])) if st["bytes"] else 0.0, 1),
            "by_kind": {k: round(v / n_meas, 2) for k, v in sorted(st["kinds"].items())},
            "hit_rate": round(st["hits"] / st["pairs"], 4) if st["pairs"] else 0.0,
            "stale_reads": int(checkers[n].stale_reads) if args.check else None,
            "sched_ms_median": round(float(np.median(st["ms"])), 3) if st["ms"] else 0.0,
            "sched_ms_p90": round(float(np.percentile(st["ms"], 90)), 3) if st["ms"] else 0.0,
            "sched_cpu_ms_median": round(float(np.median(st["cpu_ms"])), 3) if st["cpu_ms"] else 0.0,
            "sched_cpu_ms_last_quarter": (
                round(float(np.median(st["cpu_ms"][-max(1, len(st["cpu_ms"]) // 4) :])), 3) if st["cpu_ms"] else 0.0
            ),
            "rows_per_sample": round(rows / (R * B), 4),
            "steps": step,
            "plan_digest": digests[n].hexdigest()[:16],  # equal digests: the same plans, step by step
        }
        # herald_hier: each host's own plan (the whole one is their union)
        if getattr(pols[n], "last_host_plans", None):
            entry["host_plans_digest"] = host_digests[n].hexdigest()[:16]
        entry.update(hosts[n].summary(n_meas, R * B))
        if n in protocol:
            entry.update(protocol[n].summary())
        if args.check and checkers[n].errors:
            entry["check_errors"] = checkers[n].errors[:5]
        if n in ("herald", "herald_hier", *VARIANTS):
            entry["tables"] = pols[n].tables
        if getattr(pols[n], "replicas", None) is not None and n not in ("fae", "p2res"):
            entry.update(pols[n].replicas.describe())
        if getattr(pols[n], "owner_balance", None) is not None:
            entry["owner_balance"] = pols[n].owner_balance
            entry["owner_balanced_rows"] = pols[n].balanced
        if getattr(args, "plan_budget_ms", None) is not None and hasattr(pols[n], "plan_levels"):
            levels = pols[n].plan_levels()  # plans made cheaper because planning took longer than the budget
            entry.update(plans_full=levels.full, plans_reduced=levels.reduced, plans_static=levels.static)
        if n == "het":
            entry["staleness"] = pols[n].staleness
        if n in ("fae", "p2res"):
            entry["replicated_rows"] = int(pols[n].replicated.sum())
        if n == "fae":
            entry["hot_batches"] = pols[n].hot_batches
        out[n] = entry
    res = {"policies": out}
    ratios = {}
    for base in ("het_bsp", "herald_greedy", "static"):
        if base in out and "herald" in out and out[base]["rows_per_step"] > 0:
            ratios[f"herald/{base}"] = round(out["herald"]["rows_per_step"] / out[base]["rows_per_step"], 4)
    if "herald_hier" in out and "herald" in out and out["herald"]["rows_per_step"] > 0:
        ratios["herald_hier/herald"] = round(out["herald_hier"]["rows_per_step"] / out["herald"]["rows_per_step"], 4)
    if ratios:
        res["ratios"] = ratios
    return res


class ProtocolTotals:
    """Planning time per host and protocol bytes per rank per step (medians over the measured steps).

    herald_hier: its own record (`HierStep`, schedule/herald/hierarchy.py): plan_ms_per_host = the slowest host's
    planner + directory role (its own plan and replica update included), the slowest directory role alone, the
    slowest host's own plan and replica update alone, and the union of the parts into one Plan (not a host's work);
    protocol_bytes_per_rank = its ids (to its own host), the messages between hosts / R (and the busiest host's / its
    ranks), its plan part (mean and max over ranks), and what the in-process transport really carried between hosts
    / R (`wire_between_hosts`: every phase and the routed parts in schedule/message_wire.py's form, each array in
    the form of fewest bytes; the protocol's count gives every field a fixed width); `total` = ids + wire + part;
    parts_bytes_per_host = the plan parts a host's planner receives on the wire, routed to it (its own ranks' plan)
    against every host's whole part (what an all-gather carries), both in the wire's form.
    herald, today's protocol (plan_on="host"): one planner per host plans everything (plan_ms_per_host = its time),
    every rank sends its ids to every host's planner and receives the whole plan (`encode_plan` bytes)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[float]] = {}

    def _put(self, **vals: float) -> None:
        for k, v in vals.items():
            self.rows.setdefault(k, []).append(float(v))

    def add(self, pol, plan, batch: GlobalBatch, ranks_per_host: int) -> None:
        R, B = pol.num_ranks, pol.batch_per_rank
        step = getattr(pol, "last_step", None)
        if step is not None:  # herald_hier
            P, H = pol.ranks_per_host, pol.num_hosts
            per_host = step.per_host_seconds
            own_plan = step.host_plan_seconds if step.host_plan_seconds.shape[0] else np.zeros_like(per_host)
            self._put(
                max_host_ms=per_host.max() * 1e3,
                max_directory_ms=step.directory_seconds.max() * 1e3,
                max_host_plan_ms=own_plan.max() * 1e3,
                union_ms=step.union_seconds * 1e3,
                ids=step.ids_bytes.mean(),
                between_hosts=sum(step.message_bytes.values()) / R,
                between_hosts_busiest_host=step.host_message_bytes.max() / P,
                plan_part=step.plan_part_bytes.mean(),
                plan_part_max=step.plan_part_bytes.max(),
                parts_wire_per_host=step.wire_bytes.get("parts", 0) / H,
                parts_all_gather_per_host=step.parts_bytes * (H - 1) / H,
                wire_between_hosts=sum(step.wire_bytes.values()) / R,
            )
            for k, v in step.message_bytes.items():
                self._put(**{f"msg_{k}": v / R})
            return
        H = -(-R // ranks_per_host)
        self._put(
            max_host_ms=plan.sched_seconds * 1e3,
            ids=ids_bytes(batch, R, B).mean() * H,
            between_hosts=0.0,
            plan_part=encode_plan(plan).nbytes,
        )

    def summary(self) -> dict:
        med = {k: float(np.median(v)) for k, v in self.rows.items()}
        ms = {
            k: round(med[k], 3) for k in ("max_host_ms", "max_directory_ms", "max_host_plan_ms", "union_ms") if k in med
        }
        by = {k: round(med[k]) for k in ("ids", "between_hosts", "between_hosts_busiest_host", "plan_part",
                                         "plan_part_max", "wire_between_hosts") if k in med}  # fmt: skip
        # what a rank's ids, the planners' messages as their wire carries them (/ R) and its plan part add up to;
        # total_fixed_width: with the messages in the protocol's fixed-width count instead
        by["total"] = round(med["ids"] + med.get("wire_between_hosts", med["between_hosts"]) + med["plan_part"])
        if "wire_between_hosts" in med:
            by["total_fixed_width"] = round(med["ids"] + med["between_hosts"] + med["plan_part"])
        msgs = {k[4:]: round(v) for k, v in med.items() if k.startswith("msg_") and v}
        if msgs:
            by["between_hosts_by_kind"] = msgs
        out = {"plan_ms_per_host": ms, "protocol_bytes_per_rank": by}
        if "parts_wire_per_host" in med:  # herald_hier's plan parts on the planners' wire, per host
            out["parts_bytes_per_host"] = {
                "routed": round(med["parts_wire_per_host"]),
                "all_gathered": round(med["parts_all_gather_per_host"]),
            }
        return out


TABLE_CLASSES = ((1_000, "tiny"), (20_000, "mid"))  # rows below the bound; larger tables are "large"


def size_class(rows: int) -> str:
    """A table's size class for the per-table split of cross-host rows: tiny (< 1,000 rows), mid, large."""
    return next((name for bound, name in TABLE_CLASSES if rows < bound), "large")


class HostTotals:
    """A policy's host-split traffic (schedule.traffic.HostTraffic) summed over the measured steps."""

    def __init__(self) -> None:
        self.cross: dict[str, float] = {}
        self.cross_agg: dict[str, float] = {}
        self.intra = self.intra_agg = 0.0
        self.by_class: dict[str, float] = {}  # "kind/class" -> crossing rows
        self.by_class_agg: dict[str, float] = {}
        self.balance: list[float] = []
        self.unattributed: dict[str, int] = {}

    def add(self, ht, table_class: list[str]) -> None:
        for acc, part in ((self.cross, ht.cross), (self.cross_agg, ht.cross_aggregated)):
            for k, v in part.items():
                acc[k] = acc.get(k, 0.0) + v
        self.intra += ht.intra_rows
        self.intra_agg += ht.intra_rows_aggregated
        for acc, part in ((self.by_class, ht.cross_by_table), (self.by_class_agg, ht.cross_by_table_aggregated)):
            for (kind, t), v in part.items():
                key = f"{kind}/{table_class[t]}"
                acc[key] = acc.get(key, 0.0) + v
        self.balance.append(ht.balance())
        for k, v in ht.unattributed.items():
            self.unattributed[k] = self.unattributed.get(k, 0) + v

    def summary(self, steps: int, global_batch: int) -> dict:
        """The JSON fields: rows per sample crossing hosts / inside hosts, today and host-aggregated; crossing rows
        per step by kind and by kind / table size class; the busiest rank's rows over the mean (median over steps)."""
        per = steps * global_batch

        def by(d: dict) -> dict:
            return {k: round(v / steps, 2) for k, v in sorted(d.items()) if v}

        out = {
            "cross_host_rows_per_sample": round(sum(self.cross.values()) / per, 4),
            "intra_host_rows_per_sample": round(self.intra / per, 4),
            "cross_host_rows_per_sample_host_aggregated": round(sum(self.cross_agg.values()) / per, 4),
            "intra_host_rows_per_sample_host_aggregated": round(self.intra_agg / per, 4),
            "cross_host_by_kind": by(self.cross),
            "cross_host_by_kind_host_aggregated": by(self.cross_agg),
            "cross_host_by_kind_table_class": by(self.by_class),
            "cross_host_by_kind_table_class_host_aggregated": by(self.by_class_agg),
            "busiest_rank_over_mean": round(float(np.median(self.balance)), 3) if self.balance else 1.0,
        }
        if self.unattributed:
            out["unattributed_by_kind"] = by(self.unattributed)
        return out


def plot(result: dict, path: str) -> None:
    """Rows per sample vs workers per policy; where the result has the host split, a second panel with the rows
    per sample that cross hosts, as delivered today (solid) and host-aggregated (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = result.get("sweep") or {str(result["config"]["workers"][0]): {"policies": result["policies"]}}
    ws = sorted(int(w) for w in sweep)
    names = list(next(iter(sweep.values()))["policies"])
    hosts = all("cross_host_rows_per_sample" in sweep[str(w)]["policies"][n] for w in ws for n in names)
    fig, axes = plt.subplots(1, 2 if hosts else 1, figsize=(11 if hosts else 6, 4), squeeze=False)
    cfg = result["config"]

    def series(ax, field: str, n: str, **kw) -> None:
        ax.plot(ws, [sweep[str(w)]["policies"][n][field] for w in ws], marker="o", **kw)

    ax = axes[0][0]
    for i, n in enumerate(names):
        series(ax, "rows_per_sample", n, label=n, color=f"C{i}")
    ax.set_ylabel("transmitted rows per sample")
    ax.set_title(f"{cfg['data']}: B={cfg['batch']}, cache {cfg['cache_ratio']:.0%}, {cfg['steps']} steps")
    if hosts:
        ax = axes[0][1]
        for i, n in enumerate(names):
            series(ax, "cross_host_rows_per_sample", n, label=f"{n} (today)", color=f"C{i}")
            series(ax, "cross_host_rows_per_sample_host_aggregated", n, label=f"{n} (host-aggregated)",
                   color=f"C{i}", linestyle="--")  # fmt: skip
        ax.set_ylabel("rows per sample crossing hosts")
        ax.set_title(f"{cfg.get('ranks_per_host', 8)} ranks per host")
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ws)
        ax.set_xticklabels([str(w) for w in ws])
        ax.set_xlabel("workers (R)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"[simulate] wrote {path}")


def merge_results(paths: list[str]) -> dict:
    """One sweep result from single-worker-count results of the same settings (runs made one R at a time)."""
    results = []
    for path in paths:
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, ValueError) as e:
            raise SystemExit(f"--merge: cannot read {path}: {e}")
        if "policies" not in results[-1] or len(results[-1]["config"]["workers"]) != 1:
            raise SystemExit(f"--merge: {path} is not the result of one worker count")
    first = {k: v for k, v in results[0]["config"].items() if k != "workers"}
    for path, r in zip(paths, results):
        cfg = {k: v for k, v in r["config"].items() if k != "workers"}
        if cfg != first:
            diff = sorted(k for k in set(cfg) | set(first) if cfg.get(k) != first.get(k))
            raise SystemExit(f"--merge: {path} was run with other settings ({', '.join(diff)})")
    config = dict(results[0]["config"], workers=[r["config"]["workers"][0] for r in results])
    sweep = {str(r["config"]["workers"][0]): {k: v for k, v in r.items() if k != "config"} for r in results}
    return {"config": config, "sweep": sweep}


def add_trace_arguments(p: argparse.ArgumentParser, seed_help: str = "synthetic: seed") -> None:
    """The trace's options (`open_trace` reads them): --data, --path and the synthetic generator's."""
    p.add_argument("--data", choices=["synthetic", *LOADERS], default="synthetic")
    p.add_argument("--path", help="data file for criteo / avazu / movielens")
    p.add_argument("--locality", type=float, default=SyntheticSpec.locality, help="synthetic: share of trending ids")
    p.add_argument("--zipf", type=float, default=SyntheticSpec.zipf, help="synthetic: Zipf exponent")
    p.add_argument("--scale", type=float, default=SyntheticSpec.scale, help="synthetic: table size scale")
    p.add_argument("--seed", type=int, default=0, help=seed_help)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_trace_arguments(p)
    p.add_argument("--workers", default="8", help="worker count, or a comma list for a sweep")
    p.add_argument("--batch", type=int, default=256, help="samples per worker (B)")
    p.add_argument("--cache-ratio", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=0, help="steps left out of the traffic averages")
    p.add_argument("--policies", default="static,het_bsp,herald_greedy,herald")
    p.add_argument("--lookahead", type=int, default=4)
    p.add_argument(
        "--ranks-per-host",
        type=int,
        default=8,
        help="ranks r..r+H-1 share a host: cross-host and intra-host rows are reported apart",
    )
    p.add_argument(
        "--intra-host-cost",
        type=float,
        default=INTRA_HOST_COST,
        help="herald_host: a row moved inside a host over one crossing hosts (host-aware LAIA)",
    )
    p.add_argument("--dim", type=int, default=512, help="embedding dimension (floats per value / gradient)")
    p.add_argument("--state-width", type=int, default=1, help="optimizer state floats per row (rowwise adagrad: 1)")
    p.add_argument("--refine", type=int, default=None, help="herald: best-response rounds (default: the policy's)")
    p.add_argument("--budget-ms", type=float, default=None, help="herald: scheduling-time budget per step")
    p.add_argument(
        "--first-pass",
        choices=FIRST_PASSES,
        default=None,
        help="herald, herald_hier and herald's variants: LAIA's first pass (default: the policy's, auto: the stream "
        "from 8 ranks, 8 ranks per host for herald_hier; herald_bids always bids)",
    )
    p.add_argument(
        "--plan-budget-ms",
        type=float,
        default=None,
        help="herald: a fixed planning budget per plan in ms (schedule/herald/budget.py): plans whose planner CPU "
        "exceeds it get fewer tables, then static (timing-dependent plans); counted as plans_reduced / plans_static",
    )
    p.add_argument("--staleness", type=int, default=None, help="het: staleness bound S (default 0 = het_bsp)")
    p.add_argument(
        "--hot-budget",
        type=int,
        default=None,
        help="fae / p2res: replicated rows per rank (default: sum of ceil(cache_ratio x rows))",
    )
    p.add_argument(
        "--profile-fraction",
        type=float,
        default=0.05,
        help="fae / p2res: share of the --steps batches profiled (a prefix of the stream)",
    )
    p.add_argument("--fae-window", type=int, default=8, help="fae: global batches reordered together")
    p.add_argument(
        "--replica-budget",
        type=int,
        default=None,
        help="herald_rep: replicated rows per rank (default: the policy's REPLICA_BUDGET)",
    )
    p.add_argument(
        "--owner-balance",
        type=owner_balance_arg,
        default=None,
        help="herald, its variants and herald_hier: hand shared rows from owners above this factor x the mean rank's "
        "rows to their least loaded readers; 'off' disables (default: the policy's, 1.15)",
    )
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the independent checker")
    p.add_argument(
        "--hier-clock",
        choices=("wall", "cpu"),
        default="wall",
        help="herald_hier: measure plan_ms_per_host in wall time or in this process's CPU time (which other jobs on "
        "a shared machine disturb less)",
    )
    p.add_argument(
        "--planner-wire",
        choices=WIRE_FORMS,
        default=DEFAULT_PLANNER_WIRE,
        help="herald_hier: the planners' messages in their form of fewest bytes (compact) or as raw arrays (the "
        "policy's default); wire_between_hosts counts the form chosen",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (default: also)")
    p.add_argument("--plot", help="PNG: transmitted rows per sample (and crossing hosts) vs workers per policy")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="combine results of one worker count each (same settings) into one sweep result; runs nothing",
    )
    args = p.parse_args(argv)
    if args.merge:
        result = merge_results(args.merge)
        if args.plot:
            plot(result, args.plot)
        print(json.dumps(result, indent=None if args.json else 2))
        return result
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    bad = [x for x in args.policies if x not in POLICIES and x not in VARIANTS]
    if bad:
        p.error(f"unknown policies {bad}; choose from {sorted([*POLICIES, *VARIANTS])}")
    if not 0.0 <= args.intra_host_cost <= 1.0:
        p.error(f"--intra-host-cost must be in [0, 1], got {args.intra_host_cost}")
    for name, v, lo in (
        ("--batch", args.batch, 1),
        ("--steps", args.steps, 1),
        ("--lookahead", args.lookahead, 0),
        ("--dim", args.dim, 1),
        ("--state-width", args.state_width, 0),
        ("--warmup", args.warmup, 0),
        ("--ranks-per-host", args.ranks_per_host, 1),
    ):
        if v < lo:
            p.error(f"{name} must be >= {lo}, got {v}")
    for name, v in (
        ("--staleness", args.staleness),
        ("--hot-budget", args.hot_budget),
        ("--replica-budget", args.replica_budget),
    ):
        if v is not None and v < 0:
            p.error(f"{name} must be >= 0, got {v}")
    if args.fae_window < 1:
        p.error(f"--fae-window must be >= 1, got {args.fae_window}")
    if not 0.0 < args.profile_fraction <= 1.0:
        p.error(f"--profile-fraction must be in (0, 1], got {args.profile_fraction}")
    if args.warmup >= args.steps:
        p.error("--warmup must be smaller than --steps")
    workers = parse_workers(args.workers)
    hierarchy.CLOCK = time.process_time if args.hier_clock == "cpu" else time.perf_counter
    config = {
        "data": args.data,
        "path": args.path,
        "workers": workers,
        "batch": args.batch,
        "cache_ratio": args.cache_ratio,
        "steps": args.steps,
        "warmup": args.warmup,
        "policies": args.policies,
        "lookahead": args.lookahead,
        "ranks_per_host": args.ranks_per_host,
        "dim": args.dim,
        "state_width": args.state_width,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "hier_clock": args.hier_clock,
        "planner_wire": args.planner_wire,
    }
    if args.data == "synthetic":
        config.update({"locality": args.locality, "zipf": args.zipf, "scale": args.scale, "seed": args.seed})
    if args.refine is not None:
        config["refine"] = args.refine
    if args.budget_ms is not None:
        config["budget_ms"] = args.budget_ms
    for key in ("staleness", "hot_budget", "first_pass"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    if {"herald_host", "herald_rep"} & set(args.policies):  # the variants that read it
        config["intra_host_cost"] = args.intra_host_cost
    if {"fae", "p2res"} & set(args.policies):
        config.update({"profile_fraction": args.profile_fraction, "fae_window": args.fae_window})
    result: dict = {"config": config}
    if len(workers) == 1:
        result.update(run_policies(args, workers[0]))
    else:
        result["sweep"] = {}
        for R in workers:
            log(f"[simulate] --- {R} workers ---")
            result["sweep"][str(R)] = run_policies(args, R)
    if args.plot:
        plot(result, args.plot)
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # the whole process
    print(json.dumps(result, indent=None if args.json else 2))
    return result


if __name__ == "__main__":
    main()
