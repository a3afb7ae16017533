"""The scheduler's compiled kernels (schedule/native.py) against the numpy code they replace: the same plans, step by
step, byte for byte, and the same ownership directory, on every path the kernels take (single-hot and jagged
batches, 2..8 ranks, refine rounds, integer and float per-key scores, small eviction pools that rebuild and
overflow, the lookahead). A kernel that rounded, broke a tie or ordered a slot differently fails here."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from herald_torchrec import _native
from herald_torchrec.schedule import GlobalBatch, PlanChecker, make_policy, native, reads
from herald_torchrec.schedule.directory import OwnershipDirectory
from herald_torchrec.schedule.herald import hierarchy as hier_mod
from herald_torchrec.schedule.herald import planner as herald_mod
from herald_torchrec.schedule.herald.eviction import EvictionPool
from herald_torchrec.schedule.herald.laia import balanced_assign
from herald_torchrec.schedule.plan_wire import encode_plan_tree
from herald_torchrec.schedule.reads import Scratch, batch_keys, step_reads

pytestmark = pytest.mark.skipif(not native.enabled(), reason="no C++ compiler here: the numpy path is the only one")

ROWS = [40, 300, 7, 1200, 90]


@pytest.fixture
def numpy_only():
    """Run a block with the kernels off, then turn them back on."""
    _native.set_mode(False)
    try:
        yield
    finally:
        _native.set_mode(True)


def _single_hot(rng: np.random.Generator, n: int, skew: float = 1.3) -> np.ndarray:
    # skewed ids: a hot head read by many samples, a long tail (so keys are shared, migrate and get evicted)
    return np.stack([np.minimum(rng.zipf(skew, n) - 1, r - 1) for r in ROWS], axis=1).astype(np.int64)


def _jagged(rng: np.random.Generator, n: int) -> GlobalBatch:
    offs, vals = [], []
    for r in ROWS:
        lens = rng.integers(0, 4, n)  # empty bags and multi-hot ones; a bag may read a key twice
        offs.append(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
        vals.append(np.minimum(rng.zipf(1.3, int(lens.sum())) - 1, r - 1).astype(np.int64))
    return GlobalBatch(offs, vals, ROWS)


def _trace(kind: str, R: int, B: int, steps: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    if kind == "dense":
        return [_single_hot(rng, R * B) for _ in range(steps)]
    return [_jagged(rng, R * B) for _ in range(steps)]


def _batch(item, index: int) -> GlobalBatch:
    if isinstance(item, GlobalBatch):  # fresh objects per run: a batch caches policy views
        return GlobalBatch(item.offsets, item.values, ROWS, index=index)
    return GlobalBatch.from_dense(item, ROWS, index=index)


def _run(trace, R: int, B: int, L: int, **kw) -> tuple[list[bytes], object]:
    pol = make_policy("herald", ROWS, R, B, kw.pop("cache_ratio", 0.1), L, tables="all", **kw)
    chk = PlanChecker(ROWS, R, B, pol.cache_ratio)
    plans = []
    for i in range(len(trace) - L):
        window = [_batch(trace[j], j) for j in range(i, i + L + 1)]
        plan = pol.plan(window)
        chk.check(plan, window[0])
        plans.append(encode_plan_tree(dataclasses.replace(plan, sched_seconds=0.0)).tobytes())
    assert chk.stale_reads == 0 and not chk.errors
    return plans, pol


def _compare(trace, R: int, B: int, L: int, **kw) -> None:
    _native.set_mode(True)
    got, pol_c = _run(trace, R, B, L, **dict(kw))
    assert pol_c._native is not None  # the kernels ran
    _native.set_mode(False)
    try:
        want, pol_n = _run(trace, R, B, L, **dict(kw))
    finally:
        _native.set_mode(True)
    assert pol_n._native is None
    for step, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"plan {step} differs"
    dc, dn = pol_c.directory, pol_n.directory
    for name in ("owner", "last_use"):
        np.testing.assert_array_equal(getattr(dc, name), getattr(dn, name))
    for name in ("fill", "slot", "pos_of"):  # the same slot of every guest: slots break eviction ties
        np.testing.assert_array_equal(getattr(dc.slots, name), getattr(dn.slots, name))


@pytest.mark.parametrize("R", [2, 3, 4, 8])
@pytest.mark.parametrize("refine", [0, 2])
def test_single_hot_plans_equal(R, refine):
    _compare(_trace("dense", R, 16, 40, seed=R), R, 16, 3, refine=refine)


@pytest.mark.parametrize("R", [2, 4])
def test_jagged_plans_equal(R):
    _compare(_trace("jagged", R, 12, 30, seed=10 + R), R, 12, 2, refine=2)


def test_float_scores_plans_equal():
    # an owner weight that is not a whole number makes the per-key scores float32: sums must round as numpy's
    _compare(_trace("dense", 4, 16, 30, seed=7), 4, 16, 2, refine=2, owner_weight=1.3, stay_bonus=0.7)
    _compare(_trace("dense", 8, 16, 30, seed=9), 8, 16, 2, refine=2, owner_weight=1.3, stay_bonus=0.7)  # 8 ranks
    _compare(_trace("jagged", 2, 12, 24, seed=8), 2, 12, 2, refine=1, owner_weight=0.3)


def test_small_pools_plans_equal(monkeypatch):
    # pools of 4 keys: rebuilds and overflows every few steps; a tight cache makes every group evict
    monkeypatch.setattr(herald_mod, "EvictionPool", functools.partial(EvictionPool, size=4))
    _compare(_trace("dense", 2, 32, 60, seed=3), 2, 32, 4, refine=1, cache_ratio=0.05)
    _compare(_trace("jagged", 4, 8, 40, seed=4), 4, 8, 3, refine=0, cache_ratio=0.05)


def test_no_lookahead_and_no_forward():
    _compare(_trace("dense", 2, 16, 20, seed=5), 2, 16, 0, refine=1)
    _compare(_trace("dense", 3, 16, 20, seed=6), 3, 16, 2, refine=1, forward=False)


@pytest.mark.parametrize("R", [2, 8])
@pytest.mark.parametrize("refine", [0, 1])
def test_stream_first_pass_plans_equal(R, refine):
    _compare(_trace("dense", R, 16, 30, seed=20 + R), R, 16, 3, refine=refine, first_pass="stream")
    _compare(_trace("jagged", R, 12, 24, seed=30 + R), R, 12, 2, refine=refine, first_pass="stream")


@pytest.mark.parametrize("R", [3, 8, 16, 64, 65, 130])  # one word of reader bits, exactly one, two, three
def test_stream_assign_equal(R):
    """The compiled stream (native.assign with stream_cap) against laia.stream_assign: keys owned by no rank, keys
    read at more ranks than the cap, elements in table-major order (jagged batches), float weights with ties, and
    host-aware (3 hosts, a row inside a host at 0.2 and 0.7 of one crossing hosts). A cap of R or more (a host
    planner's 8 ranks, one planner's 16) takes the kernel's pass without reader counts, up to R = 64."""
    from herald_torchrec.schedule.herald.laia import stream_assign

    rng = np.random.default_rng(R)
    B, K = 6, 40
    N = R * B
    per = rng.integers(0, 4, N)  # elements per sample, some none
    es = np.repeat(np.arange(N), per)
    ec = np.minimum(rng.zipf(1.4, es.shape[0]) - 1, K - 1)
    table_major = np.argsort(ec % 3, kind="stable")
    es, ec = es[table_major], ec[table_major]
    w = rng.choice([0.25, 0.5, 1.0], es.shape[0])
    own = rng.integers(-1, R, K)
    hosts = np.arange(R) * 3 // R  # 3 hosts (R=3: one rank each)
    caps = ((1, None, 0.0), (4, None, 0.0), (16, None, 0.0), (R, None, 0.0), (16, hosts, 0.2), (2, hosts, 0.7))
    for cap, host_of, intra in caps:
        want = stream_assign(N, R, B, es, ec, w, own, cap=cap, hosts=host_of, intra=intra)
        got = native.assign(N, R, B, K, es, ec, w, 0, own, 0, 0.0, 0.0, False, cap, host_of, intra)
        np.testing.assert_array_equal(got, want)
        assert (np.bincount(got, minlength=R) == B).all()


