"""A rank's part of a step's plan: what a planner sends each rank it plans for, instead of the whole plan.

Why: the whole plan lists every move, every shared row with all its readers and every sample's rank, so what each
rank receives grows with R, while a rank executes only the rows it sends, receives or relays. `plan_parts` cuts the
whole plan into `PlanPart`s (schedule/plan.py) such that `prepare_moves` and `prepare_shared` lay out, on a rank's
part, exactly what they lay out on the whole plan for that rank: the same rows in the same relative order, hence
the same all-to-all splits on both sides of every pair of ranks, bit for bit
(tests/distributed/step/test_plan_part.py). The pairs of a shared row that a rank needs:

* as the row's owner before the moves (it sends the values) or after them (it sums the gradients): every pair;
* as a reader: its own pair and its host's relay pair (host_relay.py: where its value comes from and its gradient
  goes), and, where it is that relay, every pair of its host (it forwards their values and adds their gradients).

Moves: a part holds those this rank sends or receives, and those of the shared rows it holds (their owner before
the moves sends the values). So a rank's ownership map (`RowStore.owner_all`) stays exact for its own rows only; the
executor checks a part's moves against those, and a static plan, a whole plan or a checkpoint first rebuilds the map
from every rank's guests (`HeraldEmbeddingBagCollection.sync_directory`, one all-gather). The whole step's facts
that decide which collectives run travel in every part (`moved_tables`, `shared_tables`, `relayed_tables`), so
every rank still runs the same collectives.

Worked example (4 ranks, hosts {0, 1} and {2, 3}, relays on; row k owned by rank 0 before and after the moves, read
by ranks 1, 2 and 3; rank 2 relays k for host 1): rank 0's part lists k with readers [1, 2, 3] (it sends k's value
to 1 and 2 and receives two gradients), rank 1's [1], rank 2's [2, 3] (it forwards the value to 3 and adds 3's
gradient to its own), rank 3's [2, 3] (its value comes from 2). Had k moved this step from some rank q to rank 0,
the move would be in the parts of q and 0 (its two ends) and of ranks 1, 2 and 3 (k's value comes from q).

numpy, with two compiled passes over every pair (host_kernels.relay_groups, part_pairs); the input stage
(train_pipeline/input_stage.py) cuts the parts on the planning rank.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from herald_torchrec.distributed import host_kernels
from herald_torchrec.distributed.step.host_relay import HostMap, pair_routes
from herald_torchrec.schedule.herald.planner import host_ids
from herald_torchrec.schedule.plan import HostPlan, Plan, PlanPart, RowMoves, SharedRows, relayed_pairs

_ROW_BITS = 40  # a (table, row) pair as one int64: table << 40 | row (rows < 2^40)
MARK_LIMIT = 1 << 26  # (part, pair) cells marked in a bitmap (64 MB); past it the parts' pairs are sorted


PARTS_FROM_RANKS = 9  # on one machine, parts pay from this many ranks on (`parts_pay`)


def parts_pay(num_ranks: int, num_hosts: int) -> bool:
    """Whether a run's planners send parts rather than whole plans: where ranks span several machines (each rank
    would lay out the whole plan's every pair, the host relays' layout: 1.6 ms at R=16 against 0.8 on its part), or
    from PARTS_FROM_RANKS ranks on one machine. Below that, on one machine, the whole plan is small (11 KB at R=2,
    where a part is 12 KB) and the compiled layout lays it out faster (0.2 against 0.4 ms at R=2) than the planner
    cuts parts (0.4 ms) (benchmarks/plan_bytes.py, RESULTS.md)."""
    return num_hosts > 1 or num_ranks >= PARTS_FROM_RANKS


def splittable(plan: Plan) -> bool:
    """Whether the plan can travel as parts: an ownership plan (no replicas, caches or read versions) for ranks
    executing it, whole or a host's (`HostPlan`, which only travels so). The others travel whole."""
    return (
        type(plan) in (Plan, HostPlan)
        and plan.executable
        and plan.replicas is None
        and plan.cache is None
        and plan.reads is None
    )


def _tables_in(tables: np.ndarray) -> np.ndarray:
    """The distinct tables among `tables` (table indices), sorted: a count, not a sort."""
    return np.flatnonzero(np.bincount(tables)) if tables.shape[0] else tables[:0]


def _keys(table: np.ndarray, row: np.ndarray) -> np.ndarray:
    return (np.asarray(table, dtype=np.int64) << _ROW_BITS) | np.asarray(row, dtype=np.int64)


def _positions(where: np.ndarray, what: np.ndarray) -> np.ndarray:
    """The index in `where` (distinct keys) of each of `what`, -1 where absent."""
    out = np.full(what.shape[0], -1, dtype=np.int64)
    if where.shape[0] and what.shape[0]:
        order = np.argsort(where, kind="stable")
        at = np.minimum(np.searchsorted(where[order], what), where.shape[0] - 1)
        hit = where[order[at]] == what
        out[hit] = order[at[hit]]
    return out


