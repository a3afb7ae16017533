#!/usr/bin/env python
"""What one host's `herald_hier` planner holds in memory, against what its protocol needs (computed sizes).

    python benchmarks/hier_memory.py --scale 1 --workers 64,256 --steps 30      # full Criteo Kaggle tables

The simulator (and `plan_host` in training) keeps in every planner process arrays over every row (owner, home, table,
last use, slot position: O(rows)) and the guest slots and eviction pools of all R ranks. By the protocol
(schedule/herald/hierarchy.py), host h reads and updates only: the owner of the rows it is the directory host of (it
decides them), and the guests of its own ranks (their slots, last use and eviction pools); a key's home, table and
directory host follow from the key and the layout. This prints, after `--steps` plans of the synthetic trace:

- replica_bytes: the policy's arrays in this process (what each host holds today), by array;
- host_needs_bytes (the largest host): its directory rows' owners (int16 ranks) + its ranks' guests held at that step x
  GUEST_BYTES (key, slot, group of slot, a key -> slot hash entry, last use) + its (rank, table) groups' bookkeeping
  and eviction pools; and the same with every guest group of its ranks full (cache_ratio of each table per rank),
  the bound of a long run;
- peak_rss_mib: this process (the trace generator and every host's replica: one replica, shared, in one process).
One JSON object; sizes in bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from herald_torchrec.data.synthetic import SyntheticCTR, SyntheticSpec  # noqa: E402
from herald_torchrec.schedule import GlobalBatch, make_policy  # noqa: E402

RANK_BYTES = 2  # an owner rank, int16 (R < 32,768)
# a guest: its key (8), its slot (8) and the slot's group (4) in GuestSlots (x 2: regions grow by doubling), a
# key -> slot hash entry (key 8 + slot 4, at load 0.75: 16), its last use (4)
GUEST_BYTES = 2 * (8 + 8 + 4) + 16 + 4
GROUP_BYTES = 7 * 8  # base, alloc, fill, cap; the pool's tau, count, row
POOL_KEY_BYTES = 8


def measure(scale: float, R: int, P: int, B: int, steps: int, cache_ratio: float, lookahead: int) -> dict:
    spec = SyntheticSpec(scale=scale, val_block=R * B)
    gen = SyntheticCTR(spec)
    rows = list(gen.table_rows)
    pol = make_policy("herald_hier", rows, R, B, cache_ratio, lookahead, hosts=P)
    window = [GlobalBatch.from_dense(gen.train_samples(i * R * B, R * B).ids, rows, index=i) for i in range(lookahead)]
    for i in range(steps):
        window.append(GlobalBatch.from_dense(gen.train_samples((i + lookahead) * R * B, R * B).ids, rows, index=i))
        pol.plan(window)
        window.pop(0)
    d, pool = pol.directory, pol.eviction
    T, H = d.num_tables, pol.num_hosts
    replica = {
        "owner": d.owner.nbytes,
        "home": d.home.nbytes,
        "table": d.table.nbytes,
        "last_use": d.last_use.nbytes,
        "slot_pos_of": d.slots.pos_of.nbytes,
        "slots": d.slots.slot.nbytes + d.slots.group_of_slot.nbytes,
        "eviction_pools": pool.keys.nbytes,
        "groups": R * T * GROUP_BYTES,
    }
    directory_host = (d.home.astype(np.int64) // P + d.table) % H  # `HeraldHierPolicy.directory_host_of`
    homed = np.bincount(directory_host, minlength=H)  # the rows whose directory each host keeps
    fill = d.slots.fill.reshape(H, P * T).sum(axis=1)  # guests held on each host's ranks
    cap = d.slots.cap.reshape(H, P * T)
    big = (d.slots.cap > pool.size).reshape(H, P * T).sum(axis=1)
    fixed = P * T * GROUP_BYTES + big * pool.size * POOL_KEY_BYTES
    needs = homed * RANK_BYTES + fill * GUEST_BYTES + fixed
    needs_full = homed * RANK_BYTES + cap.sum(axis=1) * GUEST_BYTES + fixed
    h = int(np.argmax(needs))
    return {
        "R": R,
        "hosts": H,
        "total_rows": int(d.owner.shape[0]),
        "steps": steps,
        "replica_bytes": {**replica, "total": int(sum(replica.values()))},
        "host_needs_bytes": {
            "host": h,
            "directory_rows": int(homed[h]),
            "directory_owners": int(homed[h] * RANK_BYTES),
            "guests_held": int(fill[h]),
            "guests": int(fill[h] * GUEST_BYTES),
            "groups_and_pools": int(fixed[h]),
            "total": int(needs[h]),
            "total_caches_full": int(needs_full.max()),
        },
        "guest_bytes": GUEST_BYTES,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0, help="synthetic table size scale (1: full Criteo Kaggle)")
    p.add_argument("--workers", default="64,256", help="R, a comma list (one process each is fairer for the RSS)")
    p.add_argument("--ranks-per-host", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--cache-ratio", type=float, default=0.1)
    p.add_argument("--lookahead", type=int, default=4)
    args = p.parse_args(argv)
    workers = [int(x) for x in args.workers.split(",") if x.strip()]
    bad = [w for w in workers if w < 2 * args.ranks_per_host or w % args.ranks_per_host]
    if bad or args.steps < 1 or args.batch < 1:
        p.error(
            f"--workers must be multiples of --ranks-per-host with two hosts or more (got {bad}); steps, batch >= 1"
        )
    out = {
        "config": vars(args),
        "runs": [
            measure(args.scale, R, args.ranks_per_host, args.batch, args.steps, args.cache_ratio, args.lookahead)
            for R in workers
        ],
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
