"""Compiled kernels for the scheduler's hottest loops (`_kernels.cpp`), with the numpy code as the fallback.

Why: on a 2-core host the planner's ~2 ms of CPU per step shows in the step time (docs/performance.md); in numpy it is
~100 passes over 10^4-element arrays, each a few microseconds. The kernels do the same arithmetic in single passes and
give bit-identical plans (tests compare every plan of both paths, on every policy setting that reaches them).
Built and switched as every kernel set of the project (`herald_torchrec/_native.py`: built on first use with the
system C++ compiler, `HERALD_NATIVE=0` turns them off); a C ABI on numpy buffers loaded with ctypes, so the control
plane stays torch-free, and the GIL is released while a kernel runs.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from herald_torchrec import _native
from herald_torchrec._native import address as _p
from herald_torchrec._native import contiguous as _c

SOURCE = Path(__file__).with_name("_kernels.cpp")
VERSION = 22  # herald_kernels_version() of the source this module expects

# Arrays travel as raw addresses (`_p`): ctypes' ndpointer checks cost ~2.5 us per argument, ~60 per plan. The
# wrappers below make every array C-contiguous of the kernel's dtype first (`_c`); the directory's and the eviction
# pool's arrays are checked once (`DirectoryArrays.supported`) and their addresses kept.
_i64p = _f64p = _f32p = _u8p = _i32p = _i16p = ctypes.c_void_p
_i64 = ctypes.c_int64

SIGNATURES = {
    "herald_kernels_version": ([], ctypes.c_int),
    "herald_balanced_assign": ([_f32p, _i64, _i64, _i64, _i64p], None),
    "herald_assign": (
        [
            _i64,
            _i64,
            _i64,
            _i64,
            _i64,
            _i64p,
            _i64p,
            _f64p,
            _i64,
            _i64p,
            _i64,
            ctypes.c_double,
            ctypes.c_double,
            ctypes.c_int,
            _i64,
            _i64p,
            _i64,
            ctypes.c_double,
            _i64p,
        ],
        None,
    ),
    "herald_batch_keys": ([_i64p, _i64, _i64, _i64p, _i64p, _i64p], _i64),
    "herald_demand": ([_i64, _i64p, _i64, _i64p, _i64p, _i64, _i64, _i64p, _i64p, _i64p, _i64p], ctypes.c_int),
    "herald_scheduled_elements": ([_i64, _i64, _i64p, _i64, _i64p, _i64p, _f64p, _i64, _i64p, _i64p, _f64p], None),
    "herald_last_error": ([], ctypes.c_char_p),
    "herald_make_room": (
        [
            _i64,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _u8p,
            _i64,
            _i64,
            _i16p,
            _i32p,
            _i16p,
            _i32p,
            _u8p,
            _i64,
            _i64,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i32p,
            _i64,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i32p,
            _i64p,
            _i64p,
            _i64,
            _i64p,
            _i64p,
        ],
        ctypes.c_int,
    ),
    "herald_apply_moves": (
        [
            _i64,
            _i64p,
            _i64p,
            _i64,
            _i16p,
            _i32p,
            _i32p,
            _i64,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i32p,
            _i64,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i32p,
            _i32p,
        ],
        ctypes.c_int,
    ),
    "herald_release_guests": (
        [_i64, _i64p, _i64p, _i64p, _i64p, _i64, _i64, _i64, _i64] + [_i64p] * 5 + [_i32p],
        ctypes.c_int,
    ),
    "herald_land_guests": (
        [_i64, _i64p, _i64p, _i64p, _i64p, _i64, _i64, _i64, _i32p, _i64]
        + [_i64p] * 5
        + [_i32p, _i64p, _i64, _i64, _i64]
        + [_i64p] * 4
        + [_i32p, _i32p, _i64p],
        ctypes.c_int,
    ),
    "herald_move_guests": (
        [_i64, _i64p, _i64p, _i64p, _i64p, _i64p, _i64, _i64, _i64, _i32p, _i64]
        + [_i64p] * 5
        + [_i32p, _i64p, _i64, _i64, _i64]
        + [_i64p] * 4
        + [_i32p, _i32p, _i64p],
        ctypes.c_int,
    ),
    "herald_host_room": (
        [_i64, _i64p, _i64p, _i64p, _u8p, _i64, _i64, _i64, _i64, _i64p, _i64p, _i64, _i64p, _i64p, _i32p, _i32p]
        + [_i64, _i64, _i64]
        + [_i64p] * 5
        + [_i32p, _i64]
        + [_i64p] * 4
        + [_i32p, _i64p, _i64p, _i64, _i64p, _i64p, _i64p],
        ctypes.c_int,
    ),
    "herald_sort_nonneg": ([_i64, _i64p, _i64p], ctypes.c_int),
    "herald_distinct": ([_i64, _i64p, _i64p, _i64p, _i64p], _i64),
    "herald_host_reads": (
        [_i64, _i64p, _i64, _i64p, _i64p, _i64, _i64, _i64p, _i64, _i64p, _i64, _i32p, _i64p, _i32p, _i64p, _i32p],
        _i64,
    ),
    "herald_gather_segments": ([_i64, _i64p, _i64p, _i64p, _i64p, _i64p], None),
    "herald_host_plan": (
        [_i64, _i64, _i64p, _i16p, _i16p, _i64, _i64p, _i16p, _i16p, _i64, _i16p, _i64, _i64p, _i16p]
        + [_i64, _i64p, _i64p, _i64, _i64, _i64, _i64p, _i64, _i64p, _i64p, _i64p, _i64, _i64p, _i16p]
        + [_i64, _i64p, _i64, _u8p, ctypes.c_int8, ctypes.c_int8, _i64]
        + [_i64p] * 4
        + [_u8p]
        + [_i64p] * 14,
        ctypes.c_int,
    ),
    "herald_decide": (
        [_i64, _i64p, _i64p, _i64p, _i64p, _i64, _i64p, _i64, _i64p, _i64p, _i64, _i64, _i64p, _u8p, _i64p],
        None,
    ),
    "herald_host_decide": (
        [_i64] * 3 + [_i64p] * 6 + [_i64, _i32p] + [_i64] * 6 + [ctypes.c_double] + [_i64p] * 2 + [_i64] + [_i64p] * 3,
        ctypes.c_int,
    ),
    "herald_host_part": (
        [_i64] * 3 + [_i64p] * 7 + [_i64, _i64p, _i64, _i64p, _i32p, _i64, _i64p, _i64] + [_i64p] * 2,
        ctypes.c_int,
    ),
    "herald_balance_owners": ([_i64, _i64, _i64p, _i64p, _i64p, _i64p, _i64p, _u8p, ctypes.c_double, _u8p], _i64),
    "herald_assemble": (
        [
            _i64,
            _i64p,
            _i64p,
            _i64p,
            _u8p,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i64,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            ctypes.c_int8,
            _i16p,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
            _i64p,
        ],
        _i64,
    ),
    "herald_step_reads": ([_i64p, _i64, _i64, _i64p, _i64p, _i64, _i64, _u8p, _i64p, _i64p, _i64p, _i64p], _i64),
    "herald_step_reads_sparse": ([_i64p, _i64, _i64, _i64p, _i64p, _i64, _i64, _i64p, _i64p, _i64p, _i64p], _i64),
    "herald_route_part": ([_i64p, ctypes.c_void_p], _i64),
    "herald_wire_assignment": ([_i64, _i64, _i64p, _i64p], ctypes.c_int),
    "herald_wire_reader_mask": ([_i64, _i64p, _i64, _i64p, _i64p], ctypes.c_int),
    "herald_wire_pack": ([_i64, ctypes.c_void_p, _i64p, _u8p, _i64p], _i64),
    "herald_wire_unpack": ([_i64, _u8p, _i64p, _i64p, ctypes.c_void_p], None),
    "herald_wire_readers": ([_i64, _i64, _i64p, _i64p, _i64p], _i64),
    "herald_wire_sample_order": ([_i64, _i64, _i64p, _i64p], ctypes.c_int),
    "herald_msg_encode": ([_i64, _i64p, ctypes.c_void_p, _i64p, _i64p, _i64p, _i64p, _u8p, _i64, _i64p], _i64),
    "herald_msg_encode_slices": (
        [_i64, _i64, _u8p, _i64p, _i64p, _i64p, _i64p, _i64p, _i64p, _u8p, _i64, _i64p],
        _i64,
    ),
    "herald_msg_decode_fields": ([_i64, _u8p, _i64, _i64p, _i64p, _i64, _i64p, _i64p, _i64p, _u8p], _i64),
    "herald_msg_scan": ([_i64, _u8p, _i64p, _i64p, _i64, _i64p, _i64p, _i64p, _i64p, _i64p, _i64p], _i64),
    "herald_msg_unpack": ([_i64, _u8p, _i64p, _i64p, _i64p, _i64p, _i64p, _i64p, _i64p, _u8p], _i64),
}

KERNELS = _native.Kernels(SOURCE, SIGNATURES, VERSION, "the scheduler's", "herald_kernels")


def lib() -> ctypes.CDLL | None:
    """The loaded kernels, or None (turned off with HERALD_NATIVE=0, or unavailable: warned once)."""
    return KERNELS.get()


def enabled() -> bool:
    return lib() is not None


# ---- wrappers (numpy in, numpy out) ------------------------------------------------------------------------------
def balanced_assign(score: np.ndarray, batch_per_rank: int) -> np.ndarray:
    """laia.balanced_assign(score, B) with first = 0."""
    sc = _c(score, np.float32)
    N, R = sc.shape
    out = np.empty(N, dtype=np.int64)
    lib().herald_balanced_assign(_p(sc), N, R, int(batch_per_rank), _p(out))
    return out


def assign(
    N: int,
    R: int,
    B: int,
    K: int,
    es: np.ndarray,
    ec: np.ndarray,
    w0: np.ndarray,
    per_sample: int,
    own: np.ndarray,
    refine: int,
    owner_weight: float,
    stay_bonus: float,
    w_int16: bool,
    stream_cap: int = 0,
    hosts: np.ndarray | None = None,
    intra: float = 0.0,
) -> np.ndarray:
    """HeraldPolicy.assign's dense path in rotated coordinates (see the kernel's comment); per_sample > 0: single-hot
    elements, that many per sample, sample-major; stream_cap > 0: the first pass is laia.stream_assign's (`hosts`: the
    host of every rank, host-aware with `intra`)."""
    a = np.empty(N, dtype=np.int64)
    es, ec, w0, own = _c(es, np.int64), _c(ec, np.int64), _c(w0, np.float64), _c(own, np.int64)
    if hosts is not None:
        hosts = _c(hosts, np.int64)
    lib().herald_assign(
        N,
        R,
        B,
        K,
        es.shape[0],
        _p(es),
        _p(ec),
        _p(w0),
        int(per_sample),
        _p(own),
        int(refine),
        float(owner_weight),
        float(stay_bonus),
        int(w_int16),
        int(stream_cap),
        _p(hosts) if hosts is not None else None,
        int(hosts.max()) + 1 if hosts is not None and hosts.shape[0] else 0,
        float(intra),
        _p(a),
    )
    return a


def batch_keys(gid: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted distinct keys, index of every element's key, count per key) of `gid` (values in [0, n_rows))."""
    g = _c(gid, np.int64)
    E = g.shape[0]
    cap = min(E, n_rows)
    keys, cnt, cid = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64), np.empty(E, dtype=np.int64)
    K = lib().herald_batch_keys(_p(g), E, n_rows, _p(keys), _p(cid), _p(cnt))
    return keys[:K], cid, cnt[:K]


