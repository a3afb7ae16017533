"""Criteo Sponsored Search Conversion Log (Criteo AI Lab): the paper's fourth workload (DCN), with a multi-hot bag.

Source: the dataset page, https://ailab.criteo.com/criteo-sponsored-search-conversion-log-dataset/ (file
`CriteoSearchData`, 15,995,634 rows, 90 days of Criteo Predictive Search clicks, sorted by click_timestamp), whose
field list describes every column below and gives -1 as the value of the post-sale columns without a conversion.
The file has no header; the column order is the one public readers of it use: the 23 `names=` of
github.com/columbia/cookiemonster (data/criteo/creators/base_creator.py, which also reads "-1" as the missing value
of every feature column) and of github.com/hypper-team/hypper (its Criteo search reader). (Some write-ups list 22
names, without audience_id: the file has 23 columns.) Layout, 23 tab-separated columns:

     0 Sale                       label: 1 if the click led to a conversion (exactly "0" or "1")
     1 SalesAmountInEuro          post-sale: revenue of the conversion, -1 without one        -> EXCLUDED
     2 time_delay_for_conversion  post-sale: seconds from click to conversion, -1 without one -> EXCLUDED
     3 click_timestamp            integer; the file is sorted by it -> ordering only (see below)
     4 nb_clicks_1week            integer, -1 missing     -> dense log1p(max(x, 0))
     5 product_price              decimal, -1 missing     -> dense log1p(max(x, 0))
     6 product_age_group .. 19 product_id, 21 partner_id, 22 user_id   hashed strings, -1 missing -> single-hot
       (6 product_age_group, 7 device_type, 8 audience_id, 9 product_gender, 10 product_brand,
        11..17 product_category1..7, 18 product_country, 19 product_id)
    20 product_title              space-separated hashed tokens, -1 missing -> the multi-hot bag `product_title`

Why two columns are excluded: SalesAmountInEuro and time_delay_for_conversion are only known *after* the sale and
are -1 exactly when Sale = 0, so either one alone gives the label away (a rule on it reaches AUC 1, and neither
exists at serving time, before the sale). They are never parsed: any content is accepted and ignored.

click_timestamp is not a feature: a model would meet, at validation time, timestamps outside the range it trained
on. It is used only for ordering, which the file already gives (rows are in click order and every pass streams them
in file order, so batches are chronological, as Herald's locality needs). It must still be an integer (a format
check: a file whose fourth column is not one is not this log).

Features (numpy only; streamed block by block with `_stream.py`, gzip files too):
- dense (num_dense = 2): nb_clicks_1week and product_price, missing (-1 or empty) -> 0, x -> log(1 + max(x, 0)) as
  float32 (as criteo.py does). product_price is a decimal number ("149.0", "0.0", "-1"); anything else (or a
  non-integer nb_clicks_1week) makes the row malformed.
- single-hot, 16 tables in file order (feature names above, `product_category1`..`7` for the parenthesized
  names): table t has R_t = table_rows[t] rows; row R_t - 1 is reserved for the missing value ("-1" or empty), the
  others take id = splitmix64(FNV-1a-64(field bytes)) % (R_t - 1) (the values are opaque hashes: hashed as strings,
  stable across runs and machines, like avazu.py).
- multi-hot `product_title` (the last feature): each space-separated token t -> splitmix64(FNV-1a-64(t)) % R_title
  (every row of the title table takes tokens: a missing title is an empty bag, not a reserved row).
- table sizes: the full log's cardinalities are not published, so every table gets `rows_per_table` rows unless
  `table_rows` (17 sizes, feature order) says otherwise.

Memory: the block tokenizer pads every field of a block to its widest field, and titles are the widest fields, so
this loader reads smaller blocks (`chunk_bytes` 1 MiB) and refuses (as a malformed row) a field over 2 KiB.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from herald_torchrec.data._stream import StreamingSource, Tokens, fields_as_bytes, fnv1a64, parse_int, show
from herald_torchrec.data.samples import Bag, Samples
from herald_torchrec.data.synthetic import splitmix64

SEARCH_COLUMNS: tuple[str, ...] = (
    "Sale", "SalesAmountInEuro", "time_delay_for_conversion", "click_timestamp", "nb_clicks_1week", "product_price",
    "product_age_group", "device_type", "audience_id", "product_gender", "product_brand",
    "product_category1", "product_category2", "product_category3", "product_category4", "product_category5",
    "product_category6", "product_category7", "product_country", "product_id", "product_title", "partner_id",
    "user_id",
)  # fmt: skip
LEAK_COLUMNS = ("SalesAmountInEuro", "time_delay_for_conversion")  # known only after the sale: never read
DENSE_COLUMNS = ("nb_clicks_1week", "product_price")
BAG_FEATURE = "product_title"
SINGLE_HOT = tuple(SEARCH_COLUMNS[6:20]) + ("partner_id", "user_id")
_COL = {name: i for i, name in enumerate(SEARCH_COLUMNS)}
_CAT_COLS = np.array([_COL[n] for n in SINGLE_HOT])
_NCOLS = len(SEARCH_COLUMNS)
_MISSING = b"-1"
_INT_RE = re.compile(rb"-?[0-9]{1,18}")
DEFAULT_ROWS_PER_TABLE = 1 << 20
SEARCH_CHUNK_BYTES = 1 << 20


def split_tokens(b: np.ndarray, lens: np.ndarray, sep: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Split each field of b (uint8 [k, W], byte lengths lens) at `sep` bytes; runs of separators and leading or
    trailing ones give no empty tokens. Returns (tokens per field int64 [k], FNV-1a-64 of each token uint64 [T]),
    the tokens in field order, then left to right."""
    k, w = b.shape
    tok = (np.arange(w)[None, :] < lens[:, None]) & (b != sep)
    before = np.zeros_like(tok)
    before[:, 1:] = tok[:, :-1]
    after = np.zeros_like(tok)
    after[:, :-1] = tok[:, 1:]
    rows, starts = np.nonzero(tok & ~before)  # row-major: field order, then left to right
    _, ends = np.nonzero(tok & ~after)
    counts = np.bincount(rows, minlength=k).astype(np.int64)
    if rows.size == 0:
        return counts, np.zeros(0, dtype=np.uint64)
    tlen = (ends - starts + 1).astype(np.int64)
    tw = int(tlen.max())
    flat = np.concatenate([np.ascontiguousarray(b).reshape(-1), np.zeros(tw, dtype=np.uint8)])
    windows = sliding_window_view(flat, tw)[rows * w + starts]
    return counts, fnv1a64(windows, tlen)


