"""Location-aware input allocation: capacity-constrained assignment of samples to ranks (exactly B each).

`balanced_assign(score, B, first)` maximises sum(score[s, rank(s)]) approximately, deterministically and
vectorised: in rounds, every unassigned sample bids for its best rank among those with room; each rank accepts the
bids with the largest *regret* (best minus second-best score: what the sample loses if sent elsewhere), then the
highest score, then the lowest sample index. Every round fills at least one rank or assigns every sample, so there
are at most R rounds. Ties between ranks go to the first rank in the rotation first, first+1, ... (by batch id), so
that no rank is favoured across steps. numpy (native.balanced_assign: the same, compiled).

`stream_assign` is the other first pass (HeraldPolicy's `first_pass`): one pass over the samples in batch order, each
to the open rank where most of its keys already are (owned, or read by a sample placed before it).
"""

from __future__ import annotations

import numpy as np


def balanced_assign(score: np.ndarray, batch_per_rank: int, first: int = 0) -> np.ndarray:
    """Rank of every sample (int64 [N]); score is [N, R] (int or float), N must equal R * batch_per_rank."""
    N, R = score.shape
    B = batch_per_rank
    if N != R * B:
        raise ValueError(f"balanced_assign: {N} samples cannot fill {R} ranks x {B}")
    rot = (np.arange(R, dtype=np.int64) + first) % R
    sc = np.asarray(score).astype(np.float32)  # our working copy (rounds mask columns in place)
    if first % R:
        sc = np.roll(sc, -(first % R), axis=1)  # column j is rank rot[j]
    if R == 2 and N:
        return _two_ranks(sc, B, rot)
    return _rounds(sc, B, rot)


def _key(best: np.ndarray, regret: np.ndarray, bval: np.ndarray, scale: float) -> np.ndarray:
    """Acceptance order within a round: rank, then regret descending, then score descending (sorted stably, so
    sample order breaks the remaining ties)."""
    return best * (4.0 * scale * scale + 4.0 * scale) - regret.astype(np.float64) * (2.0 * scale + 1.0) - bval


def _two_ranks(sc: np.ndarray, B: int, rot: np.ndarray) -> np.ndarray:
    """`_rounds` for two ranks in one pass: the first round (every sample bids for its better column, ties to the
    first) either fills both exactly or overfills one column, which keeps its B best bids; the second round sends
    every other sample to the other column. The same arithmetic as `_rounds`, hence the same assignment."""
    N = sc.shape[0]
    s0, s1 = sc[:, 0], sc[:, 1]
    best = (s1 > s0).astype(np.int64)  # argmax: ties go to column 0
    n1 = int(best.sum())
    if n1 == B:
        return rot[best]
    bval = np.where(best == 1, s1, s0)
    regret = bval - np.where(best == 1, s0, s1)
    order = np.argsort(_key(best, regret, bval, float(np.abs(sc).max()) + 1.0), kind="stable")
    c = 1 if n1 > B else 0  # the overfilled column
    col = np.full(N, 1 - c, dtype=np.int64)
    col[order[best[order] == c][:B]] = c
    return rot[col]


def _rounds(sc: np.ndarray, B: int, rot: np.ndarray) -> np.ndarray:
    """The bidding rounds (module docstring) on float32 scores whose column j is rank rot[j]."""
    N, R = sc.shape
    room = np.full(R, B, dtype=np.int64)
    out = np.full(N, -1, dtype=np.int64)
    todo = None
    neg = np.float32(-np.inf)
    scale = float(np.abs(sc).max()) + 1.0 if N else 1.0
    while True:
        open_ = room > 0
        nopen = int(open_.sum())
        sub = sc if todo is None else sc[todo]
        n = sub.shape[0]
        if n == 0:
            break
        if nopen == 1:
            out[np.arange(N) if todo is None else todo] = rot[np.flatnonzero(open_)[0]]
            break
        if not open_.all():
            sub[:, ~open_] = neg
        ar = np.arange(n)
        best = np.argmax(sub, axis=1)
        bval = sub[ar, best]
        sub[ar, best] = neg
        regret = bval - sub.max(axis=1)
        if todo is None:
            sub[ar, best] = bval  # restore (sc is reused by later rounds)
        cnt = np.bincount(best, minlength=R)
        if (cnt <= room).all():
            acc = ar
        else:
            # rank, then regret desc, then score desc; a stable sort keeps sample order among equals
            order = np.argsort(_key(best, regret, bval, scale), kind="stable")
            b_sorted = best[order]
            start = np.cumsum(cnt) - cnt
            within = ar - start[b_sorted]
            acc = order[within < room[b_sorted]]
        idx = acc if todo is None else todo[acc]
        out[idx] = rot[best[acc]]
        room -= np.bincount(best[acc], minlength=R)
        keep = np.ones(n, dtype=bool)
        keep[acc] = False
        todo = np.flatnonzero(keep) if todo is None else todo[keep]
    return out


