#!/usr/bin/env python
"""One `herald_hier` host planner alone in its process, as in training: its planning time per step, replayed.

    python benchmarks/hier_alone.py --workers 256 --steps 30 --warmup 10 --hosts 0,5,17       # scale 0.01
    python benchmarks/hier_alone.py --scale 1 --workers 64 --steps 20 --warmup 6 --hosts 0,3   # full tables
    python benchmarks/hier_alone.py --workers 64 --hosts 0,1 --refine 0     # each host's LAIA without its refine round

Why: the simulator runs every host in one process, phase by phase, each host's phase after the other hosts' (its own
data gone cold in between) and the first host of each phase paying for the code and the allocator (the slowest
host there is whichever runs first: RESULTS.md). In training a machine's planner runs its own phases back to back
in its own process. This records, in one in-process run, every message each host receives in every phase (the
`Transport`'s inboxes), then replays each host of `--hosts` in a fresh process: a new policy plans that host alone
(`plan_host`, its own samples only, the recorded messages as the other hosts' answers) and its messages out are
checked against the recorded ones (a replay that diverged would stop with an error). Prints one JSON object: per
host, the median over the steps after `--warmup` of its planning time (phases, directory role, its own plan and
replica update; `--hier-clock` wall or CPU), beside the same host's figure in the in-process run, and what its
messages' wire form costs it (encoding what it sends to other hosts and decoding what they send it, as the training
transport does around its all-to-alls; not in `alone_ms`): `codec_ms` in the compact form (each array in its form of
fewest bytes, schedule/message_wire.py, `planner_wire: compact`), `codec_raw_ms` with every array raw
(`planner_wire: raw`), and the bytes of each; and `cut_ms`, what the input stage's planner does next: cutting its
ranks' parts from the host's plan and encoding those it sends (step/plan_part.py, host relays on). Two more replays
time the planner's thread as the input stage runs it (raw wire, no check; wall ms per step): `planner_thread_ms`
with the cut on the same thread, `planner_thread_cut_thread_ms` with the cut on a thread of its own while the next
plan is made (`cut_thread`, the default).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulate import owner_balance_arg, owner_balance_kwargs  # noqa: E402

from herald_torchrec.data.synthetic import SyntheticCTR, SyntheticSpec  # noqa: E402
from herald_torchrec.distributed.step.host_relay import HostMap  # noqa: E402
from herald_torchrec.distributed.step.plan_part import plan_parts  # noqa: E402
from herald_torchrec.schedule import GlobalBatch, make_policy  # noqa: E402
from herald_torchrec.schedule.herald import hierarchy  # noqa: E402
from herald_torchrec.schedule.herald.host_messages import (  # noqa: E402
    InProcessTransport,
    Transport,
    decode_inbox,
    encode_outgoing,
    outgoing_messages,
)
from herald_torchrec.schedule.herald.planner import FIRST_PASSES  # noqa: E402
from herald_torchrec.schedule.message_wire import WIRE_FORMS, encode_messages  # noqa: E402
from herald_torchrec.schedule.plan_wire import encode_plan  # noqa: E402

# the options a replay runs with (the recording's)
REPLAYED = (
    "scale", "workers", "ranks_per_host", "batch", "cache_ratio", "lookahead", "steps", "warmup", "hier_clock",
    "first_pass", "owner_balance", "refine",
)  # fmt: skip


class RecordingTransport(InProcessTransport):
    """The in-process transport, keeping every host's inbox and outbox of every exchange, in order."""

    def __init__(self, num_hosts: int, log: list) -> None:
        super().__init__(num_hosts)
        self.log = log

    def exchange(self, kind, out):
        inbox = super().exchange(kind, out)
        self.log.append((kind, inbox, out))
        return inbox


