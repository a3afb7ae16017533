"""A rank's part of a step's plan: what a planner sends each rank it plans for, instead of the whole plan.

Why: the whole plan lists every shared row with all its readers and every sample's rank, so what each rank receives
grows with R, while a rank executes only the pairs it sends, receives or relays. `plan_parts` cuts the whole plan
into `PlanPart`s (schedule/plan.py) such that `prepare_shared` lays out, on a rank's part, exactly what it lays out on
the whole plan for that rank: the same pairs in the same relative order, hence the same all-to-all splits on both
sides of every pair of ranks, bit for bit (tests/distributed/step/test_plan_part.py). The pairs of a shared row that
a rank needs:

* as the row's owner before the moves (it sends the values) or after them (it sums the gradients): every pair;
* as a reader: its own pair and its host's relay pair (host_relay.py: where its value comes from and its gradient
  goes), and, where it is that relay, every pair of its host (it forwards their values and adds their gradients).

Every move stays in every part: each rank's ownership directory applies all of them (and the executor checks the
moves against it). The whole step's facts that decide which collectives run stay too (`shared_tables`,
`relayed_tables`), so every rank still runs the same collectives.

Worked example (4 ranks, hosts {0, 1} and {2, 3}, relays on; row k owned by rank 0 before and after the moves, read
by ranks 1, 2 and 3; rank 2 relays k for host 1): rank 0's part lists k with readers [1, 2, 3] (it sends k's value
to 1 and 2 and receives two gradients), rank 1's [1], rank 2's [2, 3] (it forwards the value to 3 and adds 3's
gradient to its own), rank 3's [2, 3] (its value comes from 2); both parts of host 1 name relays [k: 2].

numpy only; the input stage (train_pipeline/input_stage.py) cuts the parts on the planning rank.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from herald_torchrec.distributed.step.host_relay import FROM_RELAY, TO_RELAY, HostMap, pair_routes
from herald_torchrec.schedule.plan import Plan, PlanPart, SharedRows

_ROW_BITS = 40  # a (table, row) pair as one int64: table << 40 | row (rows < 2^40)


def splittable(plan: Plan) -> bool:
    """Whether the plan can travel as parts: an ownership plan (no replicas, caches or read versions) for ranks
    executing it. The others travel whole."""
    return (
        type(plan) is Plan and plan.executable and plan.replicas is None and plan.cache is None and plan.reads is None
    )


def owners_before_moves(plan: Plan) -> np.ndarray:
    """The owner of every shared row before the step's moves: a moved row's source, else its owner after them."""
    sh, mv = plan.shared, plan.moves
    before = np.asarray(sh.owner, dtype=np.int64).copy()
    if len(mv) and len(sh):
        moved = (np.asarray(mv.table, dtype=np.int64) << _ROW_BITS) | np.asarray(mv.row, dtype=np.int64)
        order = np.argsort(moved, kind="stable")
        moved = moved[order]
        keys = (np.asarray(sh.table, dtype=np.int64) << _ROW_BITS) | np.asarray(sh.row, dtype=np.int64)
        at = np.minimum(np.searchsorted(moved, keys), moved.shape[0] - 1)
        hit = moved[at] == keys
        before[hit] = np.asarray(mv.src, dtype=np.int64)[order[at[hit]]]
    return before


def plan_parts(plan: Plan, ranks: Sequence[int], hosts: HostMap | None) -> dict[int, PlanPart]:
    """The part of `plan` each of `ranks` executes (module docstring). `hosts` must be the host map the ranks' modules
    relay with (`set_hosts`): the relays decide which readers a part keeps."""
    if not splittable(plan):
        raise ValueError(f"plan {plan.step}: only ownership plans travel as parts (replicas and caches travel whole)")
    R, B = plan.num_ranks, plan.batch_per_rank
    sh = plan.shared
    n = len(sh)
    counts = np.diff(np.asarray(sh.reader_offsets, dtype=np.int64))
    pair_row = np.repeat(np.arange(n, dtype=np.int64), counts)
    readers = np.asarray(sh.readers, dtype=np.int64)
    after = np.asarray(sh.owner, dtype=np.int64)
    before = owners_before_moves(plan)
    p_before, p_after = before[pair_row], after[pair_row]
    fill = (readers == p_after) & (p_before != p_after)  # the reader receives the row itself in the moves
    by_host = hosts if hosts is not None and hosts.shares_hosts else None
    rt = pair_routes(pair_row, readers, p_before, p_after, fill, by_host)
    tables = np.asarray(sh.table, dtype=np.int64)
    relayed = (rt.value_stage == FROM_RELAY) | (rt.grad_stage == TO_RELAY)
    shared_tables, relayed_tables = np.unique(tables), np.unique(tables[pair_row[relayed]])
    # (rank, pair) for every pair a rank needs: the owners', the reader's own, the relay's, the reader's relay pair
    P = readers.shape[0]
    pair = np.arange(P, dtype=np.int64)
    rp = rt.relay_pair
    dest = np.concatenate([p_before, p_after, readers, readers[rp], readers])
    what = np.concatenate([pair, pair, pair, pair, rp])
    wanted = np.zeros(R, dtype=bool)
    wanted[np.asarray(ranks, dtype=np.int64)] = True
    keep = wanted[dest]
    code = np.unique(dest[keep] * max(P, 1) + what[keep])  # by rank, then pair (the whole plan's order)
    code_rank, code_pair = np.divmod(code, max(P, 1))
    order = np.asarray(plan.sample_order, dtype=np.int64)
    assignment = plan.assignment()
    parts: dict[int, PlanPart] = {}
    for d in sorted({int(x) for x in ranks}):
        lo, hi = np.searchsorted(code_rank, [d, d + 1])
        pairs = code_pair[lo:hi]
        rows, first = np.unique(pair_row[pairs], return_index=True)
        offsets = np.append(first, pairs.shape[0]).astype(np.asarray(sh.reader_offsets).dtype)
        shared = SharedRows(sh.table[rows], sh.row[rows], sh.owner[rows], offsets, sh.readers[pairs])
        parts[d] = PlanPart(
            step=plan.step,
            num_ranks=R,
            batch_per_rank=B,
            sample_order=order[d * B : (d + 1) * B].astype(plan.sample_order.dtype),
            moves=plan.moves,
            shared=shared,
            counters=dict(plan.counters),
            stateful_kinds=plan.stateful_kinds,
            executable=plan.executable,
            sched_seconds=plan.sched_seconds,
            stale_reads=plan.stale_reads,
            rank=d,
            slice_ranks=assignment[d * B : (d + 1) * B],
            shared_tables=shared_tables,
            relayed_tables=relayed_tables,
        )
    return parts
