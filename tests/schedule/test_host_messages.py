"""The planners' messages as slices and as fields (schedule/herald/host_messages.py): an Outbox is the messages it
stands for, an Inbox the messages it decoded, and every transport carries either form to the same inbox."""

import numpy as np

from herald_torchrec.schedule import GlobalBatch
from herald_torchrec.schedule.herald import host_messages
from herald_torchrec.schedule.herald.host_messages import (
    Inbox,
    InProcessTransport,
    Outbox,
    concatenated,
    decode_inbox,
    outgoing_messages,
    source_counts,
)
from herald_torchrec.schedule.message_wire import encode_messages


def _same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for t in a:
        assert len(a[t]) == len(b[t])
        for x, y in zip(a[t], b[t]):
            assert x.dtype == y.dtype and np.array_equal(x, y)


def test_an_outbox_is_its_messages():
    dest = np.array([3, 0, 3, 1, 0, 3])
    keys, ranks = np.arange(6) * 10, np.arange(6, dtype=np.int16)
    box = Outbox.by_host(dest, 5, [keys, ranks])
    assert box.dests == [0, 1, 3]  # hosts 2 and 4 get nothing
    _same(
        box.messages(),
        {0: [keys[[1, 4]], ranks[[1, 4]]], 1: [keys[[3]], ranks[[3]]], 3: [keys[[0, 2, 5]], ranks[[0, 2, 5]]]},
    )
    assert box.message(2) is None and np.array_equal(box.message(3)[0], [0, 20, 50])
    pins = Outbox.by_host(np.array([2, 2]), 5, [np.array([7, 8])])
    joined = Outbox.joined([box, pins])  # a host one part sends nothing gets its fields empty
    want = {t: m + [np.zeros(0, np.int64)] for t, m in box.messages().items()}
    want[2] = [np.zeros(0, np.int64), np.zeros(0, np.int16), np.array([7, 8])]
    _same(joined.messages(), want)


def test_an_inbox_is_the_messages_it_decoded():
    msgs = {0: [np.array([1, 2]), np.array([5], np.int16)], 2: [np.array([3]), np.zeros(0, np.int16)],
            3: [np.zeros(0, np.int64), np.array([6, 7], np.int16)]}  # fmt: skip
    sizes = [0] * 4
    bufs = encode_messages([msgs[s] for s in sorted(msgs)], compact=False)
    for s, b in zip(sorted(msgs), bufs):
        sizes[s] = b.shape[0]
    inbox = decode_inbox(np.concatenate(bufs), sizes)
    assert isinstance(inbox, Inbox) and list(inbox) == [0, 2, 3] and 1 not in inbox
    _same(dict(inbox.items()), msgs)
    keys, ranks = concatenated(inbox, (np.int64, np.int64))
    assert keys.tolist() == [1, 2, 3] and ranks.tolist() == [5, 6, 7] and ranks.dtype == np.int64
    assert source_counts(inbox, 1).tolist() == [1, 0, 2] == source_counts(dict(inbox.items()), 1).tolist()


def test_the_in_process_transport_delivers_either_form_alike():
    rng = np.random.default_rng(0)
    H = 4
    out_lists, out_boxes = {}, {}
    for src in range(H):
        dest = rng.integers(0, H, 20)
        box = Outbox.by_host(dest, H, [rng.integers(0, 1000, 20), rng.integers(0, 8, 20).astype(np.int16)])
        out_boxes[src], out_lists[src] = box, outgoing_messages(box)
    a = InProcessTransport(H).exchange("reads", out_lists)
    b = InProcessTransport(H, compact=True).exchange("reads", out_boxes)
    for h in range(H):
        _same(dict(a[h].items()), dict(b[h].items()))
        for src in a[h]:
            _same({0: a[h][src]}, {0: outgoing_messages(out_boxes[src])[h]})


def test_ids_bytes_of_a_single_hot_batch_without_a_pass_per_table():
    """A rank's id bytes: 8 per id it loads; a single-hot batch's (B ids per table) as the jagged form's count."""
    rows = [10, 20, 30]
    ids = np.random.default_rng(3).integers(0, 10, (8, 3))
    dense = GlobalBatch.from_dense(ids, rows)
    jagged = GlobalBatch(dense.offsets, dense.values, rows)
    assert "dense" not in jagged._cache
    np.testing.assert_array_equal(host_messages.ids_bytes(dense, 4, 2), [48, 48, 48, 48])
    np.testing.assert_array_equal(host_messages.ids_bytes(jagged, 4, 2), [48, 48, 48, 48])
    bags = GlobalBatch(
        [np.array([0, 2, 2, 3]), np.array([0, 1, 2, 3])], [np.array([1, 2, 3]), np.array([0, 1, 2])], [5, 5]
    )
    np.testing.assert_array_equal(host_messages.ids_bytes(bags, 3, 1), [24, 8, 16])
