"""A herald_hier planner message as bytes: what the planners' transport sends between machines.

Why: a message is a list of numpy arrays (schedule/herald/hierarchy.py), and most of them are sorted keys, ranks of
one machine, element counts and indices into an earlier message. Sent as their arrays' bytes (int64 keys, int16
ranks) the planners' messages grow the ids + plan bytes per rank 1.72x from R=8 to R=256; each array in the form of
fewest bytes for its values (`compact`, herald_hier's `planner_wire: compact`) brings them to about a quarter and
that growth to 1.20x, with nothing lost: the decoded message equals the sent one, dtypes included. It costs the
planner 0.55-1.2 ms of CPU per step (R=64-256), which the bytes repay on slow host links only, so the default form
sends every array RAW behind the same headers; a receiver decodes either (each header names its array's mode).

Format of one message: one byte, the number of arrays n (at most 255); then every array: one byte (its dtype's
code in DTYPES << 3 | its mode), its element count as a varint, its payload. Modes:

    0 RAW          the array's own bytes (floats, bools, uint64; an empty array)
    1 BITS         varint base = min, one byte b, then every (value - base) in b bits
    2 DELTA_BITS   varint first value, varint least delta d, one byte b, then every (delta - d) in b bits (n >= 2)
    3 VARINT       every value as a varint
    4 DELTA_VARINT every delta (the first from 0) as a varint

A varint is LEB128 of the zigzag of a signed int64 (0, -1, 1, -2 -> 0, 1, 2, 3); bits pack least significant first;
deltas wrap as uint64 does. In the compact form each array takes the mode of fewest bytes, ties to the lower mode;
in the raw form, RAW. Worked example: the
sorted keys [1000, 1001, 1003] (int64, 24 bytes raw) take BITS: varint 2000 (the zigzag of 1000; 2 bytes), b = 2
(1 byte), then [0, 1, 3] in 2 bits each (1 byte): 4 bytes, and the message [keys] 1 + 2 + 4 = 7 bytes.

    bufs = encode_messages([m0, m1])          # np.uint8 views, one per message
    same = decode_messages(np.concatenate(bufs), [b.shape[0] for b in bufs])

A planner's phase sends the same few fields to up to H - 1 hosts and reads what it receives field by field, so two
more entry points do the same work per field instead of per array: `encode_slices(fields, starts, stops)` writes
the bytes of messages made of slices of the same arrays, and `decode_fields(buf, sizes)` decodes messages of one
layout into each field's concatenation over the senders (schedule/herald/host_messages.py: Outbox, Inbox). A
phase's messages come out as one buffer with each message's end (`Encoded`: `encode_joined`, `encode_slices`), a
transport's send buffer as it is.

Compiled (schedule/native.py: one call over every message of a phase each way), with this numpy code as the
fallback; both write the same bytes (tests/schedule/test_message_wire.py). numpy only (the control plane never
imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from herald_torchrec._native import address_array
from herald_torchrec.schedule import native

Message = list  # a message between planners: a list of numpy arrays (its phase says which)

RAW, BITS, DELTA_BITS, VARINT, DELTA_VARINT = range(5)
WIRE_FORMS = ("compact", "raw")  # each array in its form of fewest bytes; every array RAW
# the dtypes a message carries, by code (the header byte's high bits); a decoded array has the dtype of its code
DTYPES = tuple(
    np.dtype(t)
    for t in (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
              np.float16, np.float32, np.float64)
)  # fmt: skip
_CODE = {dt: i for i, dt in enumerate(DTYPES)}
_ITEMSIZE = np.zeros(32, dtype=np.int64)  # by code, for the compiled scan (0: no such dtype)
_ITEMSIZE[: len(DTYPES)] = [dt.itemsize for dt in DTYPES]
_KIND = {"i1": 1, "u1": 2, "i2": 3, "u2": 4, "i4": 5, "u4": 6, "i8": 7}  # integer element codes of the kernels


def _kind(dt: np.dtype) -> int:
    return _KIND.get(f"{dt.kind}{dt.itemsize}", 0)


def _check(m: Message) -> list[np.ndarray]:
    """The message's arrays, C-contiguous and native-endian; ValueError for what the format cannot carry."""
    if len(m) > 255:
        raise ValueError(f"message_wire: a message holds at most 255 arrays, not {len(m)}")
    out = []
    for a in m:
        if not (a.flags.c_contiguous and a.dtype.isnative):
            a = np.ascontiguousarray(a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("=")))
        if a.ndim != 1 or a.dtype not in _CODE or a.shape[0] >= 1 << 32:
            raise ValueError(
                f"message_wire: a message's arrays are 1-D, < 2**32 long, of a numeric dtype or bool: {a.dtype} "
                f"{a.shape}"
            )
        out.append(a)
    return out


