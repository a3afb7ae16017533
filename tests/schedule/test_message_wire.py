"""The herald_hier planners' messages as bytes (schedule/message_wire.py): every array comes back equal, dtype
included; each takes the mode of fewest bytes; the compiled pass and numpy write the same bytes; a malformed buffer is
an error, never garbage."""

import numpy as np
import pytest

from herald_torchrec.schedule import message_wire as mw
from herald_torchrec.schedule import native

INT_TYPES = (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64)


def _random_messages(seed: int, count: int) -> list[list[np.ndarray]]:
    """Messages of every integer dtype with values of every shape the planners send (sorted keys, a few ranks,
    constants, full-range noise), plus the edge values and the dtypes sent raw."""
    rng = np.random.default_rng(seed)
    i64 = np.iinfo(np.int64)
    out = [
        [np.array([i64.min, i64.max, 0, -5], np.int64), np.array([i64.max, i64.min], np.int64)],
        [np.zeros(0, np.int64), np.array([5], np.int16), np.array([-1], np.int8), np.zeros(0, np.float32)],
        [np.array([1.5, -2.5]), np.array([True, False]), np.array([2**63 + 5, 1], np.uint64)],
        [np.array([7, 7, 7, 7], np.int32), np.array([-3, -3], np.int64)],
        [],
    ]
    for _ in range(count):
        m = []
        for _ in range(rng.integers(0, 7)):
            t = INT_TYPES[rng.integers(0, len(INT_TYPES))]
            info, n, shape = np.iinfo(t), int(rng.integers(0, 60)), rng.integers(0, 4)
            if shape == 0:  # anything
                a = rng.integers(
                    info.min, info.max, size=n, endpoint=True, dtype=np.int64 if t != np.uint32 else np.uint64
                )
            elif shape == 1:  # sorted keys
                a = np.sort(rng.integers(max(info.min, -1000), min(info.max, 10**6), size=n))
            elif shape == 2:  # one value
                a = np.full(n, rng.integers(max(info.min, -5), min(info.max, 100)))
            else:  # ranks of one machine
                a = rng.integers(0, min(info.max, 8), size=n)
            m.append(a.astype(t))
        out.append(m)
    return out


def _same(sent: list[np.ndarray], got: list[np.ndarray]) -> None:
    assert len(sent) == len(got)
    for a, b in zip(sent, got):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_every_message_comes_back_equal_with_its_dtypes():
    msgs = _random_messages(0, 300)
    bufs = mw.encode_messages(msgs)
    sizes = [b.shape[0] for b in bufs]
    got = mw.decode_messages(np.concatenate(bufs), sizes)
    for m, g in zip(msgs, got):
        _same(m, g)
    assert mw.decode_messages(np.concatenate(bufs), sizes[:3] + [0] + sizes[3:])[3] is None  # nothing sent: None


def test_decoded_arrays_are_aligned_writable_and_independent():
    """The compiled pass lays a phase's arrays out in one arena: each still starts 8-byte aligned (kernels read
    them), is writable, and a write into one leaves the others and the received bytes as they were."""
    msgs = _random_messages(4, 60) + [[np.array([3, 1, 2], np.int16), np.arange(5, dtype=np.int64) * 7]]
    for compact in (True, False):
        bufs = mw.encode_messages(msgs, compact)
        buf = np.concatenate(bufs)
        before = buf.copy()
        got = mw.decode_messages(buf, [b.shape[0] for b in bufs])
        arrays = [a for m in got for a in m]
        assert all(a.flags.aligned and a.flags.writeable for a in arrays)
        got[-1][0][:] = -1
        assert np.array_equal(buf, before)
        for m, g in zip(msgs[:-1], got[:-1]):
            _same(m, g)
        assert got[-1][1].tolist() == [0, 7, 14, 21, 28]


