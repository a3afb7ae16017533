"""plan_exec: a step's preparation from (Plan, directories, local ids), two "ranks" simulated in one process.

Each rank has its own RowStore (rank 0 and 1 of a 2-rank group); the preparation is a pure function of the plan and
the directories, so the send side of one rank must match the receive side of the other exactly (orders and split
sizes), which is what the all-to-alls rely on, with no size exchange.
"""

from __future__ import annotations

import numpy as np
import pytest

from herald_torchrec.distributed.step.lookup_layout import grad_sum_layout, lookup_layout, with_owner_bags
from herald_torchrec.distributed.step.prepare import (
    SharedMarks,
    classify,
    local_input,
    prepare_moves,
    prepare_shared,
    routes,
    sent_by_kind,
)
from herald_torchrec.distributed.step.static_plan import static_plan, static_plan_keys
from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec
from herald_torchrec.schedule.plan import EVICT_HOME, FORWARD, MIGRATE, Plan, RowMoves, SharedRows

# table a: rows 0-4 home on rank 0, 5-9 on rank 1; table b: rows 0-3 on rank 0, 4-6 on rank 1. Capacity 3 guests.
# Row-wise adagrad: a packed row is dim + 1 floats (a: 5, b: 9).
TABLES = [TableSpec("a", 10, 4), TableSpec("b", 7, 8)]
FEATURES = ["fa", "fb"]
A, B = 0, 1


def stores() -> list[RowStore]:
    return [RowStore(TABLES, r, 2, cache_ratio=0.3, optimizer="exact_rowwise_adagrad") for r in range(2)]


def plan(moves: list[tuple] = (), shared: list[tuple] = (), batch: int = 2) -> Plan:
    """moves: (table, row, src, dst, kind); shared: (table, row, owner, [readers])."""
    mv = np.array(list(moves), dtype=np.int64).reshape(-1, 5)
    rm = RowMoves(table=mv[:, 0], row=mv[:, 1], src=mv[:, 2], dst=mv[:, 3], kind=mv[:, 4].astype(np.int8))
    readers = [np.asarray(s[3], dtype=np.int64) for s in shared]
    sr = SharedRows(
        table=np.array([s[0] for s in shared], dtype=np.int64),
        row=np.array([s[1] for s in shared], dtype=np.int64),
        owner=np.array([s[2] for s in shared], dtype=np.int64),
        reader_offsets=np.concatenate([[0], np.cumsum([len(r) for r in readers])]).astype(np.int64),
        readers=np.concatenate(readers) if readers else np.zeros(0, dtype=np.int64),
    )
    return Plan(step=7, num_ranks=2, batch_per_rank=batch, sample_order=np.arange(2 * batch), moves=rm, shared=sr)


def ids(st: RowStore, a: list[list[int]], b: list[list[int]]):
    """A batch of len(a) samples: feature fa reads table a, fb reads table b (KJT layout: key-major lengths)."""
    lens = np.array([len(x) for x in a] + [len(x) for x in b], dtype=np.int64)
    vals = np.array([v for x in a + b for v in x], dtype=np.int64)
    return local_input(vals, lens, 2, len(a), np.array([0, 1]), st, FEATURES)


MOVES = [(A, 2, 0, 1, MIGRATE), (B, 5, 1, 0, MIGRATE), (A, 7, 1, 0, FORWARD)]
SHARED = [(A, 2, 1, [0, 1]), (B, 0, 0, [1])]  # a:2 is owned by rank 1 once it has moved


def test_routes_group_by_peer_and_count_elements() -> None:
    src, dst = np.array([0, 1, 0, 0, 1]), np.array([1, 0, 0, 1, 0])
    send, recv, ss, rs = routes(src, dst, np.array([2, 3, 4, 5, 6]), 0, 2)
    assert send.tolist() == [2, 0, 3] and ss == [4, 7]  # self-send first (dst 0), then dst 1 in plan order
    assert recv.tolist() == [2, 1, 4] and rs == [4, 9]


