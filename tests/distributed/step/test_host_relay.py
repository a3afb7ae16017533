"""Host relays (step/host_relay.py): the routes of one row, and whole steps of 4 "ranks" on 2 hosts exchanged in one
process through the SharedStep layouts, as the all-to-alls would, checked value by value and gradient sum by sum."""

from __future__ import annotations

import numpy as np
import pytest

from herald_torchrec.distributed.step.host_relay import (
    FROM_OWNER,
    FROM_RELAY,
    TO_OWNER,
    TO_RELAY,
    HostMap,
    LinkRows,
    pair_routes,
)
from herald_torchrec.distributed.step.lookup_layout import grad_sum_layout, value_items
from herald_torchrec.distributed.step.prepare import SharedStep, prepare_moves, prepare_shared
from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec
from herald_torchrec.schedule import GlobalBatch, make_policy

HOSTS = HostMap(np.array([0, 0, 1, 1]))


def test_worked_example_of_the_docstring() -> None:
    # row 0 owned by rank 0 (before and after), read by ranks 1, 2, 3: rank 2 relays for host 1
    rt = pair_routes(
        np.zeros(3, dtype=np.int64),
        np.array([1, 2, 3]),
        np.zeros(3, dtype=np.int64),
        np.zeros(3, dtype=np.int64),
        np.zeros(3, dtype=bool),
        HOSTS,
    )
    assert rt.value_src.tolist() == [0, 0, 2] and rt.value_stage.tolist() == [FROM_OWNER, FROM_OWNER, FROM_RELAY]
    assert rt.grad_dst.tolist() == [0, 0, 2] and rt.grad_stage.tolist() == [TO_OWNER, TO_OWNER, TO_RELAY]
    assert rt.relay_pair.tolist() == [0, 1, 1] and rt.relayed
    off = pair_routes(np.zeros(3, np.int64), np.array([1, 2, 3]), *[np.zeros(3, np.int64)] * 2, np.zeros(3, bool), None)
    assert off.value_src.tolist() == [0, 0, 0] and off.grad_dst.tolist() == [0, 0, 0] and not off.relayed


def test_a_reader_that_receives_the_row_never_relays_and_owners_move_hosts() -> None:
    # row 0 moves from rank 0 (host 0) to rank 2 (host 1) and is read by 2 (fill: it gets the row), 3 and 1
    rt = pair_routes(
        np.zeros(3, dtype=np.int64),
        np.array([1, 2, 3]),
        np.zeros(3, dtype=np.int64),
        np.full(3, 2, dtype=np.int64),
        np.array([False, True, False]),
        HOSTS,
    )
    # values: rank 3 is host 1's relay (rank 2 gets the row itself); gradients: 3 is on the new owner's host
    assert rt.value_src.tolist() == [0, 0, 0] and rt.value_stage.tolist() == [FROM_OWNER] * 3
    assert rt.grad_dst.tolist() == [2, 2, 2] and rt.grad_stage.tolist() == [TO_OWNER] * 3


@pytest.mark.parametrize(
    "host", [np.repeat([0, 1, 2], 4), np.array([2, 0, 1, 0, 2, 1, 1, 0, 2, 0, 1, 2])], ids=["3x4", "interleaved"]
)
def test_compiled_routes_equal_numpy(host) -> None:
    """The compiled pass (host_kernels.pair_routes) gives numpy's routes for random rows (readers in any order, fills,
    owners on any host); pairs of a row that are not together fall back to numpy, with the same routes."""
    from herald_torchrec import _native

    rng = np.random.default_rng(7)
    hm, R = HostMap(host), host.shape[0]
    counts = rng.integers(1, R + 1, 400)
    pair_row = np.repeat(np.arange(400, dtype=np.int64), counts)
    readers = np.concatenate([rng.permutation(R)[:c] for c in counts]).astype(np.int64)
    before, after = rng.integers(0, R, 400)[pair_row], rng.integers(0, R, 400)[pair_row]
    fill = (readers == after) & (before != after)
    shuffled = rng.permutation(pair_row.shape[0])
    relayed = 0
    try:
        for rows, idx in ((pair_row, slice(None)), (pair_row[shuffled], shuffled)):
            args = (rows, readers[idx], before[idx], after[idx], fill[idx], hm)
            _native.set_mode(True)
            got = pair_routes(*args)
            _native.set_mode(False)
            want = pair_routes(*args)
            for f in ("value_src", "value_stage", "grad_dst", "grad_stage", "relay_pair"):
                np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
            relayed += int((want.value_stage == FROM_RELAY).sum())
    finally:
        _native.set_mode(None)
    assert relayed > 100


def test_host_map_and_link_rows() -> None:
    assert HOSTS.shares_hosts and HOSTS.relays and HOSTS.num_hosts == 2
    assert not HostMap(np.zeros(4, np.int64)).shares_hosts  # one host
    assert not HostMap(np.arange(4)).shares_hosts  # every rank its own host
    assert not HostMap(np.array([0, 0, 1, 1]), relay=False).relays
    assert LinkRows.of(HOSTS, 1, np.array([0, 1, 2, 3, 3])) == LinkRows(cross=3, intra=1)  # the self-send is none


def _exchange(parts: list[np.ndarray], send_splits: list[list[int]], r: int) -> np.ndarray:
    """What rank r receives in an all-to-all: from each peer q in order, q's block for r."""
    out = []
    for q, (buf, splits) in enumerate(zip(parts, send_splits)):
        start = int(np.sum(splits[:r]))
        out.append(buf[start : start + splits[r]])
    return np.concatenate(out) if out else np.zeros(0)


