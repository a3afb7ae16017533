"""`RowAccessMixin`: host-side reads and writes of a `RowStore`'s rows and optimizer states, cache-coherent on CUDA.

Rows leave and enter the TBE's storage behind its back (moves, shared values, checkpoints, the baselines' caches).
That half of the store is here, mixed into `RowStore` (row_store.py), so that row_store.py holds the TBE, the slot
layout and the directory. `RowStore.__init__` sets what is read here: the TBE (`tbe`), its weight and state views
(`_weights`, `_states`, and `_flat` / `_rows2d` from `_flat_layout` / `_row_layout`), `_cached` and the sizes
(`slot_base`, `dims_arr`, `state_widths`).

Weights and optimizer states are read and written for many tables at once (`read_packed`, `write_packed`) through
flat views of the TBE's own storage, in which each table is a block of [local_rows, width] rows.

Cache coherence on CUDA: there the tables are `EmbeddingLocation.MANAGED_CACHING` (UVM + an HBM cache whose lines
may be newer than the UVM rows behind them). `split_embedding_weights()` views the UVM backing store, so host-side
access works row by row: before rows are read, the cache lines that hold exactly those rows are written back
(`_sync_rows`); after rows are written behind the TBE's back, exactly their cache lines are invalidated
(`_invalidate_rows`; the rest of the cache, and its LRU state, stay warm). Lines are found with FBGEMM's own
`lxu_cache_lookup` over the TBE's linear cache index (table's cache base + local slot). `_begin_access()` /
`_end_write()` (TBE `flush()` / `reset_cache_states()`: the whole cache) remain for whole-table access (`weights`).
All of this is a no-op on CPU (`EmbeddingLocation.HOST`, no cache). FBGEMM caches weights only, never optimizer
states (per row or per element), so those need nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from herald_torchrec.distributed import host_kernels
from herald_torchrec.distributed.storage.row_layout import exclusive_cumsum, ragged_arange


class RowAccessMixin:
    """Row reads and writes of `RowStore` (see the module doc)."""

    def _flat_layout(self) -> list[tuple[torch.Tensor, np.ndarray, np.ndarray]] | None:
        """Flat views of the weights and of each optimizer-state tensor, each as (flat tensor over its whole storage,
        element offset of every table's block, row width of every table); None if the TBE's views do not all share
        one row-major storage per kind (then the per-table path is taken)."""
        kinds = [list(self._weights)] + [
            [self._states[t][j] for t in range(self.num_tables)] for j in range(len(self._states[0]))
        ]
        if any(len(st) != len(self._states[0]) for st in self._states):
            return None
        out = []
        for views in kinds:
            v0 = views[0]
            width = np.array([1 if v.dim() == 1 else int(v.shape[1]) for v in views], dtype=np.int64)
            ok = all(
                v.untyped_storage().data_ptr() == v0.untyped_storage().data_ptr()
                and v.dtype == v0.dtype
                and v.is_contiguous()
                for v in views
            )
            if not ok:
                return None
            n = v0.untyped_storage().nbytes() // v0.element_size()
            flat = v0.as_strided((n,), (1,), 0)
            out.append((flat, np.array([v.storage_offset() for v in views], dtype=np.int64), width))
        return out

    def _row_layout(self) -> list[tuple[torch.Tensor, np.ndarray]] | None:
        """Per storage kind (weights, then each optimizer state): (a [rows, width] view of its whole storage, the row
        of every table's slot 0 in it), when every table of the kind has one row width and its block starts on a row
        boundary (the common case: one dim for all tables). Host reads and writes of rows are then row gathers and
        scatters, with index arrays `width` times smaller than element positions. None otherwise."""
        if self._flat is None:
            return None
        out = []
        for flat, off, w in self._flat:
            w0 = int(w[0])
            if (w != w0).any() or (off % w0).any():
                return None
            n = (flat.shape[0] // w0) * w0
            out.append((flat[:n].view(-1, w0), off // w0))
        return out

    # ------------------------------------------------------------- host access
    def packed_widths(self, tables: np.ndarray, with_state: bool = True) -> np.ndarray:
        """Float32 words per item of `read_packed` / `write_packed`: the row (dim floats; with_state and FP16 rows:
        dim / 2 words, two float16 per word), plus its optimizer state if `with_state`."""
        if not with_state:
            return self.dims_arr[tables]
        return self._row_words[tables] + np.asarray(self.state_widths, dtype=np.int64)[tables]

    @property
    def _half_rows(self) -> bool:
        """Rows in float16: a moved row travels as its float16 bits, two to a float32 word (`read_packed`)."""
        return self.row_dtype == torch.float16

    @property
    def _row_words(self) -> np.ndarray:
        """Float32 words of a moved row per table: dim, or dim / 2 for float16 rows (dims are multiples of 4)."""
        return self.dims_arr // 2 if self._half_rows else self.dims_arr

    def unpack_rows(self, t: int, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Moved rows of table t as `read_packed` (with state) packs them, [n, packed width] float32, split into
        (rows [n, dim] in the rows' own dtype, optimizer state [n, state width] float32): bit for bit."""
        words = int(self._row_words[t])
        rows = block[:, :words]
        if self._half_rows:
            rows = rows.contiguous().view(torch.float16)
        return rows, block[:, words:]

    def _begin_access(self) -> None:
        """Whole-table host access (`weights`): write every cache line back (CUDA caching) first."""
        self.tbe.flush()

    def _end_write(self) -> None:
        """After writing whole tables behind the TBE's back: invalidate the whole cache (CUDA caching)."""
        self.tbe.reset_cache_states()

    def _cache_locations(self, tables: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        """Flat HBM-cache line (row of `lxu_cache_weights`) holding each (table, slot), -1 where none does (int64)."""
        lin = torch.from_numpy(self.slot_base[tables] + slots).to(self.tbe.lxu_cache_state.device)
        return torch.ops.fbgemm.lxu_cache_lookup(lin, self.tbe.lxu_cache_state, int(self.slot_base[-1])).long()

    def _sync_rows(self, tables: np.ndarray, slots: np.ndarray) -> None:
        """Before host reads of these rows: write back the cache lines that hold them (their UVM copy may be stale).
        The lines stay valid (now equal to UVM). No-op without a cache."""
        if not self._cached or tables.shape[0] == 0:
            return
        loc = self._cache_locations(tables, slots)
        hit = torch.nonzero(loc >= 0).squeeze(1)
        if hit.numel() == 0:
            return
        hit_np = hit.cpu().numpy()
        t, sl, d = tables[hit_np], slots[hit_np], self.dims_arr[tables[hit_np]]
        dev = loc.device
        item = torch.from_numpy(np.repeat(np.arange(t.shape[0], dtype=np.int64), d)).to(dev)
        col = torch.from_numpy(ragged_arange(np.zeros_like(d), d)).to(dev)
        cache_w = self.tbe.lxu_cache_weights
        src = cache_w.view(-1).index_select(0, loc[hit][item] * cache_w.shape[1] + col)
        with torch.no_grad():
            if self._flat is not None:
                flat, off, w = self._flat[0]
                dst = torch.from_numpy(ragged_arange(off[t] + sl * w[t], w[t])).to(dev)
                flat.index_copy_(0, dst, src.to(flat.dtype))
            else:  # pragma: no cover - per-table views
                start = exclusive_cumsum(d)
                for tt in np.unique(t).tolist():
                    m = np.flatnonzero(t == tt)
                    pos = torch.from_numpy(ragged_arange(start[m], d[m])).to(dev)
                    idx = torch.from_numpy(sl[m]).to(dev)
                    self._weights[tt].index_copy_(0, idx, src[pos].view(m.size, -1).to(self._weights[tt]))

    def _invalidate_rows(self, tables: np.ndarray, slots: np.ndarray) -> None:
        """After writing these rows behind the TBE's back: drop the cache lines that hold them (an invalid line is
        neither read nor flushed, so the next lookup of the row fetches the new UVM copy). No-op without a cache."""
        if not self._cached or tables.shape[0] == 0:
            return
        loc = self._cache_locations(tables, slots)
        self.tbe.lxu_cache_state.view(-1).index_fill_(0, loc[loc >= 0], -1)

    def cache_stats(self) -> torch.Tensor | None:
        """FBGEMM's cumulative HBM-cache counters [calls, requested ids, unique ids, unique misses, conflict unique
        misses, conflict misses] (int64), or None when not gathered (`cache_stats=False`, or no cache)."""
        return self.tbe.uvm_cache_stats.clone() if getattr(self.tbe, "gather_uvm_cache_stats", False) else None

    def weights(self, t: int) -> torch.Tensor:
        """View [local_rows, dim] of table t's slots (call `_begin_access()` first on CUDA)."""
        return self._weights[t]

    def state_view(self, t: int) -> torch.Tensor | None:
        """View of table t's optimizer state (`momentum1`): [local_rows] (`StateLayout.PER_ROW`) or [local_rows,
        dim] (`PER_ELEMENT`), or None when the optimizer keeps none."""
        st = self._states[t]
        return st[0] if len(st) == 1 else None

    def flat_weights(self, t: int) -> tuple[torch.Tensor, int] | None:
        """(the TBE's flat weight tensor, element offset of table t's slot 0 in it), or None when `weights(t)` is not
        a plain view of one flat tensor: what a `TableBatchedEmbeddingSlice` of the table is built on, as TorchRec
        builds the parameters of its FUSED tables."""
        w = self._weights[t]
        base = w._base
        if base is None or base.dim() != 1 or base.storage_offset() != 0 or not w.is_contiguous():
            return None
        return base, int(w.storage_offset())

    def read_slots(self, t: int, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of rows and optimizer state at local `slots`: ([n, dim], [n, state_widths[t]])."""
        slots = np.asarray(slots, dtype=np.int64)
        self._sync_rows(np.full(slots.shape[0], t, dtype=np.int64), slots)
        idx = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self._weights[t].device)
        rows = self._weights[t].index_select(0, idx)
        parts = [x.index_select(0, idx).view(len(idx), -1) for x in self._states[t]]
        state = torch.cat(parts, dim=1) if parts else rows.new_zeros(len(idx), 0)
        return rows, state

    def read_rows(self, t: int, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows + optimizer state of owned `keys` (raises if one is not owned here)."""
        keys = np.asarray(keys, dtype=np.int64)
        self.check_keys(t, keys, "keys")
        slots = self.slots(t, keys)
        if (slots < 0).any():
            raise ValueError(f"table {self.tables[t].name!r}: rank {self.rank} does not own keys {keys[slots < 0][:5]}")
        return self.read_slots(t, slots)

    def write_slots(self, t: int, slots: np.ndarray, rows: torch.Tensor, state: torch.Tensor | None = None) -> None:
        """Overwrite rows (and optimizer state) at local `slots`; their stale cache lines are dropped."""
        slots = np.asarray(slots, dtype=np.int64)
        idx = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self._weights[t].device)
        with torch.no_grad():
            self._weights[t].index_copy_(0, idx, rows.to(self._weights[t]))
            if state is not None and self.state_widths[t]:
                col = 0
                for x in self._states[t]:
                    w = 1 if x.dim() == 1 else int(x.shape[1])
                    part = state[:, col : col + w].to(x)
                    x.index_copy_(0, idx, part.view(-1) if x.dim() == 1 else part)
                    col += w
        self._invalidate_rows(np.full(slots.shape[0], t, dtype=np.int64), slots)

    def read_packed(self, tables: np.ndarray, slots: np.ndarray, with_state: bool = True) -> torch.Tensor:
        """Rows at (table, local slot) pairs, packed item after item into one flat float32 tensor: the row's dim
        floats, then (with_state) its optimizer state. One gather per kind for all tables (no per-table loop).
        With state, float16 rows are packed as their bits, dim / 2 words (`_read_packed_half`, `unpack_rows`)."""
        tables, slots = np.asarray(tables, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        if with_state and self._half_rows:
            return self._read_packed_half(tables, slots)
        if self._rows2d is not None:  # one row gather per storage kind
            self._sync_rows(tables, slots)
            kinds = self._rows2d if with_state else self._rows2d[:1]
            out = host_kernels.read_rows(kinds, tables, slots)  # host storage: one compiled pass (None: torch)
            if out is not None:
                return out
            parts = [v.index_select(0, torch.from_numpy(base[tables] + slots).to(v.device)) for v, base in kinds]
            return (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).to(torch.float32).reshape(-1)
        width = self.packed_widths(tables, with_state)
        start = exclusive_cumsum(width)
        out = torch.empty(int(width.sum()), dtype=torch.float32, device=self._weights[0].device)
        if self._flat is None:  # pragma: no cover - TBE storage not laid out as expected: one table at a time
            for t in np.unique(tables).tolist():
                m = np.flatnonzero(tables == t)
                rows, state = self.read_slots(t, slots[m])
                data = torch.cat([rows, state], dim=1) if with_state else rows
                out[torch.from_numpy(ragged_arange(start[m], width[m])).to(out.device)] = data.reshape(-1).to(out)
            return out
        self._sync_rows(tables, slots)
        for flat, stored, packed in self._packed_positions(tables, slots, start, with_state):
            out.index_copy_(0, packed.to(out.device), flat.index_select(0, stored.to(flat.device)).to(out.dtype))
        return out

    def _packed_positions(self, tables: np.ndarray, slots: np.ndarray, start: np.ndarray, with_state: bool):
        """Per storage kind (weights, then optimizer state): (its flat storage, element positions there, element
        positions in the packed buffer) of the (table, slot) pairs — the index map shared by read and write."""
        col = np.zeros(tables.shape[0], dtype=np.int64)
        for flat, off, w in self._flat[: None if with_state else 1]:
            ww = w[tables]
            stored = torch.from_numpy(ragged_arange(off[tables] + slots * ww, ww))
            yield flat, stored, torch.from_numpy(ragged_arange(start + col, ww))
            col += ww

    def write_packed(self, tables: np.ndarray, slots: np.ndarray, data: torch.Tensor, with_state: bool = True) -> None:
        """Inverse of `read_packed`: write packed rows (and optimizer state) to (table, local slot) pairs."""
        tables, slots = np.asarray(tables, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        if with_state and self._half_rows:
            self._write_packed_half(tables, slots, data)
            return
        if self._rows2d is not None:  # one row scatter per storage kind
            kinds = self._rows2d if with_state else self._rows2d[:1]
            if host_kernels.write_rows(kinds, tables, slots, data):  # host storage: one compiled pass
                self._invalidate_rows(tables, slots)
                return
            block = data.view(tables.shape[0], sum(v.shape[1] for v, _ in kinds))
            col = 0
            with torch.no_grad():
                for v, base in kinds:
                    w = v.shape[1]
                    v.index_copy_(
                        0, torch.from_numpy(base[tables] + slots).to(v.device), block[:, col : col + w].to(v.dtype)
                    )
                    col += w
            self._invalidate_rows(tables, slots)
            return
        width = self.packed_widths(tables, with_state)
        start = exclusive_cumsum(width)
        if self._flat is None:  # pragma: no cover - see read_packed
            for t in np.unique(tables).tolist():
                m = np.flatnonzero(tables == t)
                pos = torch.from_numpy(ragged_arange(start[m], width[m])).to(data.device)
                block = data[pos].view(m.size, int(width[m[0]]))
                d = self.dims[t]
                self.write_slots(t, slots[m], block[:, :d], block[:, d:] if with_state else None)
            return
        with torch.no_grad():
            for flat, stored, packed in self._packed_positions(tables, slots, start, with_state):
                flat.index_copy_(0, stored.to(flat.device), data.index_select(0, packed.to(data.device)).to(flat.dtype))
        self._invalidate_rows(tables, slots)

    def _read_packed_half(self, tables: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        """`read_packed` with state of float16 rows: each row's float16 bits as dim / 2 float32 words (a view, no
        rounding: what arrives is the row bit for bit, in half the bytes of float32 values), then its state."""
        self._sync_rows(tables, slots)
        if self._rows2d is not None:  # one gather per storage kind
            parts = [v.index_select(0, torch.from_numpy(base[tables] + slots).to(v.device)) for v, base in self._rows2d]
            parts[0] = parts[0].view(torch.float32)  # [n, dim] float16, contiguous -> [n, dim / 2] words
            return (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).reshape(-1)
        width = self.packed_widths(tables)
        start = exclusive_cumsum(width)
        out = torch.empty(int(width.sum()), dtype=torch.float32, device=self._weights[0].device)
        for t in np.unique(tables).tolist():  # tables of different dims: one table at a time
            m = np.flatnonzero(tables == t)
            rows, state = self.read_slots(t, slots[m])
            data = torch.cat([rows.contiguous().view(torch.float32), state.to(torch.float32)], dim=1)
            out[torch.from_numpy(ragged_arange(start[m], width[m])).to(out.device)] = data.reshape(-1)
        return out

    def _write_packed_half(self, tables: np.ndarray, slots: np.ndarray, data: torch.Tensor) -> None:
        """The inverse of `_read_packed_half`."""
        width = self.packed_widths(tables)
        start = exclusive_cumsum(width)
        for t in np.unique(tables).tolist():
            m = np.flatnonzero(tables == t)
            pos = torch.from_numpy(ragged_arange(start[m], width[m])).to(data.device)
            rows, state = self.unpack_rows(t, data[pos].view(m.size, int(width[m[0]])))
            self.write_slots(t, slots[m], rows, state)
