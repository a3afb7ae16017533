"""Owner balancing: hand shared rows from overloaded owners to their least loaded readers (one step, numpy).

Why: the owner of a shared row sends its value to every remote reader and takes every gradient back, 2 rows per
remote reader; home placement is TorchRec's ROW_WISE blocks, so the Zipf heads of every table (rows 0, 1, ...) start
on the lowest ranks, and a row read by n other ranks every step costs its owner 2 n rows a step. Replication takes
the rows every rank reads off the shared path; the heads read by many but not all ranks stay, and at R=64 they make
ranks 0-3 the busiest of a BSP step (1.3-1.4x the mean rank's rows; benchmarks/RESULTS.md).

Each rank's load in the step is the rows it sends plus receives under the decided owners: 2 per remote read it
makes, 2 per remote read of a row it owns, 1 per migration it sends or takes. While a rank's load is above
`factor` x the mean, its shared rows that it reads itself, most remote readers first, move to the reader with the
least load, where the move keeps that reader at or below the threshold. Moving row k (n = readers - 1 remote
readers) from an owner that reads it to another reader: the old owner's load falls by 2 n - 3 (it stops serving,
becomes a remote reader, sends the row), the new owner's rises by 2 n - 1; the step moves 1 row more (the
migration; 0 when the row was migrating this step anyway, whose previous target's load falls by 2 n - 1). The new
owner keeps the row while it reads it (the ownership rule), so a hot row moves about once. It is an ordinary
MIGRATE of a row read this step, as the ownership rule already makes for shared rows whose owner does not read them:
the protocol's exactness is untouched, and the capacity pass after it may cancel a move like any other arrival.
Replicated rows are left out (no shared path). Deterministic: ties go to the lowest rank, then the lowest key.

Planned per host (`herald_hier`), each directory host balances the load its own keys make, against its keys' mean:
if every directory host keeps each rank at or below the factor x its mean, so does their sum. It knows nothing of
the other directory hosts' rows, so a row whose move would pass the threshold at any rank (read by most ranks:
2 n - 1 above the threshold less the least loaded rank's rows; the rows of the 18 tiny tables, all homed on rank 0,
at R=256) cannot be balanced that way, and it is the bulk of the busiest rank's rows (rank 0 owned 31 such rows of
32 directory hosts: 4x the mean). Such a heavy row goes to its directory host's own `heavy_ranks` (herald_hier:
ranks = d mod H for directory host d, disjoint between directory hosts, so that none piles its heavy rows where
another already did), to the least loaded of them reading it, and stays while its owner reads it there.

Compiled where the kernels run (`native.balance_owners`, the same moves in the same order; tests/schedule/
test_native.py): the loop below is a few microseconds per candidate row in Python, hundreds of rows per step.
"""

from __future__ import annotations

import heapq

import numpy as np

from herald_torchrec.schedule import native

OWNER_BALANCE = 1.15  # default factor over the mean rank's rows above which an owner hands rows on (docs/scheduler.md)


def check_factor(factor) -> float | None:
    """The owner-balance setting: None (off), a number >= 1, or "auto" (`OWNER_BALANCE`)."""
    if factor is None:
        return None
    if isinstance(factor, str) and factor == "auto":
        return OWNER_BALANCE
    if isinstance(factor, bool) or not isinstance(factor, (int, float, np.floating)) or not factor >= 1.0:
        raise ValueError(f"herald: owner_balance must be None, a number >= 1 or 'auto', got {factor!r}")
    return float(factor)


def rank_loads(
    want: np.ndarray,
    own: np.ndarray,
    count: np.ndarray,
    pair_key: np.ndarray,
    pair_rank: np.ndarray,
    skip: np.ndarray | None,
    num_ranks: int,
) -> np.ndarray:
    """Rows every rank sends + receives in the step (float64 [R]): shared values and gradients of the keys not in
    `skip` (read by `pair_rank` of `pair_key`, owned by `want`) and the migrations own -> want."""
    R = num_ranks
    po = want[pair_key]
    remote = pair_rank != po
    if skip is not None:
        remote &= ~skip[pair_key]
    load = 2.0 * (np.bincount(pair_rank[remote], minlength=R) + np.bincount(po[remote], minlength=R))
    mig = want != own
    load += np.bincount(own[mig], minlength=R) + np.bincount(want[mig], minlength=R)
    return load