def test_distinct_and_radix_sort_equal_numpy():
    """The hash-table distinct keys and the radix sort against np.unique / np.sort: skewed ids, uniform ids, one value,
    a few values, wide ids; ids too wide to pack with their index and negative values are declined (None), and
    reads.sort_ints then sorts with numpy."""
    rng = np.random.default_rng(8)
    cases = [
        rng.integers(0, 2**26, 5000), np.minimum(rng.zipf(1.2, 53248), 2**26), np.full(300, 7), rng.integers(0, 3, 999),
        rng.integers(0, 2**45, 4000), np.zeros(0, np.int64), np.array([5]),
    ]  # fmt: skip
    for v in cases:
        np.testing.assert_array_equal(native.sort_nonneg(v), np.sort(v))
        keys, cid, cnt = native.distinct(v)
        u, inv, c = np.unique(v, return_inverse=True, return_counts=True)
        for got, want in ((keys, u), (cid, inv.reshape(-1)), (cnt, c)):
            np.testing.assert_array_equal(got, want)
    assert native.distinct(rng.integers(0, 2**61, 100)) is None  # 61 id bits + 7 index bits > 62
    neg = np.tile(np.array([3, -1, 8, -7]), 100)
    assert native.sort_nonneg(neg) is None and native.distinct(neg) is None
    np.testing.assert_array_equal(reads.sort_ints(neg), np.sort(neg))


