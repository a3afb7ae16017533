"""Shared machinery of the streaming real-log loaders: file opening, block reading, vectorized field parsing,
the deterministic train/validation split, malformed-row accounting and global-batch accumulation.

Streaming: a file is read in blocks of about `chunk_bytes` (default 4 MiB) cut at line ends; each block is split
into fields and parsed with numpy (no per-field Python work on the fast path), its rows are routed to the train or
validation split, and full global batches are yielded as soon as they are complete. Memory is bounded by one block
plus one global batch, whatever the size of the file. Files starting with the gzip magic bytes are decompressed on
the fly (whatever their suffix).

Split: data row i (0-based, header excluded, malformed rows included in the count) is a validation row iff
splitmix64(i XOR mix(split_seed)) mod 10000 < round(val_fraction * 10000). It depends on i only: no RNG state, the
same on every rank and every epoch, and the two splits are disjoint by construction.

Malformed rows (wrong column count, non-numeric or out-of-range fields, bad hex) are counted and skipped; the pass's
`LoaderStats` records the first offending line and why, and a warning goes to stderr when a pass ends. A file whose
first `PROBE_LINES` data lines are all malformed, that has no data rows, or whose header is wrong is not that format:
it raises `DataFormatError` (a ValueError) naming the file and the line. A missing file raises FileNotFoundError.
"""

from __future__ import annotations

import errno
import gzip
import sys
import zlib
from abc import abstractmethod
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from herald_torchrec.data.errors import DataFormatError
from herald_torchrec.data.samples import Samples
from herald_torchrec.data.source import DataSource
from herald_torchrec.data.synthetic import splitmix64

SPLIT_BUCKETS = 10_000
PROBE_LINES = 5  # this many malformed data lines at the start of a file => wrong format
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_LINE_BYTES = 1 << 20  # a "line" longer than this means the file is not a text log
U64_MAX_DEC = b"18446744073709551615"

_GZIP_MAGIC = b"\x1f\x8b"


# ----------------------------------------------------------------------------------------------- files, blocks


def check_file(path: str | Path, kind: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(errno.ENOENT, f"{kind}: data file not found", str(p))
    if p.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"{kind}: expected a data file, got a directory", str(p))
    return p