def test_moves_send_order_matches_receive_order() -> None:
    st = stores()
    ms = [prepare_moves(plan(MOVES), s) for s in st]
    assert not ms[0].globally_empty
    assert ms[0].send_idx.tolist() == [0] and ms[0].send_splits == [0, 5]
    assert ms[0].recv_idx.tolist() == [1, 2] and ms[0].recv_splits == [0, 9 + 5]
    assert ms[1].send_idx.tolist() == [1, 2] and ms[1].send_splits == [14, 0]
    assert ms[1].recv_idx.tolist() == [0] and ms[1].recv_splits == [5, 0]
    assert sent_by_kind(ms[0]) == {"migrate": 1, "evict_home": 0, "forward": 0}
    assert sent_by_kind(ms[1]) == {"migrate": 1, "evict_home": 0, "forward": 1}
    empty = prepare_moves(plan(), st[0])
    assert empty.globally_empty and empty.send_splits == [0, 0] and sent_by_kind(empty) == {}


def test_shared_routes_are_consistent_between_ranks() -> None:
    st = stores()
    p = plan(MOVES, SHARED)
    sh = [prepare_shared(p, s, prepare_moves(p, s)) for s in st]
    # a:2 moves 0 -> 1 and is read by 0 and 1: rank 0 (its owner before the moves) sends the value to itself, rank 1
    # gets the row itself in the moves (a fill pair); rank 0 owns b:0 and sends its value to reader 1
    assert sh[0].value_splits == [4, 8] and sh[0].value_gkey.tolist() == [2, 10]
    assert sh[0].recv_splits == [4, 0] and sh[0].recv_row.tolist() == [2] and sh[0].n_fill == 0
    assert sh[1].value_splits == [0, 0] and sh[1].recv_splits == [8, 0] and sh[1].n_fill == 1
    assert sh[1].recv_table.tolist() == [B, A] and sh[1].recv_off.tolist() == [0, 8]  # received, then the fill
    # gradients go to the owners after the moves: rank 1 owns a:2 (from readers 0 and 1), rank 0 owns b:0
    assert sh[0].grad_splits == [0, 4] and sh[0].grad_idx.tolist() == [0]
    assert sh[1].grad_splits == [8, 4] and sh[1].grad_idx.tolist() == [0, 1]
    assert sh[0].send_splits == [0, 8] and sh[0].send_row.tolist() == [0]
    assert sh[1].send_splits == [4, 4] and sh[1].send_off.tolist() == [0, 4]
    for q in range(2):  # what q sends to r is what r receives from q, for values and for gradients
        for r in range(2):
            assert sh[q].value_splits[r] == sh[r].recv_splits[q]
            assert sh[q].grad_splits[r] == sh[r].send_splits[q]
    assert [s.n_values_out for s in sh] == [1, 1] and [s.n_grads_out for s in sh] == [1, 1]
    g = grad_sum_layout(sh[1], st[1])  # the two gradients of a:2 sum into one row of 4
    assert g.tables.tolist() == [A] and g.size == 4 and g.dst.tolist() == [0, 1, 2, 3] * 2


def test_classify_counts_hits_and_checks_the_batch() -> None:
    st = stores()
    p = plan(MOVES, SHARED)
    ms = prepare_moves(p, st[0])
    sh = prepare_shared(p, st[0], ms)
    marks = SharedMarks(int(st[0].key_base[-1]))
    marks.mark(sh)
    # a:3 owned, not moved (hit); a:2 shared, owner 1 (no hit); b:5 arrives this step (no hit)
    hits, reads = classify(p, ids(st[0], [[2], [3]], [[5], []]), ms, marks, st[0])
    assert hits.tolist() == [1, 0] and reads.tolist() == [2, 1]
    with pytest.raises(ValueError, match="row 8 of table 'a', owned by rank 1 after the moves and not in plan.shared"):
        classify(p, ids(st[0], [[8], []], [[], []]), ms, marks, st[0])
    with pytest.raises(ValueError, match="reads shared row 0 of table 'b' but is not among its readers"):
        classify(p, ids(st[0], [[], []], [[0], []]), ms, marks, st[0])
    marks.reset(sh)
    assert (marks.by_key == SharedMarks.NOT_SHARED).all()


