"""MovieLens ratings as an implicit-feedback (NCF-style) click log with two tables, "user" and "item".

Formats (`fmt`, "auto" detects from the first line):
    "csv":   ratings.csv of ML-20M / ML-25M / latest: header `userId,movieId,rating,timestamp`, comma-separated;
    "udata": ML-100K `u.data`: `user item rating timestamp`, tab-separated, no header;
    "dat":   ML-1M / ML-10M `ratings.dat`: `user::item::rating::timestamp`, no header.

Ids: the raw user / movie ids are not contiguous, so the constructor makes one streaming pass over the file (only
the two id maps are held in memory: ~225k entries for ML-25M) and numbers users and items 0..n-1 in first-seen
file order (deterministic). `table_rows = [num_users, num_items]`; `user_map` / `item_map` are raw -> contiguous.

Labels (`positive_threshold`):
    None (default, as NCF): every rating is an interaction, label 1;
    t: rating >= t -> label 1, rating < t -> label 0 (an explicit negative, gets no sampled negatives).
Each positive is followed, in the stream, by `num_negatives` (default 4, as NCF) sampled negatives with label 0:
same user, item drawn uniformly from the other num_items - 1 items (never the positive's own item; it may be another
item the user rated — no per-user history is kept, which would not stream). The draw for negative k (1-based) of
data row i is splitmix64(splitmix64(i XOR mix(neg_seed)) + k): stateless, the same on every run, rank and epoch.
Negatives follow their positive into its split. num_dense = 0 (dense is a float32 [N, 0] array).
Ratings must be numbers, ids and timestamps integers; other rows are malformed.
"""

from __future__ import annotations

import re
from contextlib import closing
from pathlib import Path

import numpy as np

from herald_torchrec.data._stream import (
    DEFAULT_CHUNK_BYTES,
    LoaderStats,
    StreamingSource,
    Tokens,
    fields_as_bytes,
    mix_seed,
    parse_int,
    show,
)
from herald_torchrec.data.errors import DataFormatError
from herald_torchrec.data.samples import Samples
from herald_torchrec.data.synthetic import splitmix64

MOVIELENS_HEADER = b"userId,movieId,rating,timestamp"
FORMATS = ("auto", "csv", "udata", "dat")
_SEP = {"csv": 44, "udata": 9, "dat": 0x1F}  # "dat" turns "::" into \x1f before splitting
_INT_RE = re.compile(rb"-?[0-9]{1,18}")