def owners_before_moves(plan: Plan, moved: np.ndarray | None = None) -> np.ndarray:
    """The owner of every shared row before the step's moves: a moved row's source, else its owner after them (a
    part holds the moves of its shared rows, so this holds for parts too). `moved`: `_shared_row_of_moves(plan)`,
    where the caller has it (a row moves at most once in a step: schedule/checker.py)."""
    sh, mv = plan.shared, plan.moves
    moved = _shared_row_of_moves(plan) if moved is None else moved
    before = np.asarray(sh.owner, dtype=np.int64).copy()
    ok = moved < len(sh)
    before[moved[ok]] = np.asarray(mv.src, dtype=np.int64)[ok]
    return before


def _shared_row_of_moves(plan: Plan) -> np.ndarray:
    """For every move, the index of its row among the shared rows, or len(shared) where the row is not shared."""
    at = _positions(_keys(plan.shared.table, plan.shared.row), _keys(plan.moves.table, plan.moves.row))
    at[at < 0] = len(plan.shared)
    return at


def _relay_groups(
    sh: SharedRows,
    pair_row: np.ndarray,
    before: np.ndarray,
    after: np.ndarray,
    hosts: HostMap,
    wanted_host: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(the tables with a relayed (row, host) group, whether each pair is read on a wanted host), without routing
    every pair: a (row, host) goes through its relay iff it has two readers that do not receive the row in the
    moves and the host is not both owners' (pair_routes' rule, at the level of the group). `before` / `after`: every
    shared row's owners. One compiled pass where the kernels are on (O(pairs), the cut's largest cost at R=256)."""
    tables = np.asarray(sh.table, dtype=np.int64)
    readers = np.asarray(sh.readers, dtype=np.int64)
    num_tables = int(tables.max()) + 1 if tables.shape[0] else 0
    got = host_kernels.relay_groups(
        sh.reader_offsets, readers, before, after, tables, hosts.host, wanted_host, num_tables
    )
    if got is not None:
        return got
    relayed = relayed_pairs(pair_row, readers, before, after, hosts.host)
    return _tables_in(tables[pair_row[relayed]]), wanted_host[hosts.host[readers]]


def _relay_pairs(
    sh: SharedRows,
    pair_row: np.ndarray,
    before: np.ndarray,
    after: np.ndarray,
    hosts: HostMap | None,
    wanted: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the step's relayed tables, the pairs read on the hosts of the `wanted` ranks, their relay pairs as
    host_relay.pair_routes chooses them). Elsewhere a pair is its own relay pair: no part here needs theirs."""
    none = np.zeros(0, dtype=np.int64)
    P = pair_row.shape[0]
    if hosts is None or not hosts.relays or P == 0:
        return none, none, none
    wanted_host = np.zeros(hosts.num_hosts, dtype=bool)
    wanted_host[hosts.host[wanted]] = True
    relayed_tables, on_mask = _relay_groups(sh, pair_row, before, after, hosts, wanted_host)
    on = np.flatnonzero(on_mask)  # whole (row, host) groups: pair_routes needs every reader of the group
    rows = pair_row[on]
    readers = np.asarray(sh.readers, dtype=np.int64)[on]
    b, a = before[rows], after[rows]
    rt = pair_routes(rows, readers, b, a, (readers == a) & (b != a), hosts)
    return relayed_tables, on, on[rt.relay_pair]