def test_local_input_reorders_keys_and_rejects_bad_ids() -> None:
    st = stores()[0]
    # KJT with keys (fb, fa): index maps module feature f to its KJT position
    loc = local_input(np.array([6, 1, 9]), np.array([1, 0, 1, 1]), 2, 2, np.array([1, 0]), st, FEATURES)
    assert loc.values.tolist() == [1, 9, 6] and loc.lengths.tolist() == [[1, 1], [1, 0]]
    assert loc.gkeys.tolist() == [1, 9, 10 + 6] and loc.seg.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"feature 'fb' \(table 'b', 7 rows\): ids out of range \[7\]"):
        ids(st, [[1], []], [[7], []])
    with pytest.raises(ValueError, match="3 lengths for 2 keys x batch 2"):
        local_input(np.array([1]), np.array([1, 0, 0]), 2, 2, np.array([0, 1]), st, FEATURES)


@pytest.mark.parametrize(
    "moves, shared, match",
    [
        ([(A, 2, 1, 0, MIGRATE)], [], "row 2 moves from rank 1 but is owned by rank 0"),
        ([(A, 2, 0, 0, MIGRATE)], [], "src == dst"),
        ([(A, 2, 0, 1, MIGRATE), (A, 2, 0, 1, MIGRATE)], [], "moves twice"),
        ([(A, r, 0, 1, MIGRATE) for r in range(4)], [], "rank 1 holds 4 guests of table 'a', capacity 3"),
        ([(A, 2, 0, 1, EVICT_HOME)], [], "evict_home move does not send a guest to its home rank"),
        ([(2, 2, 0, 1, MIGRATE)], [], r"move table index out of range \[0, 2\)"),
        ([(A, 2, 0, 2, MIGRATE)], [], r"src/dst rank out of range \[0, 2\)"),
        ([(A, 2, 0, 1, 9)], [], "unknown move kind"),
        ([], [(A, 2, 1, [0, 1])], "names owner 1, but its owner after the moves is 0"),
        ([], [(A, 2, 0, [1, 0])], "sorted and distinct"),
        ([], [(A, 2, 0, [])], "has no reader"),
        ([], [(A, 2, 0, [1]), (A, 2, 0, [1])], "listed twice"),
        ([], [(A, 2, 0, [3])], "owner/reader rank out of range"),
    ],
)
def test_inconsistent_plans_raise_alike_on_every_rank(moves, shared, match) -> None:
    for st in stores():  # global checks: both ranks reject the plan with the same error
        p = plan(moves, shared)
        with pytest.raises(ValueError, match=match) as e:
            prepare_shared(p, st, prepare_moves(p, st))
        assert "plan 7" in str(e.value)


def test_static_plan_shares_every_non_owner_read_and_lays_out_the_lookup() -> None:
    st = stores()
    locs = [ids(st[0], [[2], [7]], [[], []]), ids(st[1], [[7], [8]], [[], []])]
    p = static_plan([static_plan_keys(loc, s) for loc, s in zip(locs, st)], st[0], 2)
    # a:2 (owner 0, read by 0) and a:8 (owner 1, read by 1) stay exclusive; a:7 (owner 1) is read by both
    assert p.shared.table.tolist() == [A] and p.shared.row.tolist() == [7] and p.shared.owner.tolist() == [1]
    assert p.shared.readers.tolist() == [0, 1] and p.counters["hit"] == 3 and p.counters["shared_value"] == 1
    assert p.sample_order.tolist() == [0, 1, 2, 3] and len(p.moves) == 0
    ms = prepare_moves(p, st[0])
    sh = prepare_shared(p, st[0], ms)
    marks = SharedMarks(int(st[0].key_base[-1]))
    marks.mark(sh)
    lay = lookup_layout(locs[0], sh, marks, st[0])
    assert lay.indices.tolist() == [2]  # a:2 in rank 0's home slot 2; a:7 comes as a received value
    assert lay.offsets.tolist() == [0, 1, 1, 1, 1]  # bags (fa, s0), (fa, s1), (fb, s0), (fb, s1)
    assert lay.value_src.tolist() == [0, 1, 2, 3] and lay.out_dst.tolist() == [12, 13, 14, 15]  # row 1, cols 0-3


