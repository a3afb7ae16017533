"""RowStore: home/guest layout on one FBGEMM TBE, slot directory, row + optimizer-state transfer, summed updates."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from herald_torchrec.distributed.storage.optimizer_params import StateLayout, parse_optimizer
from herald_torchrec.distributed.storage.row_layout import check_cache_ratio, guest_capacity, home_range
from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec

TABLES = [TableSpec("a", 10, 4), TableSpec("b", 7, 8)]


def make(rank: int = 0, world: int = 2, opt: str = "exact_rowwise_adagrad", ratio: float = 0.3, fpt=None) -> RowStore:
    return RowStore(TABLES, rank, world, cache_ratio=ratio, optimizer=opt, learning_rate=0.1, features_per_table=fpt)


def test_layout_matches_torchrec_row_wise() -> None:
    assert [home_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [home_range(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert guest_capacity(30, 0.1) == 3 and guest_capacity(10, 0.1) == 1 and guest_capacity(7, 0.3) == 3
    s = make(rank=1)
    assert s.home_lo == [5, 4] and s.home_len == [5, 3] and s.capacity == [3, 3]
    assert s.local_rows == [8, 6]
    assert s.slots(0, np.array([5, 9, 0])).tolist() == [0, 4, -1]
    assert s.owned_keys(1).tolist() == [4, 5, 6]
    assert s.owner[0].tolist() == [0] * 5 + [1] * 5
    assert s.state_widths == [1, 1] and make(opt="exact_sgd").state_widths == [0, 0]
    # Adagrad keeps one float per element: a row carries dim floats of state
    ada = make(opt="exact_adagrad")
    assert ada.state_layout == StateLayout.PER_ELEMENT and ada.state_widths == [4, 8]
    assert [tuple(ada.state_view(t).shape) for t in range(2)] == [(8, 4), (7, 8)]
    assert tuple(s.state_view(0).shape) == (8,) and make(opt="exact_sgd").state_view(0) is None
    assert [ada.row_width(t) for t in range(2)] == [8, 16] and ada.packed_widths(np.array([1, 0])).tolist() == [16, 8]
    # an empty home block still gets its guest slots
    e = RowStore([TableSpec("c", 5, 4)], 3, 4, cache_ratio=0.2)
    assert e.home_len == [0] and e.capacity == [1] and e.owned_keys(0).size == 0


def test_bad_arguments() -> None:
    for bad in (0.0, -0.1, 1.5, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="cache_ratio"):
            check_cache_ratio(bad)
        with pytest.raises(ValueError, match="cache_ratio"):
            make(ratio=bad)
    with pytest.raises(ValueError, match="optimizer"):
        parse_optimizer("adam")
    with pytest.raises(ValueError, match="unknown"):
        parse_optimizer("nope")
    assert parse_optimizer("rowwise_adagrad") == EmbOptimType.EXACT_ROWWISE_ADAGRAD
    assert parse_optimizer("SGD") == EmbOptimType.EXACT_SGD
    assert parse_optimizer("adagrad") == parse_optimizer("exact_adagrad") == EmbOptimType.EXACT_ADAGRAD
    for other in ("rowwise_adagrad_with_counter", "partial_rowwise_adam", "lamb", "row_wise_adagrad"):
        with pytest.raises(ValueError, match="optimizer"):
            parse_optimizer(other)
    with pytest.raises(ValueError, match="rank"):
        RowStore(TABLES, 2, 2)
    with pytest.raises(ValueError, match="dim % 4"):
        RowStore([TableSpec("x", 10, 6)], 0, 1)


@pytest.mark.parametrize("opt, width", [("exact_rowwise_adagrad", 1), ("exact_adagrad", 4)])
def test_rows_and_state_travel_between_stores(opt: str, width: int) -> None:
    a, b = make(rank=0, opt=opt), make(rank=1, opt=opt)
    g = torch.Generator().manual_seed(0)
    for s in (a, b):
        for t in range(2):
            s.write_slots(
                t,
                np.arange(s.local_rows[t]),
                torch.rand(s.local_rows[t], s.dims[t], generator=g),
                torch.rand(s.local_rows[t], s.state_widths[t], generator=g),
            )
    keys = np.array([1, 4, 0])
    w, st = a.read_rows(0, keys)
    assert w.shape == (3, 4) and st.shape == (3, width)
    state = a.state_view(0)[torch.tensor([1, 4, 0])]  # the TBE's own state rows, whole
    assert torch.equal(st, state.view(3, width))
    assert torch.equal(w, a.weights(0)[torch.tensor([1, 4, 0])])
    # a -> b: leave, update the global map on both, arrive
    a.release(0, keys)
    for s in (a, b):
        s.set_owner(0, keys, np.array([1, 1, 1]))
    slots = b.allocate(0, keys)
    assert slots.tolist() == [5, 6, 7]  # guest slots follow the home block
    b.write_slots(0, slots, w, st)
    w2, st2 = b.read_rows(0, keys)
    assert torch.equal(w2, w) and torch.equal(st2, st)
    assert b.num_guests(0) == 3 and b.occupancy(0) == 1.0 and a.num_guests(0) == 0
    assert a.guest_count[0].tolist() == [0, 3] == b.guest_count[0].tolist()
    assert a.slots(0, keys).tolist() == [-1, -1, -1]
    with pytest.raises(ValueError, match="free guest slots"):
        b.allocate(0, np.array([2]))
    with pytest.raises(ValueError, match="does not own"):
        a.read_rows(0, np.array([1]))
    with pytest.raises(ValueError, match="out of range"):
        a.read_rows(0, np.array([10]))
    # back home: the home slot is reused, the guest slot freed
    b.release(0, np.array([4]))
    assert a.allocate(0, np.array([4])).tolist() == [4]
    assert b.num_guests(0) == 2 and b.allocate(0, np.array([3])).tolist() == [6]


@pytest.mark.parametrize("opt", ["exact_rowwise_adagrad", "exact_adagrad", "exact_sgd"])
def test_summed_gradient_update_is_bit_exact_with_the_fused_path(opt: str) -> None:
    """One update with g1 + g2 through apply_summed_gradients == the fused backward where the row sits in 2 bags."""
    fused, summed = make(opt=opt, fpt=[2, 1]), make(opt=opt, fpt=[2, 1])
    g = torch.Generator().manual_seed(1)
    for t in range(2):
        w = torch.rand(fused.local_rows[t], fused.dims[t], generator=g)
        for s in (fused, summed):
            s.write_slots(t, np.arange(s.local_rows[t]), w, torch.full((s.local_rows[t], s.state_widths[t]), 0.5))
    # features: f0 (table a), f1 (table a), f2 (table b); B = 2
    idx = torch.tensor([1, 2, 2, 3, 1, 4, 0, 5])
    off = torch.tensor([0, 2, 3, 5, 6, 7, 8])
    out = fused.lookup(idx, off)
    go = torch.randn(out.shape, generator=g)
    # the per-row summed gradient, computed by autograd on dense copies
    W = [fused.weights(t).detach().clone().requires_grad_() for t in range(2)]
    ref = torch.cat(
        [
            torch.stack([W[0][[1, 2]].sum(0), W[0][2]]),
            torch.stack([W[0][[3, 1]].sum(0), W[0][4]]),
            torch.stack([W[1][0], W[1][5]]),
        ],
        dim=1,
    )
    assert torch.equal(ref, out.detach())
    ref.backward(go)
    out.backward(go)
    rows = [np.array([1, 2, 3, 4]), np.array([0, 5])]
    summed.apply_summed_gradients(rows, [W[0].grad[rows[0]], W[1].grad[rows[1]]])
    for t in range(2):
        assert torch.equal(fused.weights(t), summed.weights(t))
        _, s1 = fused.read_slots(t, np.arange(fused.local_rows[t]))
        _, s2 = summed.read_slots(t, np.arange(summed.local_rows[t]))
        assert torch.equal(s1, s2)
        if opt == "exact_adagrad":  # per-element state: each element's squared gradient sum, not a row mean
            G = W[t].grad[rows[t]]
            assert torch.allclose(s2[rows[t]], 0.5 + G * G) and not torch.allclose(s2[rows[t]], s2[rows[t]][:, :1])
    # untouched rows did not move
    assert torch.equal(summed.weights(0)[0], fused.weights(0)[0])
    summed.apply_summed_gradients([None, None], [None, None])  # nothing to do


def test_compiled_directory_updates_match_numpy() -> None:
    """distributed/host_kernels.py: release / set_owner / allocate leave the same directory (slots, keys, free-slot
    stacks, owners, guest counts) as the numpy code, over random rounds of guests arriving and leaving; bad input
    still raises numpy's errors and changes nothing."""
    from herald_torchrec import _native
    from herald_torchrec.distributed import host_kernels

    if host_kernels.lib() is None:
        pytest.skip("no C++ compiler here: the numpy path is the only one")
    stores = {}
    try:
        for on in (True, False):
            _native.set_mode(on)
            rng = np.random.default_rng(1)  # the same rounds for both
            s = make(rank=0, ratio=0.5)
            guests: set[tuple[int, int]] = set()
            for _ in range(30):  # rows homed on rank 1 arrive as guests of rank 0 and leave again
                leave = [g for g in sorted(guests) if rng.random() < 0.4]
                if leave:
                    t, r = np.array(leave).T
                    s.release_many(t, r)
                    s.set_owner_many(t, r, np.ones(len(leave), dtype=np.int64))
                    guests -= set(leave)
                cand = [(t, r) for t in (0, 1) for r in range(TABLES[t].rows) if s.owner[t][r] == 1]
                room = [s.capacity[t] - s.num_guests(t) for t in (0, 1)]
                come = []
                for c in cand:
                    if rng.random() < 0.3 and room[c[0]] > 0:
                        room[c[0]] -= 1
                        come.append(c)
                if come:
                    t, r = np.array(come).T
                    s.set_owner_many(t, r, np.zeros(len(come), dtype=np.int64))
                    s.allocate_many(t, r)
                    guests |= set(come)
            with pytest.raises(ValueError, match="already owns"):
                s.allocate_many(np.array([0]), np.array([0]))
            with pytest.raises(ValueError, match="does not own departing keys"):
                s.release_many(np.array([0]), np.array([9]))
            for bad in (
                lambda: s.set_owner_many(np.array([2]), np.array([0]), np.array([0])),  # no table 2
                lambda: s.release_many(np.array([0]), np.array([10])),  # table a has 10 rows
                lambda: s.allocate_many(np.array([-1]), np.array([0])),
            ):
                with pytest.raises((IndexError, ValueError)):  # numpy's own error; the kernels decline
                    bad()
            stores[on] = s
    finally:
        _native.set_mode(True)
    a, b = stores[True], stores[False]
    for name in ("slot_of_all", "key_of_all", "owner_all", "guest_count_all", "_free_all", "_free_top"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a.num_guests(0) + a.num_guests(1) > 0 and host_kernels._store_ok(a)  # guests moved; the kernels ran


@pytest.mark.parametrize("opt", ["exact_rowwise_adagrad", "exact_adagrad"])
def test_compiled_row_reads_and_writes_match_torch(opt: str) -> None:
    """read_packed / write_packed through host_kernels.rows against the torch path (index_select / index_copy_ per
    storage kind): the same packed floats, with and without optimizer state, and the same storage after a write."""
    from herald_torchrec import _native
    from herald_torchrec.distributed import host_kernels

    if host_kernels.lib() is None:
        pytest.skip("no C++ compiler here: the torch path is the only one")
    rng = np.random.default_rng(11)
    stores = [
        RowStore([TableSpec("a", 10, 4), TableSpec("b", 7, 4)], 0, 2, cache_ratio=0.3, optimizer=opt) for _ in range(2)
    ]  # one dim: the row layout
    init = [rng.standard_normal(tuple(v.shape)).astype(np.float32) for v, _ in stores[0]._rows2d]
    for st in stores:  # the same contents in both
        with torch.no_grad():
            for (v, _), x in zip(st._rows2d, init):
                v.copy_(torch.from_numpy(x))
        assert len(st._rows2d) == 2  # weights and the optimizer state: both kinds travel
        assert st._rows2d[1][0].shape[1] == st.state_widths[0]  # the whole state row: 1 or dim floats
    tables = np.array([0, 1, 1, 0, 1], dtype=np.int64)
    slots = np.array([2, 0, 3, 2, 1], dtype=np.int64)
    got = {}
    for compiled, st in zip((True, False), stores):
        _native.set_mode(compiled)
        try:
            reads = [st.read_packed(tables, slots, with_state=w) for w in (True, False)]
            data = (
                torch.from_numpy(rng.standard_normal(reads[0].shape[0]).astype(np.float32)) if compiled else got["data"]
            )
            got["data"] = data
            assert reads[0].shape[0] == 5 * (4 + st.state_widths[0])
            st.write_packed(tables[:3], slots[:3], data[: reads[0].shape[0] // 5 * 3])
            got[compiled] = reads + [v.clone() for v, _ in st._rows2d]
        finally:
            _native.set_mode(True)
    for a, b in zip(got[True], got[False]):
        assert torch.equal(a, b)