def balance_owners(
    want: np.ndarray,
    own: np.ndarray,
    count: np.ndarray,
    start: np.ndarray,
    pair_key: np.ndarray,
    pair_rank: np.ndarray,
    skip: np.ndarray | None,
    num_ranks: int,
    factor: float,
    heavy_ranks: np.ndarray | None = None,
) -> int:
    """Move shared rows off overloaded owners (module docstring), in place in `want` (the owner of every key after
    the step; `own`: before it). `count` / `start` / `pair_*`: the step's readers per key (CSR, sorted by key then
    rank); `skip`: keys that are not on the shared path (replicated); `heavy_ranks`: bool [R], the ranks that take
    the rows too heavy for the threshold (None: those stay). Returns the number of rows handed on."""
    if native.enabled():
        return native.balance_owners(want, own, count, start, pair_rank, skip, num_ranks, factor, heavy_ranks)
    R = num_ranks
    load = rank_loads(want, own, count, pair_key, pair_rank, skip, R)
    thr = factor * float(load.mean())
    moved = 0 if heavy_ranks is None else _place_heavy(want, own, count, start, pair_rank, skip, load, thr, heavy_ranks)
    over = load > thr
    if not over.any():
        return moved
    # candidates: shared keys (>= 2 readers) whose owner after the step reads them, owned by an overloaded rank
    K = want.shape[0]
    owner_reads = np.zeros(K, dtype=bool)
    owner_reads[pair_key[pair_rank == want[pair_key]]] = True
    cand = owner_reads & (count >= 2) & over[want]
    if skip is not None:
        cand &= ~skip
    ck = np.flatnonzero(cand)
    if ck.shape[0] == 0:
        return moved
    # per owner, most remote readers first (then lowest key)
    o = np.lexsort((ck, -count[ck], want[ck]))
    ck = ck[o]
    co = want[ck]
    bounds = np.searchsorted(co, np.arange(R + 1))
    heap = [(-load[r], r) for r in np.flatnonzero(over).tolist()]
    heapq.heapify(heap)
    while heap:
        _, r = heapq.heappop(heap)
        for k in ck[bounds[r] : bounds[r + 1]].tolist():
            if load[r] <= thr:
                break
            n = int(count[k]) - 1
            gain = 2 * n - 1  # the new owner's extra rows
            drop = gain if want[k] != own[k] else gain - 2  # the old one's fewer rows (it sends the row if it owns it)
            if drop <= 0:
                continue  # one remote reader: handing the row on would not lighten its owner
            readers = pair_rank[start[k] : start[k] + count[k]]
            readers = readers[(readers != r) & (readers != own[k])]  # (own[k] reads no migrating row: kept simple)
            if readers.shape[0] == 0:
                continue
            lr = load[readers]
            best = int(np.argmin(lr))  # ties: the lowest rank (readers are sorted)
            if lr[best] + gain > thr:
                continue  # no reader takes it without becoming overloaded; a smaller row may fit
            dst = int(readers[best])
            load[dst] += gain
            load[r] -= drop
            want[k] = dst
            moved += 1
    return moved


def _place_heavy(want, own, count, start, pair_rank, skip, load, thr: float, heavy_ranks: np.ndarray) -> int:
    """Rows no rank could take under `thr` (2 n - 1 > thr - the least load, n remote readers) and owned outside
    `heavy_ranks` go to the least loaded of their readers among `heavy_ranks` (ties: the lowest rank), widest rows
    first; `load` is updated as `balance_owners` counts it (the decided owner reads every shared row it keeps).
    Returns the moves."""
    heavy = (2 * count - 3 > thr - load.min()) & ~heavy_ranks[want]
    if skip is not None:
        heavy &= ~skip
    hk = np.flatnonzero(heavy)
    moved = 0
    for k in hk[np.argsort(-count[hk], kind="stable")].tolist():
        readers = pair_rank[start[k] : start[k] + count[k]]
        readers = readers[heavy_ranks[readers] & (readers != own[k])]
        if readers.shape[0] == 0:
            continue
        dst = int(readers[int(np.argmin(load[readers]))])
        gain = 2 * int(count[k]) - 3
        load[dst] += gain
        load[want[k]] -= gain if want[k] != own[k] else gain - 2
        want[k] = dst
        moved += 1
    return moved
