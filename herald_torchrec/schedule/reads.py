"""Who reads what in one step: distinct keys of a batch and, for an assignment, the distinct (key, reader) pairs.

Speed matters here (the whole step has a ~5 ms budget at R=8): sorting the ~50k (sample, key) elements of a step
costs ~2 ms and np.unique ~7 ms on the reference machine. So:
* `batch_keys` finds the distinct keys of a batch once (the batch object caches it: it is seen first as lookahead)
  with a *representative* scatter — `scratch[gid] = arange(n)` leaves one position per distinct gid — then sorts
  only the distinct keys; past `SCRATCH_LIMIT` rows (full-size tables) with one sort of (id, index) packed into
  int64 (`packed_distinct`). Every element gets the compact id `cid` of its key (index into the sorted keys).
* `step_reads` marks every (key, rank) code in a dense [K, R] bitmap; its set cells, read in row-major order, are
  the distinct (key, reader) pairs already sorted by key, then rank. Above `DENSE_LIMIT` cells (R=256 on a small
  model, R=128 on full-size tables) no [K, R] table is made: the compiled path takes the elements rank by rank and
  appends each key's new readers (O(E + K + R)), the numpy one sorts the codes. Either way the result is a CSR
  (`StepReads`: readers per key, sorted), which every later pass reads.
All arrays are int64 (ids never pass through float). numpy, or the same passes compiled (`native`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from herald_torchrec.schedule import native

DENSE_LIMIT = 1 << 23  # cells of the dense [K, R] count matrix (64 MiB of int64); beyond it, sort


SCRATCH_LIMIT = 1 << 24  # rows beyond which distinct keys are found by sorting instead of a scratch scatter


RADIX_MIN = 256  # sort_ints: below this many values a kernel call saves nothing


def sort_ints(values: np.ndarray) -> np.ndarray:
    """np.sort(values) of int64 values: the compiled radix sort where they are non-negative (10,000-50,000 values:
    0.06-0.3 against 0.35-1.9 ms for numpy's sort on the 2-core machine, whose numpy build sorts int64 without SIMD),
    else numpy's."""
    if values.shape[0] >= RADIX_MIN and native.enabled():
        got = native.sort_nonneg(values)
        if got is not None:
            return got
    return np.sort(values)


def packed_order(values: np.ndarray) -> np.ndarray | None:
    """np.argsort(values, kind="stable") for non-negative integers, by one np.sort of (value, index) packed into one
    int64 (numpy sorts plain integers 10-15x faster than it argsorts them: 0.05 against 0.67 ms for 15,000 values),
    or None where value and index bits do not fit in 62."""
    n = values.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    b = max(int(n - 1).bit_length(), 1)
    if int(values.min()) < 0 or int(values.max()).bit_length() + b > 62:
        return None
    packed = sort_ints((values.astype(np.int64, copy=False) << b) | np.arange(n, dtype=np.int64))
    packed &= (1 << b) - 1
    return packed


RUNS_SHARE = 32  # stable_order: values in fewer than n / RUNS_SHARE sorted runs go to numpy's merge sort


def stable_order(values: np.ndarray) -> np.ndarray:
    """np.argsort(values, kind="stable") of integers (int64), the fastest way numpy has: a radix sort where values
    fit in int16; numpy's stable sort (a timsort, which merges sorted runs) where the values are a few sorted runs,
    as the concatenation of several hosts' sorted messages (5,000-7,000 pairs in 8 runs: 0.02 against 0.24-0.41 ms
    for `packed_order`); else `packed_order`, else the merge sort anyway."""
    v = np.asarray(values)
    n = v.shape[0]
    if n and 0 <= int(v.min()) and int(v.max()) < 2**15:
        return np.argsort(v.astype(np.int16, copy=False), kind="stable").astype(np.int64, copy=False)
    if n > 1 and np.count_nonzero(v[1:] < v[:-1]) < n // RUNS_SHARE:
        return np.argsort(v, kind="stable")
    o = packed_order(v)
    return o if o is not None else np.argsort(v, kind="stable")


def packed_distinct(gid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """np.unique(gid, return_inverse=True, return_counts=True) of non-negative ids from one sort of (id, index)
    packed into int64 (`packed_order`'s trick: 0.6 against 1.1 ms for a host batch of 53,248 ids on full Criteo
    tables); None where the bits do not fit."""
    E = gid.shape[0]
    b = max(int(E - 1).bit_length(), 1)
    if int(gid.min()) < 0 or int(gid.max()).bit_length() + b > 62:
        return None
    packed = (gid.astype(np.int64, copy=False) << b) | np.arange(E, dtype=np.int64)
    packed.sort()
    g = packed >> b
    new = np.empty(E, dtype=bool)
    new[0] = True
    np.not_equal(g[1:], g[:-1], out=new[1:])
    start = np.flatnonzero(new)
    cid = np.empty(E, dtype=np.int64)
    cid[packed & ((1 << b) - 1)] = np.cumsum(new) - 1
    return g[start], cid, np.diff(np.append(start, E))


class Scratch:
    """Reusable scratch indexed by global row; never cleared (every use writes before it reads). It holds positions
    of a batch's elements: int32 (half the bytes of int64 for the random scatter / gather over all rows, which is
    what these passes cost) unless a batch has 2^31 elements or more."""

    def __init__(self, size: int = 0) -> None:
        self.a = {np.dtype(np.int32): np.zeros(0, dtype=np.int32)}  # allocated on first use, grown on demand

    def get(self, size: int, elements: int = 0) -> np.ndarray:
        dtype = np.dtype(np.int32 if elements < 2**31 else np.int64)
        a = self.a.get(dtype)
        if a is None or a.shape[0] < size:
            a = self.a[dtype] = np.zeros(max(size, 1), dtype=dtype)
        return a


def distinct(values: np.ndarray, scratch: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distinct values in first-representative order, compact id of every element (int64), count per distinct
    value).

    `values` are non-negative and index `scratch`, whose integer type holds positions up to len(values).
    Which duplicate becomes the representative does not matter to callers that sort the result (`batch_keys`)."""
    n = values.shape[0]
    ar = np.arange(n, dtype=scratch.dtype)
    scratch[values] = ar
    rep = scratch[values]
    is_rep = rep == ar
    uniq = values[is_rep]
    cid_of = np.cumsum(is_rep, dtype=scratch.dtype) - 1
    cid = cid_of[rep].astype(np.int64)
    counts = np.bincount(cid, minlength=uniq.shape[0])
    return uniq, cid, counts


class BatchKeys:
    """The (sample, key) elements of a batch and its distinct keys (sorted global rows).

    Elements are the batch's flat order (`GlobalBatch.flat`). For single-hot batches (`width` = T) they are
    sample-major [N, T], so per-element sample / table arrays are not materialised unless asked for.
    The batch caches this object, so it holds its batch through a weak reference: a strong one would make a
    reference cycle that only the cyclic garbage collector frees, and finished batches (GBs at hundreds of ranks)
    would pile up between its passes.
    """

    def __init__(self, batch, keys: np.ndarray, cid: np.ndarray, count: np.ndarray, width: int | None) -> None:
        self._batch = weakref.ref(batch)
        self.keys = keys  # int64 [K] distinct global rows, sorted
        self.cid = cid  # int64 [E] index of every element's key in `keys`
        self.count = count  # int64 [K] elements reading the key (samples, for single-hot tables)
        self.width = width  # T for single-hot batches, else None
        self.num_samples = batch.num_samples
        self._first: np.ndarray | None = None

    @property
    def batch(self):
        """The GlobalBatch these keys belong to (alive while anyone uses the keys through it)."""
        batch = self._batch()
        if batch is None:
            raise RuntimeError("BatchKeys: its GlobalBatch was freed; keep the batch while using its keys")
        return batch

    @property
    def smp(self) -> np.ndarray:
        """int64 [E]: sample of every element."""
        return self.batch.flat()[0]

    @property
    def tab(self) -> np.ndarray:
        """int64 [E]: table of every element."""
        return self.batch.flat()[1]

    def element_ranks(self, sample_rank: np.ndarray) -> np.ndarray:
        """rank of every element under an assignment (rank of every sample)."""
        if self.width is not None:
            return np.repeat(sample_rank, self.width)
        return sample_rank[self.smp]

    @property
    def first_sample(self) -> np.ndarray:
        """int64 [K]: a sample that reads the key (computed on first use)."""
        if self._first is None:
            self._first = np.empty(self.keys.shape[0], dtype=np.int64)
            if self.width is not None:  # sample-major [N, T]: element e belongs to sample e // T
                self._first[self.cid] = np.arange(self.cid.shape[0], dtype=np.int64) // self.width
            else:
                self._first[self.cid] = self.smp  # any reader will do
        return self._first


def batch_keys(batch, scratch: Scratch) -> BatchKeys:
    """Distinct keys of a GlobalBatch (cached on the batch)."""
    bk = batch._cache.get("batch_keys")
    if bk is None:
        dense = batch._cache.get("dense")
        if dense is not None:
            gid = (dense + batch.layout.offsets[:-1][None, :]).ravel()
        else:
            gid = batch.flat()[2]
        n_rows = batch.layout.total_rows
        if gid.shape[0] and n_rows <= 32 * gid.shape[0] and gid.shape[0] < 2**31 and native.enabled():
            keys, cid, cnt = native.batch_keys(gid, n_rows)
        elif gid.shape[0] and n_rows <= 32 * gid.shape[0]:
            # few rows for this many elements: a bitmap over all rows yields the sorted distinct keys directly
            mark = np.zeros(n_rows, dtype=bool)
            mark[gid] = True
            keys = np.flatnonzero(mark)
            s = scratch.get(n_rows, keys.shape[0])
            s[keys] = np.arange(keys.shape[0], dtype=s.dtype)
            cid = s[gid].astype(np.int64)
            cnt = np.bincount(cid, minlength=keys.shape[0])
        elif gid.shape[0] and native.enabled() and (got := native.distinct(gid)) is not None:
            keys, cid, cnt = got  # a hash table: no pass over every row, no sort of every element
        elif gid.shape[0] and n_rows > SCRATCH_LIMIT:
            got = packed_distinct(gid)
            if got is None:
                keys, cid, cnt = np.unique(gid, return_inverse=True, return_counts=True)
                cid = cid.astype(np.int64).reshape(-1)
            else:
                keys, cid, cnt = got
        elif gid.shape[0]:
            s = scratch.get(int(gid.max()) + 1, gid.shape[0])
            uniq, cid, cnt = distinct(gid, s)
            order = np.argsort(uniq, kind="stable")
            inv = np.empty_like(order)
            inv[order] = np.arange(order.shape[0], dtype=np.int64)
            keys, cid, cnt = uniq[order], inv[cid], cnt[order]
        else:
            keys = cid = cnt = np.zeros(0, dtype=np.int64)
        bk = BatchKeys(batch, keys, cid, cnt, None if dense is None else dense.shape[1])
        batch._cache["batch_keys"] = bk
    return bk


@dataclass
class StepReads:
    """Reads of one step: distinct keys and (key, reader) pairs, pairs sorted by key then rank."""

    keys: np.ndarray  # int64 [K] sorted global rows
    count: np.ndarray  # int64 [K] distinct readers (lambda)
    start: np.ndarray  # int64 [K] first pair of every key
    pair_key: np.ndarray  # int64 [P] index into keys
    pair_rank: np.ndarray  # int64 [P]

    @property
    def num_pairs(self) -> int:
        return int(self.pair_key.shape[0])

    def readers_csr(self, key_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For the keys selected by `key_mask` [K] (bool): (key indices, reader offsets, readers sorted)."""
        ids = np.flatnonzero(key_mask)
        cnt = self.count[ids]
        offs = np.concatenate([[0], np.cumsum(cnt)]).astype(np.int64)
        readers = self.pair_rank[key_mask[self.pair_key]]
        return ids, offs, readers


def step_reads(bk: BatchKeys, sample_rank: np.ndarray, num_ranks: int) -> StepReads:
    """Distinct (key, reader) pairs of a batch for an assignment (rank of every sample)."""
    R, K = num_ranks, bk.keys.shape[0]
    if native.enabled():  # a [K, R] bitmap where it fits (faster up to ~R=128), else rank by rank, O(E + K + R)
        kernel = native.step_reads if K * R <= DENSE_LIMIT else native.step_reads_sparse
        count, start, pk, pr = kernel(bk.cid, bk.width, None if bk.width is not None else bk.smp, sample_rank, K, R)
        return StepReads(bk.keys, count, start, pk, pr)
    if bk.width is not None:  # sample-major [N, T]: broadcast the sample's rank over its row
        code = (bk.cid.reshape(-1, bk.width) * R + sample_rank[:, None]).ravel()
    else:
        code = bk.cid * R + sample_rank[bk.smp]
    if K * R <= DENSE_LIMIT:
        mark = np.zeros(K * R, dtype=bool)
        mark[code] = True
        nz = np.flatnonzero(mark)
    else:
        nz = sorted_distinct(code)
    pk, pr = nz // R, nz % R
    count = np.bincount(pk, minlength=K)
    start = np.cumsum(count) - count
    return StepReads(bk.keys, count, start, pk, pr)


def in_sorted(values: np.ndarray, sorted_keys: np.ndarray) -> np.ndarray:
    """np.isin(values, sorted_keys) where `sorted_keys` is sorted: a binary search per value, no sort of either (np.isin
    sorts both: 0.2 ms for a host planner's 5,000 migrations against 20,000 moves on full Criteo tables)."""
    if sorted_keys.shape[0] == 0 or values.shape[0] == 0:
        return np.zeros(values.shape[0], dtype=bool)
    i = np.minimum(np.searchsorted(sorted_keys, values), sorted_keys.shape[0] - 1)
    return sorted_keys[i] == values


def sorted_distinct(values: np.ndarray) -> np.ndarray:
    """np.unique(values) for int64 values: one sort and a mask (np.unique's hashing pass took 2.3 s on the 1.7 M
    (key, rank) codes of a step at R=256, against 37 ms for the sort)."""
    if values.shape[0] == 0:
        return values.copy()
    s = sort_ints(values)
    keep = np.empty(s.shape[0], dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]