def test_scheduled_elements_equal_numpy():
    """A single-hot batch's scheduled columns, their samples and first-pass weights (counts capped at N) compiled:
    numpy's gathers."""
    rng = np.random.default_rng(13)
    N, width, K = 50, 7, 40
    cid, count = rng.integers(0, K, N * width), rng.integers(1, 80, K)  # some counts above N
    idx, geo = np.array([0, 3, 6]), rng.random(N + 1)
    es, ec, w0 = native.scheduled_elements(cid, N, width, idx, count, geo, N)
    want_ec = cid.reshape(N, width)[:, idx].ravel()
    np.testing.assert_array_equal(ec, want_ec)
    np.testing.assert_array_equal(es, np.repeat(np.arange(N), idx.shape[0]))
    np.testing.assert_array_equal(w0, geo[np.minimum(count, N)][want_ec])


def test_batch_keys_bitmap_at_word_edges():
    """The bitmap's key index (keys in earlier 64-row words + set bits below in the word) at a word's first and last
    row, the last row of a partial word, and a key read many times: np.unique's."""
    rng = np.random.default_rng(12)
    n_rows = 200  # 3 words and 8 rows
    gid = rng.permutation(np.concatenate([[0, 63, 64, 127, 128, 191, 192, 199], rng.integers(0, n_rows, 300)]))
    keys, cid, cnt = native.batch_keys(gid, n_rows)
    u, inv, c = np.unique(gid, return_inverse=True, return_counts=True)
    np.testing.assert_array_equal(keys, u)
    np.testing.assert_array_equal(cid, inv)
    np.testing.assert_array_equal(cnt, c)