STREAM_READERS = 16  # distinct reader ranks a key is tracked for in `stream_assign`; beyond, it is everywhere


def stream_assign(
    num_samples: int,
    num_ranks: int,
    batch_per_rank: int,
    es: np.ndarray,
    ec: np.ndarray,
    w: np.ndarray,
    own: np.ndarray,
    cap: int = STREAM_READERS,
    hosts: np.ndarray | None = None,
    intra: float = 0.0,
) -> np.ndarray:
    """LAIA's first pass as a stream: rank of every sample (int64 [N], exactly B per rank). Samples go in batch order,
    each to the open rank where most of its keys already are, weighed by `w` per element: owned there (`own[k]`;
    < 0: by no rank here), or read there by a sample placed before it. So the samples that share a key gather where
    the first of them went, which bidding on owners alone (`balanced_assign`) does not do: at 64 ranks it co-located
    fewer (key, rank) pairs than the contiguous split. A key read at more than `cap` ranks scores nowhere (it is
    everywhere). Ties go to the lowest rank; a sample that scores at no open rank goes to the least loaded one.

    Host-aware (`hosts`: the host of every rank): the same sums over hosts too (a key is at a host that owns it or
    reads it, its reading hosts never saturate), and a rank scores `intra` x its own sum + (1 - intra) x its host's,
    HeraldPolicy's host-aware cost (a row moved inside a host costs `intra` of one crossing hosts); the best open rank
    with a positive score wins.

    `es` / `ec`: every element's sample and key index. The loop is Python's here (seconds at 64 ranks: the numpy
    fallback of native.assign(stream_cap=cap), which computes the same assignment, float sums in the same order).
    """
    N, R, B = num_samples, num_ranks, batch_per_rank
    if N != R * B:
        raise ValueError(f"stream_assign: {N} samples cannot fill {R} ranks x {B}")
    order = np.argsort(es, kind="stable")
    bounds = np.searchsorted(es[order], np.arange(N + 1)).tolist()
    keys, weights = ec[order].tolist(), w[order].tolist()
    owners = own.tolist()
    host_of = None if hosts is None else [int(h) for h in hosts]
    left: dict[int, int] = {}
    for k in keys:
        left[k] = left.get(k, 0) + 1
    readers: dict[int, list[int]] = {}
    host_readers: dict[int, set[int]] = {}
    saturated: set[int] = set()
    load = [0] * R
    out = np.empty(N, dtype=np.int64)
    for n in range(N):
        lo, hi = bounds[n], bounds[n + 1]
        score: dict[int, float] = {}
        host_score: dict[int, float] = {}
        for k, x in zip(keys[lo:hi], weights[lo:hi]):
            o = owners[k]
            if o >= 0:
                score[o] = score.get(o, 0.0) + x
            if k not in saturated:
                for r in readers.get(k, ()):
                    if r != o:
                        score[r] = score.get(r, 0.0) + x
            if host_of is not None:
                ho = host_of[o] if o >= 0 else -1
                if ho >= 0:
                    host_score[ho] = host_score.get(ho, 0.0) + x
                for h in host_readers.get(k, ()):
                    if h != ho:
                        host_score[h] = host_score.get(h, 0.0) + x
        best, top = -1, 0.0
        if host_of is None:
            for r, v in score.items():
                if load[r] < B and (best < 0 or v > top or (v == top and r < best)):
                    best, top = r, v
        else:
            for r in range(R):
                v = intra * score.get(r, 0.0) + (1.0 - intra) * host_score.get(host_of[r], 0.0)
                if load[r] < B and v > 0.0 and (best < 0 or v > top):
                    best, top = r, v
        if best < 0:
            best = min((r for r in range(R) if load[r] < B), key=lambda r: (load[r], r))
        out[n] = best
        load[best] += 1
        for k in keys[lo:hi]:
            left[k] -= 1
            if left[k] == 0:  # no later sample reads it
                continue
            if host_of is not None:
                host_readers.setdefault(k, set()).add(host_of[best])
            if k in saturated:
                continue
            got = readers.setdefault(k, [])
            if best in got:
                continue
            if len(got) == cap:
                saturated.add(k)
            else:
                got.append(best)
    return out