@pytest.mark.parametrize("compiled", [True, False])
def test_slices_of_fields_encode_as_the_lists_they_are(monkeypatch, compiled):
    """encode_slices writes, per message, the bytes encode_messages writes for its slices of the fields (empty fields
    and empty slices included); a slice outside its field is refused."""
    if compiled and not native.enabled():
        pytest.skip("compiled kernels unavailable (HERALD_NATIVE=0 or no C++ compiler)")
    if not compiled:
        monkeypatch.setattr(native, "enabled", lambda: False)
    rng = np.random.default_rng(7)
    fields = [np.sort(rng.integers(0, 10**9, 500)), rng.integers(0, 64, 300).astype(np.int16),
              np.zeros(0, np.int32), rng.integers(0, 2, 40).astype(np.int8), np.array([3, 1, 4], np.int64)]  # fmt: skip
    M = 9
    lens = np.array([f.shape[0] for f in fields])
    a = rng.integers(0, lens + 1, (M, len(fields)))
    b = rng.integers(0, lens + 1, (M, len(fields)))
    starts, stops = np.minimum(a, b), np.maximum(a, b)
    for compact in (True, False):
        joined = mw.encode_slices(fields, starts, stops, compact)
        got = joined.messages()
        want = mw.encode_messages([[f[s:e] for f, s, e in zip(fields, starts[m], stops[m])] for m in range(M)], compact)
        assert len(got) == M and all(np.array_equal(g, w) for g, w in zip(got, want))
        assert np.array_equal(joined.buf, np.concatenate(want))  # back to back, as a transport sends them
        assert joined.sizes().tolist() == [w.shape[0] for w in want]
    past_the_end = np.where(np.arange(len(fields)) == 0, lens + 1, stops)
    for bad_starts, bad_stops in ((starts, past_the_end), (starts - 1, stops), (stops, starts - 1)):
        if (bad_starts <= bad_stops).all() and (bad_starts >= 0).all() and (bad_stops <= lens).all():
            continue  # (a draw where the slices happen to be fine)
        with pytest.raises(ValueError, match="outside its field"):
            mw.encode_slices(fields, bad_starts, bad_stops)


def test_messages_of_one_layout_decode_field_by_field():
    """decode_fields: each field the concatenation of the sources' arrays, bounds per source; None where the layouts
    differ (array count or dtype) or the kernels are off."""
    if not native.enabled():
        pytest.skip("compiled kernels unavailable (HERALD_NATIVE=0 or no C++ compiler)")
    rng = np.random.default_rng(11)
    msgs = [[np.sort(rng.integers(0, 10**6, n)), rng.integers(0, 8, n).astype(np.int16), np.arange(k, dtype=np.int8)]
            for n, k in ((5, 2), (0, 0), (17, 9), (3, 1))]  # fmt: skip
    for compact in (True, False):
        bufs = mw.encode_messages(msgs, compact)
        sizes = [b.shape[0] for b in bufs]
        sizes_with_gap = sizes[:2] + [0] + sizes[2:]  # host 2 sent nothing
        got = mw.decode_fields(np.concatenate(bufs), sizes_with_gap)
        assert got.sources == [0, 1, 3, 4]
        for i in range(3):
            want = np.concatenate([m[i] for m in msgs])
            assert got.fields[i].dtype == want.dtype and np.array_equal(got.fields[i], want)
            assert got.fields[i].flags.aligned and got.fields[i].flags.writeable
        assert got.bounds[:, 0].tolist() == [0, 5, 5, 22, 25] and got.bounds[:, 2].tolist() == [0, 2, 2, 11, 12]
    bytes_first = [[np.arange(n, dtype=np.int8), np.arange(n + 2), np.arange(n, dtype=np.int16)] for n in (3, 0, 4)]
    for compact in (True, False):  # each field 8-byte aligned after a field of an odd number of bytes
        bufs = mw.encode_messages(bytes_first, compact)
        got = mw.decode_fields(np.concatenate(bufs), [b.shape[0] for b in bufs])
        assert [f.ctypes.data % 8 for f in got.fields] == [0, 0, 0]
        assert got.fields[1].tolist() == [*range(5), *range(2), *range(6)]
        assert got.fields[2].tolist() == [0, 1, 2, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="malformed"):  # the compiled pass checks the sizes too: one left out
        native.msg_decode_fields(np.concatenate(bufs), np.array([b.shape[0] for b in bufs[:-1]]), mw._ITEMSIZE, 3)
    for odd in ([msgs[0], msgs[1][:2]], [msgs[0][:2], msgs[1]]):  # three arrays in one, two in the other
        bufs = mw.encode_messages(odd)
        assert mw.decode_fields(np.concatenate(bufs), [b.shape[0] for b in bufs]) is None
    other_dtype = [msgs[0], [msgs[1][0], msgs[1][1].astype(np.int32), msgs[1][2]]]
    bufs = mw.encode_messages(other_dtype)
    assert mw.decode_fields(np.concatenate(bufs), [b.shape[0] for b in bufs]) is None
    assert mw.decode_fields(np.zeros(0, np.uint8), [0, 0]).sources == []