def test_distinct_keys_without_a_sort() -> None:
    marks = SharedMarks(50)
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 200):
        keys = rng.integers(0, 50, n)
        got = marks.distinct(keys)
        assert got.shape[0] == np.unique(keys).shape[0]
        assert sorted(got.tolist()) == np.unique(keys).tolist()  # stale scratch from the previous round is harmless


def test_compiled_step_preparation_matches_numpy() -> None:
    """distributed/host_kernels.py: classify and the row lookup layout give numpy's arrays (moves, shared keys read
    here and not, fills, repeated ids, empty bags), and a batch the plan does not allow still raises numpy's error."""
    from herald_torchrec import _native
    from herald_torchrec.distributed import host_kernels

    if host_kernels.lib() is None:
        pytest.skip("no C++ compiler here: the numpy path is the only one")
    tables = [TableSpec("a", 10, 4), TableSpec("b", 7, 4)]  # one dim: lookup items are rows
    st = RowStore(tables, 0, 2, cache_ratio=0.3, optimizer="exact_rowwise_adagrad")
    p = plan(MOVES, SHARED + [(B, 6, 1, [0, 1])], batch=3)
    loc = local_input(
        np.array([2, 0, 2, 7, 5, 1, 6, 6], dtype=np.int64),
        np.array([2, 2, 0, 1, 0, 3]),
        2,
        3,
        np.array([0, 1]),
        st,
        FEATURES,
    )
    ms = prepare_moves(p, st)
    sh = prepare_shared(p, st, ms)
    marks = SharedMarks(int(st.key_base[-1]))
    marks.mark(sh)
    try:
        cls = classify(p, loc, ms, marks, st)
        _native.set_mode(False)
        cls_np = classify(p, loc, ms, marks, st)
        for r, s in enumerate(stores()):  # both ranks' sides of the moves, compiled and not
            a = prepare_moves(p, s)
            _native.set_mode(True)
            b = prepare_moves(p, s)
            _native.set_mode(False)
            for f in (
                "send_idx",
                "recv_idx",
                "send_splits",
                "recv_splits",
                "globally_empty",
                "gkey_sorted",
                "dst_sorted",
                "table",
                "row",
                "dst",
                "kind",
            ):
                np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f"rank {r}: {f}")
            assert len(b.send_idx) + len(b.recv_idx) > 0
        # the lookup runs once the moves are applied (HeraldLookup._land)
        st.land_moves(ms.table, ms.row, ms.dst, ms.send_idx, ms.recv_idx)
        lay_np = lookup_layout(loc, sh, marks, st)
        want = [cls_np, lay_np, with_owner_bags(lay_np, grad_sum_layout(sh, st), st, 3)]
        _native.set_mode(True)
        lay = lookup_layout(loc, sh, marks, st)
        got = [cls, lay, with_owner_bags(lay, grad_sum_layout(sh, st), st, 3)]
        assert sh.send_gkey.shape[0] and got[2][1].tolist() == want[2][1].tolist()  # rank 0 owns b:0, read by 1
        for f in ("indices", "offsets", "value_src", "out_dst", "width"):
            np.testing.assert_array_equal(getattr(got[2][0], f), getattr(want[2][0], f))
        for g, w in zip(got[0], want[0]):
            np.testing.assert_array_equal(g, w)
        assert got[0][0].tolist() == [1, 1] and got[0][1].tolist() == [3, 3]  # a:0 and b:1 are hits
        for f in ("indices", "offsets", "value_src", "out_dst", "width"):
            np.testing.assert_array_equal(getattr(got[1], f), getattr(want[1], f))
        bad = local_input(
            np.array([8], dtype=np.int64), np.array([1, 0, 0, 0, 0, 0]), 2, 3, np.array([0, 1]), st, FEATURES
        )
        with pytest.raises(ValueError, match="owned by rank 1 after the moves and not in plan.shared"):
            classify(p, bad, ms, marks, st)
        assert not marks.seen.any()  # the kernel's scratch is left clean, also when it declines
    finally:
        _native.set_mode(True)