@pytest.mark.parametrize("P", [4, 8])  # 8: a key's readers as a byte (SSE2)
@pytest.mark.parametrize("kind", ["dense", "jagged"])
def test_host_reads_equal_step_reads(kind, P):
    """A host's reads message compiled: every (key, rank) pair with its element count, grouped by directory host, in
    step_reads' (key, rank) order, against step_reads and a bincount of the elements."""
    rng = np.random.default_rng(10)
    H = 3
    b = _batch(_trace(kind, P, 12, 1, seed=11)[0], 0)
    bk = batch_keys(b, Scratch())
    K = bk.keys.shape[0]
    a = rng.permutation(np.repeat(np.arange(P), 12))
    dest, index = rng.integers(0, H, K), rng.permutation(K)
    bounds, idx, rank, cnt = native.host_reads(
        bk.cid, bk.width, None if bk.width else bk.smp, a, K, P, dest, H, index, 8
    )
    rd = step_reads(bk, a, P)
    want_cnt = np.bincount(bk.cid * P + bk.element_ranks(a), minlength=K * P)[rd.pair_key * P + rd.pair_rank]
    o = np.argsort(dest[rd.pair_key], kind="stable")
    np.testing.assert_array_equal(bounds, np.searchsorted(dest[rd.pair_key][o], np.arange(H + 1)))
    np.testing.assert_array_equal(idx, index[rd.pair_key][o])
    np.testing.assert_array_equal(rank, rd.pair_rank[o] + 8)
    np.testing.assert_array_equal(cnt, want_cnt[o])
    assert idx.dtype == cnt.dtype == np.int32 and cnt.sum() == bk.cid.shape[0]


def test_gather_segments_reorders_a_csr():
    """A CSR's rows in another order (a host's shared rows' readers from the parts' order into key order)."""
    rng = np.random.default_rng(12)
    for n in (0, 1, 40, 2000):
        cnt = rng.integers(0, 5, n)  # empty rows too
        start = np.cumsum(cnt) - cnt
        values = rng.integers(0, 300, int(cnt.sum())).astype(np.int16)
        order = rng.permutation(n)
        want = np.concatenate([values[start[i] : start[i] + cnt[i]] for i in order] + [np.zeros(0, np.int16)])
        got = native.gather_segments(values, start, cnt, order)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)


def test_balance_owners_equal():
    """The compiled owner balancing against balance.balance_owners on random steps: the same moves in the same order
    (so the same owners) with and without skipped (replicated) keys, with and without heavy ranks, at three factors;
    most trials hand rows on."""
    from herald_torchrec.schedule.herald.balance import balance_owners

    rng = np.random.default_rng(7)
    handed = 0
    for trial in range(120):
        R, K = int(rng.integers(2, 40)), int(rng.integers(0, 120))
        readers = [np.sort(rng.choice(R, min(R, int(rng.zipf(1.3))), replace=False)) for _ in range(K)]
        count = np.array([r.shape[0] for r in readers], dtype=np.int64)
        start = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)[:K]
        pk = np.repeat(np.arange(K), count)
        pr = np.concatenate(readers + [np.zeros(0, np.int64)]).astype(np.int64)
        own = rng.integers(0, R, K)
        # the decided owner reads every shared key: the owner if it reads it, else one of its readers
        want = np.array([o if o in r else r[int(rng.integers(r.shape[0]))] for o, r in zip(own, readers)], np.int64)
        skip = rng.random(K) < 0.1 if trial % 2 else None
        heavy = np.arange(R) % 3 == trial % 3 if trial % 3 else None
        factor = float(rng.choice([1.0, 1.15, 1.5]))
        got = []
        for on in (True, False):
            _native.set_mode(on)
            try:
                w = want.copy()
                got.append((balance_owners(w, own, count, start, pk, pr, skip, R, factor, heavy), w))
            finally:
                _native.set_mode(True)
        (mc, wc), (mn, wn) = got
        assert mc == mn, trial
        np.testing.assert_array_equal(wc, wn)
        handed += mc > 0
    assert handed > 60