class InboxTransport(Transport):
    """Host `host`'s side of a recorded run as training runs it: each exchange encodes what it sends and decodes what
    it receives in the raw wire form (the default `planner_wire`) and returns what the host received then; no check.
    What the other hosts sent is encoded when the transport is made (their work, not this host's)."""

    def __init__(self, host: int, log: list) -> None:
        super().__init__()
        self.host, self.log, self.at = host, log, 0
        self.sent_here = []
        for _, inbox, _ in log:
            bufs = encode_messages([m for s, m in inbox[host].items() if s != host], False)
            self.sent_here.append((np.concatenate(bufs) if bufs else np.zeros(0, np.uint8), [b.shape[0] for b in bufs]))

    def exchange(self, kind, out):
        _, inbox, _ = self.log[self.at]
        buf, sizes = self.sent_here[self.at]
        self.at += 1
        encode_outgoing(out.get(self.host, {}), self.host, False)
        decode_inbox(buf, sizes)
        return {self.host: inbox[self.host]}


class ReplayTransport(Transport):
    """Host `host`'s side of a recorded run: each exchange returns what the host received then, after checking that
    what it sends now is what it sent then."""

    def __init__(self, host: int, log: list) -> None:
        super().__init__()
        self.host, self.log, self.at = host, log, 0
        # per wire form: seconds encoding what it sends other hosts and decoding what they sent it (wall), bytes sent
        self.codec_seconds = {form: 0.0 for form in WIRE_FORMS}
        self.codec_bytes = {form: 0 for form in WIRE_FORMS}

    def exchange(self, kind, out):
        want_kind, inbox, sent = self.log[self.at]
        self.at += 1
        mine, then = outgoing_messages(out.get(self.host, {})), outgoing_messages(sent.get(self.host, {}))
        same = want_kind == kind and sorted(mine) == sorted(then)
        same = same and all(
            len(mine[t]) == len(then[t]) and all(np.array_equal(a, b) for a, b in zip(mine[t], then[t])) for t in mine
        )
        if not same:
            raise RuntimeError(f"hier_alone: host {self.host} diverged from the recorded run at exchange {self.at}")
        for form in WIRE_FORMS:
            compact = form == "compact"
            got = [m for s, m in inbox[self.host].items() if s != self.host]
            bufs = encode_messages(got, compact)  # as the other hosts sent them
            buf = np.concatenate(bufs) if bufs else np.zeros(0, np.uint8)
            t0 = time.perf_counter()
            _, sent = encode_outgoing(out.get(self.host, {}), self.host, compact)
            decode_inbox(buf, [b.shape[0] for b in bufs])
            self.codec_seconds[form] += time.perf_counter() - t0
            self.codec_bytes[form] += sent.buf.shape[0]
        return {self.host: inbox[self.host]}


def _trace(args: argparse.Namespace, R: int, host: int | None = None):
    """The table rows and each global batch's samples: every rank's, or with `host` that host's alone, as training's
    input stage gives them to its planner. The generator is a function of a sample's place in the stream, so a host's
    samples alone are the global batch cut to it, without generating the other R - P ranks' (at R=256, 13.6 MB of
    ids a step through the caches the planner uses, between its steps: no host's planner pays for that in training)."""
    gen = SyntheticCTR(SyntheticSpec(scale=args.scale, val_block=R * args.batch))
    rows = list(gen.table_rows)
    n = R * args.batch if host is None else args.ranks_per_host * args.batch
    first = 0 if host is None else host * n

    def batch(i: int) -> GlobalBatch:
        return GlobalBatch.from_dense(gen.train_samples(i * R * args.batch + first, n).ids, rows, index=i)

    return rows, batch