def parse_decimal(b: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decimal numbers of fields b (uint8 [k, W]) -> (float64 values, ok). Accepts -?digits[.digits] only (no
    exponent, nan or inf); an empty field is not ok."""
    k, w = b.shape
    if k == 0:
        return np.zeros(0), np.zeros(0, dtype=bool)
    pos = np.arange(w)[None, :]
    inside = pos < lens[:, None]
    digit = (b >= 48) & (b <= 57)
    dot = b == 46
    neg = b[:, 0] == 45
    ndots = (dot & inside).sum(axis=1)
    first = np.where(neg, 1, 0)
    dot_at = np.where(ndots == 1, np.argmax(dot & inside, axis=1), lens)
    shape_ok = np.all(~inside | digit | (dot & (pos == dot_at[:, None])) | ((pos == 0) & neg[:, None]), axis=1)
    ok = shape_ok & (ndots <= 1) & (dot_at > first) & (dot_at != lens - 1) & (lens <= 32)
    vals = np.zeros(k, dtype=np.float64)
    if ok.any():  # numpy's own string -> float conversion, on fields already known to be plain decimals
        vals[ok] = fields_as_bytes(b[ok]).astype(np.float64)
    return vals, ok


class CriteoSearchSource(StreamingSource):
    """Streaming `DataSource` over the Criteo Sponsored Search Conversion Log (see the module docstring):
    16 single-hot features, then the `product_title` bag; 2 dense features; label Sale."""

    kind = "criteo_search"
    sep = 9  # '\t'
    num_columns = _NCOLS
    field_width = 2048
    expected_format = (
        "23 tab-separated columns, no header: Sale (0/1), SalesAmountInEuro, time_delay_for_conversion, "
        "click_timestamp (integer), nb_clicks_1week (integer), product_price (number), 17 hashed columns"
    )

    def __init__(
        self,
        path: str | Path,
        *,
        table_rows: Sequence[int] | None = None,
        rows_per_table: int = DEFAULT_ROWS_PER_TABLE,
        val_fraction: float = 0.05,
        split_seed: int = 0,
        chunk_bytes: int = SEARCH_CHUNK_BYTES,
    ) -> None:
        super().__init__(path, val_fraction=val_fraction, split_seed=split_seed, chunk_bytes=chunk_bytes)
        names = list(SINGLE_HOT) + [BAG_FEATURE]
        if table_rows is not None:
            rows = [int(r) for r in table_rows]
            if len(rows) != len(names):
                raise ValueError(f"criteo_search: table_rows needs {len(names)} sizes ({names}), got {len(rows)}")
        else:
            rows = [int(rows_per_table)] * len(names)
        if min(rows) < 2:
            raise ValueError(f"criteo_search: every table needs >= 2 rows (rows_per_table / table_rows), got {rows}")
        self.feature_names = names
        self.bag_features = (BAG_FEATURE,)
        self.table_rows = rows
        self.dense_names = list(DENSE_COLUMNS)
        self.num_dense = len(DENSE_COLUMNS)
        self.missing_ids = [r - 1 for r in rows[: len(SINGLE_HOT)]]
        self._buckets = np.array(self.missing_ids, dtype=np.uint64)
        self._missing = np.array(self.missing_ids, dtype=np.int64)
        self._title_rows = np.uint64(rows[-1])
        self._probe()

    def _parse(self, tok: Tokens) -> tuple[np.ndarray, Samples]:
        mat, lens = tok.mat, tok.lens
        m, _, w = mat.shape
        sale = mat[:, 0, 0]
        ok = (lens[:, 0] == 1) & ((sale == 48) | (sale == 49))
        _, ts_ok = parse_int(mat[:, _COL["click_timestamp"]], lens[:, _COL["click_timestamp"]])
        ok &= ts_ok

        def missing(col: int) -> np.ndarray:  # "-1" (the log's marker) or an empty field
            if w < 2:
                return lens[:, col] == 0
            f = mat[:, col]
            return (lens[:, col] == 0) | ((lens[:, col] == 2) & (f[:, 0] == 45) & (f[:, 1] == 49))

        c, p = _COL["nb_clicks_1week"], _COL["product_price"]
        clicks, cok = parse_int(mat[:, c], lens[:, c])
        price, pok = parse_decimal(mat[:, p], lens[:, p])
        cmiss, pmiss = missing(c), missing(p)
        ok &= (cok | cmiss) & (pok | pmiss)
        raw = np.stack([np.where(cmiss, 0, clicks).astype(np.float64), np.where(pmiss, 0.0, price)], axis=1)
        dense = np.log1p(np.maximum(raw, 0.0)).astype(np.float32)

        ncat = _CAT_COLS.shape[0]
        cl = lens[:, _CAT_COLS]
        cw = max(1, int(cl.max())) if m else 1  # the ids are narrow; titles widen the block, not them
        h = fnv1a64(mat[:, _CAT_COLS, :cw].reshape(-1, cw), cl.reshape(-1)).reshape(m, ncat)
        ids = (splitmix64(h) % self._buckets).astype(np.int64)
        cmissing = np.stack([missing(int(col)) for col in _CAT_COLS], axis=1)
        ids = np.where(cmissing, self._missing, ids)

        t = _COL["product_title"]
        tlens = np.where(missing(t), 0, lens[:, t])
        counts, th = split_tokens(mat[:, t], tlens)
        title = Bag(counts, (splitmix64(th) % self._title_rows).astype(np.int64))
        labels = (sale == 49).astype(np.float32)
        samples = Samples(dense, ids, labels, {BAG_FEATURE: title})
        return ok, samples.take(ok)

    def _explain(self, line: bytes) -> str:
        f = line.split(b"\t")
        if len(f) != _NCOLS:
            return f"expected {_NCOLS} tab-separated columns (Sale, ..., partner_id, user_id), got {len(f)}"
        if f[0] not in (b"0", b"1"):
            return f"Sale must be 0 or 1, got {show(f[0])}"
        if not _INT_RE.fullmatch(f[_COL["click_timestamp"]]):
            return f"click_timestamp must be an integer, got {show(f[_COL['click_timestamp']])}"
        clicks = f[_COL["nb_clicks_1week"]]
        if clicks and not _INT_RE.fullmatch(clicks):
            return f"nb_clicks_1week must be an integer or -1, got {show(clicks)}"
        price = f[_COL["product_price"]]
        if price and not re.fullmatch(rb"-?[0-9]+(\.[0-9]+)?", price):
            return f"product_price must be a decimal number or -1, got {show(price)}"
        for name, v in zip(SEARCH_COLUMNS, f):
            if len(v) > self.field_width:
                return f"{name} is longer than {self.field_width} bytes"
        return "malformed row"


__all__ = ["CriteoSearchSource", "LEAK_COLUMNS", "SEARCH_COLUMNS", "SINGLE_HOT", "split_tokens", "parse_decimal"]