def test_stream_first_pass_moves_fewer_rows_at_eight_ranks():
    """The reason it is the default from 8 ranks: on the synthetic default's shape (Criteo-like tables, Zipf ids with
    trending ones; 8 x 256 samples, where the time model affords no refine round) it moves ~6 % fewer rows than
    bidding. (On a few tiny tables read by every rank, as _trace's, the two are within 2 % either way.)"""
    from herald_torchrec.data.synthetic import SyntheticCTR, SyntheticSpec

    R, B = 8, 256
    gen = SyntheticCTR(SyntheticSpec(scale=0.003, val_block=R * B))
    rows = list(gen.table_rows)
    ids = [gen.train_samples(i * R * B, R * B).ids for i in range(22)]

    def moved(first_pass: str) -> int:
        pol = make_policy("herald", rows, R, B, 0.1, 2, first_pass=first_pass)
        windows = ([GlobalBatch.from_dense(ids[j], rows, index=j) for j in range(i, i + 3)] for i in range(20))
        return sum(pol.plan(w).transmitted_rows() for w in windows)

    stream, bids = moved("stream"), moved("bids")
    assert stream < 0.97 * bids, (stream, bids)
    assert make_policy("herald", ROWS, 8, 32).first_pass == "stream"  # auto, from 8 ranks
    assert make_policy("herald", ROWS, 4, 32).first_pass == "bids"
    with pytest.raises(ValueError, match="first_pass must be one of auto, stream, bids"):
        make_policy("herald", ROWS, 8, 32, first_pass="greedy")


@pytest.mark.parametrize("R", [2, 3, 5, 8, 16])
def test_balanced_assign_equal(R):
    """The compiled bidding rounds (each overfull rank takes its best bids by selection) against laia's (a sort of
    every bid): ties, spread scores, and every sample preferring the same two ranks (columns overfull round after
    round)."""
    rng = np.random.default_rng(R)
    B = 9
    skewed = rng.normal(size=(R * B, R)).astype(np.float32)
    skewed[:, :2] += 3.0
    for scores in (
        rng.integers(0, 4, (R * B, R)).astype(np.float32),  # many ties
        rng.normal(size=(R * B, R)).astype(np.float32),
        skewed,
    ):
        np.testing.assert_array_equal(native.balanced_assign(scores, B), balanced_assign(scores, B))


@pytest.mark.parametrize("kernel", ["move_guests", "land_guests"])
def test_guest_moves_grow_regions_as_numpy_does(kernel):
    """A host's moves applied by the kernels leave its replica slot for slot as numpy's halves do, pools included,
    while its guests' regions grow into the slot array's free end (in the kernel) and the array is laid out again
    (GuestSlots.reserve, when the end has no room)."""
    rows, R, lo, hi = [300, 200, 90], 4, 0, 2
    rng = np.random.default_rng(5)
    a, b = (OwnershipDirectory(rows, num_ranks=R, cache_ratio=1.0) for _ in range(2))
    pa, pb = EvictionPool(a.slots, a.last_use, size=4), EvictionPool(b.slots, b.last_use, size=4)
    assert native.guests_supported(b, pb)
    grown = laid_out = 0
    for step in range(40):
        gid = np.sort(rng.choice(sum(rows), 40, replace=False))
        dst = rng.integers(0, R, gid.shape[0])
        src, home, table = (x[gid].astype(np.int64) for x in (a.owner, a.home, a.table))
        a.last_use[gid] = b.last_use[gid] = rng.integers(-1, step + 1, gid.shape[0])  # the pools' floors
        a.release_guests(gid, src, home, table, (lo, hi))
        got = a.land_guests(gid, dst, home, table, (lo, hi))
        pa.arrived(got.pos, got.keys, got.groups)
        generation, alloc = b.slots.generation, b.slots.alloc.copy()
        if kernel == "move_guests":
            native.move_guests(b, pb, gid, src, dst, home, table, lo, hi)
        else:
            native.release_guests(b, gid, src, home, table, lo, hi)
            native.land_guests(b, pb, gid, dst, home, table, lo, hi)
        laid_out += b.slots.generation != generation
        grown += b.slots.generation == generation and bool((b.slots.alloc != alloc).any())
        np.testing.assert_array_equal(b.owner, a.owner)
        for name in ("slot", "pos_of", "base", "alloc", "fill", "group_of_slot", "top_cell"):
            np.testing.assert_array_equal(getattr(b.slots, name), getattr(a.slots, name), err_msg=name)
        np.testing.assert_array_equal(pb.tau, pa.tau)
        np.testing.assert_array_equal(pb.count, pa.count)
        for g in np.flatnonzero(a.slots.cap > pa.size):
            np.testing.assert_array_equal(pb.keys[pb.row[g], : pb.count[g]], pa.keys[pa.row[g], : pa.count[g]])
    assert grown >= 5 and laid_out >= 2