def test_read_only_and_strided_arrays_travel_too():
    read_only = np.frombuffer(np.arange(6, dtype=np.int32).tobytes(), dtype=np.int32)
    strided = np.arange(20, dtype=np.int64)[::3]
    assert not read_only.flags.writeable and not strided.flags.c_contiguous
    for compact in (True, False):
        (got,) = mw.decode_messages(*_one(mw.encode_messages([[read_only, strided, np.zeros(0, np.int16)]], compact)))
        _same([read_only, np.ascontiguousarray(strided), np.zeros(0, np.int16)], got)


def _one(bufs):
    return np.concatenate(bufs), [b.shape[0] for b in bufs]


@pytest.mark.parametrize("code", [0, 10, 11])  # bool, float32, float64: sent raw by the encoder, never encoded
def test_an_encoded_array_of_a_non_integer_dtype_decodes_as_numpy_does(monkeypatch, code):
    buf = np.array([2, 7 << 3 | mw.RAW, 1, 9, 0, 0, 0, 0, 0, 0, 0, code << 3 | mw.VARINT, 3, 2, 1, 4], np.uint8)
    got = mw.decode_message(buf)
    if native.enabled():  # field by field: the compiled pass leaves it to numpy (decode_messages)
        assert mw.decode_fields(np.concatenate([buf, buf]), [buf.shape[0]] * 2) is None
    monkeypatch.setattr(native, "enabled", lambda: False)
    want = mw.decode_message(buf)
    _same(want, got)
    assert got[1].tolist() == np.array([1, -1, 2]).astype(mw.DTYPES[code]).tolist()


def test_compiled_and_numpy_write_the_same_bytes(monkeypatch):
    if not native.enabled():
        pytest.skip("compiled kernels unavailable (HERALD_NATIVE=0 or no C++ compiler)")
    msgs = _random_messages(1, 200)
    compiled = mw.encode_messages(msgs)
    monkeypatch.setattr(native, "enabled", lambda: False)
    numpy_ = mw.encode_messages(msgs)
    for a, b in zip(compiled, numpy_):
        assert np.array_equal(a, b)
    got = mw.decode_messages(np.concatenate(compiled), [b.shape[0] for b in compiled])  # numpy decodes them
    for m, g in zip(msgs, got):
        _same(m, g)


def test_the_worked_example_and_the_mode_of_fewest_bytes():
    """The docstring's example byte for byte, and the mode each kind of array the planners send takes."""
    buf = mw.encode_message([np.array([1000, 1001, 1003], np.int64)])
    assert buf.tolist() == [1, 7 << 3 | mw.BITS, 3, 208, 15, 2, 0b110100]

    def mode_and_size(a):
        b = mw.encode_message([a])
        count_bytes = 1 + (a.shape[0] >= 128) + (a.shape[0] >= 1 << 14)
        return int(b[1]) & 7, b.shape[0] - 2 - count_bytes

    keys = np.cumsum(np.full(1000, 3)) + 10**9  # sorted keys 3 apart: one byte of header, 0 bits each
    assert mode_and_size(keys) == (mw.DELTA_BITS, 5 + 1 + 1 + 0)
    ranks = np.tile(np.arange(8, 16, dtype=np.int16), 100)  # the ranks of machine 1: 3 bits each
    assert mode_and_size(ranks) == (mw.BITS, 1 + 1 + 300)
    gaps = np.random.default_rng(0).permutation(np.r_[np.ones(490, np.int64), np.full(10, 10**6)])
    assert mode_and_size(np.cumsum(gaps)) == (mw.DELTA_VARINT, 490 + 10 * 3)  # sorted, a few wide gaps
    # every value wide as a varint, every delta but one narrow: the delta varints win by 192 bytes over 14 bits each
    steps = np.r_[100, np.ones(254, np.int16), 10_000]
    assert mode_and_size(np.cumsum(steps).astype(np.int16)) == (mw.DELTA_VARINT, 2 + 254 + 3)
    wide = np.r_[0, 2**41 - 1, np.random.default_rng(0).integers(0, 2**41, 7)]  # 9 x 41 bits: one bit left over
    assert mode_and_size(wide) == (mw.BITS, 1 + 1 + 47)
    noise = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, 100, endpoint=True)
    assert mode_and_size(noise) == (mw.RAW, 800)  # nothing smaller than the raw bytes
    assert mode_and_size(np.full(9, 42, np.int32)) == (mw.BITS, 1 + 1 + 0)  # one value: no bits at all