class MovieLensSource(StreamingSource):
    """Streaming `DataSource` over MovieLens ratings (see the module docstring)."""

    kind = "movielens"
    num_columns = 4
    field_width = 32
    expected_format = (
        "ratings.csv with header 'userId,movieId,rating,timestamp', u.data (tab-separated) or ratings.dat ('::')"
    )

    def __init__(
        self,
        path: str | Path,
        *,
        fmt: str = "auto",
        positive_threshold: float | None = None,
        num_negatives: int = 4,
        neg_seed: int = 0,
        val_fraction: float = 0.05,
        split_seed: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        super().__init__(path, val_fraction=val_fraction, split_seed=split_seed, chunk_bytes=chunk_bytes)
        if fmt not in FORMATS:
            raise ValueError(f"movielens: fmt must be one of {FORMATS}, got {fmt!r}")
        if int(num_negatives) != num_negatives or num_negatives < 0:
            raise ValueError(f"movielens: num_negatives must be an integer >= 0, got {num_negatives}")
        self.fmt = fmt
        self.positive_threshold = None if positive_threshold is None else float(positive_threshold)
        self.num_negatives = int(num_negatives)
        self.neg_seed = int(neg_seed)
        self._neg_mix = mix_seed(self.neg_seed)
        self.sep = _SEP.get(fmt, 44)
        self.feature_names = ["user", "item"]
        self.num_dense = 0
        self.dense_names: list[str] = []
        self.user_map: dict[int, int] = {}
        self.item_map: dict[int, int] = {}
        self.scan_stats = LoaderStats(split="scan")
        self._scan()
        self.table_rows = [len(self.user_map), len(self.item_map)]
        if self.num_negatives and self.table_rows[1] < 2:
            raise ValueError(f"movielens: {self.path} has {self.table_rows[1]} item(s); negatives need >= 2")
        self._ukeys, self._uvals = _sorted_map(self.user_map)
        self._ikeys, self._ivals = _sorted_map(self.item_map)

    # ---- format
    def _header(self, line: bytes) -> bool:
        line = line.removeprefix(b"\xef\xbb\xbf")
        fmt = self.fmt
        if fmt == "auto":
            if line == MOVIELENS_HEADER or b"," in line:
                fmt = "csv"
            elif b"::" in line:
                fmt = "dat"
            elif b"\t" in line:
                fmt = "udata"
            else:
                raise DataFormatError(
                    self.path, 1, f"cannot tell the MovieLens format from the first line {show(line, 80)}",
                    self.expected_format,
                )  # fmt: skip
            self.fmt = fmt
            self.sep = _SEP[fmt]
        if fmt == "csv":
            if line != MOVIELENS_HEADER:
                raise DataFormatError(
                    self.path, 1, f"not the MovieLens ratings.csv header: got {show(line, 80)}",
                    f"header {MOVIELENS_HEADER.decode()!r}",
                )  # fmt: skip
            return True
        return False

    # ---- parsing
    def _parse(self, tok: Tokens):
        mat, lens = tok.mat, tok.lens
        user, uok = parse_int(mat[:, 0], lens[:, 0])
        item, iok = parse_int(mat[:, 1], lens[:, 1])
        _, tok_ok = parse_int(mat[:, 3], lens[:, 3])
        ok = uok & iok & tok_ok & (lens[:, 2] >= 1)
        raw = fields_as_bytes(mat[:, 2])
        try:
            rating = raw.astype(np.float64)
        except ValueError:
            rating = np.array([_float_or_nan(x) for x in raw.tolist()], dtype=np.float64)
        ok &= np.isfinite(rating)
        return ok, (user[ok], item[ok], rating[ok])

    def _explain(self, line: bytes) -> str:
        if self.fmt == "dat":
            line = line.replace(b"::", b"\x1f")
        f = line.split(bytes([self.sep]))
        if len(f) != 4:
            sep = _SEP_NAME[self.fmt]
            return f"expected 4 columns (user, item, rating, timestamp) separated by {sep}, got {len(f)}"
        for name, v in (("user id", f[0]), ("item id", f[1]), ("timestamp", f[3])):
            if not _INT_RE.fullmatch(v):
                return f"{name} must be an integer, got {show(v)}"
        if not np.isfinite(_float_or_nan(f[2])):
            return f"rating must be a number, got {show(f[2])}"
        return "malformed row"

    def _prepare(self, block: bytes) -> bytes:
        return block.replace(b"::", b"\x1f") if self.fmt == "dat" else block

    # ---- the id scan
    def _scan(self) -> None:
        with closing(self._parsed_blocks(self.scan_stats)) as blocks:
            for _, (user, item, _) in blocks:
                _extend_first_seen(self.user_map, user)
                _extend_first_seen(self.item_map, item)
        self.scan_stats.complete = True

    def _build(self, payload, rows: np.ndarray) -> tuple[Samples, np.ndarray]:
        user_raw, item_raw, rating = payload
        u = _lookup(self._ukeys, self._uvals, user_raw)
        i = _lookup(self._ikeys, self._ivals, item_raw)
        if (u < 0).any() or (i < 0).any():
            raise DataFormatError(self.path, None, "an id not seen when the file was scanned: the file changed")
        if self.positive_threshold is None:
            pos = np.ones(u.shape[0], dtype=bool)
        else:
            pos = rating >= self.positive_threshold
        k = self.num_negatives
        if k == 0:
            ids = np.stack([u, i], axis=1)
            return Samples(np.zeros((u.shape[0], 0), np.float32), ids, pos.astype(np.float32)), rows
        group = 1 + k * pos.astype(np.int64)
        rep = np.repeat(np.arange(u.shape[0]), group)
        first = np.cumsum(group) - group
        j = np.arange(rep.shape[0]) - first[rep]  # 0: the rating itself, 1..k: its negatives
        item = i[rep]
        neg = j > 0
        sample_rows = rows[rep]
        item[neg] = self.negative_items(sample_rows[neg], j[neg], item[neg])
        labels = np.where(neg, 0.0, pos[rep]).astype(np.float32)
        ids = np.stack([u[rep], item], axis=1)
        return Samples(np.zeros((rep.shape[0], 0), np.float32), ids, labels), sample_rows

    def negative_items(self, rows: np.ndarray, k: np.ndarray, positive_item: np.ndarray) -> np.ndarray:
        """Item of negative k (1-based) of data row `rows`: uniform over the items other than `positive_item`."""
        n = self.table_rows[1]
        with np.errstate(over="ignore"):
            h = splitmix64(splitmix64(rows.astype(np.uint64) ^ self._neg_mix) + k.astype(np.uint64))
        draw = (h % np.uint64(n - 1)).astype(np.int64)
        return draw + (draw >= positive_item)


_SEP_NAME = {"csv": "commas", "udata": "tabs", "dat": "'::'", "auto": "commas"}


def _float_or_nan(x: bytes) -> float:
    try:
        return float(x)
    except ValueError:
        return float("nan")


def _extend_first_seen(mapping: dict[int, int], raw: np.ndarray) -> None:
    if raw.size == 0:
        return
    uniq, first = np.unique(raw, return_index=True)
    for v in uniq[np.argsort(first, kind="stable")].tolist():
        if v not in mapping:
            mapping[v] = len(mapping)


def _sorted_map(mapping: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    keys = np.fromiter(mapping.keys(), dtype=np.int64, count=len(mapping))
    vals = np.fromiter(mapping.values(), dtype=np.int64, count=len(mapping))
    order = np.argsort(keys)
    return keys[order], vals[order]


def _lookup(keys: np.ndarray, vals: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """raw ids -> contiguous ids, -1 where unknown."""
    if keys.size == 0:
        return np.full(raw.shape, -1, dtype=np.int64)
    pos = np.searchsorted(keys, raw)
    pos = np.minimum(pos, keys.size - 1)
    return np.where(keys[pos] == raw, vals[pos], -1)
