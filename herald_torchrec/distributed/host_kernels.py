"""Compiled kernels for the data plane's host work (`_host_kernels.cpp`), with the numpy / torch code as the fallback.

Why: the step's preparation runs in the training thread, on the step's critical path, as ~15 numpy passes per
function over the rank's few thousand ids (docs/performance.md); the input stage's sample blocks likewise. The kernels
give the same arrays in one pass; where the numpy code would raise (a plan that does not match the batch), a kernel says
so and the caller runs its numpy code, which raises with its message. A few take contiguous float32 host tensors
(`on_host`): the shared values' gather-and-add and the store's packed row reads and writes, in torch's order, so
the bits are torch's. Built and switched with the scheduler's kernels (`herald_torchrec/_native.py`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from herald_torchrec import _native
from herald_torchrec._native import address as _ptr
from herald_torchrec._native import contiguous as _a

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
SIGNATURES = {
    "herald_step_version": ([], ctypes.c_int),
    "herald_step_classify": ([_i64, _p, _p, _p, _i64, _p, _p, _i64, _p, _i64, _p, _p, _p], ctypes.c_int),
    "herald_step_lookup_layout": ([_i64, _p, _p, _p, _p, _i64, _i64, _p, _p, _p, _p, _p], ctypes.c_int),
    "herald_step_release": ([_i64, _p, _p, _p, _p, _p, _p, _p, _p, _i64, _p, _p, _p, _p, _p], ctypes.c_int),
    "herald_step_set_owner": ([_i64, _p, _p, _p, _p, _p, _p, _i64, _i64, _p, _p], ctypes.c_int),
    "herald_step_owner_bags": ([_i64, _i64, _p, _p, _i64, _p, _p, _p, _i64, _p, _p, _p], _i64),
    "herald_step_prepare_moves": (
        [
            _i64,
            _p,
            _p,
            _p,
            _p,
            _p,
            _p,
            _i64,
            _i64,
            _i64,
            _p,
            _p,
            _p,
            _p,
            _p,
            _p,
            _p,
            _i64,
            _i64,
            _p,
            _p,
            _p,
            _p,
            _p,
            _p,
        ],
        ctypes.c_int,
    ),
    "herald_step_allocate": ([_i64, _p, _p, _p, _p, _p, _p, _p, _p, _i64, _p, _p, _p, _p, _p], ctypes.c_int),
    "herald_step_prepare_shared": (
        [_i64, _p, _p, _p, _p, _i64, _p, _i64, _i64, _i64, _p, _p, _p, _p, _i64, _p, _p, _p],
        ctypes.c_int,
    ),
    "herald_step_local_input": ([_i64, _p, _i64, _i64, _p, _p, _p, _p, _p, _p], ctypes.c_int),
    "herald_step_gather_add": ([_i64, _p, _p, _i64, _p, _p], None),
    "herald_step_grad_sum": ([_i64, _p, _i64, _p, _p, _p, _p, _p, _p], _i64),
    "herald_step_sample_blocks": (
        [_i64, _i64, _p, _p, _i64, _i64, _p, _i64, _p, _i64, _p, _i64, _p, _p, _p, _p, _p],
        None,
    ),
    "herald_step_received_uniform": ([_i64, _p, _p, _i64, _i64, _i64, _p, _i64, _p, _i64, _p, _p], None),
    "herald_step_rows": ([_i64, _p, _p, _i64, _p, _p, _p, _p, ctypes.c_int], None),
    "herald_step_relay_groups": ([_i64, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p], None),
    "herald_step_part_pairs": ([_i64, _p, _p, _p, _p, _p, _i64, _i64, _p, _p, _i64, _p, _p], _i64),
    "herald_step_pair_routes": ([_i64, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p], ctypes.c_int),
}
KERNELS = _native.Kernels(
    Path(__file__).with_name("_host_kernels.cpp"), SIGNATURES, 16, "the data plane's", "herald_step"
)


def lib() -> ctypes.CDLL | None:
    return KERNELS.get()


def classify(
    gk: np.ndarray,
    by_key: np.ndarray,
    owner_all: np.ndarray,
    moved: np.ndarray,
    moved_dst: np.ndarray,
    key_base: np.ndarray,
    rank: int,
    seen: np.ndarray,
) -> tuple[np.ndarray, np.ndarray] | None:
    """plan_exec.classify's (hits, reads) per table, or None where its numpy code must run (kernels off, or an id
    the plan does not allow: numpy raises). `seen`: uint8 [keys], all zero (left so)."""
    k = lib()
    if k is None or by_key.dtype != np.int64 or owner_all.dtype != np.int32:
        return None
    T = key_base.shape[0] - 1
    g, mv, md, kb = _a(gk, np.int64), _a(moved, np.int64), _a(moved_dst, np.int64), _a(key_base, np.int64)
    hits, reads = np.empty(T, dtype=np.int64), np.empty(T, dtype=np.int64)
    rc = k.herald_step_classify(
        g.shape[0],
        _ptr(g),
        _ptr(by_key),
        _ptr(owner_all),
        mv.shape[0],
        _ptr(mv),
        _ptr(md),
        T,
        _ptr(kb),
        int(rank),
        _ptr(seen),
        _ptr(hits),
        _ptr(reads),
    )
    return (hits, reads) if rc == 0 else None


def lookup_layout(
    gk: np.ndarray, seg: np.ndarray, by_key: np.ndarray, slot_of_all: np.ndarray, B: int, F: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """lookup_layout.lookup_layout's (indices, offsets, value_src, out_dst) for row items, or None where its numpy
    code must run."""
    k = lib()
    if k is None or by_key.dtype != np.int64 or slot_of_all.dtype != np.int32:
        return None
    g, s = _a(gk, np.int64), _a(seg, np.int64)
    n = g.shape[0]
    indices, offsets = np.empty(n, dtype=np.int64), np.empty(F * B + 1, dtype=np.int64)
    src, dst, counts = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.zeros(2, dtype=np.int64)
    rc = k.herald_step_lookup_layout(
        n,
        _ptr(g),
        _ptr(s),
        _ptr(by_key),
        _ptr(slot_of_all),
        int(B),
        int(F),
        _ptr(indices),
        _ptr(offsets),
        _ptr(src),
        _ptr(dst),
        _ptr(counts),
    )
    if rc != 0:
        return None
    ne, ns = int(counts[0]), int(counts[1])
    return indices[:ne], offsets, src[:ns], dst[:ns]


def _store_ok(st) -> bool:
    """The store's directory arrays have the kernels' dtypes and layout (they are updated in place)."""
    want = (
        (st.slot_of_all, np.int32),
        (st.key_of_all, np.int64),
        (st.owner_all, np.int32),
        (st.guest_count_all, np.int64),
        (st._free_all, np.int64),
        (st._free_top, np.int64),
    )
    return all(a.dtype == t and a.flags.c_contiguous and a.flags.writeable for a, t in want)


def _slot_update(name: str, st, tables: np.ndarray, keys: np.ndarray) -> np.ndarray | None:
    """herald_step_release / herald_step_allocate on the store's directory: the slots, or None where the numpy code
    must run (kernels off, or input it rejects: nothing was changed)."""
    k = lib()
    if k is None or not _store_ok(st):
        return None
    t, r = _a(tables, np.int64), _a(keys, np.int64)
    slots = np.empty(t.shape[0], dtype=np.int64)
    rc = getattr(k, name)(
        t.shape[0],
        _ptr(t),
        _ptr(r),
        _ptr(st.rows_arr),
        _ptr(st.key_base),
        _ptr(st.slot_base),
        _ptr(st._home_lo_arr),
        _ptr(st._home_len_arr),
        _ptr(st.free_base),
        st.num_tables,
        _ptr(st.slot_of_all),
        _ptr(st.key_of_all),
        _ptr(st._free_all),
        _ptr(st._free_top),
        _ptr(slots),
    )
    return slots if rc == 0 else None


def release(st, tables: np.ndarray, keys: np.ndarray) -> np.ndarray | None:
    """RowStore.release_many's slots (the directory updated), or None where its numpy code must run."""
    return _slot_update("herald_step_release", st, tables, keys)