@pytest.mark.parametrize("compiled", [True, False])
def test_a_malformed_buffer_is_an_error(monkeypatch, compiled):
    if compiled and not native.enabled():
        pytest.skip("compiled kernels unavailable (HERALD_NATIVE=0 or no C++ compiler)")
    if not compiled:
        monkeypatch.setattr(native, "enabled", lambda: False)
    good = mw.encode_message([np.arange(100, dtype=np.int64) * 1000, np.array([1, 2, 3], np.int16)])
    bad = {
        "truncated": good[:-1],
        "trailing": np.concatenate([good, [0]]).astype(np.uint8),
        "unknown mode": np.concatenate([good[:1], [7 << 3 | 7], good[2:]]).astype(np.uint8),
        "unknown dtype": np.concatenate([good[:1], [31 << 3 | int(good[1]) & 7], good[2:]]).astype(np.uint8),
        "header only": good[:3],
        "no arrays": good[:1],
    }
    for name, buf in bad.items():
        with pytest.raises(ValueError, match="malformed"):
            mw.decode_message(buf)
        if compiled:  # field by field: the same refusals (a second message after it, well formed)
            with pytest.raises(ValueError, match="malformed"):
                mw.decode_fields(np.concatenate([buf, good]), [buf.shape[0], good.shape[0]])
            with pytest.raises(ValueError, match="malformed"):
                mw.decode_fields(np.concatenate([good, buf]), [good.shape[0], buf.shape[0]])
    for decode in (mw.decode_messages, mw.decode_fields):
        with pytest.raises(ValueError, match="bytes for messages"):
            decode(good, [good.shape[0] + 1])
    if compiled:
        with pytest.raises(ValueError, match="malformed"):  # sizes that add up but cut a message in two
            mw.decode_fields(np.concatenate([good, good]), [good.shape[0] - 1, good.shape[0] + 1])


def test_what_the_format_cannot_carry_is_refused():
    with pytest.raises(ValueError, match="1-D"):
        mw.encode_message([np.zeros((2, 2), np.int64)])
    with pytest.raises(ValueError, match="numeric dtype"):
        mw.encode_message([np.zeros(2, np.complex64)])
    with pytest.raises(ValueError, match="at most 255"):
        mw.encode_message([np.zeros(1, np.int8)] * 256)
    big_endian = np.array([1, 2, 300], dtype=">i4")
    (got,) = mw.decode_message(mw.encode_message([big_endian]))
    assert got.dtype == np.dtype("<i4") and got.tolist() == [1, 2, 300]  # travels native-endian, same values


@pytest.mark.parametrize("compiled", [True, False])
def test_damaged_buffers_decode_or_are_refused_never_crash(monkeypatch, compiled):
    """Random bytes, truncations, bytes flipped and bytes appended to a valid message: each either decodes (a
    payload byte changed is a changed value: the format has no checksum, the transport's TCP does) or is a
    ValueError; no other exception, no crash of the compiled pass."""
    if compiled and not native.enabled():
        pytest.skip("compiled kernels unavailable (HERALD_NATIVE=0 or no C++ compiler)")
    if not compiled:
        monkeypatch.setattr(native, "enabled", lambda: False)
    rng = np.random.default_rng(3)
    good = mw.encode_message(
        [np.sort(rng.integers(0, 10**6, 300)), rng.integers(0, 8, 300).astype(np.int16),
         rng.integers(1, 30, 300).astype(np.int32), np.array([1.5, 2.5]), np.zeros(0, np.int64)]
    )  # fmt: skip
    refused = 0
    for _ in range(1500 if compiled else 300):
        b = good.copy()
        how = rng.integers(0, 4)
        if how == 0:
            b = rng.integers(0, 256, rng.integers(1, 200)).astype(np.uint8)
        elif how == 1:
            b = b[: rng.integers(1, b.shape[0])]
        elif how == 2:
            b[rng.integers(0, b.shape[0], rng.integers(1, 5))] = rng.integers(0, 256)
        else:
            b = np.concatenate([b, rng.integers(0, 256, rng.integers(1, 20)).astype(np.uint8)])
        try:
            mw.decode_message(b)
        except ValueError:
            refused += 1
        if compiled:  # field by field, beside a good message: decoded, None (another layout) or a ValueError
            try:
                mw.decode_fields(np.concatenate([good, b]), [good.shape[0], b.shape[0]])
            except ValueError:
                pass
    assert refused > 0