def scheduled_elements(
    cid: np.ndarray, N: int, width: int, idx: np.ndarray, count: np.ndarray, geo: np.ndarray, nmax: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(es, ec, w0) of planner.scheduled_elements for a single-hot batch: columns `idx` of the [N, width] keys."""
    c, ix, cnt, g = _c(cid, np.int64), _c(idx, np.int64), _c(count, np.int64), _c(geo, np.float64)
    n = N * ix.shape[0]
    es, ec, w0 = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.empty(n, dtype=np.float64)
    lib().herald_scheduled_elements(
        N, width, _p(c), ix.shape[0], _p(ix), _p(cnt), _p(g), int(nmax), _p(es), _p(ec), _p(w0)
    )
    return es, ec, w0


def demand(
    keys: np.ndarray, offsets: np.ndarray, block: np.ndarray, P: int, H: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(directory host of every key, the keys' order by host, each key's index in its host's demand, keys per host)
    of a host batch's sorted keys (`HostPlanner._keys`)."""
    k, off, blk = _c(keys, np.int64), _c(offsets, np.int64), _c(block, np.int64)
    K = k.shape[0]
    dir_host, order, index = (np.empty(K, dtype=np.int64) for _ in range(3))
    per_host = np.empty(H, dtype=np.int64)
    rc = lib().herald_demand(
        K, _p(k), blk.shape[0], _p(off), _p(blk), P, H, _p(dir_host), _p(order), _p(index), _p(per_host)
    )
    if rc != 0:
        raise ValueError(f"native.demand: {lib().herald_last_error().decode()}")
    return dir_host, order, index, per_host


def step_reads(
    cid: np.ndarray, width: int | None, smp: np.ndarray | None, sample_rank: np.ndarray, K: int, R: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(count, start, pair_key, pair_rank) of reads.step_reads' dense path."""
    c, rk = _c(cid, np.int64), _c(sample_rank, np.int64)
    E = c.shape[0]
    count, start = np.empty(K, dtype=np.int64), np.empty(K, dtype=np.int64)
    pk, pr = np.empty(E, dtype=np.int64), np.empty(E, dtype=np.int64)
    s = _c(smp, np.int64) if smp is not None else np.zeros(1, dtype=np.int64)
    mark = np.empty(K * R, dtype=np.uint8)
    P = lib().herald_step_reads(
        _p(c), E, int(width or 0), _p(s), _p(rk), K, R, _p(mark), _p(count), _p(start), _p(pk), _p(pr)
    )
    return count, start, pk[:P], pr[:P]


def step_reads_sparse(
    cid: np.ndarray, width: int | None, smp: np.ndarray | None, sample_rank: np.ndarray, K: int, R: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(count, start, pair_key, pair_rank) of reads.step_reads without a [K, R] table (its sparse path)."""
    c, rk = _c(cid, np.int64), _c(sample_rank, np.int64)
    E = c.shape[0]
    if E >= 2**31 or K >= 2**31:
        raise ValueError(f"step_reads_sparse: {E} elements / {K} keys do not fit its int32 scratch")
    count, start = np.empty(K, dtype=np.int64), np.empty(K, dtype=np.int64)
    pk, pr = np.empty(E, dtype=np.int64), np.empty(E, dtype=np.int64)
    s = _c(smp, np.int64) if smp is not None else np.zeros(1, dtype=np.int64)
    P = lib().herald_step_reads_sparse(
        _p(c), E, int(width or 0), _p(s), _p(rk), K, R, _p(count), _p(start), _p(pk), _p(pr)
    )
    return count, start, pk[:P], pr[:P]


def decide(
    own: np.ndarray,
    count: np.ndarray,
    start: np.ndarray,
    pair_rank: np.ndarray,
    cid: np.ndarray,
    width: int | None,
    smp: np.ndarray | None,
    sample_rank: np.ndarray,
    R: int,
    dense_cells: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """HeraldPolicy._plan's ownership decision: (want, single, sole) per read key (see the kernel's comment); the
    reader counts of shared keys in an [F, R] table up to `dense_cells` cells, else per (key, reader) pair."""
    K = own.shape[0]
    own, count, start, pr = _c(own, np.int64), _c(count, np.int64), _c(start, np.int64), _c(pair_rank, np.int64)
    c, rk = _c(cid, np.int64), _c(sample_rank, np.int64)
    s = _c(smp, np.int64) if smp is not None else np.zeros(1, dtype=np.int64)
    want, sole, single = np.empty(K, dtype=np.int64), np.empty(K, dtype=np.int64), np.empty(K, dtype=np.bool_)
    lib().herald_decide(
        K,
        _p(own),
        _p(count),
        _p(start),
        _p(pr),
        c.shape[0],
        _p(c),
        int(width or 0),
        _p(s),
        _p(rk),
        R,
        int(dense_cells),
        _p(want),
        _p(single),
        _p(sole),
    )
    return want, single, sole


def balance_owners(
    want: np.ndarray,
    own: np.ndarray,
    count: np.ndarray,
    start: np.ndarray,
    pair_rank: np.ndarray,
    skip: np.ndarray | None,
    num_ranks: int,
    factor: float,
    heavy_ranks: np.ndarray | None,
) -> int:
    """schedule.herald.balance.balance_owners (the same moves), in place in `want` (int64, C-contiguous)."""
    if want.dtype != np.int64 or not want.flags.c_contiguous:
        raise ValueError("native.balance_owners: want must be a C-contiguous int64 array (it is updated in place)")
    own, count, start, pr = _c(own, np.int64), _c(count, np.int64), _c(start, np.int64), _c(pair_rank, np.int64)
    sk = None if skip is None else _c(skip, np.uint8)
    hv = None if heavy_ranks is None else _c(heavy_ranks, np.uint8)
    return int(
        lib().herald_balance_owners(
            want.shape[0],
            int(num_ranks),
            _p(want),
            _p(own),
            _p(count),
            _p(start),
            _p(pr),
            None if sk is None else _p(sk),
            float(factor),
            None if hv is None else _p(hv),
        )
    )


def assemble(
    keys,
    own,
    want,
    single,
    sole,
    count,
    start,
    pair_rank,
    victims,
    v_src,
    v_dst,
    v_kind,
    migrate_kind: int,
    table_of: np.ndarray,
    offsets: np.ndarray,
) -> dict:
    """HeraldPolicy._plan's assembly: the moves (by row for the plan, `apply_*` in the directory's order), the shared
    rows' CSR and the hit / remote pair counts."""
    K, V, P = keys.shape[0], victims.shape[0], pair_rank.shape[0]
    ins = (
        [_c(a, np.int64) for a in (keys, own, want)]
        + [_c(single, np.bool_)]
        + [_c(a, np.int64) for a in (sole, count, start, pair_rank, victims, v_src, v_dst)]
    )
    vk, offs = _c(v_kind, np.int8), _c(offsets, np.int64)
    n = K + V
    out = {name: np.empty(n, dtype=np.int64) for name in ("apply_gid", "apply_dst", "table", "row", "src", "dst")}
    out["kind"] = np.empty(n, dtype=np.int8)
    sh = {name: np.empty(K, dtype=np.int64) for name in ("sh_table", "sh_row", "sh_owner")}
    sh["sh_offsets"], sh["sh_readers"] = np.empty(K + 1, dtype=np.int64), np.empty(P, dtype=np.int64)
    counts = np.zeros(4, dtype=np.int64)
    M = lib().herald_assemble(
        K,
        *(_p(a) for a in ins[:8]),
        V,
        *(_p(a) for a in ins[8:]),
        _p(vk),
        int(migrate_kind),
        _p(table_of),
        _p(offs),
        *(_p(out[k]) for k in ("apply_gid", "apply_dst", "table", "row", "src", "dst", "kind")),
        *(_p(sh[k]) for k in ("sh_table", "sh_row", "sh_owner", "sh_offsets", "sh_readers")),
        _p(counts),
    )
    S, nr, hit, remote = (int(x) for x in counts)
    res = {k: v[:M] for k, v in out.items()}
    res.update(
        sh_table=sh["sh_table"][:S],
        sh_row=sh["sh_row"][:S],
        sh_owner=sh["sh_owner"][:S],
        sh_offsets=sh["sh_offsets"][: S + 1],
        sh_readers=sh["sh_readers"][:nr],
        hit=hit,
        remote=remote,
    )
    return res


def _check(rc: int) -> None:
    if rc != 0:
        raise RuntimeError(lib().herald_last_error().decode())


class DirectoryArrays:
    """The addresses of a HeraldPolicy's ownership directory, guest slots, eviction pool, next-use and picked arrays,
    which the capacity kernels update in place. The guest slots replace their slot arrays when they grow
    (`GuestSlots.generation`): the addresses are read again then; every other array is updated in place only."""

    def __init__(self, directory, pool, next_use: np.ndarray, picked: np.ndarray) -> None:
        self.directory, self.pool, self.next_use_a, self.picked_a = directory, pool, next_use, picked
        d, sl = directory, directory.slots
        self.R, self.T, self.G, self.pool_size = d.num_ranks, d.num_tables, sl.num_groups, pool.size
        self._bind()

    def _bind(self) -> None:
        d, sl, pool = self.directory, self.directory.slots, self.pool
        self.arrays = (
            d.table,
            d.owner,
            d.home,
            d.last_use,
            sl.cap,
            sl.base,
            sl.alloc,
            sl.fill,
            sl.slot,
            sl.pos_of,
            pool.tau,
            pool.row,
            pool.keys,
            pool.count,
            sl.group_of_slot,
            self.next_use_a,
            self.picked_a,
        )  # kept alive here
        (
            self.table,
            self.owner,
            self.home,
            self.last_use,
            self.cap,
            self.base,
            self.alloc,
            self.fill,
            self.slot,
            self.pos_of,
            self.tau,
            self.row,
            self.pool_keys,
            self.pool_count,
            self.group_of_slot,
            self.next_use,
            self.picked,
        ) = (_p(a) for a in self.arrays)
        self.generation = sl.generation

    def _current(self) -> None:
        if self.generation != self.directory.slots.generation:
            self._bind()

    @staticmethod
    def supported(directory, pool, next_use: np.ndarray, picked: np.ndarray) -> bool:
        """Whether the kernels can work on these arrays in place (their dtypes and layout)."""
        d = directory
        extra = ((d.table, np.int16), (d.home, np.int32), (next_use, np.int16), (picked, np.bool_))
        return guests_supported(directory, pool) and _in_place(extra)

    def make_room(self, keys, own, home, want, single, step: int, L1: int) -> tuple[np.ndarray, np.ndarray]:
        """HeraldPolicy._make_room (cancellations written to `want`, int64); returns (victims, room)."""
        K = keys.shape[0]
        if want.dtype != np.int64 or not want.flags.c_contiguous or not want.flags.writeable:
            raise ValueError("make_room: `want` must be a writeable C-contiguous int64 array (it is updated in place)")
        keys, own, home, single = _c(keys, np.int64), _c(own, np.int64), _c(home, np.int64), _c(single, np.bool_)
        self._current()
        victims, nv = np.empty(2 * K + 1, dtype=np.int64), np.zeros(1, dtype=np.int64)
        room, rb = np.empty(self.G, dtype=np.int64), np.zeros(1, dtype=np.int64)
        _check(
            lib().herald_make_room(
                K,
                _p(keys),
                _p(own),
                _p(home),
                _p(want),
                _p(single),
                self.R,
                self.T,
                self.table,
                self.owner,
                self.next_use,
                self.last_use,
                self.picked,
                int(step),
                int(L1),
                self.cap,
                self.base,
                self.alloc,
                self.fill,
                self.slot,
                self.pos_of,
                self.pool_size,
                self.tau,
                self.row,
                self.pool_keys,
                self.pool_count,
                self.group_of_slot,
                _p(rb),
                _p(victims),
                victims.shape[0],
                _p(nv),
                _p(room),
            )
        )
        self.pool.rebuilds += int(rb[0])
        return victims[: int(nv[0])], room

    def apply_moves(self, gid: np.ndarray, dst: np.ndarray) -> None:
        """OwnershipDirectory.apply_moves, then EvictionPool.arrived. The groups that gain guests get their regions
        first (GuestSlots.reserve, numpy: it may replace the slot arrays); the kernel checks the capacity."""
        gid, dst = _c(gid, np.int64), _c(dst, np.int64)
        d, sl = self.directory, self.directory.slots
        if gid.shape[0]:
            tab = d.table[gid].astype(np.int64)
            home = d.home[gid]
            src = d.owner[gid].astype(np.int64)
            arrive, leave = dst != home, src != home
            net = np.bincount(dst[arrive] * self.T + tab[arrive], minlength=self.G)
            net -= np.bincount(src[leave] * self.T + tab[leave], minlength=self.G)
            sl.reserve(np.minimum(sl.fill + net, sl.cap))
        self._current()
        _check(
            lib().herald_apply_moves(
                gid.shape[0],
                _p(gid),
                _p(dst),
                self.T,
                self.table,
                self.owner,
                self.home,
                self.G,
                self.cap,
                self.base,
                self.alloc,
                self.fill,
                self.slot,
                self.pos_of,
                self.pool_size,
                self.tau,
                self.row,
                self.pool_keys,
                self.pool_count,
                self.group_of_slot,
                self.last_use,
            )
        )


def _in_place(arrays) -> bool:
    return all(a.dtype == t and a.flags.c_contiguous and a.flags.writeable for a, t in arrays)


def guests_supported(directory, pool) -> bool:
    """Whether `release_guests` / `land_guests` can update this directory's owners, guest slots and eviction pool in
    place (their dtypes and layout)."""
    d, sl = directory, directory.slots
    return not sl.payload and _in_place(  # (the kernels move no payload with the keys)
        (
            (d.owner, np.int32),
            (d.last_use, np.int32),
            (sl.cap, np.int64),
            (sl.base, np.int64),
            (sl.alloc, np.int64),
            (sl.fill, np.int64),
            (sl.slot, np.int64),
            (sl.pos_of, np.int32),
            (pool.tau, np.int64),
            (pool.row, np.int64),
            (pool.keys, np.int64),
            (pool.count, np.int64),
            (sl.group_of_slot, np.int32),
            (sl.top_cell, np.int64),
        )
    )


def _slot_arrays(sl) -> list:
    return [sl.num_groups, _p(sl.cap), _p(sl.base), _p(sl.alloc), _p(sl.fill), _p(sl.slot), _p(sl.pos_of)]


def _pool_arrays(pool, sl) -> list:
    return [pool.size, _p(pool.tau), _p(pool.row), _p(pool.keys), _p(pool.count), _p(sl.group_of_slot)]


def release_guests(directory, gid, src, home, table, lo: int, hi: int) -> None:
    """OwnershipDirectory.release_guests for ranks lo..hi-1, compiled (`guests_supported` first)."""
    gid, src, home, table = (_c(a, np.int64) for a in (gid, src, home, table))
    moves = [gid.shape[0], _p(gid), _p(src), _p(home), _p(table), int(lo), int(hi), directory.num_tables]
    _check(lib().herald_release_guests(*moves, *_slot_arrays(directory.slots)))


def land_guests(directory, pool, gid, dst, home, table, lo: int, hi: int) -> None:
    """OwnershipDirectory.land_guests for ranks lo..hi-1 then EvictionPool.arrived, compiled (`guests_supported`
    first)."""
    gid, dst, home, table = (_c(a, np.int64) for a in (gid, dst, home, table))
    moves = [gid.shape[0], _p(gid), _p(dst), _p(home), _p(table), int(lo), int(hi), directory.num_tables]
    _land(directory, pool, lib().herald_land_guests, moves, "land_guests")


def move_guests(directory, pool, gid, src, dst, home, table, lo: int, hi: int) -> None:
    """`release_guests` then `land_guests` in one call, for a host that applies its moves alone (`guests_supported`
    first)."""
    gid, src, dst, home, table = (_c(a, np.int64) for a in (gid, src, dst, home, table))
    moves = [gid.shape[0], _p(gid), _p(src), _p(dst), _p(home), _p(table), int(lo), int(hi), directory.num_tables]
    _land(directory, pool, lib().herald_move_guests, moves, "move_guests")


def _land(directory, pool, kernel, moves: list, name: str) -> None:
    """A kernel that lands guests (`moves`, then the directory's and the pool's arrays): it grows the regions too
    small into the slot array's free end as GuestSlots.reserve does; where the end lacks room it returns 2, with every
    group's fill after the moves, before it changes anything: GuestSlots.reserve then lays every region out again in
    a larger array (so the addresses are read again) and it runs again."""
    sl = directory.slots
    need = np.empty(sl.num_groups, dtype=np.int64)
    for _ in range(2):
        regions = [_p(sl.top_cell), sl.slot.shape[0], sl.MIN_REGION]
        rc = kernel(
            *moves, _p(directory.owner), *_slot_arrays(sl), *regions, *_pool_arrays(pool, sl), _p(directory.last_use),
            _p(need),
        )  # fmt: skip
        if rc != 2:
            _check(rc)
            return
        sl.reserve(need)
    raise RuntimeError(f"native.{name}: the guest regions were not reserved")  # pragma: no cover - invariant


@dataclass
class HostRoom:
    """A host's capacity phase (`host_room`): its victims (sorted), the cancelled arrivals grouped by directory host
    (each host's in key order) and their count per host."""

    victims: np.ndarray
    cancelled: np.ndarray
    per_host: np.ndarray


def host_room(
    directory, pool, keys, own, want, single, t: int, P: int, H: int, offsets, block, window_keys, step: int, L1: int
) -> HostRoom:
    """HostPlanner.make_room's capacity phase for host t, compiled (`guests_supported` first), from the arrivals as
    received (each sender's in key order): HeraldHierPolicy.room_for_arrivals' victims and cancellations."""
    K = keys.shape[0]
    keys, own, want, single = _c(keys, np.int64), _c(own, np.int64), _c(want, np.int64), _c(single, np.bool_)
    off, blk = _c(offsets, np.int64), _c(block, np.int64)
    window = [_c(w, np.int64) for w in window_keys]
    addrs = _native.address_array(window)
    lens = np.array([w.shape[0] for w in window], dtype=np.int64)
    sl = directory.slots
    victims, nv, rb = np.empty(2 * K + 1, dtype=np.int64), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    cancelled, per_host = np.empty(max(K, 1), dtype=np.int64), np.empty(H, dtype=np.int64)
    _check(
        lib().herald_host_room(
            K, _p(keys), _p(own), _p(want), _p(single), int(t), int(P), int(H), blk.shape[0], _p(off), _p(blk),
            len(window), _p(addrs) if window else None, _p(lens) if window else None, _p(directory.owner),
            _p(directory.last_use), int(step), int(L1), *_slot_arrays(sl), *_pool_arrays(pool, sl), _p(rb), _p(victims),
            victims.shape[0], _p(nv), _p(cancelled), _p(per_host),
        )
    )  # fmt: skip
    pool.rebuilds += int(rb[0])
    return HostRoom(victims[: int(nv[0])], cancelled[: int(per_host.sum())], per_host)


def sort_nonneg(values: np.ndarray) -> np.ndarray | None:
    """np.sort(values) of non-negative int64 values (a radix sort), or None where one is negative."""
    v = _c(values, np.int64)
    out = np.empty(v.shape[0], dtype=np.int64)
    return out if lib().herald_sort_nonneg(v.shape[0], _p(v), _p(out)) == 0 else None


def distinct(gid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """np.unique(gid, return_inverse=True, return_counts=True) of non-negative ids (a hash table, then a radix sort of
    the distinct ids alone), or None where an id is negative or too large."""
    g = _c(gid, np.int64)
    E = g.shape[0]
    keys, cid, cnt = np.empty(E, dtype=np.int64), np.empty(E, dtype=np.int64), np.empty(E, dtype=np.int64)
    K = int(lib().herald_distinct(E, _p(g), _p(keys), _p(cid), _p(cnt)))
    return None if K < 0 else (keys[:K], cid, cnt[:K])


def host_reads(
    cid: np.ndarray,
    width: int | None,
    smp: np.ndarray | None,
    sample_rank: np.ndarray,
    K: int,
    P: int,
    dest: np.ndarray,
    H: int,
    index: np.ndarray,
    rank0: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A host's (key, reader) pairs with their element counts, grouped by the key's directory host (see the kernel's
    comment): (bounds [H + 1], the keys' `index` (int32), the ranks rank0 + r (int64), the counts (int32))."""
    c, rk, d, ix = _c(cid, np.int64), _c(sample_rank, np.int64), _c(dest, np.int64), _c(index, np.int64)
    s = _c(smp, np.int64) if smp is not None else np.zeros(1, dtype=np.int64)
    E = c.shape[0]
    cells, bounds = np.empty(max(K * P, 1), dtype=np.int32), np.empty(H + 1, dtype=np.int64)
    n = min(E, K * P)
    out_index, out_rank, out_count = np.empty(n, np.int32), np.empty(n, np.int64), np.empty(n, np.int32)
    got = lib().herald_host_reads(
        E, _p(c), int(width or 0), _p(s), _p(rk), K, P, _p(d), H, _p(ix), int(rank0), _p(cells), _p(bounds),
        _p(out_index), _p(out_rank), _p(out_count),
    )  # fmt: skip
    return bounds, out_index[:got], out_rank[:got], out_count[:got]


def gather_segments(values: np.ndarray, start: np.ndarray, count: np.ndarray, order: np.ndarray) -> np.ndarray:
    """np.concatenate([values[start[i]:start[i] + count[i]] for i in order]) as int64 (a CSR's rows reordered)."""
    v, st, ct, o = _c(values, np.int64), _c(start, np.int64), _c(count, np.int64), _c(order, np.int64)
    out = np.empty(int(ct[o].sum()) if o.shape[0] else 0, dtype=np.int64)
    lib().herald_gather_segments(o.shape[0], _p(o), _p(st), _p(ct), _p(v), _p(out))
    return out


@dataclass
class HostPlanArrays:
    """A herald_hier host's plan arrays from the parts routed to it (host_plans.host_plan; `host_plan`): the
    plan's moves in key order (`moves_*`), the replica's moves (`replica_*`: every move, then the host's own
    migrations no part brought), the shared rows in key order with their readers in CSR, the host's sample order
    and slice ranks, the tables with moves, shared rows and relayed groups, and the step's summed counts."""

    moves_table: np.ndarray
    moves_row: np.ndarray
    moves_src: np.ndarray
    moves_dst: np.ndarray
    moves_kind: np.ndarray
    replica_gid: np.ndarray
    replica_dst: np.ndarray
    replica_src: np.ndarray
    replica_home: np.ndarray
    replica_table: np.ndarray
    shared_table: np.ndarray
    shared_row: np.ndarray
    shared_owner: np.ndarray
    shared_offsets: np.ndarray
    shared_readers: np.ndarray
    sample_order: np.ndarray
    slice_ranks: np.ndarray
    moved_tables: np.ndarray
    shared_tables: np.ndarray
    relayed_tables: np.ndarray
    hit: int
    remote: int
    migrations: int
    victims: int


_NO_I64, _NO_RANKS = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int16)


def host_plan(
    cat: list[np.ndarray],
    offsets: np.ndarray,
    block: np.ndarray,
    h: int,
    P: int,
    own: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None,
    samples: tuple[np.ndarray, np.ndarray] | None,
    kinds: tuple[int, int],
    table_bits: tuple[int, int, int],
) -> HostPlanArrays | None:
    """`HostPlanArrays` of host h from a routed inbox's 11 fields concatenated (`cat`, host_plans.part_dtypes: rank
    fields int16 or int32); h < 0: the whole plan's rows (every move kept; `cat`'s first 9 fields). `own`: h's
    migrations (indices into its keys) and its keys, wants and owners; `samples`: h's members and their ranks;
    kinds: (MIGRATE, EVICT_HOME). None where the kernels are off or the inputs are not the kernel's (numpy runs)."""
    L = lib()
    if L is None:
        return None
    mig_key, mig_src, mig_dst, sh_key, sh_owner, sh_count, sh_readers, victims, victim_src = cat[:9]
    rk = mig_src.dtype
    rank_fields = (mig_src, mig_dst, sh_owner, sh_count, sh_readers, victim_src)
    if rk not in (np.int16, np.int32) or any(a.dtype != rk for a in rank_fields):
        return None
    mig_key, sh_key, victims = _c(mig_key, np.int64), _c(sh_key, np.int64), _c(victims, np.int64)
    mig_src, mig_dst, sh_owner, sh_count, sh_readers, victim_src = (_c(a, rk) for a in rank_fields)
    offsets, block = _c(offsets, np.int64), _c(block, np.int64)
    if own is None:
        mig, keys, want, k_own = _NO_I64[:0], _NO_I64, _NO_I64, _NO_I64
    else:
        mig, keys, want, k_own = (_c(a, np.int64) for a in own)
        if not keys.shape[0] == want.shape[0] == k_own.shape[0]:
            return None
    if samples is None:
        members, ranks = _NO_I64[:0], _NO_RANKS.astype(rk)
    else:
        if samples[0].dtype != np.int64 or samples[1].dtype != rk or samples[0].shape[0] != samples[1].shape[0]:
            return None  # (the sample order has the members' dtype)
        members, ranks = _c(samples[0], np.int64), _c(samples[1], rk)
    summary = _c(cat[9], np.int64) if len(cat) > 9 else _NO_I64[:0]
    flags = _c(cat[10], np.uint8) if len(cat) > 10 else np.zeros(0, dtype=np.uint8)
    T = offsets.shape[0] - 1
    n, n_sh, n_own, n_smp = mig_key.shape[0] + victims.shape[0], sh_key.shape[0], mig.shape[0], members.shape[0]
    if mig_src.shape[0] != mig_key.shape[0] or mig_dst.shape[0] != mig_key.shape[0] or block.shape[0] != T:
        return None
    if victim_src.shape[0] != victims.shape[0] or sh_owner.shape[0] != n_sh or sh_count.shape[0] != n_sh:
        return None
    # the plan's arrays from one allocation, the replica's moves (dropped once applied) and the counts from another
    n_rd = sh_readers.shape[0]
    plan, plan_at = _carve([n] * 4 + [n_sh] * 3 + [n_sh + 1, n_rd, n_smp, n_smp, 3 * T])
    replica, replica_at = _carve([n + n_own] * 5 + [10])
    kind = np.empty(n, dtype=np.int8)
    moves, shared, (order, slice_ranks, tables), counts = plan[:4] + [kind], plan[4:9], plan[9:], replica.pop()
    ins = (mig_key, mig_src, mig_dst, sh_key, sh_owner, sh_count, sh_readers, victims, victim_src, offsets, block,
           mig, keys, want, k_own, members, ranks, summary, flags)  # fmt: skip
    a = [_p(x) if x.shape[0] else None for x in ins]  # (an empty array is never read)
    rc = L.herald_host_plan(
        rk.itemsize, mig_key.shape[0], a[0], a[1], a[2], n_sh, a[3], a[4], a[5], n_rd, a[6],
        victims.shape[0], a[7], a[8], T, a[9], a[10], int(h), int(P), n_own, a[11], keys.shape[0], a[12], a[13],
        a[14], n_smp, a[15], a[16], summary.shape[0], a[17], flags.shape[0], a[18], int(kinds[0]), int(kinds[1]),
        int(table_bits[0]) | int(table_bits[1]) << 8 | int(table_bits[2]) << 16,
        *plan_at[:4], _p(kind), *replica_at[:5], *plan_at[4:], replica_at[5],
    )  # fmt: skip
    if rc != 0:
        return None
    kept, m, readers, n_moved, n_shared, n_relayed, hit, remote, migrations, n_victims = counts.tolist()
    return HostPlanArrays(
        *(x[:kept] for x in moves),
        *(x[:m] for x in replica),
        *shared[:4],
        shared[4][:readers],
        order,
        slice_ranks,
        tables[:n_moved],
        tables[T : T + n_shared],
        tables[2 * T : 2 * T + n_relayed],
        hit,
        remote,
        migrations,
        n_victims,
    )


def _carve(sizes: list[int]) -> tuple[list[np.ndarray], list[int]]:
    """int64 arrays of these sizes cut from one allocation, and their addresses: one `_p` (0.6-1.5 us here) for all."""
    whole = np.empty(max(sum(sizes), 1), dtype=np.int64)
    base, at, views, addresses = _p(whole), 0, [], []
    for size in sizes:
        views.append(whole[at : at + size])
        addresses.append(base + 8 * at)
        at += size
    return views, addresses


@dataclass
class HostDecision:
    """A directory host's decision of a step (host_planner.HostPlanner.decide, `host_decide`): its keys' arrays as
    HeraldHierPolicy.decide_keys returns them, and phase 6's messages in Outbox's form: `fields` (the arrivals' key,
    owner, destination, single; the pins' key), grouped by destination host, and the hosts sent to with their slices
    [len(dests), 5]; per host, the arrivals and the pins it gets; the rows owner balancing handed on."""

    keys: np.ndarray
    own: np.ndarray
    want: np.ndarray
    single: np.ndarray
    sole: np.ndarray
    pair_key: np.ndarray
    pair_rank: np.ndarray
    fields: list[np.ndarray]
    dests: np.ndarray
    starts: np.ndarray
    stops: np.ndarray
    arrivals_to: np.ndarray
    pins_to: np.ndarray
    balanced: int


def host_decide(
    first: np.ndarray,
    n_of: np.ndarray,
    idx: np.ndarray,
    r: np.ndarray,
    c: np.ndarray,
    demanded: np.ndarray,
    demand_owner: np.ndarray,
    R: int,
    P: int,
    H: int,
    h: int,
    static: bool,
    balance: float | None,
    offsets: np.ndarray,
    block: np.ndarray,
    rank_dtype: type,
) -> HostDecision:
    """Directory host h's phases 5-6 in one pass (the kernel's comment): from the reads it received, n_of[s] (index
    in sender s's demand, which begins at first[s] in `demanded`; reader rank; elements) triples per sender, in
    sender order; `demand_owner`, the owner of every demanded key (aligned with `demanded`: phase 2 read them, and
    nothing moves before phase 5). `balance`: owner balancing's factor (None: off); `static`: every row stays with
    its owner; offsets / block: the tables' first rows and ROW_WISE blocks (a key's home rank)."""
    rk = np.dtype(rank_dtype)
    first, n_of, dem = _c(first, np.int64), _c(n_of, np.int64), _c(demanded, np.int64)
    own = _c(demand_owner, np.int32)
    if own.shape != dem.shape:
        raise ValueError(f"native.host_decide: {own.shape[0]} owners for {dem.shape[0]} demanded keys")
    idx, r, c = _c(idx, np.int32), _c(r, rk), _c(c, np.int32)
    offsets, block = _c(offsets, np.int64), _c(block, np.int64)
    n = idx.shape[0]
    if r.shape[0] != n or c.shape[0] != n:
        raise ValueError("native.host_decide: idx, r and c must be aligned")
    out64, out8, outrk = np.empty(8 * n + 13 * H + 5, np.int64), np.empty(2 * n, np.uint8), np.empty(2 * n, rk)
    _check(
        lib().herald_host_decide(
            rk.itemsize, n, first.shape[0], _p(first), _p(n_of), _p(idx), _p(r), _p(c), _p(dem), dem.shape[0],
            _p(own), R, P, H, h, int(static), int(balance is not None), float(balance or 0.0), _p(offsets),
            _p(block), block.shape[0], _p(out64), _p(out8), _p(outrk),
        )
    )  # fmt: skip
    K, na, npin, nd, balanced = out64[-5:].tolist()
    at = 8 * n + 3 * H  # the slices' starts and stops
    slices = out64[at : at + 10 * H].reshape(2, H, 5)
    return HostDecision(
        keys=out64[:K], own=out64[n : n + K], want=out64[2 * n : 2 * n + K], single=out8[:K].view(np.bool_),
        sole=out64[3 * n : 3 * n + K], pair_key=out64[4 * n : 5 * n], pair_rank=out64[5 * n : 6 * n],
        fields=[out64[6 * n : 6 * n + na], outrk[:na], outrk[n : n + na], out8[n : n + na].view(np.int8),
                out64[7 * n : 7 * n + npin]],
        dests=out64[at - H : at - H + nd], starts=slices[0, :nd], stops=slices[1, :nd],
        arrivals_to=out64[8 * n : 8 * n + H], pins_to=out64[8 * n + H : 8 * n + 2 * H], balanced=balanced,
    )  # fmt: skip


@dataclass
class HostPart:
    """A directory host's final decisions of a step (host_planner.HostPlanner.part, `host_part`): the migrations
    (indices into its keys; key, source, destination), the shared rows (indices; key, owner, reader count), each
    shared pair's row (index into the shared) and reader (int64, and in the ranks' type), the (hit, remote) counts,
    the victims' owners and the host's samples' ranks."""

    mig: np.ndarray
    mig_key: np.ndarray
    mig_src: np.ndarray
    mig_dst: np.ndarray
    shared: np.ndarray
    sh_key: np.ndarray
    sh_owner: np.ndarray
    sh_count: np.ndarray
    shared_pair_row: np.ndarray
    readers: np.ndarray
    readers_rk: np.ndarray
    counts: np.ndarray
    victim_src: np.ndarray
    sample_rank: np.ndarray


def host_part(
    keys: np.ndarray,
    own: np.ndarray,
    want: np.ndarray,
    single: np.ndarray,
    sole: np.ndarray,
    pair_key: np.ndarray,
    pair_rank: np.ndarray,
    cancelled: np.ndarray,
    victims: np.ndarray,
    owner: np.ndarray,
    local_rank: np.ndarray,
    rank0: int,
    rank_dtype: type,
) -> HostPart:
    """A directory host's phase 8 in one pass (the kernel's comment): the cancelled arrivals undone in `want` (int64,
    C-contiguous: updated in place), then its part of the plan."""
    if want.dtype != np.int64 or not want.flags.c_contiguous:
        raise ValueError("native.host_part: want must be a C-contiguous int64 array (it is updated in place)")
    if owner.dtype != np.int32 or not owner.flags.c_contiguous:
        raise ValueError("native.host_part: owner must be a C-contiguous int32 array")
    rk = np.dtype(rank_dtype)
    keys, own, sole, pk, pr = (_c(x, np.int64) for x in (keys, own, sole, pair_key, pair_rank))
    single, cancelled, victims, local = (
        _c(single, np.bool_),
        _c(cancelled, np.int64),
        _c(victims, np.int64),
        _c(local_rank, np.int64),
    )
    K, n, V, L = keys.shape[0], pk.shape[0], victims.shape[0], local.shape[0]
    if not own.shape[0] == want.shape[0] == single.shape[0] == sole.shape[0] == K or pr.shape[0] != n:
        raise ValueError("native.host_part: the keys' arrays and the pairs' must be aligned")
    out64, outrk = np.empty(4 * K + 2 * n + 5, np.int64), np.empty(4 * K + n + V + L, rk)
    _check(
        lib().herald_host_part(
            rk.itemsize, K, n, _p(keys), _p(own), _p(want), _p(single), _p(sole), _p(pk), _p(pr),
            cancelled.shape[0], _p(cancelled), V, _p(victims), _p(owner), L, _p(local), int(rank0), _p(out64),
            _p(outrk),
        )
    )  # fmt: skip
    nm, ns, npairs, hit, remote = out64[-5:].tolist()
    r0 = 4 * K + n  # the victims' owners, then the samples' ranks
    return HostPart(
        mig=out64[:nm], mig_key=out64[K : K + nm], mig_src=outrk[:nm], mig_dst=outrk[K : K + nm],
        shared=out64[2 * K : 2 * K + ns], sh_key=out64[3 * K : 3 * K + ns], sh_owner=outrk[2 * K : 2 * K + ns],
        sh_count=outrk[3 * K : 3 * K + ns], shared_pair_row=out64[4 * K : 4 * K + npairs],
        readers=out64[4 * K + n : 4 * K + n + npairs], readers_rk=outrk[4 * K : 4 * K + npairs],
        counts=out64[-2:], victim_src=outrk[r0 : r0 + V], sample_rank=outrk[r0 + V :],
    )  # fmt: skip


@dataclass
class RoutedPart:
    """A directory host's part of the plan split by the host that needs each entry (host_planner.HostPlanner.routed):
    its Outbox's 11 fields in order (migrations: key, source, destination; runs of one shared row: key, owner, reader
    count; their readers; victims: key, owner; the summary; the table bits), host t's slice of field i at
    `starts[t, i]:stops[t, i]`."""

    fields: list[np.ndarray]
    starts: np.ndarray
    stops: np.ndarray


def route_part(
    h: int,
    P: int,
    H: int,
    offsets: np.ndarray,
    block: np.ndarray,
    k_own: np.ndarray,
    mig_at: np.ndarray,
    shared_at: np.ndarray,
    readers: np.ndarray,
    counts: np.ndarray,
    part: list[np.ndarray],
) -> RoutedPart | None:
    """`RoutedPart` of host h's `part` (HostPlanner.part's first 9 arrays: migrations, shared rows, victims, ranks of
    one dtype) from its keys' owners before the moves `k_own`, the migrations' and shared rows' indices among its
    keys, the shared readers (int64) and the (hit, remote) counts; the layout's `offsets` and the directory's `block`
    give a victim's home. None where the kernels are off or a shared row's readers are not in rank order."""
    L = lib()
    if L is None:
        return None
    rk = part[1].dtype
    mig_key, mig_src, mig_dst, sh_key, sh_owner, sh_count, sh_readers, victims, victim_src = (
        _c(x, np.int64 if i in (0, 3, 7) else rk) for i, x in enumerate(part[:9])
    )
    off, blk, own, ma, sa = (_c(x, np.int64) for x in (offsets, block, k_own, mig_at, shared_at))
    rd, cnt = _c(readers, np.int64), _c(counts, np.int64)
    T, n_mig, n, n_pairs, n_vic = blk.shape[0], ma.shape[0], sa.shape[0], rd.shape[0], victims.shape[0]
    n_m, n_r = 2 * n_mig + n_pairs, 2 * n + n_pairs
    fields = [
        np.empty(n_m, np.int64), np.empty(n_m, rk), np.empty(n_m, rk), np.empty(n_r, np.int64), np.empty(n_r, rk),
        np.empty(n_r, rk), np.empty(3 * n_pairs, rk), np.empty(3 * n_vic, np.int64), np.empty(3 * n_vic, rk),
        np.empty(4, np.int64), np.empty(T, np.uint8),
    ]  # fmt: skip
    starts, stops, lens = np.empty((H, 11), np.int64), np.empty((H, 11), np.int64), np.empty(4, np.int64)
    dims = np.array([rk.itemsize, h, P, H, T, own.shape[0], n_mig, n, n_pairs, n_vic], dtype=np.int64)
    arrays = [
        off, blk, own, ma, mig_key, mig_src, mig_dst, sa, sh_key, sh_owner, sh_count, rd, sh_readers, victims,
        victim_src, cnt, *fields, starts, stops, lens,
    ]  # fmt: skip
    table = _native.address_array(arrays)  # kept alive through the call
    got = L.herald_route_part(_p(dims), _p(table))
    if got == -1:
        return None
    if got != 0:
        raise ValueError(f"native.route_part: {L.herald_last_error().decode()}")
    m, r, p, v = lens.tolist()
    for i, k in enumerate((m, m, m, r, r, r, p, v, v)):
        fields[i] = fields[i][:k]
    return RoutedPart(fields, starts, stops)


# ---- the plan's flat wire form (plan_wire.py) --------------------------------------------------------------------
def wire_assignment(sample_order: np.ndarray, R: int, B: int) -> np.ndarray | None:
    """plan_wire._assignment (each sample's rank), or None where the sample order does not determine it."""
    so = _c(sample_order, np.int64)
    rank = np.empty(R * B, dtype=np.int64)
    return rank if lib().herald_wire_assignment(int(R), int(B), _p(so), _p(rank)) == 0 else None


def wire_reader_mask(reader_offsets: np.ndarray, readers: np.ndarray) -> np.ndarray | None:
    """plan_wire._reader_mask (each shared row's readers as a bitmask), or None where it would not say the same."""
    ro, rd = _c(reader_offsets, np.int64), _c(readers, np.int64)
    n = ro.shape[0] - 1
    mask = np.empty(max(n, 0), dtype=np.int64)
    return mask if n >= 0 and lib().herald_wire_reader_mask(n, _p(ro), rd.shape[0], _p(rd), _p(mask)) == 0 else None


def wire_pack(arrays: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """plan_wire._narrow of every array, back to back: (the bytes, each array's item size)."""
    a = [_c(x, np.int64) for x in arrays]
    lens = np.array([x.shape[0] for x in a], dtype=np.int64)
    out, sizes = np.empty(int(lens.sum()) * 8, dtype=np.uint8), np.empty(len(a), dtype=np.int64)
    n = lib().herald_wire_pack(len(a), _native.addresses(a), _p(lens), _p(out), _p(sizes))
    return out[:n], sizes.tolist()


def wire_unpack(buf: np.ndarray, lens: list[int], sizes: list[int]) -> list[np.ndarray]:
    """The inverse of `wire_pack`: int64 copies of the arrays in `buf` (item sizes `sizes`)."""
    outs = [np.empty(n, dtype=np.int64) for n in lens]
    b, n, z = _c(buf, np.uint8), np.asarray(lens, dtype=np.int64), np.asarray(sizes, dtype=np.int64)  # kept alive
    lib().herald_wire_unpack(len(outs), _p(b), _p(n), _p(z), _native.addresses(outs))
    return outs


def wire_readers(mask: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray] | None:
    """plan_wire._readers_from_mask for readers below R: (reader_offsets, readers), or None (a bit at R or above)."""
    m = _c(mask, np.int64)
    offsets, readers = np.empty(m.shape[0] + 1, dtype=np.int64), np.empty(m.shape[0] * min(R, 63), dtype=np.int64)
    P = lib().herald_wire_readers(m.shape[0], int(R), _p(m), _p(offsets), _p(readers))
    return (offsets, readers[:P]) if P >= 0 else None


def wire_sample_order(rank: np.ndarray, R: int) -> np.ndarray | None:
    """np.argsort(rank, kind="stable") for ranks in [0, R), or None for a rank out of range."""
    r = _c(rank, np.int64)
    order = np.empty(r.shape[0], dtype=np.int64)
    return order if lib().herald_wire_sample_order(r.shape[0], int(R), _p(r), _p(order)) == 0 else None


def msg_encode(
    addresses: np.ndarray,
    first: np.ndarray,
    lens: np.ndarray,
    kinds: np.ndarray,
    itemsizes: np.ndarray,
    codes: np.ndarray,
    cap: int,
) -> tuple[np.ndarray, np.ndarray]:
    """message_wire's messages (message m: arrays first[m] .. first[m + 1], array i at addresses[i] (uint64; 0 for an
    empty one), C-contiguous, lens[i] elements, kept alive by the caller) back to back: (the bytes, each message's
    end)."""
    out, ends = np.empty(cap, dtype=np.uint8), np.empty(first.shape[0] - 1, dtype=np.int64)
    a = _c(addresses, np.uint64)
    n = lib().herald_msg_encode(
        ends.shape[0], _p(first), _p(a), _p(lens), _p(kinds), _p(itemsizes), _p(codes), _p(out), cap, _p(ends)
    )
    if n < 0:
        raise RuntimeError("message_wire: the encoding outgrew its capacity")  # the capacity is an upper bound
    return out[:n], ends


def msg_encode_slices(
    fields: np.ndarray,
    field_len: np.ndarray,
    kinds: np.ndarray,
    itemsizes: np.ndarray,
    codes: np.ndarray,
    starts: np.ndarray,
    stops: np.ndarray,
    cap: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    """msg_encode for messages of the same fields (at addresses `fields`, uint64; field_len elements each, kept alive
    by the caller): message m is field i's elements starts[m, i] .. stops[m, i] for every i. (the bytes, each
    message's end), or None for a slice outside its field."""
    st, sp = _c(starts, np.int64), _c(stops, np.int64)
    out, ends = np.empty(cap, dtype=np.uint8), np.empty(st.shape[0], dtype=np.int64)
    n = lib().herald_msg_encode_slices(
        st.shape[0], st.shape[1], _p(fields), _p(field_len), _p(kinds), _p(itemsizes), _p(codes), _p(st), _p(sp),
        _p(out), cap, _p(ends),
    )  # fmt: skip
    if n == -2:
        return None
    if n < 0:
        raise RuntimeError("message_wire: the encoding outgrew its capacity")  # the capacity is an upper bound
    return out[:n], ends


@dataclass
class MessageArrays:
    """herald_msg_scan's table: every array of the messages, in order."""

    msg: np.ndarray
    code: np.ndarray
    mode: np.ndarray
    count: np.ndarray
    start: np.ndarray
    stop: np.ndarray


def msg_scan(buf: np.ndarray, bounds: np.ndarray, itemsize: np.ndarray) -> MessageArrays:
    """The arrays of the messages in `buf` (message m: bytes bounds[m] .. bounds[m + 1]); ValueError if malformed."""
    b, bd, isz = _c(buf, np.uint8), _c(bounds, np.int64), _c(itemsize, np.int64)
    # a message's first byte counts its arrays: their sum bounds the table (a bound from the buffer's length, 2
    # bytes per array, would allocate ~1 MB per 100 KB received, page mappings that cost more than the scan)
    starts = bd[:-1][(bd[:-1] < bd[1:]) & (bd[:-1] >= 0) & (bd[:-1] < b.shape[0])]  # (empty ones: the scan's error)
    cap = int(b[starts].sum(dtype=np.int64))
    cols = [np.empty(cap, dtype=np.int64) for _ in range(6)]
    k = lib().herald_msg_scan(bd.shape[0] - 1, _p(b), _p(bd), _p(isz), cap, *(_p(c) for c in cols))
    if k < 0:
        raise ValueError(f"message_wire: a malformed message ({lib().herald_last_error().decode()})")
    return MessageArrays(*(c[:k] for c in cols))


def msg_unpack(buf: np.ndarray, arrays: MessageArrays, itemsize: np.ndarray, offset: np.ndarray, size: int):
    """Every array of `arrays` in its own dtype, array i at byte offset[i] of one new np.uint8 arena of `size` bytes;
    None where an encoded array has a dtype the compiled pass does not decode (not an integer: numpy does)."""
    b, arena, a = _c(buf, np.uint8), np.empty(size, dtype=np.uint8), arrays
    cols = (a.code, a.mode, a.count, a.start, a.stop)
    if lib().herald_msg_unpack(a.msg.shape[0], _p(b), *(_p(c) for c in cols), _p(itemsize), _p(offset), _p(arena)):
        return None
    return arena


def msg_decode_fields(
    buf: np.ndarray, sizes: np.ndarray, itemsize: np.ndarray, nf: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """message_wire.decode_fields' compiled part: the messages of `sizes` bytes (each > 0) back to back in `buf`, each
    of nf arrays, decoded field by field: (the arena, each field's dtype code, at [len(sizes) + 1, nf]: each field's
    elements before each message's, each field's first byte in the arena); None where the layouts differ or an
    encoded array is not of an integer dtype; ValueError if malformed."""
    b, s = _c(buf, np.uint8), _c(sizes, np.int64)
    M = s.shape[0]
    codes, at, first = np.empty(nf, dtype=np.int64), np.empty((M + 1) * nf, dtype=np.int64), np.empty(nf, np.int64)
    args = (M, _p(b), b.shape[0], _p(s), _p(itemsize), nf, _p(codes), _p(at), _p(first))
    size = lib().herald_msg_decode_fields(*args, None)
    if size == -1:
        raise ValueError(f"message_wire: a malformed message ({lib().herald_last_error().decode()})")
    if size < 0:
        return None
    arena = np.empty(max(size, 1), dtype=np.uint8)  # (one byte where every field is empty: an address to pass)
    lib().herald_msg_decode_fields(*args, _p(arena))
    return arena, codes, at.reshape(M + 1, nf), first