def open_data(path: Path):
    """Binary file object for `path`; gzip-compressed files (detected by their magic bytes) are decompressed."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == _GZIP_MAGIC:
        return gzip.open(path, "rb")
    return open(path, "rb", buffering=1 << 20)


def _read_blocks(f, path: Path, first_line_no: int, pending: bytes, chunk_bytes: int) -> Iterator[bytes]:
    """Blocks of whole lines (each ending with b'\\n'), about chunk_bytes each, starting with `pending`."""
    carry = pending
    line_no = first_line_no
    while True:
        try:
            block = f.read(chunk_bytes)
        except (EOFError, OSError, zlib.error) as e:  # truncated / corrupt gzip stream
            raise DataFormatError(path, line_no, f"cannot read the file: {e}") from e
        if not block:
            if carry:
                yield carry if carry.endswith(b"\n") else carry + b"\n"
            return
        data = carry + block if carry else block
        cut = data.rfind(b"\n")
        if cut < 0:
            if len(data) > MAX_LINE_BYTES:
                raise DataFormatError(path, line_no, f"a line longer than {MAX_LINE_BYTES} bytes: not a text log")
            carry = data
            continue
        out, carry = data[: cut + 1], data[cut + 1 :]
        if len(carry) > MAX_LINE_BYTES:
            raise DataFormatError(path, line_no, f"a line longer than {MAX_LINE_BYTES} bytes: not a text log")
        line_no += out.count(b"\n")
        yield out


# ------------------------------------------------------------------------------------------------- tokenizing


@dataclass
class Tokens:
    """A block split into fields. Lines with exactly `ncols` fields, none longer than the width limit, are "good";
    their fields are in `mat` (uint8 [m, ncols, W], zero-padded) with byte lengths in `lens` (int64 [m, ncols])."""

    data: np.ndarray  # uint8 view of the block
    nl: np.ndarray  # positions of the line ends
    good: np.ndarray  # bool [n]
    good_idx: np.ndarray  # int64 [m]
    mat: np.ndarray
    lens: np.ndarray

    @property
    def n(self) -> int:
        return int(self.nl.shape[0])

    def line(self, i: int) -> bytes:
        start = int(self.nl[i - 1]) + 1 if i > 0 else 0
        return self.data[start : int(self.nl[i])].tobytes().rstrip(b"\r")


def tokenize(block: bytes, sep: int, ncols: int, width: int) -> Tokens:
    """Vectorized field split of a block of whole lines (every line ends with b'\\n'; a trailing b'\\r' is dropped)."""
    if b"\r" in block:
        block = block.replace(b"\r\n", b"\n")
    size = len(block)
    buf = np.frombuffer(block + bytes(width + 1), dtype=np.uint8)  # padded: a window of `width` never overruns
    text = buf[:size]
    is_nl = text == 10
    nl = np.flatnonzero(is_nl)
    n = nl.shape[0]
    ends = np.flatnonzero(is_nl | (text == sep))
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    flen = ends - starts
    at_nl = is_nl[ends]
    line_of = np.cumsum(at_nl) - at_nl
    good = np.bincount(line_of, minlength=n) == ncols
    too_long = flen > width
    if too_long.any():
        good &= np.bincount(line_of[too_long], minlength=n) == 0
    good_idx = np.flatnonzero(good)
    m = good_idx.shape[0]
    if m == n:
        st, ln = starts, flen
    else:
        sel = good[line_of]
        st, ln = starts[sel], flen[sel]
    w = max(1, int(ln.max())) if ln.size else 1
    mat = sliding_window_view(buf, w)[st]  # gathers [k, w] bytes, fancy indexing copies
    mat[np.arange(w)[None, :] >= ln[:, None]] = 0
    return Tokens(text, nl, good, good_idx, mat.reshape(m, ncols, w), ln.reshape(m, ncols).astype(np.int64))


# ------------------------------------------------------------------------------------------- field parsers


def parse_int(b: np.ndarray, lens: np.ndarray, max_digits: int = 18) -> tuple[np.ndarray, np.ndarray]:
    """Decimal integers `-?[0-9]{1,max_digits}` of fields b (uint8 [k, W]) -> (int64 values, ok). Empty is not ok."""
    k, w = b.shape
    neg = b[:, 0] == 45  # '-'
    start = neg.astype(np.int64)
    ndig = lens - start
    ok = (ndig >= 1) & (ndig <= max_digits)
    v = np.zeros(k, dtype=np.int64)
    for j in range(min(w, max_digits + 1)):
        in_num = (start <= j) & (lens > j)
        if not in_num.any():
            break
        c = b[:, j].astype(np.int64) - 48
        ok &= ~in_num | ((c >= 0) & (c <= 9))
        v = np.where(in_num, v * 10 + c, v)
    return np.where(neg, -v, v), ok


def parse_uint64_ok(b: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """True where the field is an unsigned 64-bit decimal integer (0 .. 2^64-1); never goes through float."""
    k, w = b.shape
    digit = (b >= 48) & (b <= 57)
    in_field = np.arange(w)[None, :] < lens[:, None]
    ok = (lens >= 1) & (lens <= 20) & np.all(digit | ~in_field, axis=1)
    if w >= 20:
        twenty = lens == 20
        if twenty.any():
            s = np.ascontiguousarray(b[:, :20]).view("S20").ravel()
            ok &= ~twenty | (s <= U64_MAX_DEC)
    return ok


def parse_u64(text: str | bytes) -> int:
    """Scalar twin of `parse_uint64_ok` (e.g. an Avazu `id`): Python int, raises ValueError if not a u64 decimal."""
    s = text.decode("ascii", "replace") if isinstance(text, bytes) else text
    if not (1 <= len(s) <= 20 and s.isascii() and s.isdigit()):
        raise ValueError(f"not an unsigned 64-bit decimal integer: {s!r}")
    v = int(s)
    if v >= 1 << 64:
        raise ValueError(f"out of the unsigned 64-bit range: {s!r}")
    return v


_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i


def parse_hex(b: np.ndarray, lens: np.ndarray, max_digits: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Hex strings `[0-9a-fA-F]{1,max_digits}` of fields b (uint8 [k, W]) -> (uint64 values, ok). Empty is not ok."""
    k, w = b.shape
    ok = (lens >= 1) & (lens <= max_digits)
    v = np.zeros(k, dtype=np.uint64)
    for j in range(min(w, max_digits + 1)):
        act = lens > j
        if not act.any():
            break
        nib = _HEX_LUT[b[:, j]]
        ok &= ~act | (nib != 255)
        v = np.where(act, (v << np.uint64(4)) | (nib & 15).astype(np.uint64), v)
    return v, ok


_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


