"""One global batch as the scheduler sees it: the ids of every table in jagged (CSR) form, int64 throughout.

`GlobalBatch` holds, per table t, `offsets[t]` (int64 [N+1], non-decreasing, offsets[0] = 0) and `values[t]`
(int64 [offsets[t][-1]]): sample i reads rows `values[t][offsets[t][i]:offsets[t][i+1]]` of table t. Single-hot
data (the `Samples.ids` [N, T] array) is the special case offsets = arange(N+1).

The policies work on a *flat* view of all (sample, key) pairs in one global row space (`gid` = row + offset of its
table, see `TableLayout`), which is computed once per batch and cached on the object: the simulator and the data
plane pass the same object as lookahead and, later, as the current batch.
Ids never pass through float (REFERENCE: Herald's released code rounds ids above 2^24).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class TableLayout:
    """Sizes of the managed tables and their place in one global row space (gid = offsets[t] + row)."""

    def __init__(self, table_rows: Sequence[int]) -> None:
        rows = tuple(int(r) for r in table_rows)
        if len(rows) == 0:
            raise ValueError("TableLayout: need at least one table")
        if min(rows) < 1:
            raise ValueError(f"TableLayout: every table needs >= 1 row, got {rows}")
        self.table_rows = rows
        self.offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TableLayout) and other.table_rows == self.table_rows

    def __hash__(self) -> int:
        return hash(self.table_rows)

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    @property
    def total_rows(self) -> int:
        return int(self.offsets[-1])

    def table_of(self, gid: np.ndarray) -> np.ndarray:
        """table index of global rows (int64)."""
        return np.searchsorted(self.offsets, gid, side="right").astype(np.int64) - 1

    def split(self, gid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(table, row) of global rows."""
        t = self.table_of(gid)
        return t, gid - self.offsets[t]