SHARED_STEP_FIELDS = (
    "send_table",
    "send_row",
    "send_gkey",
    "send_off",
    "send_splits",
    "recv_table",
    "recv_row",
    "recv_off",
    "recv_splits",
    "n_values_out",
    "n_grads_out",
    "globally_empty",
    "marked",
    "recv_gkey",
    "value_table",
    "value_gkey",
    "value_splits",
    "n_fill",
    "grad_idx",
    "grad_splits",
)


def test_compiled_shared_preparation_matches_numpy_on_scheduled_plans() -> None:
    """host_kernels.prepare_shared (and the owners' gradient-sum keys) against the numpy code: every rank's
    SharedStep and GradSumLayout, field by field, for 3 ranks and
    the Herald scheduler's own plans over skewed batches (moves, forwards, fills, owners reading their rows), the
    stores' directories updated between steps as the lookup does; a plan it rejects still raises numpy's error."""
    from herald_torchrec import _native
    from herald_torchrec.distributed import host_kernels
    from herald_torchrec.schedule import GlobalBatch, make_policy

    if host_kernels.lib() is None:
        pytest.skip("no C++ compiler here: the numpy path is the only one")
    R, Bs, L, rows = 3, 8, 2, [40, 300, 7, 120]
    st = [
        RowStore(
            [TableSpec(f"t{i}", n, 4) for i, n in enumerate(rows)],
            r,
            R,
            cache_ratio=0.1,
            optimizer="exact_rowwise_adagrad",
        )
        for r in range(R)
    ]
    pol = make_policy("herald", rows, R, Bs, 0.1, L, tables="all")
    rng = np.random.default_rng(3)
    batches = [
        GlobalBatch.from_dense(
            np.stack([np.minimum(rng.zipf(1.3, R * Bs) - 1, n - 1) for n in rows], axis=1), rows, index=i
        )
        for i in range(14)
    ]
    fills = shared_pairs = owned = 0
    try:
        for s in range(len(batches) - L):
            p = pol.plan(batches[s : s + L + 1])
            steps = []
            for r in range(R):
                ms = prepare_moves(p, st[r])
                _native.set_mode(True)
                got = prepare_shared(p, st[r], ms)
                _native.set_mode(False)
                want = prepare_shared(p, st[r], ms)
                gs_np = grad_sum_layout(want, st[r])
                _native.set_mode(True)  # the policy plans with its kernels
                for f in SHARED_STEP_FIELDS:
                    np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f"step {s} rank {r}: {f}")
                gs = grad_sum_layout(got, st[r])  # the owner's per-key sums, compiled and not
                for f in ("tables", "slots", "dst", "size", "width"):
                    np.testing.assert_array_equal(getattr(gs, f), getattr(gs_np, f), err_msg=f"step {s} rank {r}: {f}")
                owned += gs.tables.shape[0]
                fills += got.n_fill
                shared_pairs += got.recv_gkey.shape[0]
                steps.append(ms)
            for r, ms in enumerate(steps):  # the moves applied, as HeraldLookup._land does
                st[r].land_moves(ms.table, ms.row, ms.dst, ms.send_idx, ms.recv_idx)
        assert fills > 0 and shared_pairs > 50 and owned > 20  # fills, many shared reads, owners summing gradients
        _native.set_mode(True)
        for r in range(R):  # rejected by the kernel, raised by numpy: a reader listed twice
            bad = plan([], [(A, 2, 0, [1, 1])])
            with pytest.raises(ValueError, match="sorted and distinct"):
                prepare_shared(bad, stores()[0], prepare_moves(bad, stores()[0]))
    finally:
        _native.set_mode(True)