def fnv1a64(b: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """64-bit FNV-1a of each field's bytes (uint8 [k, W], lengths lens): a stable string hash (not Python's salted
    hash()), equal to the textbook FNV-1a of the field's bytes."""
    k, w = b.shape
    h = np.full(k, _FNV_OFFSET, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(w):
            act = lens > j
            if not act.any():
                break
            h = np.where(act, (h ^ b[:, j].astype(np.uint64)) * _FNV_PRIME, h)
    return h


def fields_as_bytes(b: np.ndarray) -> np.ndarray:
    """uint8 [k, W] zero-padded fields -> numpy bytes array 'S{W}' [k]."""
    k, w = b.shape
    return np.ascontiguousarray(b).view(f"S{w}").ravel()


def mix_seed(seed: int) -> np.uint64:
    return splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]


def validation_mask(rows: np.ndarray, val_fraction: float, split_seed: int = 0) -> np.ndarray:
    """The deterministic split: True where data row `rows[i]` belongs to the validation split."""
    threshold = int(round(val_fraction * SPLIT_BUCKETS))
    if threshold <= 0:
        return np.zeros(rows.shape, dtype=bool)
    h = splitmix64(rows.astype(np.uint64) ^ mix_seed(split_seed))
    return (h % np.uint64(SPLIT_BUCKETS)) < np.uint64(threshold)


# ------------------------------------------------------------------------------------------------ accounting


@dataclass
class LoaderStats:
    """What one pass over the file saw. `rows_*` count data lines of the file (both splits: every pass reads the
    whole file), `samples_*` count the samples of this pass's split (MovieLens adds sampled negatives)."""

    split: str = ""
    rows_read: int = 0
    rows_malformed: int = 0
    samples_yielded: int = 0
    samples_dropped: int = 0  # the incomplete trailing global batch
    samples_skipped: int = 0  # the head of the split a resumed run had trained already (`start`)
    batches: int = 0
    first_malformed_line: int | None = None  # 1-based line number in the file
    first_malformed_reason: str | None = None
    complete: bool = False  # the pass reached the end of the file


class _BatchBuffer:
    def __init__(self, global_batch: int) -> None:
        self.b = global_batch
        self.parts: list[Samples] = []
        self.n = 0

    def add(self, s: Samples) -> None:
        if len(s):
            self.parts.append(s)
            self.n += len(s)

    def pop_full(self) -> Iterator[Samples]:
        if self.n < self.b:
            return
        cat = self.parts[0] if len(self.parts) == 1 else Samples.concat(self.parts)
        k = self.n // self.b
        rest = cat.take(slice(k * self.b, self.n))
        self.parts = [rest.copy()] if len(rest) else []
        self.n -= k * self.b
        for i in range(k):
            yield cat.take(slice(i * self.b, (i + 1) * self.b))


# ---------------------------------------------------------------------------------------------- base source


class StreamingSource(DataSource):
    """A `DataSource` over one delimited text log, streamed block by block. Subclasses set `kind`, `sep`,
    `num_columns`, `field_width`, `expected_format` and implement `_parse`, `_explain` (and `_header`, `_build`)."""

    kind = "data"
    sep: int = 9
    num_columns: int = 1
    field_width: int = 32
    expected_format = ""

    def __init__(self, path: str | Path, *, val_fraction: float, split_seed: int, chunk_bytes: int) -> None:
        self.path = check_file(path, self.kind)
        if not 0.0 <= float(val_fraction) <= 1.0:
            raise ValueError(f"{self.kind}: val_fraction must be in [0, 1], got {val_fraction}")
        if int(chunk_bytes) < 1:
            raise ValueError(f"{self.kind}: chunk_bytes must be >= 1, got {chunk_bytes}")
        self.val_fraction = float(val_fraction)
        self.split_seed = int(split_seed)
        self.chunk_bytes = int(chunk_bytes)
        self.stats = LoaderStats(split="none")
        self.pass_stats: dict[str, LoaderStats] = {}

    # ---- hooks
    def _header(self, line: bytes) -> bool:
        """Check the first line; return True if it is a header (consumed), False if it is a data line. Raise
        DataFormatError if the file is clearly another format."""
        return False

    @abstractmethod
    def _parse(self, tok: Tokens) -> tuple[np.ndarray, Any]:
        """(ok: bool over tok's good lines, payload for the ok rows only)."""

    def _build(self, payload: Any, rows: np.ndarray) -> tuple[Samples, np.ndarray]:
        """Payload of the ok rows (global data-row indices `rows`) -> (samples, data row of each sample)."""
        return payload, rows

    def _prepare(self, block: bytes) -> bytes:
        """Rewrite a block of whole lines before it is split (e.g. a multi-byte separator to one byte)."""
        return block

    @abstractmethod
    def _explain(self, line: bytes) -> str:
        """Why a malformed line is malformed (only called for the first offender of a block)."""

    # ---- reading
    def _parsed_blocks(self, stats: LoaderStats) -> Iterator[tuple[np.ndarray, Any]]:
        """(global data-row indices of the ok rows, payload) per block, with malformed-row accounting."""
        with open_data(self.path) as f:
            try:
                first = f.readline(MAX_LINE_BYTES + 1)
            except (EOFError, OSError, zlib.error) as e:
                raise DataFormatError(self.path, 1, f"cannot read the file: {e}") from e
            if not first:
                raise DataFormatError(self.path, 1, "the file is empty", self.expected_format)
            if len(first) > MAX_LINE_BYTES:
                raise DataFormatError(self.path, 1, f"a line longer than {MAX_LINE_BYTES} bytes: not a text log")
            header_lines = 1 if self._header(first.rstrip(b"\r\n")) else 0
            pending = b"" if header_lines else first
            row0 = 0
            leading_bad = 0
            seen_good = False
            for block in _read_blocks(f, self.path, header_lines + 1, pending, self.chunk_bytes):
                tok = tokenize(self._prepare(block), self.sep, self.num_columns, self.field_width)
                n = tok.n
                ok, payload = self._parse(tok)
                bad = ~tok.good
                bad[tok.good_idx[~ok]] = True
                nbad = int(bad.sum())
                if nbad:
                    i = int(np.argmax(bad))
                    if stats.first_malformed_line is None:
                        stats.first_malformed_line = header_lines + row0 + i + 1
                        stats.first_malformed_reason = self._explain(tok.line(i))
                    if not seen_good:
                        leading_bad += n if nbad == n else int(np.argmax(~bad))
                        if leading_bad >= PROBE_LINES:
                            raise DataFormatError(
                                self.path,
                                stats.first_malformed_line,
                                f"the first {PROBE_LINES} data lines are all malformed, this is not a {self.kind} "
                                f"file; line {stats.first_malformed_line}: {stats.first_malformed_reason}",
                                self.expected_format,
                            )
                if nbad < n:
                    seen_good = True
                stats.rows_read += n
                stats.rows_malformed += nbad
                yield row0 + tok.good_idx[ok], payload
                row0 += n
            if row0 == 0:
                raise DataFormatError(self.path, header_lines + 1, "no data rows", self.expected_format)
            if not seen_good:
                raise DataFormatError(
                    self.path,
                    stats.first_malformed_line,
                    f"all {row0} data lines are malformed; line {stats.first_malformed_line}: "
                    f"{stats.first_malformed_reason}",
                    self.expected_format,
                )

    def _probe(self) -> None:
        """Fail fast at construction: header, emptiness and leading-garbage checks on the start of the file."""
        stats = LoaderStats(split="probe")
        with closing(self._parsed_blocks(stats)) as blocks:
            for _ in blocks:
                if stats.rows_read > stats.rows_malformed:
                    break

    def _is_val(self, rows: np.ndarray) -> np.ndarray:
        return validation_mask(rows, self.val_fraction, self.split_seed)

    def _pass(self, split: str, global_batch: int, start: int = 0) -> Iterator[Samples]:
        if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
            raise ValueError(f"{self.kind}: global_batch must be a positive integer, got {global_batch!r}")
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise ValueError(
                f"{self.kind}: start must be an integer >= 0 (samples of the split to skip), got {start!r}"
            )
        return self._stream(split, int(global_batch), int(start))

    def _stream(self, split: str, global_batch: int, start: int = 0) -> Iterator[Samples]:
        """The split's samples from its sample `start` on (the first `start` are read and skipped), cut into
        consecutive global batches."""
        stats = LoaderStats(split=split)
        self.stats = stats
        self.pass_stats[split] = stats
        buf = _BatchBuffer(global_batch)
        for rows, payload in self._parsed_blocks(stats):
            samples, sample_rows = self._build(payload, rows)
            val = self._is_val(sample_rows)
            keep = val if split == "val" else ~val
            kept = samples if keep.all() else samples.take(keep)
            if start:  # still inside the skipped head of the split
                skip = min(start, len(kept))
                start -= skip
                stats.samples_skipped += skip
                kept = kept.take(slice(skip, len(kept)))
            buf.add(kept)
            for batch in buf.pop_full():
                stats.batches += 1
                stats.samples_yielded += len(batch)
                yield batch
        stats.samples_dropped = buf.n
        stats.complete = True
        if stats.rows_malformed:
            print(
                f"warning: {self.kind}: {self.path}: skipped {stats.rows_malformed} malformed of {stats.rows_read} "
                f"rows in the {split} pass; first at line {stats.first_malformed_line}: "
                f"{stats.first_malformed_reason}",
                file=sys.stderr,
            )

    def train_batches(self, global_batch: int, start: int = 0) -> Iterator[Samples]:
        return self._pass("train", global_batch, start)

    def val_batches(self, global_batch: int) -> Iterator[Samples]:
        return self._pass("val", global_batch)


def show(field: bytes, limit: int = 40) -> str:
    """A field for an error message."""
    s = field[:limit].decode("utf-8", "replace")
    return repr(s + ("..." if len(field) > limit else ""))