def _needed_pairs(
    sh: SharedRows,
    pair_row: np.ndarray,
    before: np.ndarray,
    after: np.ndarray,
    slot: np.ndarray,
    on: np.ndarray,
    relay_of_on: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(part, pair) for every pair a part needs, by part, then pair (the plan's order): the owners' (every pair of
    their rows), the reader's own, and on the wanted hosts (`on`, with their relay pairs) the relay's (the pairs it
    relays) and the reader's relay pair. `slot`: each rank's part (-1: none here). One compiled pass where the
    kernels are on; else marked in a bitmap, or sorted past MARK_LIMIT cells (many parts at once)."""
    K = int(slot.max()) + 1
    readers = np.asarray(sh.readers, dtype=np.int64)
    got = host_kernels.part_pairs(sh.reader_offsets, readers, before, after, slot, K, on, relay_of_on)
    if got is not None:
        return got
    P = readers.shape[0]
    wanted = slot >= 0
    codes = []
    for owner in (before, after):
        at = np.flatnonzero(wanted[owner][pair_row])
        codes.append(slot[owner[pair_row[at]]] * P + at)
    at = np.flatnonzero(wanted[readers])
    codes.append(slot[readers[at]] * P + at)
    if on.shape[0]:
        relay_reader = readers[relay_of_on]
        at = wanted[relay_reader]
        codes.append(slot[relay_reader[at]] * P + on[at])  # the relay: every pair it relays
        at = wanted[readers[on]]
        codes.append(slot[readers[on[at]]] * P + relay_of_on[at])  # the reader: its relay's pair
    if K * P <= MARK_LIMIT:  # (part, pair) marked in a bitmap: no sort (a host's 8 parts)
        needs = np.zeros(K * P, dtype=bool)
        for c in codes:
            needs[c] = True
        code = np.flatnonzero(needs)
    else:  # many parts at once (plan_on="rank0" at large R): sorted, in memory of the codes' size
        code = np.unique(np.concatenate(codes))
    return np.divmod(code, max(P, 1))


class _SampleSlices:
    """Where each sample of a rank's slice goes: the whole plan's assignment, computed once for all parts, or a host
    plan's own."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.assignment = None if isinstance(plan, HostPlan) else plan.assignment()

    def of(self, rank: int) -> np.ndarray:
        if self.assignment is None:
            return self.plan.slice_destinations(rank)
        B = self.plan.batch_per_rank
        return self.assignment[rank * B : (rank + 1) * B]


def _host_plan_relays(plan: HostPlan, hosts: HostMap | None) -> np.ndarray:
    """A host plan's relayed tables, where the ranks relay: its planners counted them under their host map, which
    must then be the modules'."""
    if hosts is None or not hosts.relays:
        return plan.relayed_tables[:0]
    R = plan.num_ranks
    same = hosts.host.shape[0] == R and np.array_equal(host_ids(hosts.host, R), host_ids(plan.hosts, R))
    if not same:  # the same grouping of ranks into hosts, whatever the hosts' ids
        raise ValueError(
            f"plan {plan.step}: host {plan.host}'s plan was made for hosts {plan.hosts.tolist()}, but the ranks relay "
            f"shared rows within hosts {hosts.host.tolist()}"
        )
    return plan.relayed_tables


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
    after = np.asarray(sh.owner, dtype=np.int64)
    m_shared = _shared_row_of_moves(plan)  # the shared row each move moves (n: none)
    before = owners_before_moves(plan, m_shared)
    wanted = np.zeros(R, dtype=bool)
    wanted[np.asarray(ranks, dtype=np.int64)] = True
    relayed_tables, on, relay_of_on = _relay_pairs(sh, pair_row, before, after, hosts, wanted)
    shared_tables = _tables_in(np.asarray(sh.table, dtype=np.int64))
    mv = plan.moves
    moved_tables = _tables_in(np.asarray(mv.table, dtype=np.int64))
    if isinstance(plan, HostPlan):  # its rows are the host's: the whole step's tables came with it
        relayed_tables = _host_plan_relays(plan, hosts)
        moved_tables, shared_tables = plan.moved_tables, plan.shared_tables
    cut = sorted({int(x) for x in ranks})
    slot = np.full(R, -1, dtype=np.int64)
    slot[cut] = np.arange(len(cut))
    code_rank, code_pair = _needed_pairs(sh, pair_row, before, after, slot, on, relay_of_on)
    m_src, m_dst = np.asarray(mv.src, dtype=np.int64), np.asarray(mv.dst, dtype=np.int64)
    slices = _SampleSlices(plan)
    parts: dict[int, PlanPart] = {}
    for i, d in enumerate(cut):
        lo, hi = np.searchsorted(code_rank, [i, i + 1])
        pairs = code_pair[lo:hi]
        rows_of = pair_row[pairs]  # non-decreasing: the pairs are in the whole plan's order
        first = np.flatnonzero(np.r_[True, rows_of[1:] != rows_of[:-1]]) if pairs.shape[0] else pairs
        rows = rows_of[first]
        offsets = np.append(first, pairs.shape[0]).astype(np.asarray(sh.reader_offsets).dtype)
        shared = SharedRows(sh.table[rows], sh.row[rows], sh.owner[rows], offsets, sh.readers[pairs])
        held = np.zeros(n + 1, dtype=bool)  # (index n: no shared row)
        held[rows] = True
        m = np.flatnonzero((m_src == d) | (m_dst == d) | held[m_shared])  # in the whole plan's order
        moves = RowMoves(mv.table[m], mv.row[m], mv.src[m], mv.dst[m], mv.kind[m])
        parts[d] = PlanPart(
            step=plan.step,
            num_ranks=R,
            batch_per_rank=B,
            sample_order=plan.local_samples(d).astype(plan.sample_order.dtype),
            moves=moves,
            shared=shared,
            counters=dict(plan.counters),
            stateful_kinds=plan.stateful_kinds,
            executable=plan.executable,
            sched_seconds=plan.sched_seconds,
            stale_reads=plan.stale_reads,
            rank=d,
            slice_ranks=slices.of(d),
            moved_tables=moved_tables,
            shared_tables=shared_tables,
            relayed_tables=relayed_tables,
        )
    return parts