def set_owner(st, tables: np.ndarray, keys: np.ndarray, ranks: np.ndarray) -> bool:
    """RowStore.set_owner_many; False where its numpy code must run (kernels off, or input out of range)."""
    k = lib()
    if k is None or not _store_ok(st):
        return False
    t, r, q = _a(tables, np.int64), _a(keys, np.int64), _a(ranks, np.int64)
    return (
        k.herald_step_set_owner(
            t.shape[0],
            _ptr(t),
            _ptr(r),
            _ptr(q),
            _ptr(st.rows_arr),
            _ptr(st.key_base),
            _ptr(st.home_block_arr),
            st.num_tables,
            st.world_size,
            _ptr(st.owner_all),
            _ptr(st.guest_count_all),
        )
        == 0
    )


def allocate(st, tables: np.ndarray, keys: np.ndarray) -> np.ndarray | None:
    """RowStore.allocate_many's slots (the directory updated), or None where its numpy code must run (it raises)."""
    return _slot_update("herald_step_allocate", st, tables, keys)


def owner_bags(
    offsets: np.ndarray,
    indices: np.ndarray,
    tables: np.ndarray,
    slots: np.ndarray,
    first_feature: np.ndarray,
    B: int,
    F: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """lookup_layout.with_owner_bags' (offsets, indices, bag rows), or None where its numpy code must run."""
    k = lib()
    if k is None:
        return None
    o, ix, t, sl, ff = (_a(a, np.int64) for a in (offsets, indices, tables, slots, first_feature))
    nk = t.shape[0]
    offs = np.empty(F * (B + nk) + 1, dtype=np.int64)
    idx, rows = np.empty(ix.shape[0] + nk, dtype=np.int64), np.empty(nk, dtype=np.int64)
    n = k.herald_step_owner_bags(
        int(B),
        int(F),
        _ptr(o),
        _ptr(ix),
        nk,
        _ptr(t),
        _ptr(sl),
        _ptr(ff),
        ff.shape[0],
        _ptr(offs),
        _ptr(idx),
        _ptr(rows),
    )
    return offs[: F * (B + n) + 1], idx, rows


def prepare_moves(
    st,
    table: np.ndarray,
    row: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    kind: np.ndarray,
    width: np.ndarray,
    known_kind: np.ndarray,
    evict_home: int,
):
    """plan_exec.prepare_moves' (send_idx, recv_idx, send_splits, recv_splits, gkey_sorted, dst_sorted), or None where
    its numpy code must run (kernels off, or a plan it rejects: it raises)."""
    k = lib()
    if k is None or st.owner_all.dtype != np.int32:
        return None
    M, R = table.shape[0], st.world_size
    a = [_a(x, np.int64) for x in (table, row, src, dst, kind, width)]
    kk = _a(known_kind, np.uint8)
    cap = _a(st.capacity, np.int64)
    send, recv, splits = np.empty(M, dtype=np.int64), np.empty(M, dtype=np.int64), np.empty(2 * R, dtype=np.int64)
    gks, dsts, counts = np.empty(M, dtype=np.int64), np.empty(M, dtype=np.int64), np.zeros(2, dtype=np.int64)
    rc = k.herald_step_prepare_moves(
        M,
        *(_ptr(x) for x in a),
        st.num_tables,
        R,
        st.rank,
        _ptr(st.rows_arr),
        _ptr(st.key_base),
        _ptr(st.owner_all),
        _ptr(st.home_block_arr),
        _ptr(st.guest_count_all),
        _ptr(cap),
        _ptr(kk),
        kk.shape[0],
        int(evict_home),
        _ptr(send),
        _ptr(recv),
        _ptr(splits),
        _ptr(gks),
        _ptr(dsts),
        _ptr(counts),
    )
    if rc != 0:
        return None
    return send[: counts[0]], recv[: counts[1]], splits[:R].tolist(), splits[R:].tolist(), gks, dsts


def grad_sum_keys(st, send_gkey: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """lookup_layout.grad_sum_layout's (sorted distinct keys, each gradient's key index, the keys' tables and local
    slots), or None where its numpy code must run (kernels off)."""
    k = lib()
    if k is None or st.slot_of_all.dtype != np.int32:
        return None
    g = _a(send_gkey, np.int64)
    n = g.shape[0]
    keys, inv, tab, slots = (np.empty(n, dtype=np.int64) for _ in range(4))
    m = k.herald_step_grad_sum(
        n,
        _ptr(g),
        st.num_tables,
        _ptr(st.key_base),
        _ptr(st.slot_of_all),
        _ptr(keys),
        _ptr(inv),
        _ptr(tab),
        _ptr(slots),
    )
    return keys[:m], inv, tab[:m], slots[:m]


def local_input(
    values: np.ndarray, lengths: np.ndarray, ftab: np.ndarray, st, B: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """plan_exec.local_input's (gkeys, seg) for features in the module's order, or None where its numpy code must run
    (kernels off, or ids it rejects: it raises)."""
    k = lib()
    if k is None:
        return None
    v, ln, ft = _a(values, np.int64), _a(lengths, np.int64), _a(ftab, np.int64)
    n = v.shape[0]
    gkeys, seg = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    rc = k.herald_step_local_input(
        n,
        _ptr(v),
        ft.shape[0],
        int(B),
        _ptr(ln),
        _ptr(ft),
        _ptr(st.rows_arr),
        _ptr(st.key_base),
        _ptr(gkeys),
        _ptr(seg),
    )
    return (gkeys, seg) if rc == 0 else None


SHARED_FIELDS = (
    "send_table",
    "send_row",
    "send_gkey",
    "send_off",
    "recv_table",
    "recv_row",
    "recv_gkey",
    "recv_off",
    "value_table",
    "value_gkey",
    "grad_idx",
)  # P entries each, in the kernel's order
SHARED_SPLITS = ("send_splits", "recv_splits", "value_splits", "grad_splits")  # R each


def prepare_shared(
    st,
    table: np.ndarray,
    row: np.ndarray,
    owner: np.ndarray,
    reader_offsets: np.ndarray,
    readers: np.ndarray,
    moved: np.ndarray,
    moved_dst: np.ndarray,
) -> dict | None:
    """plan_exec.prepare_shared's arrays and counts (a dict of SharedStep's fields, `marked` included), or None where
    its numpy code must run (kernels off, or a plan it rejects: it raises)."""
    k = lib()
    n = table.shape[0]
    if (
        k is None
        or st.owner_all.dtype != np.int32
        or not (row.shape[0] == owner.shape[0] == n == reader_offsets.shape[0] - 1)
    ):
        return None
    t, r, o, ro, q = (_a(x, np.int64) for x in (table, row, owner, reader_offsets, readers))
    mv, md, dims = _a(moved, np.int64), _a(moved_dst, np.int64), _a(st.dims_arr, np.int64)
    P, R, F = q.shape[0], st.world_size, len(SHARED_FIELDS)
    out = np.empty(n + F * P + 4 * R + 7, dtype=np.int64)
    rc = k.herald_step_prepare_shared(
        n,
        _ptr(t),
        _ptr(r),
        _ptr(o),
        _ptr(ro),
        P,
        _ptr(q),
        st.num_tables,
        R,
        st.rank,
        _ptr(st.rows_arr),
        _ptr(st.key_base),
        _ptr(st.owner_all),
        _ptr(dims),
        mv.shape[0],
        _ptr(mv),
        _ptr(md),
        _ptr(out),
    )
    if rc != 0:
        return None
    c = out[n + F * P + 4 * R :].tolist()
    n_send, n_recv, n_value, n_grad = c[:4]
    size = {"send": n_send, "recv": n_recv, "value": n_value, "grad": n_grad}
    got = {"marked": out[:n]}
    for i, name in enumerate(SHARED_FIELDS):
        got[name] = out[n + i * P : n + i * P + size[name.split("_")[0]]]
    for i, name in enumerate(SHARED_SPLITS):
        got[name] = out[n + F * P + i * R : n + F * P + (i + 1) * R].tolist()
    got["n_values_out"], got["n_grads_out"], got["n_fill"] = c[4:]
    return got


def on_host(*tensors: torch.Tensor) -> bool:
    """The kernels are on and every tensor is a contiguous float32 host tensor, as the tensor kernels below need."""
    return lib() is not None and all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors
    )


def gather_add(out, out_idx: np.ndarray, inp, in_idx: np.ndarray | None) -> bool:
    """out.view(-1, w)[out_idx[i]] += inp.view(-1, w)[in_idx[i]] for every i in order (in_idx None: row i), for
    contiguous float32 CPU tensors of the same row width w, in place; False (nothing done) where torch must do it
    (kernels off, another device or dtype). Indices must be in range: the callers' layouts guarantee it."""
    if not on_host(out, inp) or out.dim() != 2 or inp.dim() != 2 or out.shape[1] != inp.shape[1]:
        return False
    k = lib()
    o = _a(out_idx, np.int64)
    i = None if in_idx is None else _a(in_idx, np.int64)
    k.herald_step_gather_add(
        o.shape[0], _ptr(o), None if i is None else _ptr(i), out.shape[1], inp.data_ptr(), out.data_ptr()
    )
    return True


def sample_blocks_uniform(
    fixed: np.ndarray,
    values: np.ndarray,
    n: int,
    u: int,
    managed: np.ndarray,
    carried: np.ndarray,
    ids_dtype: np.dtype,
    order: np.ndarray,
    cut: np.ndarray,
    with_ids: np.ndarray,
) -> tuple[list[np.ndarray], np.ndarray] | None:
    """input_layout.sample_blocks for a slice whose bags all have length u (values [K, n, u] int64): (the blocks,
    views of one buffer; their managed ids' bytes), or None where its numpy code must run (kernels off)."""
    k = lib()
    if k is None or ids_dtype.itemsize not in (4, 8):
        return None
    fx, v, m, c = _a(fixed, np.uint8), _a(values, np.int64), _a(managed, np.int64), _a(carried, np.int64)
    o, ct, w = _a(order, np.int64), _a(cut, np.int64), _a(with_ids, np.uint8)
    R, fb, J, C, it = ct.shape[0] - 1, fx.shape[1] if fx.ndim == 2 else 0, m.shape[0], c.shape[0], ids_dtype.itemsize
    out = np.empty(o.shape[0] * (fb + u * (J * it + C * 8)), dtype=np.uint8)
    sizes, id_bytes = np.empty(R, dtype=np.int64), np.empty(R, dtype=np.int64)
    k.herald_step_sample_blocks(
        int(n),
        fb,
        _ptr(fx),
        _ptr(v),
        int(u),
        J,
        _ptr(m),
        C,
        _ptr(c),
        it,
        _ptr(o),
        R,
        _ptr(ct),
        _ptr(w),
        _ptr(out),
        _ptr(sizes),
        _ptr(id_bytes),
    )
    ends = np.cumsum(sizes).tolist()
    return [out[e - z : e] for e, z in zip(ends, sizes.tolist())], id_bytes


def received_uniform(
    blocks: list[np.ndarray],
    n_from: np.ndarray,
    fb: int,
    K: int,
    u: int,
    managed: np.ndarray,
    carried: np.ndarray,
    ids_dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray] | None:
    """input_layout._received_uniform's (dense + label bytes [n_all, fb], values [K * n_all * u] int64) from blocks
    whose sizes the caller checked, or None where its numpy code must run (kernels off)."""
    k = lib()
    if k is None or ids_dtype.itemsize not in (4, 8):
        return None
    bs = [_a(b, np.uint8) for b in blocks]  # kept alive for the call
    nf, m, c = _a(n_from, np.int64), _a(managed, np.int64), _a(carried, np.int64)
    n_all = int(nf.sum())
    fixed, values = np.empty((n_all, fb), dtype=np.uint8), np.empty(K * n_all * u, dtype=np.int64)
    k.herald_step_received_uniform(
        len(bs),
        _native.addresses(bs),
        _ptr(nf),
        int(fb),
        int(u),
        m.shape[0],
        _ptr(m),
        c.shape[0],
        _ptr(c),
        ids_dtype.itemsize,
        _ptr(fixed),
        _ptr(values),
    )
    return fixed, values


def _rows(kinds: list, tables: np.ndarray, slots: np.ndarray, packed: torch.Tensor, write: bool) -> bool:
    """herald_step_rows between the row layout's storages `kinds` [(a [rows, width] storage, the row of every
    table's slot 0 in it)] and `packed` [n * item]; False (nothing done) where torch must do it: kernels off, or a
    tensor that is not a contiguous float32 host tensor. Indices must be in range: the callers' directories
    guarantee it."""
    if not on_host(packed, *(v for v, _ in kinds)):
        return False
    t, s = _a(tables, np.int64), _a(slots, np.int64)
    if packed.numel() != t.shape[0] * sum(v.shape[1] for v, _ in kinds) or s.shape != t.shape:
        return False  # torch raises its own error
    bases = [_a(b, np.int64) for _, b in kinds]  # kept alive for the call
    widths = np.array([v.shape[1] for v, _ in kinds], dtype=np.int64)
    lib().herald_step_rows(
        t.shape[0],
        _ptr(t),
        _ptr(s),
        len(kinds),
        (ctypes.c_void_p * len(kinds))(*(v.data_ptr() for v, _ in kinds)),
        _ptr(widths),
        _native.addresses(bases),
        packed.data_ptr(),
        int(write),
    )
    return True


def read_rows(kinds: list, tables: np.ndarray, slots: np.ndarray) -> torch.Tensor | None:
    """RowStore.read_packed on the row layout: the packed float32 rows, or None where torch must read them."""
    if not on_host(*(v for v, _ in kinds)):
        return None
    out = torch.empty(tables.shape[0] * sum(v.shape[1] for v, _ in kinds), dtype=torch.float32)
    return out if _rows(kinds, tables, slots, out, write=False) else None


def write_rows(kinds: list, tables: np.ndarray, slots: np.ndarray, packed: torch.Tensor) -> bool:
    """RowStore.write_packed on the row layout; False (nothing written) where torch must write them."""
    return _rows(kinds, tables, slots, packed, write=True)


def relay_groups(
    offsets: np.ndarray,
    readers: np.ndarray,
    before: np.ndarray,
    after: np.ndarray,
    table: np.ndarray,
    host: np.ndarray,
    wanted_host: np.ndarray,
    num_tables: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    """plan_part._relay_groups' (tables with a relayed group, pairs read on a wanted host) from the shared rows'
    reader offsets, readers, owners before and after the moves and tables, or None where its numpy code must run."""
    k = lib()
    if k is None:
        return None
    o, rd, b, a = _a(offsets, np.int64), _a(readers, np.int64), _a(before, np.int64), _a(after, np.int64)
    t, h, w = _a(table, np.int64), _a(host, np.int64), _a(wanted_host, np.uint8)
    flags, on = np.zeros(num_tables, dtype=np.uint8), np.empty(rd.shape[0], dtype=np.uint8)
    count = np.zeros(w.shape[0], dtype=np.int32)
    k.herald_step_relay_groups(
        int(b.shape[0]),
        _ptr(o),
        _ptr(rd),
        _ptr(b),
        _ptr(a),
        _ptr(t),
        _ptr(h),
        _ptr(w),
        _ptr(count),
        _ptr(flags),
        _ptr(on),
    )
    return np.flatnonzero(flags), on.view(bool)


def part_pairs(
    offsets: np.ndarray,
    readers: np.ndarray,
    before: np.ndarray,
    after: np.ndarray,
    part: np.ndarray,
    num_parts: int,
    on: np.ndarray,
    relay_of_on: np.ndarray,
) -> tuple[np.ndarray, np.ndarray] | None:
    """plan_part._needed_pairs' (part, pair) of every pair a part needs, by part then pair, or None where its numpy
    code must run."""
    k = lib()
    if k is None:
        return None
    o, rd, b, a = _a(offsets, np.int64), _a(readers, np.int64), _a(before, np.int64), _a(after, np.int64)
    pt, q, rq = _a(part, np.int64), _a(on, np.int64), _a(relay_of_on, np.int64)
    cap = min(num_parts, 5) * rd.shape[0]  # owners before and after, reader, relay, relay pair: <= 5 per pair
    out_part, out_pair = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64)  # (pages touched as written)
    args = (_ptr(o), _ptr(rd), _ptr(b), _ptr(a), _ptr(pt), int(num_parts), int(q.shape[0]), _ptr(q), _ptr(rq))
    total = k.herald_step_part_pairs(int(b.shape[0]), *args, cap, _ptr(out_part), _ptr(out_pair))
    if total > cap:  # pragma: no cover - the bound above holds
        raise RuntimeError(f"part_pairs: {total} (part, pair) entries, over the bound {cap}")
    return out_part[:total], out_pair[:total]


def pair_routes(
    pair_row: np.ndarray,
    readers: np.ndarray,
    before: np.ndarray,
    after: np.ndarray,
    fill: np.ndarray,
    host: np.ndarray,
    stages: tuple[int, int, int, int],
) -> tuple[np.ndarray, ...] | None:
    """host_relay.pair_routes' arrays with relays (value source, value stage, gradient destination, gradient stage,
    relay pair), or None where its numpy code must run (kernels off, or a row's pairs not together)."""
    k = lib()
    if k is None:
        return None
    pr, rd, b, a = _a(pair_row, np.int64), _a(readers, np.int64), _a(before, np.int64), _a(after, np.int64)
    f, h, st = _a(fill, np.uint8), _a(host, np.int64), np.asarray(stages, dtype=np.int64)
    best = np.full(int(h.max()) + 1, -1, dtype=np.int64)  # (called with relays: several hosts)
    out = [np.empty(rd.shape[0], dtype=np.int64) for _ in range(5)]
    rc = k.herald_step_pair_routes(
        int(rd.shape[0]), _ptr(pr), _ptr(rd), _ptr(b), _ptr(a), _ptr(f), _ptr(h), _ptr(st), _ptr(best), *map(_ptr, out)
    )
    return None if rc else tuple(out)