def test_kernel_errors_raise():
    # the directory refuses an arrival beyond a group's capacity, as numpy's GuestSlots.add does
    pol = make_policy("herald", ROWS, 2, 4, 0.01, 0, tables="all")
    assert pol._native is not None
    cap = int(pol.directory.capacity[0])
    gid = np.arange(cap + 1, dtype=np.int64)  # rows of table 0 homed on rank 0, all sent to rank 1
    with pytest.raises(RuntimeError, match="over capacity"):
        pol._native.apply_moves(gid, np.ones(cap + 1, dtype=np.int64))


def test_kernel_addresses_refuse_strided_arrays():
    # a kernel reads an array from its first element on: a strided view would hand it other elements, silently
    a = np.arange(8, dtype=np.int64)
    assert _native.address(a) == a.ctypes.data
    ro = a.copy()
    ro.flags.writeable = False
    assert _native.address(ro) == ro.ctypes.data  # read-only arrays pass through numpy
    assert _native.address_array([a[2:], ro]).tolist() == [a.ctypes.data + 16, ro.ctypes.data]
    for strided in (a[::2], ro[::2], a.reshape(2, 4)[:, 1]):
        with pytest.raises(ValueError, match="strided"):
            _native.address(strided)
    with pytest.raises(ValueError, match="strided"):
        _native.address_array([a, a[::2]])


def test_off_switch(numpy_only):
    assert not native.enabled()
    pol = make_policy("herald", ROWS, 2, 4, 0.1, 0)
    assert pol._native is None


def test_app_setting():
    """`scheduler.native` in the app: off -> numpy, on -> the kernels, auto -> HERALD_NATIVE's default (on here)."""
    from herald_torchrec.app.model_setup import use_native_kernels

    try:
        use_native_kernels("off")
        assert not native.enabled()
        use_native_kernels("on")
        assert native.enabled()
        use_native_kernels("off")
        use_native_kernels("auto")
        assert native.enabled()
        with pytest.raises(ValueError, match="scheduler.native must be one of"):
            use_native_kernels("sometimes")
    finally:
        _native.set_mode(True)


def test_without_a_compiler_numpy_with_a_warning(monkeypatch, tmp_path):
    """No C++ compiler (and nothing built yet): the scheduler warns once and runs numpy; HERALD_NATIVE=1 makes it an
    error that says why."""
    monkeypatch.setenv(_native.DIR_ENV, str(tmp_path))  # an empty cache: the kernels would have to be built
    monkeypatch.setattr(_native, "_compiler", lambda: None)
    try:
        _native.set_mode(None)
        with pytest.warns(UserWarning, match="compiled kernels are unavailable .*no C\\+\\+ compiler.*using numpy"):
            assert not native.enabled()
        assert make_policy("herald", ROWS, 2, 4, 0.1, 0)._native is None
        monkeypatch.setenv(_native.ENV, "1")
        _native.set_mode(None)
        with pytest.raises(RuntimeError, match="HERALD_NATIVE=on but .* no C\\+\\+ compiler"):
            native.enabled()
    finally:
        monkeypatch.delenv(_native.ENV, raising=False)
        monkeypatch.delenv(_native.DIR_ENV)
        _native.set_mode(True)