def _items(buf: np.ndarray, sh: SharedStep, st: RowStore, pairs: np.ndarray) -> np.ndarray:
    idx, width = value_items(sh, st, pairs)
    return buf.reshape(-1, width)[idx].reshape(-1)


def _rows_of(sh: SharedStep, st: RowStore, gkeys: np.ndarray, tables: np.ndarray) -> np.ndarray:
    """A row's value in this simulation: its global key, repeated over its dim."""
    d = st.dims_arr[tables]
    return np.repeat(gkeys.astype(np.float64), d)


@pytest.mark.parametrize("dims", [(4, 4, 4, 4), (4, 8, 12, 4)], ids=["uniform", "mixed"])
def test_relayed_steps_deliver_every_value_and_every_gradient_sum(dims) -> None:
    """4 ranks on 2 hosts, the Herald scheduler's plans over skewed batches (moves, fills, owners reading their
    rows): every reader ends with each shared row's value, every owner with the sum of every reader's gradient of
    it, exactly as without relays; fewer rows cross hosts, and the rows by link add up."""
    R, Bs, L, rows = 4, 8, 2, [40, 300, 7, 120]
    tables = [TableSpec(f"t{i}", n, d) for i, (n, d) in enumerate(zip(rows, dims))]
    st = [RowStore(tables, r, R, cache_ratio=0.1, optimizer="exact_rowwise_adagrad") for r in range(R)]
    pol = make_policy("herald", rows, R, Bs, 0.1, L, tables="all")
    rng = np.random.default_rng(4)
    batches = [
        GlobalBatch.from_dense(
            np.stack([np.minimum(rng.zipf(1.3, R * Bs) - 1, n - 1) for n in rows], axis=1), rows, index=i
        )
        for i in range(12)
    ]
    relayed_steps = 0
    links = {True: LinkRows(), False: LinkRows()}
    for s in range(len(batches) - L):
        p = pol.plan(batches[s : s + L + 1])
        ms = [prepare_moves(p, st[r]) for r in range(R)]
        for relay in (True, False):
            hm = HostMap(HOSTS.host, relay=relay)
            sh = [prepare_shared(p, st[r], ms[r], hm) for r in range(R)]
            assert len({x.relayed for x in sh}) == 1  # a global fact
            relayed_steps += relay and sh[0].relayed
            # values: the owners' stage (rows read before the moves: the global key as the value), then the relays'
            sent = [_rows_of(x, st[r], x.value_gkey, x.value_table) for r, x in enumerate(sh)]
            got = [_exchange(sent, [x.value_splits for x in sh], r) for r in range(R)]
            fwd = [_items(got[r], sh[r], st[r], sh[r].fwd_idx) for r in range(R)]
            got = [np.concatenate([got[r], _exchange(fwd, [x.fwd_splits for x in sh], r)]) for r in range(R)]
            for r, x in enumerate(sh):
                k = x.recv_gkey.shape[0] - x.n_fill
                full = np.concatenate([got[r], _rows_of(x, st[r], x.recv_gkey[k:], x.recv_table[k:])])
                np.testing.assert_array_equal(full, _rows_of(x, st[r], x.recv_gkey, x.recv_table), err_msg=f"{s} {r}")
            # gradients: every pair's gradient is (reader + 1) x 1000 + key; to the relays, added, then to the owners
            grads = [np.repeat((r + 1) * 1000.0 + x.recv_gkey, st[r].dims_arr[x.recv_table]) for r, x in enumerate(sh)]
            up = [_items(grads[r], x, st[r], x.relay_grad_idx) for r, x in enumerate(sh)]
            for r, x in enumerate(sh):
                back = _exchange(up, [y.relay_grad_splits for y in sh], r)
                if x.relay_add_idx.shape[0]:
                    idx, width = value_items(x, st[r], x.relay_add_idx)
                    g = grads[r].reshape(-1, width)
                    np.add.at(g, idx, back.reshape(-1, width))
            out = [_items(grads[r], x, st[r], x.grad_idx) for r, x in enumerate(sh)]
            for r, x in enumerate(sh):
                back = _exchange(out, [y.grad_splits for y in sh], r)
                lay = grad_sum_layout(x, st[r])
                summed = np.zeros(lay.size)
                np.add.at(summed.reshape(-1, lay.width), lay.dst, back.reshape(-1, lay.width))
                readers = {}
                for q, y in enumerate(sh):
                    for g in y.recv_gkey.tolist():
                        readers.setdefault(g, []).append(q)
                keys = np.unique(x.send_gkey)  # the owner's rows, in GradSumLayout's order
                want = np.concatenate(
                    [np.zeros(0)]
                    + [
                        np.full(st[r].dims_arr[t], sum((q + 1) * 1000.0 + g for q in readers[g]))
                        for t, g in zip(st[r].tables_of(keys), keys.tolist())
                    ]
                )
                np.testing.assert_array_equal(summed, want, err_msg=f"step {s} rank {r} relay {relay}")
            for r, x in enumerate(sh):
                links[relay] += (x.value_links or LinkRows()) + (x.grad_links or LinkRows())
        for r in range(R):  # the moves applied, as HeraldLookup._land does
            m = ms[r]
            st[r].land_moves(m.table, m.row, m.dst, m.send_idx, m.recv_idx)
    assert relayed_steps >= 5
    on, off = links[True], links[False]
    assert on.cross + on.intra == off.cross + off.intra  # the same rows on the wire in all ...
    assert on.cross < off.cross  # ... fewer of them across hosts
