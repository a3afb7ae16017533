"""Criteo display-advertising logs: Kaggle `train.txt` and the Terabyte `day_N` files (same 40 columns).

Layout: tab-separated, no header: label (0/1), I1..I13 (integers, may be empty or negative), C1..C26 (8-hex-digit
hashes, may be empty). Streamed block by block (see `_stream.py`); gzip-compressed files are read too.

Features (numpy only):
- dense I1..I13: empty -> 0, x -> log(1 + max(x, 0)) as float32; a non-integer value makes the row malformed.
- categorical C1..C26, table t with R_t = table_rows[t] rows. Rows 0..R_t-2 take the present values,
  row R_t-1 is reserved for the missing value (empty field):
    hash_mode="mod" (default): id = int(hex, 16) % (R_t - 1)
    hash_mode="mix":           id = splitmix64(int(hex, 16)) % (R_t - 1)   (64-bit mixer, spreads structured ids)
    empty field:               id = R_t - 1                                  (`missing_ids[t]`)
  Any 1..16-digit hex string is accepted (Criteo writes 8); anything else makes the row malformed.
- table sizes: `table_rows` (26 sizes, each >= 2) or, by default, the Criteo Kaggle cardinalities + 1 (room for
  the missing row), each capped at `max_rows_per_table` when given.
- label: the first column, exactly "0" or "1".
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import numpy as np

from herald_torchrec.data._stream import (
    DEFAULT_CHUNK_BYTES,
    StreamingSource,
    Tokens,
    parse_hex,
    parse_int,
    show,
)
from herald_torchrec.data.samples import Samples
from herald_torchrec.data.synthetic import CRITEO_KAGGLE_ROWS, splitmix64

CRITEO_NUM_DENSE = 13
CRITEO_NUM_CAT = 26
CRITEO_COLUMNS = 1 + CRITEO_NUM_DENSE + CRITEO_NUM_CAT
HASH_MODES = ("mod", "mix")

_INT_RE = re.compile(rb"-?[0-9]{1,18}")
_HEX_RE = re.compile(rb"[0-9a-fA-F]{1,16}")


def criteo_table_rows(max_rows_per_table: int | None = None) -> list[int]:
    """Default table sizes: Kaggle cardinality + 1 (the missing-value row), capped at max_rows_per_table."""
    rows = [c + 1 for c in CRITEO_KAGGLE_ROWS]
    if max_rows_per_table is not None:
        rows = [min(r, int(max_rows_per_table)) for r in rows]
    return rows


class CriteoSource(StreamingSource):
    """Streaming `DataSource` over a Criteo Kaggle / Terabyte TSV log (see the module docstring)."""

    kind = "criteo"
    sep = 9  # '\t'
    num_columns = CRITEO_COLUMNS
    field_width = 32
    expected_format = "40 tab-separated columns, no header: label, I1..I13 (integers), C1..C26 (hex)"

    def __init__(
        self,
        path: str | Path,
        *,
        table_rows: Sequence[int] | None = None,
        max_rows_per_table: int | None = None,
        hash_mode: str = "mod",
        val_fraction: float = 0.05,
        split_seed: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        super().__init__(path, val_fraction=val_fraction, split_seed=split_seed, chunk_bytes=chunk_bytes)
        if hash_mode not in HASH_MODES:
            raise ValueError(f"criteo: hash_mode must be one of {HASH_MODES}, got {hash_mode!r}")
        if table_rows is not None and max_rows_per_table is not None:
            raise ValueError("criteo: give table_rows or max_rows_per_table, not both")
        if table_rows is not None:
            rows = [int(r) for r in table_rows]
            if len(rows) != CRITEO_NUM_CAT:
                raise ValueError(f"criteo: table_rows needs {CRITEO_NUM_CAT} sizes, got {len(rows)}")
        else:
            if max_rows_per_table is not None and int(max_rows_per_table) < 2:
                raise ValueError(f"criteo: max_rows_per_table must be >= 2, got {max_rows_per_table}")
            rows = criteo_table_rows(max_rows_per_table)
        if min(rows) < 2:
            raise ValueError(f"criteo: every table needs >= 2 rows (one is the missing-value row), got {rows}")
        self.hash_mode = hash_mode
        self.table_rows = rows
        self.feature_names = [f"C{i}" for i in range(1, CRITEO_NUM_CAT + 1)]
        self.dense_names = [f"I{i}" for i in range(1, CRITEO_NUM_DENSE + 1)]
        self.num_dense = CRITEO_NUM_DENSE
        self.missing_ids = [r - 1 for r in rows]
        self._buckets = np.array(self.missing_ids, dtype=np.uint64)
        self._missing = np.array(self.missing_ids, dtype=np.int64)
        self._probe()

    def _parse(self, tok: Tokens) -> tuple[np.ndarray, Samples]:
        mat, lens = tok.mat, tok.lens
        m, _, w = mat.shape
        lab = mat[:, 0, 0]
        ok = (lens[:, 0] == 1) & ((lab == 48) | (lab == 49))

        nd, nc = CRITEO_NUM_DENSE, CRITEO_NUM_CAT
        dl = lens[:, 1 : 1 + nd].reshape(-1)
        dv, dok = parse_int(mat[:, 1 : 1 + nd].reshape(-1, w), dl)
        dempty = dl == 0
        ok &= (dok | dempty).reshape(m, nd).all(axis=1)

        cl = lens[:, 1 + nd :].reshape(-1)
        cv, cok = parse_hex(mat[:, 1 + nd :].reshape(-1, w), cl)
        cempty = (cl == 0).reshape(m, nc)
        ok &= (cok.reshape(m, nc) | cempty).all(axis=1)

        dense = np.log1p(np.maximum(np.where(dempty, 0, dv), 0).astype(np.float64)).astype(np.float32)
        cv = cv.reshape(m, nc)
        if self.hash_mode == "mix":
            cv = splitmix64(cv)
        ids = (cv % self._buckets).astype(np.int64)
        ids = np.where(cempty, self._missing, ids)
        labels = (lab == 49).astype(np.float32)
        return ok, Samples(dense.reshape(m, nd)[ok], ids[ok], labels[ok])

    def _explain(self, line: bytes) -> str:
        f = line.split(b"\t")
        if len(f) != CRITEO_COLUMNS:
            return f"expected {CRITEO_COLUMNS} tab-separated columns (label, I1..I13, C1..C26), got {len(f)}"
        if f[0] not in (b"0", b"1"):
            return f"label must be 0 or 1, got {show(f[0])}"
        for i in range(1, 1 + CRITEO_NUM_DENSE):
            if f[i] and not _INT_RE.fullmatch(f[i]):
                return f"I{i} must be an integer or empty, got {show(f[i])}"
        for j in range(1 + CRITEO_NUM_DENSE, CRITEO_COLUMNS):
            if f[j] and not _HEX_RE.fullmatch(f[j]):
                return f"C{j - CRITEO_NUM_DENSE} must be a hex string or empty, got {show(f[j])}"
        return "malformed row"