def owner_balance_option(text: str):
    """--owner-balance: 'auto' (the policy's default), 'off' or a factor >= 1."""
    if text == "auto":
        return text
    try:
        return owner_balance_arg(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'off' or a number >= 1, got {text!r}") from None


def refine_option(text: str):
    """--refine: 'auto' (the policy's time model) or a number of rounds >= 0."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 0, got {text!r}")
    return int(text)


def _policy(args: argparse.Namespace, rows: list[int], R: int):
    return make_policy(
        "herald_hier", rows, R, args.batch, args.cache_ratio, args.lookahead, hosts=args.ranks_per_host,
        first_pass=args.first_pass, refine=None if args.refine == "auto" else args.refine,
        **owner_balance_kwargs(None if args.owner_balance == "auto" else args.owner_balance),
    )  # fmt: skip


def record(args: argparse.Namespace, R: int, path: Path) -> dict:
    """The in-process run: every host's inboxes per step, and each host's per-step time there."""
    rows, batch = _trace(args, R)
    pol = _policy(args, rows, R)
    H = pol.num_hosts
    steps, seconds = [], []
    window = [batch(i) for i in range(args.lookahead)]
    for i in range(args.steps):
        window.append(batch(i + args.lookahead))
        log: list = []
        windows = {h: [pol.host_batch(x, h) for x in window] for h in range(H)}
        pol.plan_hosts(windows, RecordingTransport(H, log), whole=window, host_plan=True)
        pol.step += 1
        steps.append(log)
        seconds.append(pol.last_step.per_host_seconds)
        window.pop(0)
    with open(path, "wb") as f:
        pickle.dump({"rows": rows, "steps": steps}, f, protocol=pickle.HIGHEST_PROTOCOL)
    return {"num_hosts": H, "per_host_ms": (np.median(np.array(seconds[args.warmup :]), axis=0) * 1e3).tolist()}


def planner_thread(args: argparse.Namespace, R: int, host: int, path: Path, cut_thread: bool) -> dict:
    """Host `host`'s planner thread as the input stage runs it: per step its plan (the raw wire codec of its messages
    included, no check), then the cut and encoding of its 7 other ranks' parts, on the same thread or on a thread of
    its own while the next plan is made (`cut_thread`); the median wall ms per step."""
    with open(path, "rb") as f:
        rec = pickle.load(f)
    rows, batch = _trace(args, R, host)
    pol = _policy(args, rows, R)
    P = args.ranks_per_host
    hosts = HostMap(np.arange(R, dtype=np.int64) // P, relay=True)
    ranks = list(range(host * P, (host + 1) * P))

    def cut(plan):
        parts = plan_parts(plan, ranks, hosts)
        return {d: encode_plan(parts[d]) for d in ranks[1:]}  # the planner (its first rank) keeps its own

    window = [batch(i) for i in range(args.lookahead)]
    wall, pending = [], None
    with ThreadPoolExecutor(1) as cutter:
        for i in range(args.steps):
            window.append(batch(i + args.lookahead))
            transport = InboxTransport(host, rec["steps"][i])
            t0 = time.perf_counter()
            plan = pol.plan_host(host, window, transport)
            if cut_thread:
                if pending is not None:
                    pending.result()
                pending = cutter.submit(cut, plan)
            else:
                cut(plan)
            wall.append(time.perf_counter() - t0)
            window.pop(0)
    key = "planner_thread_cut_thread_ms" if cut_thread else "planner_thread_ms"
    return {"host": host, key: round(float(np.median(wall[args.warmup :])) * 1e3, 3)}


def replay(args: argparse.Namespace, R: int, host: int, path: Path) -> dict:
    """Host `host` alone: a fresh policy, its own samples, the recorded messages."""
    with open(path, "rb") as f:
        rec = pickle.load(f)
    rows, batch = _trace(args, R, host)
    pol = _policy(args, rows, R)
    # its own samples as training gives them to its planner: single-hot ids as a dense batch (input_layout.global_batch)
    window = [batch(i) for i in range(args.lookahead)]
    ms, cut, codec, nbytes = [], [], {f: [] for f in WIRE_FORMS}, {f: [] for f in WIRE_FORMS}
    P = args.ranks_per_host
    ranks = list(range(host * P, (host + 1) * P))
    hosts = HostMap(np.arange(R, dtype=np.int64) // P, relay=True)  # the data plane's relays, on by default
    for i in range(args.steps):
        window.append(batch(i + args.lookahead))
        transport = ReplayTransport(host, rec["steps"][i])
        plan = pol.plan_host(host, window, transport)
        step = pol.last_step
        ms.append(float(step.per_host_seconds[host]) * 1e3)
        t0 = hierarchy.CLOCK()  # the cut of its ranks' parts, as the input stage's planner does after each plan
        parts = plan_parts(plan, ranks, hosts)
        for d in ranks[1:]:  # the planner (its first rank) keeps its own part
            encode_plan(parts[d])
        cut.append((hierarchy.CLOCK() - t0) * 1e3)
        for f in WIRE_FORMS:
            codec[f].append(transport.codec_seconds[f] * 1e3)
            nbytes[f].append(transport.codec_bytes[f])
        window.pop(0)
    out = {
        "host": host,
        "alone_ms": round(float(np.median(ms[args.warmup :])), 3),
        "cut_ms": round(float(np.median(cut[args.warmup :])), 3),
    }
    for f in WIRE_FORMS:
        suffix = "" if f == "compact" else f"_{f}"
        out[f"codec{suffix}_ms"] = round(float(np.median(codec[f][args.warmup :])), 3)
        out[f"sent{suffix}_bytes"] = int(np.median(nbytes[f][args.warmup :]))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=SyntheticSpec.scale, help="synthetic table size scale")
    p.add_argument("--workers", type=int, default=256, help="R")
    p.add_argument("--ranks-per-host", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--cache-ratio", type=float, default=0.1)
    p.add_argument("--lookahead", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--hosts", default="0,1", help="the hosts replayed alone, a comma list")
    p.add_argument("--hier-clock", choices=["wall", "cpu"], default="wall")
    p.add_argument(
        "--first-pass",
        choices=FIRST_PASSES,
        default="auto",
        help="LAIA's first pass on each host (the policy's default)",
    )
    p.add_argument(
        "--owner-balance",
        type=owner_balance_option,
        default="auto",
        help="each directory host's owner balancing: a factor >= 1, 'off', or 'auto' (the policy's default, 1.15)",
    )
    p.add_argument(
        "--refine",
        type=refine_option,
        default="auto",
        help="LAIA's best-response rounds per host ('auto': the policy's)",
    )
    p.add_argument("--replay", type=int, help=argparse.SUPPRESS)  # internal: replay this host from --record-file
    p.add_argument("--replay-as", choices=["check", "thread", "cut_thread"], default="check", help=argparse.SUPPRESS)
    p.add_argument("--record-file", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        raise SystemExit(f"--warmup ({args.warmup}) must be in [0, --steps ({args.steps}))")
    hierarchy.CLOCK = time.process_time if args.hier_clock == "cpu" else time.perf_counter
    R = args.workers
    if args.replay is not None:
        if args.replay_as == "check":
            out = replay(args, R, args.replay, args.record_file)
        else:
            out = planner_thread(args, R, args.replay, args.record_file, args.replay_as == "cut_thread")
        print(json.dumps(out))
        return out
    try:
        hosts = [int(h) for h in args.hosts.split(",")]
    except ValueError:
        raise SystemExit(f"--hosts: a comma list of host indices, got {args.hosts!r}") from None
    if R % args.ranks_per_host or R // args.ranks_per_host < 2:
        raise SystemExit(f"--workers {R}: needs at least two hosts of --ranks-per-host {args.ranks_per_host}")
    if any(not 0 <= h < R // args.ranks_per_host for h in hosts):
        raise SystemExit(f"--hosts: each in 0..{R // args.ranks_per_host - 1}, got {hosts}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "record.pkl"
        print(f"[hier_alone] R={R}: recording {args.steps} steps of every host in one process", file=sys.stderr)
        rec = record(args, R, path)
        alone = []
        same = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in REPLAYED]
        for h in hosts:
            print(f"[hier_alone] R={R}: host {h} alone", file=sys.stderr)
            one: dict = {}
            for mode in ("check", "thread", "cut_thread"):  # each replay in a fresh process
                cmd = [sys.executable, __file__, *same, f"--replay={h}", f"--replay-as={mode}", f"--record-file={path}"]
                got = subprocess.run(cmd, check=True, capture_output=True, text=True)
                one |= json.loads(got.stdout.strip().splitlines()[-1])
            alone.append(one)
    in_process = np.array(rec["per_host_ms"])
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("replay", "record_file")},
        "in_process_ms": {
            "slowest": round(float(in_process.max()), 3),
            "median": round(float(np.median(in_process)), 3),
            "slowest_host": int(in_process.argmax()),
        },
        "hosts": [a | {"in_process_ms": round(float(in_process[a["host"]]), 3)} for a in alone],
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