def test_compiled_local_input_matches_numpy() -> None:
    """host_kernels.local_input against the numpy code: global keys and bags of jagged batches (empty and multi-hot
    bags), in the module's key order and permuted; an id out of range still raises numpy's error."""
    from herald_torchrec import _native
    from herald_torchrec.distributed import host_kernels

    st = stores()[0]
    rng = np.random.default_rng(5)
    for order in ([0, 1], [1, 0]):
        lens = rng.integers(0, 4, 2 * 6)  # KJT layout: key-major [2, 6]
        kjt_rows = [st.rows[o] for o in order]  # key k of the KJT feeds module feature order[k]
        vals = np.concatenate([rng.integers(0, kjt_rows[k], int(lens[k * 6 : (k + 1) * 6].sum())) for k in range(2)])
        index = np.array([order.index(0), order.index(1)])
        got = local_input(vals, lens, 2, 6, index, st, FEATURES)
        _native.set_mode(False)
        try:
            want = local_input(vals, lens, 2, 6, index, st, FEATURES)
        finally:
            _native.set_mode(True)
        for f in ("values", "lengths", "gkeys", "seg"):
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f"order {order}: {f}")
        assert got.gkeys.shape[0] > 6
        if host_kernels.lib() is not None:  # the kernel took this batch (it did not decline to numpy)
            assert host_kernels.local_input(want.values, want.lengths, st.feature_table_arr, st, 6) is not None
    with pytest.raises(ValueError, match=r"feature 'fa' \(table 'a', 10 rows\): ids out of range \[-1\]"):
        ids(st, [[-1], []], [[1], []])


def test_compiled_gather_add_is_index_add_bit_for_bit() -> None:
    """The pooled output's shared values added by the compiled loop (`_GatherAddSharedValues`) against index_select
    + `_AddSharedValues` (torch's index_add_): the same bags and the same values' gradient, bit for bit (repeated
    values and repeated bags included: the adds run in the same order), with the bags' gradient passed on or handed
    to the owner's deferred update."""
    import torch

    from herald_torchrec.distributed import host_kernels
    from herald_torchrec.distributed.step.embedding_lookup import OwnerUpdate, _AddSharedValues, _GatherAddSharedValues

    if host_kernels.lib() is None:
        pytest.skip("no C++ compiler here: the numpy path is the only one")
    rng = np.random.default_rng(7)
    w, n_bags, n_vals, n = 8, 40, 30, 500
    src, dst = rng.integers(0, n_vals, n), rng.integers(0, n_bags, n)
    base = torch.from_numpy(rng.standard_normal((n_bags // 4, 4 * w)).astype(np.float32))
    vals0 = torch.from_numpy(rng.standard_normal((n_vals, w)).astype(np.float32))
    up = torch.from_numpy(rng.standard_normal((n_bags // 4, 4 * w)).astype(np.float32))
    for sink in (False, True):
        got = []
        for fused in (False, True):
            bags_leaf = base.clone().requires_grad_(True)
            vals = vals0.clone().requires_grad_(True)
            bags = bags_leaf * 1.0  # a non-leaf, as the TBE's output is
            upd = OwnerUpdate(None, np.zeros(0, dtype=np.int64)) if sink else None
            if fused:
                out = _GatherAddSharedValues.apply(bags, vals, src, dst, upd)
            else:
                v = vals.index_select(0, torch.from_numpy(src))
                out = _AddSharedValues.apply(bags, v, torch.from_numpy(dst), w, upd)
            (out * up).sum().backward()
            handed = upd.bags_grad if sink else bags_leaf.grad
            got.append((out.detach().clone(), vals.grad.clone(), handed.clone()))
        for a, b, what in zip(*got, ("bags", "values' gradient", "bags' gradient")):
            assert torch.equal(a, b), f"sink={sink}: {what} differ"