# ---- numpy (the fallback; the compiled kernels write the same bytes) ----------------------------------------------


def _zigzag(v: np.ndarray) -> np.ndarray:
    return (v.view(np.uint64) << np.uint64(1)) ^ (v >> 63).view(np.uint64)


def _unzigzag(u: np.ndarray) -> np.ndarray:
    return ((u >> np.uint64(1)) ^ (np.uint64(0) - (u & np.uint64(1)))).view(np.int64)


def _varint_lengths(u: np.ndarray) -> np.ndarray:
    n = np.ones(u.shape[0], dtype=np.int64)
    for k in range(1, 10):
        n += u >= np.uint64(1) << np.uint64(7 * k)
    return n


def _varints(u: np.ndarray) -> np.ndarray:
    lens = _varint_lengths(u)
    pos = np.cumsum(lens) - lens
    out = np.empty(int(lens.sum()), dtype=np.uint8)
    for k in range(int(lens.max()) if u.shape[0] else 0):
        has = lens > k
        byte = (u[has] >> np.uint64(7 * k)) & np.uint64(127)
        out[pos[has] + k] = (byte | np.where(lens[has] > k + 1, np.uint64(128), np.uint64(0))).astype(np.uint8)
    return out


def _bitlen(x: int) -> int:
    return int(x).bit_length()