@pytest.mark.parametrize("kind", ["dense", "jagged"])
def test_host_aware_plans_equal(kind):
    # host-aware LAIA bids in numpy on both paths, its stream first pass is compiled or numpy; the rest of the plan
    # (decision, eviction, assembly) is compiled
    _compare(_trace(kind, 4, 12, 30, seed=21), 4, 12, 2, refine=2, hosts=2)
    _compare(_trace(kind, 8, 8, 24, seed=22), 8, 8, 3, refine=1, hosts=[0, 1, 0, 1, 2, 2, 3, 3], intra_host_cost=0.5)
    for first_pass in ("stream", "bids"):
        _compare(_trace(kind, 8, 8, 24, seed=23), 8, 8, 3, refine=0, hosts=4, first_pass=first_pass)


@pytest.mark.parametrize(
    ("kind", "wire", "pool"), [("dense", "compact", None), ("jagged", "raw", None), ("dense", "raw", 4)]
)
def test_herald_hier_plans_equal(kind, wire, pool, monkeypatch):
    """herald_hier with several hosts (3 hosts of 2, 2 of 4) and a tight cache: LAIA per host, the reads, the routing,
    the capacity phase and the planners' messages through the in-process transport (compiled encoding and decoding)
    give numpy's plans, step by step, the same bytes on the planners' wire and the same directory, slots and pools.
    Pools of 4 keys (`pool`): the capacity phase's picks from pools that rebuild and overflow, and cancellations."""
    cancelled = []
    if pool:
        monkeypatch.setattr(hier_mod, "EvictionPool", functools.partial(EvictionPool, size=pool))
        room = hier_mod.HeraldHierPolicy.room_for_arrivals

        def counted(self, t, keys, own, home, want, single, window_keys):
            before = want.copy()
            out = room(self, t, keys, own, home, want, single, window_keys)
            cancelled.append(int((want != before).sum()))
            return out

        monkeypatch.setattr(hier_mod.HeraldHierPolicy, "room_for_arrivals", counted)
    for R, P, seed in ((6, 2, 31), (8, 4, 32)):
        trace = _trace(kind, R, 12, 40, seed=seed)
        runs = []
        for on in (True, False):
            _native.set_mode(on)
            try:
                # a tight cache: groups fill up, evict, and rebuild their eviction pools
                pol = make_policy("herald_hier", ROWS, R, 12, 0.03, 2, hosts=P, planner_wire=wire)
                chk = PlanChecker(ROWS, R, 12, pol.cache_ratio)
                plans, wire_bytes = [], []
                for i in range(len(trace) - 2):
                    window = [_batch(trace[j], j) for j in range(i, i + 3)]
                    plan = pol.plan(window)
                    chk.check(plan, window[0])
                    plans.append(encode_plan_tree(dataclasses.replace(plan, sched_seconds=0.0)).tobytes())
                    wire_bytes.append(pol.last_step.wire_bytes)
                assert chk.stale_reads == 0 and not chk.errors
                runs.append((plans, wire_bytes, pol))
            finally:
                _native.set_mode(True)
        (got, got_wire, pol_c), (want, want_wire, pol_n) = runs
        for step, (a, b) in enumerate(zip(got, want)):
            assert a == b, f"R={R}: plan {step} differs"
        assert got_wire == want_wire and sum(sum(w.values()) for w in got_wire) > 0
        # and leave the same replica: owners, guest slots, eviction pools
        dc, dn = pol_c.directory, pol_n.directory
        np.testing.assert_array_equal(dc.owner, dn.owner)
        for name in ("fill", "slot", "pos_of", "base"):
            np.testing.assert_array_equal(getattr(dc.slots, name), getattr(dn.slots, name))
        for name in ("tau", "count", "keys", "rebuilds"):
            np.testing.assert_array_equal(getattr(pol_c.eviction, name), getattr(pol_n.eviction, name))
        if pool:
            assert pol_c.eviction.rebuilds > 0 and sum(cancelled) > 0


