"""The step's index layouts, host side: where the lookup pools ids and values, and where owners sum gradients.

step/prepare.py decides what moves and what is shared; these functions turn its `SharedStep`, the step's `SharedMarks`
and this rank's `LocalInput` into the index arrays that embedding_lookup.py hands to torch: `lookup_layout` (which
local slots the TBE pools, and where each shared value is added into the pooled output), `grad_sum_layout` (how an
owner sums the readers' returned gradients per key), `with_owner_bags` (both in one TBE call, whose backward
updates every row of the step once), and `value_items` / `grad_send_order` (where values and their gradients sit
in the flat buffers). Items are rows when every table has the same dim (`RowStore.uniform_dim`), else floats. Like
step/prepare.py they are pure numpy functions of the step and the store's directories, checked in one process
(tests/distributed/step/test_prepare.py); they live apart because they lay out the lookup's memory, not the step's
traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from herald_torchrec.distributed import host_kernels
from herald_torchrec.distributed.step.prepare import LocalInput, SharedMarks, SharedStep, empty_ids
from herald_torchrec.distributed.storage.row_layout import exclusive_cumsum, ragged_arange
from herald_torchrec.distributed.storage.row_store import RowStore


def value_items(sh: SharedStep, st: RowStore, pairs: np.ndarray) -> tuple[np.ndarray, int]:
    """Where the value-order pairs `pairs` sit in the flat value buffer (or its gradient), as (item index, item
    width): rows of the dim when every table has the same one, else float positions (width 1)."""
    if st.uniform_dim is not None:
        return pairs, st.uniform_dim
    return ragged_arange(sh.recv_off[pairs], st.dims_arr[sh.recv_table[pairs]]), 1


def grad_send_order(sh: SharedStep, st: RowStore) -> tuple[np.ndarray, int] | None:
    """The value gradients' reorder into gradient send order (by owner after the moves) as `value_items`, or None
    when it is the identity (no shared row moved, e.g. static plans; never when relays take some gradients first)."""
    idx = sh.grad_idx
    if idx.shape[0] == sh.recv_gkey.shape[0] and (idx == np.arange(idx.shape[0])).all():
        return None
    return value_items(sh, st, idx)


@dataclass
class LookupLayout:
    """The step's lookup, in index arrays: the TBE reads `indices` / `offsets` (exclusive ids, local slots, one bag
    per feature and sample); the received values, viewed as items of `width` floats, are gathered at `value_src`
    and summed into the pooled output's items `out_dst` (shared ids). `width` is the dim when every table has the
    same one (items are rows: the pooled output [B, F * dim] viewed as [B * F, dim]), else 1 (items are floats).
    Weighted features: `weights` are the TBE's per-sample weights (one per index) and `value_weights` multiply the
    gathered value items (one per item of `value_src`); both None for unweighted ones."""

    indices: np.ndarray
    offsets: np.ndarray
    value_src: np.ndarray
    out_dst: np.ndarray
    width: int = 1
    weights: np.ndarray | None = None
    value_weights: np.ndarray | None = None


def lookup_layout(local: LocalInput, sh: SharedStep, marks: SharedMarks, st: RowStore) -> LookupLayout:
    """Index layout of the pooled output [B, sum of feature dims] for this batch (after the step's moves), with the
    ids' weights where the features are weighted."""
    lay = _unweighted_layout(local, sh, marks, st)
    if local.weights is None:
        return lay
    # both layouts keep the local order of the ids: exclusive ids in `indices`, shared ids in `value_src`
    ex = marks.by_key[local.gkeys] == SharedMarks.NOT_SHARED
    lay.weights = np.ascontiguousarray(local.weights[ex], dtype=np.float32)
    w_shared = local.weights[~ex].astype(np.float32, copy=False)
    if lay.width == 1 and w_shared.shape[0]:  # float items: each value's weight on each of its dim floats
        f = local.seg[~ex] // local.batch_size
        w_shared = np.repeat(w_shared, st.dims_arr[st.feature_table_arr][f])
    lay.value_weights = w_shared
    return lay


def _unweighted_layout(local: LocalInput, sh: SharedStep, marks: SharedMarks, st: RowStore) -> LookupLayout:
    B, F = local.batch_size, local.lengths.shape[0]
    if st.uniform_dim is not None:  # rows: the same layout, compiled (None: kernels off, or numpy raises below)
        fast = host_kernels.lookup_layout(local.gkeys, local.seg, marks.by_key, st.slot_of_all, B, F)
        if fast is not None:
            return LookupLayout(*fast, st.uniform_dim) if fast[2].shape[0] else LookupLayout(*fast)
    mark = marks.by_key[local.gkeys]
    ex = mark == SharedMarks.NOT_SHARED
    indices = st.slot_of_all[local.gkeys[ex]].astype(np.int64)
    if (indices < 0).any():  # pragma: no cover - guarded by classify
        raise RuntimeError("exclusive id without a local slot after the moves")
    offsets = np.zeros(F * B + 1, dtype=np.int64)
    np.cumsum(np.bincount(local.seg[ex], minlength=F * B), out=offsets[1:])
    shared = np.flatnonzero(~ex)
    if not shared.size:
        return LookupLayout(indices, offsets, empty_ids(), empty_ids())
    f, bag = np.divmod(local.seg[shared], B)
    src, width = value_items(sh, st, mark[shared])  # mark = index of the value among the pairs read here
    if st.uniform_dim is not None:  # rows: output row = bag * F + f of the pooled output viewed as [B * F, dim]
        return LookupLayout(indices, offsets, src, bag * F + f, width)
    f_dims = st.dims_arr[st.feature_table_arr]
    f_col = exclusive_cumsum(f_dims)  # output column of each feature
    dst = ragged_arange(bag * int(f_dims.sum()) + f_col[f], f_dims[f])
    return LookupLayout(indices, offsets, src, dst)


@dataclass
class GradSumLayout:
    """How an owner sums the returned shared-row gradients (laid out as `send_off`) into one gradient per key: the
    returned buffer, viewed as items of `width` floats, adds item i into item `dst[i]` of a buffer of `size` floats
    holding the keys' gradients in key order; `tables` / `slots` address those keys in the store. `width` is the dim
    when every table has the same one (items are rows), else 1."""

    tables: np.ndarray
    slots: np.ndarray
    dst: np.ndarray
    size: int
    width: int = 1


def grad_sum_layout(sh: SharedStep, st: RowStore) -> GradSumLayout:
    """Per-key sums of the readers' gradients, in send order (readers in rank order), all tables at once."""
    fast = host_kernels.grad_sum_keys(st, sh.send_gkey) if st.uniform_dim is not None else None
    if fast is not None:  # the same keys, compiled (one sort of the returned pairs)
        keys, inv, tab, slots = fast
    else:
        keys, inv = np.unique(sh.send_gkey, return_inverse=True)
        tab = st.tables_of(keys)
        slots = st.slot_of_all[keys].astype(np.int64)
    if st.uniform_dim is not None:
        return GradSumLayout(tab, slots, inv.reshape(-1), keys.shape[0] * st.uniform_dim, st.uniform_dim)
    kd = st.dims_arr[tab]
    dst = ragged_arange(exclusive_cumsum(kd)[inv.reshape(-1)], st.dims_arr[sh.send_table])
    return GradSumLayout(tab, slots, dst, int(kd.sum()))


def with_owner_bags(
    lay: LookupLayout, gs: GradSumLayout, st: RowStore, batch_size: int
) -> tuple[LookupLayout, np.ndarray]:
    """The step's lookup with one extra one-row bag per shared row this rank owns after the moves, so that ONE TBE
    backward applies the fused optimizer to the exclusive rows and (with the readers' summed gradients) to the shared
    ones: table t's k-th key (GradSumLayout key order) is bag B + k of t's first feature, the other extra bags are
    empty. Shared rows never sit in the exclusive bags (every reader, the owner included, reads them through the
    shared path), so every row still gets exactly its own gradient sum. Rows only (`st.uniform_dim`).

    Returns the layout over B + n bags per feature (n = the most keys of one table; `value_src` / `out_dst` are
    unchanged: the first B bags are the batch's) and, per key, its bag's row in the pooled output [(B + n) * F, dim]."""
    B, F = batch_size, len(st.feature_table_map)
    fast = host_kernels.owner_bags(lay.offsets, lay.indices, gs.tables, gs.slots, st.first_feature, B, F)
    if fast is not None:  # the same layout, compiled
        offsets, indices, bag_rows = fast
        out = LookupLayout(indices, offsets, lay.value_src, lay.out_dst, lay.width, None, lay.value_weights)
        return _owner_bag_weights(out, lay.weights, B, F), bag_rows
    k, n, feat = st.one_row_bags(gs.tables)  # the extra bags as the store's own one-row-bag updates place them
    main = np.diff(lay.offsets).reshape(F, B)
    extra = np.zeros((F, n), dtype=np.int64)
    extra[feat, k] = 1
    lengths = np.concatenate([main, extra], axis=1)
    offsets = np.zeros(F * (B + n) + 1, dtype=np.int64)
    np.cumsum(lengths.reshape(-1), out=offsets[1:])
    # feature after feature: the feature's batch ids, then its extra rows (keys by feature, then k)
    order = np.lexsort((k, feat))
    m_cnt, e_cnt = main.sum(axis=1), extra.sum(axis=1)
    m_pos = np.arange(lay.indices.shape[0], dtype=np.int64) + np.repeat(exclusive_cumsum(e_cnt), m_cnt)
    e_pos = np.arange(order.shape[0], dtype=np.int64) + np.repeat(np.cumsum(m_cnt), e_cnt)
    indices = np.empty(lay.indices.shape[0] + order.shape[0], dtype=np.int64)
    indices[m_pos] = lay.indices
    indices[e_pos] = gs.slots[order]
    out = LookupLayout(indices, offsets, lay.value_src, lay.out_dst, lay.width, None, lay.value_weights)
    return _owner_bag_weights(out, lay.weights, B, F), (B + k) * F + feat


def _owner_bag_weights(lay: LookupLayout, batch_weights: np.ndarray | None, batch_size: int, F: int) -> LookupLayout:
    """The per-sample weights of `with_owner_bags`' layout: the batch's ids keep theirs (in order), the owner's
    one-row bags weigh 1 (their gradients are the readers' sums, already weighted)."""
    if batch_weights is None:
        return lay
    lengths = np.diff(lay.offsets)
    per_feature = lengths.shape[0] // F  # B + n bags: the batch's B, then the owner's n
    in_batch = np.arange(lengths.shape[0], dtype=np.int64) % per_feature < batch_size
    weights = np.ones(lay.indices.shape[0], dtype=np.float32)
    weights[np.repeat(in_batch, lengths)] = batch_weights
    lay.weights = weights
    return lay