def _bits(u: np.ndarray, b: int) -> np.ndarray:
    if b == 0 or u.shape[0] == 0:
        return np.zeros((u.shape[0] * b + 7) // 8, dtype=np.uint8)
    bits = ((u[:, None] >> np.arange(b, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little")


def _encode_array(a: np.ndarray, compact: bool = True) -> tuple[int, np.ndarray]:
    """(mode, payload) of one array."""
    raw = a.view(np.uint8)
    n = a.shape[0]
    if not compact or _kind(a.dtype) == 0 or n == 0:
        return RAW, raw
    v = a.astype(np.int64)
    lo, hi = int(v.min()), int(v.max())
    u = v.view(np.uint64) - np.uint64(lo & (2**64 - 1))
    b = _bitlen((hi - lo) & (2**64 - 1))
    d = np.empty(n, dtype=np.int64)
    d[0] = v[0]
    np.subtract(v[1:], v[:-1], out=d[1:])  # wraps as uint64 does
    base = _varints(_zigzag(np.array([lo], dtype=np.int64)))
    options: list[tuple[int, Callable]] = [
        (raw.shape[0], lambda: raw),
        (base.shape[0] + 1 + (n * b + 7) // 8, lambda: np.concatenate([base, [b], _bits(u, b)]).astype(np.uint8)),
    ]
    if n >= 2:
        dlo, dhi = int(d[1:].min()), int(d[1:].max())
        db = _bitlen((dhi - dlo) & (2**64 - 1))
        head = _varints(_zigzag(np.array([v[0], dlo], dtype=np.int64)))
        du = d[1:].view(np.uint64) - np.uint64(dlo & (2**64 - 1))
        options.append(
            (
                head.shape[0] + 1 + ((n - 1) * db + 7) // 8,
                lambda: np.concatenate([head, [db], _bits(du, db)]).astype(np.uint8),
            )
        )
    else:
        options.append((np.iinfo(np.int64).max, lambda: raw))
    zv, zd = _zigzag(v), _zigzag(d)
    options.append((int(_varint_lengths(zv).sum()), lambda: _varints(zv)))
    options.append((int(_varint_lengths(zd).sum()), lambda: _varints(zd)))
    mode = min(range(5), key=lambda q: (options[q][0], q))
    return mode, options[mode][1]()


def _read_varints(buf: np.ndarray, at: int, n: int) -> tuple[np.ndarray, int]:
    """n varints from buf[at:] as uint64, and where they end; ValueError if they do not fit."""
    if n == 0:
        return np.zeros(0, dtype=np.uint64), at
    tail = buf[at:]
    ends = np.flatnonzero(tail < 128)
    if ends.shape[0] < n:
        raise ValueError("message_wire: a malformed message (bad varint)")
    ends = ends[:n]
    starts = np.concatenate([[0], ends[:-1] + 1])
    if (ends - starts >= 10).any():
        raise ValueError("message_wire: a malformed message (bad varint)")
    stop = int(ends[-1]) + 1
    body = tail[:stop].astype(np.uint64) & np.uint64(127)
    shift = (np.arange(stop) - np.repeat(starts, ends - starts + 1)).astype(np.uint64) * np.uint64(7)
    return np.add.reduceat(body << shift, starts), at + stop


def _read_bits(buf: np.ndarray, at: int, n: int, b: int) -> tuple[np.ndarray, int]:
    nbytes = (n * b + 7) // 8
    if at + nbytes > buf.shape[0]:
        raise ValueError("message_wire: a malformed message (payload past its end)")
    if b == 0:
        return np.zeros(n, dtype=np.uint64), at
    bits = np.unpackbits(buf[at : at + nbytes], bitorder="little")[: n * b].reshape(n, b).astype(np.uint64)
    return (bits << np.arange(b, dtype=np.uint64)).sum(axis=1, dtype=np.uint64), at + nbytes


def _decode_array(buf: np.ndarray, at: int, dtype: np.dtype, mode: int, n: int) -> tuple[np.ndarray, int]:
    with np.errstate(over="ignore"):  # a damaged payload's values wrap into the dtype, as the compiled pass's do
        return _decode_payload(buf, at, dtype, mode, n)


def _decode_payload(buf: np.ndarray, at: int, dtype: np.dtype, mode: int, n: int) -> tuple[np.ndarray, int]:
    if mode == RAW:
        end = at + n * dtype.itemsize
        if end > buf.shape[0]:
            raise ValueError("message_wire: a malformed message (payload past its end)")
        return buf[at:end].copy().view(dtype), end
    if mode in (BITS, DELTA_BITS):
        if n < mode:
            raise ValueError("message_wire: a malformed message (too few elements for its mode)")
        head, at = _read_varints(buf, at, mode)
        if at >= buf.shape[0] or buf[at] > 64:
            raise ValueError("message_wire: a malformed message (bad bit width)")
        b = int(buf[at])
        u, at = _read_bits(buf, at + 1, n - (mode == DELTA_BITS), b)
        first = _unzigzag(head[:1]).view(np.uint64)
        if mode == BITS:
            v = u + first[0]
        else:
            d = u + _unzigzag(head[1:]).view(np.uint64)[0]
            v = np.cumsum(np.concatenate([first, d]), dtype=np.uint64)
        return v.view(np.int64).astype(dtype), at
    if mode in (VARINT, DELTA_VARINT):
        u, at = _read_varints(buf, at, n)
        v = _unzigzag(u)
        if mode == DELTA_VARINT:
            v = np.cumsum(v.view(np.uint64), dtype=np.uint64).view(np.int64)
        return v.astype(dtype), at
    raise ValueError(f"message_wire: a malformed message (unknown mode {mode})")


def _encode_numpy(m: list[np.ndarray], compact: bool = True) -> np.ndarray:
    out = [np.array([len(m)], dtype=np.uint8)]
    for a in m:
        mode, payload = _encode_array(a, compact)
        out += [np.array([_CODE[a.dtype] << 3 | mode], dtype=np.uint8), _varints(np.array([a.shape[0]], np.uint64))]
        out.append(payload)
    return np.concatenate(out)


def _decode_numpy(buf: np.ndarray) -> Message:
    if buf.shape[0] < 1:
        raise ValueError("message_wire: a malformed message (empty)")
    at, out = 1, []
    for _ in range(int(buf[0])):
        if at >= buf.shape[0]:
            raise ValueError("message_wire: a malformed message (header past its end)")
        code, mode = int(buf[at]) >> 3, int(buf[at]) & 7
        if code >= len(DTYPES):
            raise ValueError("message_wire: a malformed message (unknown dtype)")
        (count,), at = _read_varints(buf, at + 1, 1)
        a, at = _decode_array(buf, at, DTYPES[code], mode, int(count))
        out.append(a)
    if at != buf.shape[0]:
        raise ValueError("message_wire: a malformed message (bytes after its last array)")
    return out


# ---- the API ----------------------------------------------------------------------------------------------------


_META = {dt: (_kind(dt), dt.itemsize, code) for dt, code in _CODE.items()}  # element code, item size, dtype code


@dataclass
class Encoded:
    """Messages as bytes, back to back: message j is buf[ends[j - 1]:ends[j]] (the first from 0). Why one buffer: a
    transport sends a phase's messages as one all-to-all buffer, in destination order, and needs only their sizes."""

    buf: np.ndarray  # np.uint8
    ends: np.ndarray  # int64, one per message

    @classmethod
    def join(cls, bufs: Sequence[np.ndarray]) -> "Encoded":
        ends = np.cumsum([b.shape[0] for b in bufs], dtype=np.int64)
        return cls(np.concatenate(bufs) if bufs else np.zeros(0, dtype=np.uint8), ends)

    def sizes(self) -> np.ndarray:
        return np.diff(self.ends, prepend=0)

    def messages(self) -> list[np.ndarray]:
        """Each message's bytes, views of `buf`."""
        ends = self.ends.tolist()
        return [self.buf[s:e] for s, e in zip([0] + ends[:-1], ends)]


def encode_joined(messages: Sequence[Message], compact: bool = True) -> Encoded:
    """Every message as bytes, back to back, in one compiled pass where the kernels are on. compact=False sends every
    array RAW (its own bytes behind the same headers): no pass over the values, for planners whose links are fast
    enough that the CPU costs more than the bytes (WIRE_FORMS)."""
    if not native.enabled() or not messages:  # (a phase that sends nothing: no pass to set up)
        return Encoded.join([_encode_numpy(_check(m), compact) for m in messages])
    arrays = [a for m in messages for a in m]
    # a step's phase sends ~650 arrays at R=256: one look per array, the whole check (_check) only where it fails
    meta = [_META.get(a.dtype) if a.ndim == 1 and a.flags.c_contiguous else None for a in arrays]
    if None in meta or any(len(m) > 255 for m in messages):
        checked = [_check(m) for m in messages]
        arrays = [a for m in checked for a in m]
        meta = [_META[a.dtype] for a in arrays]
    first = np.zeros(len(messages) + 1, dtype=np.int64)
    np.cumsum([len(m) for m in messages], out=first[1:])
    lens = np.array([len(a) for a in arrays], dtype=np.int64)  # (1-D, checked)
    if lens.shape[0] and lens.max() >= 1 << 32:
        _check([a for a in arrays if a.shape[0] >= 1 << 32])  # raises
    kinds, sizes, codes = _meta_columns(meta)
    cap = _capacity(lens, sizes, len(arrays), compact) + len(messages)
    buf, ends = native.msg_encode(address_array(arrays), first, lens, kinds * compact, sizes, codes, cap)
    return Encoded(buf, ends)


def _meta_columns(meta: list[tuple[int, int, int]]) -> np.ndarray:
    """`_META` rows (one per array or field) as three int64 columns: element codes, item sizes, dtype codes."""
    return np.array(meta, dtype=np.int64).reshape(len(meta), 3).T.copy()


def encode_messages(messages: Sequence[Message], compact: bool = True) -> list[np.ndarray]:
    """`encode_joined`'s messages, each its own np.uint8 view."""
    return encode_joined(messages, compact).messages()


def _capacity(elements: np.ndarray, sizes: np.ndarray, arrays: int, compact: bool) -> int:
    """Bytes that bound the encoding (headers and payloads) of `arrays` arrays whose elements, of item `sizes`, number
    `elements` (per array or per field): at most 10 per value as varints, 32 for a header and a mode's own words."""
    return int((elements * (np.maximum(sizes, 10) if compact else sizes)).sum()) + (32 if compact else 11) * arrays


def encode_slices(fields: Sequence[np.ndarray], starts: np.ndarray, stops: np.ndarray, compact: bool = True) -> Encoded:
    """Messages made of slices of the same arrays, as bytes: message m is [fields[i][starts[m, i]:stops[m, i]] for
    every field i], byte for byte what `encode_joined` writes for those lists. Why: a planner's phase sends up to
    H - 1 messages of the same few fields (host_messages.Outbox); addressed by the compiled pass, its Python work is
    per field, not per array sent (~1 us each, ~650 arrays a step at R=256). ValueError for a slice outside its
    field."""
    starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
    M, W = starts.shape if starts.ndim == 2 else (starts.shape[0], len(fields))
    fields = _check(list(fields))  # (at most 255 fields: a message's arrays)
    if starts.shape != (M, W) or stops.shape != (M, W) or W != len(fields):
        raise ValueError(f"message_wire: slices {starts.shape} / {stops.shape} of {len(fields)} fields")
    outside = ValueError("message_wire: a slice outside its field")
    flen = np.array([f.shape[0] for f in fields], dtype=np.int64)
    if not native.enabled():
        if ((starts < 0) | (stops < starts) | (stops > flen)).any():
            raise outside
        s0, s1 = starts.tolist(), stops.tolist()
        return encode_joined([[f[a:b] for f, a, b in zip(fields, s0[m], s1[m])] for m in range(M)], compact)
    kinds, sizes, codes = _meta_columns([_META[f.dtype] for f in fields])
    cap = _capacity(np.maximum(stops - starts, 0).sum(axis=0), sizes, M * W, compact) + M
    got = native.msg_encode_slices(address_array(fields), flen, kinds * compact, sizes, codes, starts, stops, cap)
    if got is None:
        raise outside
    return Encoded(*got)


def encode_message(m: Message, compact: bool = True) -> np.ndarray:
    return encode_messages([m], compact)[0]


def _check_total(buf: np.ndarray, total: int) -> None:
    """ValueError where the messages' sizes do not add up to the buffer."""
    if total != buf.shape[0]:
        raise ValueError(f"message_wire: {buf.shape[0]} bytes for messages of {total}")


def _bounds(buf: np.ndarray, sizes: Sequence[int]) -> tuple[np.ndarray, list[int]]:
    """Where each message of `buf` starts (and the end), and which sizes sent something; ValueError if they do not
    add up to the buffer."""
    bounds = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))]).astype(np.int64)
    _check_total(buf, int(bounds[-1]))
    return bounds, [i for i, n in enumerate(sizes) if n]


def _scan(buf: np.ndarray, bounds: np.ndarray, sent: list[int]) -> tuple[np.ndarray, native.MessageArrays]:
    """The compiled scan of the sent messages' arrays (the bytes as uint8, the table)."""
    b = np.ascontiguousarray(buf, dtype=np.uint8)
    # the sent messages' bounds as one run: messages of size 0 take no bytes, so the starts line up
    return b, native.msg_scan(b, np.concatenate([bounds[sent], bounds[-1:]]) if sent else bounds[:1], _ITEMSIZE)


def decode_messages(buf: np.ndarray, sizes: Sequence[int]) -> list[Message | None]:
    """The messages `encode_messages` wrote, back to back in `buf` (np.uint8), `sizes[i]` bytes each; None for a size
    of 0 (nothing sent). ValueError for a malformed buffer."""
    bounds, sent = _bounds(buf, sizes)
    out: list[Message | None] = [None] * len(sizes)
    if not native.enabled() or not sent:
        for i in sent:
            out[i] = _decode_numpy(buf[bounds[i] : bounds[i + 1]])
        return out
    b, arrs = _scan(buf, bounds, sent)
    nbytes = arrs.count * _ITEMSIZE[arrs.code]
    room = (nbytes + 7) & ~7  # every array 8-byte aligned in one arena, as a fresh array would be
    offset = np.cumsum(room) - room
    arena = native.msg_unpack(b, arrs, _ITEMSIZE, offset, int(room.sum()))
    if arena is None:  # an encoded array of a non-integer dtype: numpy decodes every message
        for i in sent:
            out[i] = _decode_numpy(buf[bounds[i] : bounds[i + 1]])
        return out
    flat = [
        np.frombuffer(arena, DTYPES[c], n, o)
        for c, n, o in zip(arrs.code.tolist(), arrs.count.tolist(), offset.tolist())
    ]
    per = np.zeros(len(sent) + 1, dtype=np.int64)
    np.cumsum(np.bincount(arrs.msg, minlength=len(sent)), out=per[1:])
    for i, lo, hi in zip(sent, per[:-1].tolist(), per[1:].tolist()):
        out[i] = flat[lo:hi]
    return out


@dataclass
class Fields:
    """Messages of the same layout decoded field by field (`decode_fields`): the message from sources[j] is
    [fields[i][bounds[j, i]:bounds[j + 1, i]] for every field i]."""

    sources: list[int]  # the indices of the sizes that sent something, increasing
    fields: list[np.ndarray]  # each the concatenation of its arrays over the sources, in their order
    bounds: np.ndarray  # int64 [len(sources) + 1, len(fields)]


def decode_fields(buf: np.ndarray, sizes: Sequence[int]) -> Fields | None:
    """The messages `encode_messages` wrote (as `decode_messages` takes them), where every one sent has the same
    number of arrays with the same dtype at each place: each field's arrays decoded back to back into one array, in
    one compiled pass. Why: a planner mostly concatenates what every host sent it field by field; decoded so, its
    Python work is per field, not per array received (~31 x 3-11 arrays a phase at R=256). None where the layouts
    differ or the kernels are off (`decode_messages` then); ValueError for a malformed buffer."""
    if not native.enabled():
        _bounds(buf, sizes)
        return None
    n = np.asarray(sizes, dtype=np.int64)
    _check_total(buf, int(n.sum()))
    sent = np.flatnonzero(n)
    if not sent.shape[0]:
        return Fields([], [], np.zeros((1, 0), dtype=np.int64))
    b = np.ascontiguousarray(buf, dtype=np.uint8)
    # the first message sent begins the buffer (those of size 0 take no bytes); its first byte counts its arrays
    got = native.msg_decode_fields(b, n[sent], _ITEMSIZE, int(b[0]))
    if got is None:  # layouts differ, or an encoded array of a non-integer dtype: decode_messages
        return None
    arena, codes, at, first = got
    fields = [np.frombuffer(arena, DTYPES[c], k, o) for c, k, o in zip(codes.tolist(), at[-1].tolist(), first.tolist())]
    return Fields(sent.tolist(), fields, at)


def decode_message(buf: np.ndarray) -> Message:
    return decode_messages(buf, [buf.shape[0]])[0]
