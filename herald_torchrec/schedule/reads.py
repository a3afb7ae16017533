"""Who reads what in one step: distinct keys, distinct (key, reader) pairs and reader sets, without sorting keys.

Sorting ~50k int64 keys per step costs ~2 ms and np.unique ~7 ms on the reference machine, more than the whole
scheduling budget, so distinct keys are found with a *representative* scatter: `scratch[gid] = arange(n)` leaves one
position per distinct gid (the last write wins; which one does not change any result, only the order of `keys`,
which every consumer treats as a set or re-sorts). Pairs are grouped by rank with a stable radix sort of a 16-bit
rank array. All work is O(pairs) and touches O(rows) scratch memory that is never cleared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class Scratch:
    """Reusable int64 scratch indexed by global row (or by compact key id)."""

    def __init__(self, size: int) -> None:
        self.a = np.zeros(max(1, size), dtype=np.int64)

    def get(self, size: int) -> np.ndarray:
        if self.a.shape[0] < size:
            self.a = np.zeros(size, dtype=np.int64)
        return self.a


def distinct(values: np.ndarray, scratch: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unique values, compact id of every element, count of every unique value); values index `scratch`."""
    n = values.shape[0]
    ar = np.arange(n, dtype=np.int64)
    scratch[values] = ar
    rep = scratch[values]
    is_rep = rep == ar
    uniq = values[is_rep]
    cid_of = np.cumsum(is_rep) - 1
    cid = cid_of[rep]
    counts = np.bincount(cid, minlength=uniq.shape[0])
    return uniq, cid, counts


@dataclass
class StepReads:
    """Reads of one step. Keys are global row ids; `pair_*` are the distinct (key, reader) pairs, grouped by rank."""

    keys: np.ndarray  # int64 [K] distinct keys
    key_samples: np.ndarray  # int64 [K] samples reading the key (any rank)
    count: np.ndarray  # int64 [K] distinct readers
    pair_key: np.ndarray  # int64 [P] compact key id (index into keys)
    pair_rank: np.ndarray  # int64 [P]
    pair_samples: np.ndarray  # int64 [P] samples of that rank reading that key
    rank_bounds: np.ndarray  # int64 [R+1]: pairs of rank r are pair_*[rank_bounds[r]:rank_bounds[r+1]]
    pair_cid: np.ndarray  # int64 [n] compact key id of every input (sample, key) element

    @property
    def num_pairs(self) -> int:
        return int(self.pair_key.shape[0])

    def readers_csr(self, key_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For the keys selected by `key_mask` [K] (bool): (compact key ids, reader offsets, readers sorted)."""
        sel = key_mask[self.pair_key]
        pk, pr = self.pair_key[sel], self.pair_rank[sel]
        order = np.argsort(pk, kind="stable")  # pairs are rank-ordered: stable keeps readers sorted per key
        pk, pr = pk[order], pr[order]
        ids = np.flatnonzero(key_mask)
        cnt = self.count[ids]
        offs = np.concatenate([[0], np.cumsum(cnt)]).astype(np.int64)
        # pk is sorted by compact id, so it follows `ids` order
        return ids, offs, pr


def step_reads(gid: np.ndarray, rank: np.ndarray, num_ranks: int, scratch: Scratch) -> StepReads:
    """Distinct keys and (key, reader) pairs of the (gid, rank) elements of one step."""
    n = gid.shape[0]
    keys, cid, key_samples = distinct(gid, scratch.get(int(gid.max()) + 1 if n else 1))
    K = keys.shape[0]
    rk = rank.astype(np.int16) if num_ranks < 32768 else rank
    order = np.argsort(rk, kind="stable")
    c_sorted = cid[order]
    bounds = np.concatenate([[0], np.cumsum(np.bincount(rank, minlength=num_ranks))]).astype(np.int64)
    s = scratch.get(max(K, 1))
    pk_parts, ps_parts, pr_bounds = [], [], [0]
    for r in range(num_ranks):
        seg = c_sorted[bounds[r] : bounds[r + 1]]
        if seg.shape[0] == 0:
            pr_bounds.append(pr_bounds[-1])
            continue
        u, _, c = distinct(seg, s)
        pk_parts.append(u)
        ps_parts.append(c)
        pr_bounds.append(pr_bounds[-1] + u.shape[0])
    pair_key = np.concatenate(pk_parts) if pk_parts else np.zeros(0, dtype=np.int64)
    pair_samples = np.concatenate(ps_parts) if ps_parts else np.zeros(0, dtype=np.int64)
    rb = np.array(pr_bounds, dtype=np.int64)
    pair_rank = np.repeat(np.arange(num_ranks, dtype=np.int64), np.diff(rb))
    count = np.bincount(pair_key, minlength=K)
    return StepReads(keys, key_samples, count, pair_key, pair_rank, pair_samples, rb, cid)