class GlobalBatch:
    """Ids of one global batch of N samples over T tables, CSR per table (int64).

    Build it with `from_dense` (single-hot [N, T] ids, e.g. `Samples.ids`), `from_samples`, or the constructor
    (jagged). Validation rejects negative or out-of-range ids, non-int64 data and malformed offsets with a
    ValueError that names the table.
    """

    def __init__(
        self,
        offsets: Sequence[np.ndarray],
        values: Sequence[np.ndarray],
        table_rows: Sequence[int] | TableLayout,
        index: int | None = None,
    ) -> None:
        layout = table_rows if isinstance(table_rows, TableLayout) else TableLayout(tuple(table_rows))
        T = layout.num_tables
        if len(offsets) != T or len(values) != T:
            raise ValueError(f"GlobalBatch: expected {T} tables, got {len(offsets)} offsets and {len(values)} values")
        n = None
        offs: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        for t in range(T):
            off, val = np.asarray(offsets[t]), np.asarray(values[t])
            for name, a in (("offsets", off), ("values", val)):
                if a.dtype != np.int64:
                    raise ValueError(f"GlobalBatch: table {t} {name} must be int64, got {a.dtype}")
                if a.ndim != 1:
                    raise ValueError(f"GlobalBatch: table {t} {name} must be 1-D, got shape {a.shape}")
            if off.shape[0] < 2:
                raise ValueError(f"GlobalBatch: table {t} offsets need N+1 >= 2 entries, got {off.shape[0]}")
            if n is None:
                n = off.shape[0] - 1
            elif off.shape[0] - 1 != n:
                raise ValueError(f"GlobalBatch: table {t} has {off.shape[0] - 1} samples, table 0 has {n}")
            if off[0] != 0 or off[-1] != val.shape[0] or (np.diff(off) < 0).any():
                raise ValueError(
                    f"GlobalBatch: table {t} offsets must start at 0, be non-decreasing and end at len(values)"
                    f" = {val.shape[0]}"
                )
            _check_range(val, layout.table_rows[t], t)
            offs.append(off)
            vals.append(val)
        self._set(layout, offs, vals, int(n), index)  # type: ignore[arg-type]

    def _set(
        self, layout: TableLayout, offsets: list[np.ndarray], values: list[np.ndarray], n: int, index: int | None
    ) -> None:
        """Every attribute of a batch, from checked arrays (the constructor's and `from_dense`'s common end)."""
        self.layout = layout
        self.offsets: list[np.ndarray] = offsets
        self.values: list[np.ndarray] = values
        self.num_samples: int = n
        self.index = index
        self._cache: dict = {}

    # ---- constructors -----------------------------------------------------------------------------------
    @classmethod
    def from_dense(
        cls,
        ids: np.ndarray,
        table_rows: Sequence[int] | TableLayout,
        index: int | None = None,
        *,
        columns: Sequence[np.ndarray] | None = None,
        range_checked: bool = False,
    ):
        """Single-hot ids [N, T] (int64) -> CSR with one id per sample and table. A caller that holds each table's
        ids as a contiguous int64 array already passes them as `columns` (no transposed copy), and one that has
        range-checked every id says so (`range_checked`: the input stage checks them on the rank that drew them)."""
        ids = np.asarray(ids)
        if ids.dtype != np.int64:
            raise ValueError(f"GlobalBatch.from_dense: ids must be int64 (never float), got {ids.dtype}")
        if ids.ndim != 2 or ids.shape[0] < 1:
            raise ValueError(f"GlobalBatch.from_dense: ids must be [N >= 1, T], got shape {ids.shape}")
        layout = table_rows if isinstance(table_rows, TableLayout) else TableLayout(tuple(table_rows))
        if ids.shape[1] != layout.num_tables:
            raise ValueError(f"GlobalBatch.from_dense: ids have {ids.shape[1]} tables, layout has {layout.num_tables}")
        # the constructor's range checks, all tables at once (per table, they cost more than the rest of the batch);
        # the CSR of single-hot ids is well-formed by construction
        if not range_checked:
            bad = np.flatnonzero((ids.min(axis=0) < 0) | (ids.max(axis=0) >= np.asarray(layout.table_rows)))
            if bad.shape[0]:
                _check_range(ids[:, bad[0]], layout.table_rows[bad[0]], int(bad[0]))  # raises, naming the table
        n = ids.shape[0]
        if columns is None:
            columns = list(np.ascontiguousarray(ids.T))
        elif len(columns) != layout.num_tables or any(c.shape != (n,) or c.dtype != np.int64 for c in columns):
            raise ValueError(f"GlobalBatch.from_dense: columns must be {layout.num_tables} int64 arrays of {n} ids")
        batch = cls.__new__(cls)
        batch._set(layout, [np.arange(n + 1, dtype=np.int64)] * layout.num_tables, list(columns), n, index)
        batch._cache["dense"] = np.ascontiguousarray(ids)
        return batch

    @classmethod
    def from_samples(cls, samples, table_rows: Sequence[int] | TableLayout, index: int | None = None):
        """From a `herald_torchrec.data.samples.Samples` block (single-hot ids)."""
        return cls.from_dense(samples.ids, table_rows, index)

    # ---- views ------------------------------------------------------------------------------------------
    @property
    def num_tables(self) -> int:
        return self.layout.num_tables

    def single_hot(self) -> bool:
        return "dense" in self._cache or all(
            v.shape[0] == self.num_samples and np.array_equal(o, np.arange(self.num_samples + 1))
            for o, v in zip(self.offsets, self.values)
        )

    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All (sample, key) pairs: (sample int64, table int64, gid int64), cached.

        Single-hot batches are laid out sample-major ([N, T] order); jagged ones table-major.
        """
        if "flat" not in self._cache:
            off = self.layout.offsets
            if "dense" in self._cache:
                d = self._cache["dense"]
                n, T = d.shape
                gid = (d + off[:-1][None, :]).ravel()
                smp = np.repeat(np.arange(n, dtype=np.int64), T)
                tab = np.tile(np.arange(T, dtype=np.int64), n)
            else:
                smps, tabs, gids = [], [], []
                for t in range(self.num_tables):
                    cnt = np.diff(self.offsets[t])
                    smps.append(np.repeat(np.arange(self.num_samples, dtype=np.int64), cnt))
                    tabs.append(np.full(self.values[t].shape[0], t, dtype=np.int64))
                    gids.append(self.values[t] + off[t])
                smp, tab, gid = np.concatenate(smps), np.concatenate(tabs), np.concatenate(gids)
            self._cache["flat"] = (smp, tab, gid)
        return self._cache["flat"]

    def take(self, samples: np.ndarray) -> "GlobalBatch":
        """A new batch made of the given samples (in that order)."""
        samples = np.asarray(samples, dtype=np.int64)
        offs, vals = [], []
        for t in range(self.num_tables):
            o, v = self.offsets[t], self.values[t]
            cnt = o[samples + 1] - o[samples]
            starts = np.repeat(o[samples], cnt)
            within = np.arange(int(cnt.sum()), dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
            offs.append(np.concatenate([[0], np.cumsum(cnt)]).astype(np.int64))
            vals.append(v[starts + within])
        return GlobalBatch(offs, vals, self.layout, self.index)

    def __repr__(self) -> str:
        return f"GlobalBatch(index={self.index}, samples={self.num_samples}, tables={self.num_tables})"


def _check_range(val: np.ndarray, rows: int, t: int) -> None:
    if val.shape[0] == 0:
        return
    lo, hi = int(val.min()), int(val.max())
    if lo < 0:
        raise ValueError(f"GlobalBatch: table {t} has a negative id ({lo})")
    if hi >= rows:
        raise ValueError(f"GlobalBatch: table {t} has id {hi} out of range (table has {rows} rows)")
