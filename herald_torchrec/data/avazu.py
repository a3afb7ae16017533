"""Avazu CTR log (Kaggle `train` / `train.csv`): CSV with a header, 24 columns, no quoting.

    id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,app_category,device_id,
    device_ip,device_model,device_type,device_conn_type,C14,C15,C16,C17,C18,C19,C20,C21

- `id`: an unsigned 64-bit decimal (values above 2^63 exist). Validated without ever going through float (a row
  whose id is not a u64 is malformed); it is not a feature.
- label: `click`, exactly "0" or "1".
- `hour` (YYMMDDHH, 20YY) gives hour of day (0..23) and weekday (0..6, Monday = 0, from the calendar date); an
  impossible date or hour makes the row malformed. With `time_features`:
    "both" (default): two exact categorical tables `hour_of_day` (24 rows) and `weekday` (7 rows) first, and the
        same two values as dense features hour/23 and weekday/6 (num_dense = 2; models with a dense tower work);
    "categorical": the two tables only, num_dense = 0 (dense is a float32 [N, 0] array);
    "dense": the two dense features only, no time tables.
- the other 21 columns (C1 .. C21 in header order) are categorical, hashed as strings:
    id = splitmix64(FNV-1a-64(field bytes)) % table_rows[field]
  (stable across runs and machines; no missing-value row: an empty field is hashed like any other string).
  Default table size per field: min(max_rows_per_table, next power of two >= 2 x its cardinality in the full
  40.4M-row train set), max_rows_per_table = 2^20 (None: no cap); the small fields get a table about twice their
  cardinality, so few collisions; device_id / device_ip are capped. `table_rows` overrides: 21 sizes (the hashed
  fields), or one size per `feature_names` entry (then hour_of_day >= 24 and weekday >= 7).
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Sequence

import numpy as np

from herald_torchrec.data._stream import (
    DEFAULT_CHUNK_BYTES,
    StreamingSource,
    Tokens,
    fnv1a64,
    parse_int,
    parse_u64,
    parse_uint64_ok,
    show,
)
from herald_torchrec.data.errors import DataFormatError
from herald_torchrec.data.samples import Samples
from herald_torchrec.data.synthetic import splitmix64

AVAZU_COLUMNS: tuple[str, ...] = (
    "id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id", "app_domain",
    "app_category", "device_id", "device_ip", "device_model", "device_type", "device_conn_type",
    "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21",
)  # fmt: skip
AVAZU_HASHED: tuple[str, ...] = AVAZU_COLUMNS[3:]
# Distinct values per field in the full Avazu train set (40,428,967 rows; sum ~9.45 M, REFERENCE.md).
AVAZU_CARDINALITIES: dict[str, int] = {
    "C1": 7, "banner_pos": 7, "site_id": 4737, "site_domain": 7745, "site_category": 26, "app_id": 8552,
    "app_domain": 559, "app_category": 36, "device_id": 2686408, "device_ip": 6729486, "device_model": 8251,
    "device_type": 5, "device_conn_type": 4, "C14": 2626, "C15": 8, "C16": 9, "C17": 435, "C18": 4, "C19": 68,
    "C20": 172, "C21": 60,
}  # fmt: skip
TIME_FEATURES = ("both", "categorical", "dense")
_HEADER = ",".join(AVAZU_COLUMNS).encode()
_NCOLS = len(AVAZU_COLUMNS)
_NHASH = len(AVAZU_HASHED)


def avazu_table_rows(max_rows_per_table: int | None = 1 << 20) -> list[int]:
    """Default sizes of the 21 hashed tables (header order); None = no cap."""
    out = []
    for name in AVAZU_HASHED:
        want = 1 << max(1, (2 * AVAZU_CARDINALITIES[name] - 1).bit_length())
        out.append(want if max_rows_per_table is None else min(int(max_rows_per_table), want))
    return out


def decode_hour(hour: int) -> tuple[int, int] | None:
    """YYMMDDHH -> (hour of day, weekday with Monday = 0), None if it is not a real date and hour."""
    yy, mm, dd, hh = hour // 1_000_000, hour // 10_000 % 100, hour // 100 % 100, hour % 100
    if hour < 0 or hh > 23:
        return None
    try:
        return hh, datetime.date(2000 + yy, mm, dd).weekday()
    except ValueError:
        return None


class AvazuSource(StreamingSource):
    """Streaming `DataSource` over the Avazu CSV log (see the module docstring)."""

    kind = "avazu"
    sep = 44  # ','
    num_columns = _NCOLS
    field_width = 64
    expected_format = f"the Avazu CSV header {_HEADER.decode()!r} and 24 comma-separated columns"

    def __init__(
        self,
        path: str | Path,
        *,
        table_rows: Sequence[int] | None = None,
        max_rows_per_table: int | None = 1 << 20,
        time_features: str = "both",
        val_fraction: float = 0.05,
        split_seed: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        super().__init__(path, val_fraction=val_fraction, split_seed=split_seed, chunk_bytes=chunk_bytes)
        if time_features not in TIME_FEATURES:
            raise ValueError(f"avazu: time_features must be one of {TIME_FEATURES}, got {time_features!r}")
        self.time_features = time_features
        time_tables = time_features in ("both", "categorical")
        names = (["hour_of_day", "weekday"] if time_tables else []) + list(AVAZU_HASHED)
        if table_rows is None:
            if max_rows_per_table is not None and int(max_rows_per_table) < 1:
                raise ValueError(f"avazu: max_rows_per_table must be >= 1, got {max_rows_per_table}")
            hashed = avazu_table_rows(max_rows_per_table)
        else:
            rows = [int(r) for r in table_rows]
            if len(rows) == len(names) and time_tables:
                if rows[0] < 24 or rows[1] < 7:
                    raise ValueError(f"avazu: hour_of_day needs >= 24 rows and weekday >= 7, got {rows[:2]}")
                rows = rows[2:]
            if len(rows) != _NHASH:
                raise ValueError(
                    f"avazu: table_rows needs {_NHASH} sizes (the hashed fields) or {len(names)}, got {len(rows)}"
                )
            hashed = rows
        if min(hashed) < 1:
            raise ValueError(f"avazu: table sizes must be >= 1, got {hashed}")
        self.feature_names = names
        self.table_rows = ([24, 7] if time_tables else []) + hashed
        self.num_dense = 2 if time_features in ("both", "dense") else 0
        self.dense_names = ["hour_of_day", "weekday"] if self.num_dense else []
        self._buckets = np.array(hashed, dtype=np.uint64)
        self._hour_cache: dict[int, tuple[int, int] | None] = {}
        self._probe()

    def _header(self, line: bytes) -> bool:
        got = line.removeprefix(b"\xef\xbb\xbf")
        if got != _HEADER:
            raise DataFormatError(
                self.path, 1, f"not the Avazu header: got {show(got, 120)}", f"header {_HEADER.decode()!r}"
            )
        return True

    def _parse(self, tok: Tokens) -> tuple[np.ndarray, Samples]:
        mat, lens = tok.mat, tok.lens
        m, _, w = mat.shape
        ok = parse_uint64_ok(mat[:, 0], lens[:, 0])
        click = mat[:, 1, 0]
        ok &= (lens[:, 1] == 1) & ((click == 48) | (click == 49))

        hour, hok = parse_int(mat[:, 2], lens[:, 2])
        ok &= hok & (lens[:, 2] == 8)
        uniq, inv = np.unique(np.where(ok, hour, -1), return_inverse=True)
        table = np.empty((uniq.shape[0], 3), dtype=np.int64)
        for k, h in enumerate(uniq.tolist()):
            if h not in self._hour_cache:
                self._hour_cache[h] = decode_hour(h) if h >= 0 else None
            d = self._hour_cache[h]
            table[k] = (1, d[0], d[1]) if d is not None else (0, 0, 0)
        tv = table[inv.reshape(-1)]
        ok &= tv[:, 0] == 1
        hod, wday = tv[:, 1], tv[:, 2]

        h = fnv1a64(mat[:, 3:].reshape(-1, w), lens[:, 3:].reshape(-1))
        hashed = (splitmix64(h).reshape(m, _NHASH) % self._buckets).astype(np.int64)
        if self.time_features == "dense":
            ids = hashed
        else:
            ids = np.concatenate([hod[:, None], wday[:, None], hashed], axis=1)
        if self.num_dense:
            dense = np.stack([hod / 23.0, wday / 6.0], axis=1).astype(np.float32)
        else:
            dense = np.zeros((m, 0), dtype=np.float32)
        labels = (click == 49).astype(np.float32)
        return ok, Samples(dense[ok], ids[ok], labels[ok])

    def _explain(self, line: bytes) -> str:
        f = line.split(b",")
        if len(f) != _NCOLS:
            return f"expected {_NCOLS} comma-separated columns, got {len(f)}"
        try:
            parse_u64(f[0])
        except ValueError:
            return f"id must be an unsigned 64-bit integer, got {show(f[0])}"
        if f[1] not in (b"0", b"1"):
            return f"click must be 0 or 1, got {show(f[1])}"
        if not (len(f[2]) == 8 and f[2].isdigit() and decode_hour(int(f[2])) is not None):
            return f"hour must be YYMMDDHH (a real date and hour), got {show(f[2])}"
        for name, v in zip(AVAZU_COLUMNS, f):
            if len(v) > self.field_width:
                return f"{name} is longer than {self.field_width} bytes"
        return "malformed row"