# ---- past DENSE_LIMIT: no [K, R] table ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind,R", [("dense", 3), ("dense", 8), ("jagged", 5)])
def test_step_reads_sparse_equals_dense(kind, R):
    """The (key, reader) CSR without a [K, R] table (compiled: rank by rank; numpy: sorted codes) equals the dense
    bitmap's, pair for pair, in order."""
    rng = np.random.default_rng(40 + R)
    b = _batch(_trace(kind, R, 16, 1, seed=41 + R)[0], 0)
    bk = batch_keys(b, Scratch())
    K = bk.keys.shape[0]
    smp = None if bk.width is not None else bk.smp
    for _ in range(3):
        rank = rng.permutation(np.repeat(np.arange(R), 16))
        want = native.step_reads(bk.cid, bk.width, smp, rank, K, R)
        got = native.step_reads_sparse(bk.cid, bk.width, smp, rank, K, R)
        codes = want[2] * R + want[3]
        for a, c in zip(got, want):
            np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(reads.sorted_distinct(rng.permutation(np.repeat(codes, 3))), codes)
        _native.set_mode(False)
        try:
            np_dense = step_reads(bk, rank, R)
        finally:
            _native.set_mode(True)
        np.testing.assert_array_equal(np_dense.pair_key * R + np_dense.pair_rank, codes)


@pytest.mark.parametrize("kind,R", [("dense", 4), ("dense", 8), ("jagged", 4)])
def test_sparse_reads_plans_equal(kind, R, monkeypatch):
    """Past DENSE_LIMIT (here 4 cells: every step, and most steps have 2+ far keys) who-reads-what, the ownership
    decision and, without refine rounds, the assignment use no [K, R] table: the same plans as the dense paths,
    compiled and numpy alike."""
    trace = _trace(kind, R, 12, 24, seed=30 + R)
    dense, _ = _run(trace, R, 12, 2, refine=0)
    monkeypatch.setattr(reads, "DENSE_LIMIT", 4)
    sparse, _ = _run(trace, R, 12, 2, refine=0)
    assert sparse == dense
    _compare(trace, R, 12, 2, refine=0)
    _compare(trace, R, 12, 2, refine=1)  # refine rounds past the limit: numpy's reader-list rounds on both paths


def test_past_dense_limit_the_plan_stays_compiled(monkeypatch):
    """At R=256 on a small model (K x R past DENSE_LIMIT) who-reads-what and the assignment fell back to numpy
    (np.unique took 67 % of a 606 ms plan): past the limit they now stay compiled, with no [K, R] table."""
    monkeypatch.setattr(reads, "DENSE_LIMIT", 4)
    compiled = []  # who-reads-what of every step, by kernel
    kernels = {"dense": native.step_reads, "sparse": getattr(native, "step_reads_sparse", None)}

    def counted(kind):
        def run(cid, width, smp, rank, K, R):
            assert kind == "sparse" or K * R <= reads.DENSE_LIMIT, "a [K, R] table past DENSE_LIMIT"
            compiled.append(kind)
            return kernels[kind](cid, width, smp, rank, K, R)

        return run

    def numpy_rounds(*args, **kwargs):
        raise AssertionError("the numpy assignment ran: the compiled path switched off")

    monkeypatch.setattr(native, "step_reads", counted("dense"))
    monkeypatch.setattr(native, "step_reads_sparse", counted("sparse"), raising=False)
    monkeypatch.setattr(herald_mod, "balanced_assign", numpy_rounds)
    plans, pol = _run(_trace("dense", 8, 12, 12, seed=50), 8, 12, 2, refine=0)
    assert pol._native is not None and len(plans) == 10
    assert compiled == ["sparse"] * 10
