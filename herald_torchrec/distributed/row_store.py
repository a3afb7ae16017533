"""Per-rank storage of the Herald-managed tables on ONE FBGEMM `SplitTableBatchedEmbeddingBagsCodegen` (TBE).

Layout (docs/ARCHITECTURE.md §2, §4). For table t with `rows` rows on a world of R ranks, rank r's TBE table t has
`home_len + capacity` local slots:
- slots [0, home_len): the rank's *home block*, TorchRec's ROW_WISE layout: block = ceil(rows / R), rank r's home
  rows are [r*block, min(rows, (r+1)*block)); home row k always lives in slot k - r*block when this rank owns it
  (the slot stays empty while the row is away);
- slots [home_len, home_len + capacity): *guest* slots, capacity = ceil(cache_ratio * rows), handed out from a
  free list when a foreign row arrives and given back when it leaves.

The directory is numpy, O(rows) per table: `slot_of[t][k]` (local slot of owned key k, -1 if not owned here),
`key_of[t][s]` (key held by slot s, -1 if empty), and the *global* ownership map `owner[t][k]` with the guest count
of every rank, which every rank keeps identical by applying the same plans (it is what validates a plan before
anything moves). Each per-table array is a view into one flat array over all tables, indexed by *global keys*
(`gkey = key_base[t] + row`): the `*_many` methods take (table, row) pairs of any tables and do one numpy pass,
where a per-table loop would pay T small calls per step (the per-table methods are the same code with one table).
Weights and optimizer states are likewise read and written for many tables at once (`read_packed`, `write_packed`)
through flat views of the TBE's own storage, in which each table is a block of [local_rows, width] rows.

The fused optimizer lives in the TBE (EXACT_ROWWISE_ADAGRAD by default, or EXACT_SGD): exclusive rows are updated
in the TBE's own backward; `apply_summed_gradients` applies an externally summed gradient to given slots through
the same kernel (a forward over one-row bags, then a backward) — bit-exact with the fused path
(docs/REFERENCE.md, checked again in tests/test_distributed_row_store.py).

Optimizer state = the TBE's `split_optimizer_states()` views (for row-wise Adagrad one float per row, `momentum1`),
packed with the row whenever a row moves. Weights = `split_embedding_weights()` views.

Cache coherence on CUDA: there the tables are `EmbeddingLocation.MANAGED_CACHING` (UVM + an HBM cache whose lines
may be newer than the UVM rows behind them). `split_embedding_weights()` views the UVM backing store, so host-side
access works row by row: before rows are read, the cache lines that hold exactly those rows are written back
(`_sync_rows`); after rows are written behind the TBE's back, exactly their cache lines are invalidated
(`_invalidate_rows`; the rest of the cache, and its LRU state, stay warm). Lines are found with FBGEMM's own
`lxu_cache_lookup` over the TBE's linear cache index (table's cache base + local slot). `_begin_access()` /
`_end_write()` (TBE `flush()` / `reset_cache_states()`: the whole cache) remain for whole-table access (`weights`).
All of this is a no-op on CPU (`EmbeddingLocation.HOST`, no cache). Optimizer states of row-wise optimizers are not
cached by FBGEMM, so they need nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

# SUPPORTED_OPTIMIZERS and parse_optimizer are re-exported here (they lived in this module before)
from herald_torchrec.distributed.optimizer_params import SUPPORTED_OPTIMIZERS, check_settings, parse_optimizer  # noqa: F401
from herald_torchrec.distributed.row_layout import (
    check_cache_ratio,
    exclusive_cumsum,
    guest_capacity,
    home_block,
    home_range,
    home_rank,
    ragged_arange,
    rank_within_group,
)


class _ClipPooledGradient(torch.autograd.Function):
    """Identity forward; backward clamps the gradient to [-max_gradient, max_gradient] elementwise. FBGEMM's
    `gradient_clipping` clamps the gradient of each pooled bag (the TBE's grad_output) before summing it per row;
    this does the same for pooled values that do not come out of the TBE (shared rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, max_gradient: float) -> torch.Tensor:
        ctx.max_gradient = max_gradient
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.clamp(-ctx.max_gradient, ctx.max_gradient), None


@dataclass(frozen=True)
class TableSpec:
    name: str
    rows: int
    dim: int


class RowStore(nn.Module):
    """One rank's rows of the Herald-managed tables: a TBE with a fused optimizer plus the ownership directory.

    `features_per_table[t]` = how many input features read table t (TBE features are laid out table by table, in
    this order, as an EmbeddingBagCollection orders its outputs).
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        rank: int,
        world_size: int,
        cache_ratio: float = 0.1,
        optimizer: EmbOptimType | str = EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate: float = 0.01,
        eps: float = 1e-8,
        features_per_table: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        location: EmbeddingLocation | None = None,
        cache_load_factor: float = 0.2,
        tbe_settings: Mapping[str, Any] | None = None,
        cache_stats: bool = False,
    ) -> None:
        super().__init__()
        if world_size < 1 or not (0 <= rank < world_size):
            raise ValueError(f"RowStore: bad rank {rank} for world size {world_size}")
        if not tables:
            raise ValueError("RowStore: no tables")
        for spec in tables:
            if spec.rows < 1 or spec.dim < 1:
                raise ValueError(f"RowStore: table {spec.name!r} needs rows >= 1 and dim >= 1, got {spec}")
            if spec.dim % 4:
                raise ValueError(f"RowStore: table {spec.name!r}: FBGEMM TBEs need dim % 4 == 0, got {spec.dim}")
        self.tables = list(tables)
        self.rank, self.world_size = rank, world_size
        self.cache_ratio = check_cache_ratio(cache_ratio)
        self.device = torch.device(device if device is not None else "cpu")
        # every further fused-optimizer setting the TBE takes (gradient clipping, ...), validated as the sharder does
        named = sorted({"optimizer", "learning_rate", "eps", "cache_load_factor"} & set(tbe_settings or {}))
        if named:
            raise ValueError(f"RowStore: {named} are arguments of their own, not tbe_settings")
        settings = check_settings(
            {**dict(tbe_settings or {}), "optimizer": optimizer, "learning_rate": learning_rate, "eps": eps,
             "cache_load_factor": cache_load_factor},
            self.device,
        )
        self.optimizer = settings.pop("optimizer")
        # FBGEMM clips per pooled bag: kept here for pooled values summed outside the TBE (clip_pooled_gradient)
        self.gradient_clipping = bool(settings.get("gradient_clipping", False))
        self.max_gradient = float(settings.get("max_gradient", 1.0))
        T = len(self.tables)
        fpt = list(features_per_table) if features_per_table is not None else [1] * T
        if len(fpt) != T or any(n < 1 for n in fpt):
            raise ValueError(f"RowStore: features_per_table must give >= 1 feature for each of {T} tables, got {fpt}")
        self.features_per_table = fpt
        self.feature_table_map = [t for t, n in enumerate(fpt) for _ in range(n)]
        self.first_feature = np.cumsum([0] + fpt[:-1]).tolist()

        self.rows = [s.rows for s in self.tables]
        self.dims = [s.dim for s in self.tables]
        self.home_lo, self.home_len, self.capacity = [], [], []
        for s in self.tables:
            lo, hi = home_range(s.rows, world_size, rank)
            self.home_lo.append(lo)
            self.home_len.append(hi - lo)
            self.capacity.append(guest_capacity(s.rows, self.cache_ratio))
        self.local_rows = [h + c for h, c in zip(self.home_len, self.capacity)]

        if self.device.type == "cuda":
            loc = location if location is not None else EmbeddingLocation.MANAGED_CACHING
            compute = ComputeDevice.CUDA
        else:
            loc = EmbeddingLocation.HOST  # FBGEMM forces HOST on CPU; its caches have no CPU kernels
            compute = ComputeDevice.CPU
        self.location = loc
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(max(1, n), d, loc, compute) for n, d in zip(self.local_rows, self.dims)],
            feature_table_map=self.feature_table_map,
            optimizer=self.optimizer,
            pooling_mode=PoolingMode.SUM,
            device=self.device,
            table_names=[s.name for s in self.tables],
            **settings,
            # FBGEMM's HBM-cache counters (calls, requested, unique, unique misses, ...): `cache_stats()`
            **({"gather_uvm_cache_stats": True} if cache_stats and loc == EmbeddingLocation.MANAGED_CACHING else {}),
        )
        # the TBE's parameters are updated by its fused optimizer: keep them out of dense optimizers
        # (torchrec.optim.optimizers.in_backward_optimizer_filter) and out of DDP (ShardedModule parameters)
        from torchrec.optim.fused import EmptyFusedOptimizer

        for p in self.tbe.parameters():
            p._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
        self._weights = self.tbe.split_embedding_weights()  # views [local_rows, dim]
        states = self.tbe.split_optimizer_states() if self.optimizer != EmbOptimType.EXACT_SGD else []
        # per table: list of state views, each [local_rows] (row-wise) or [local_rows, w]
        self._states: list[list[torch.Tensor]] = [list(s) for s in states] if states else [[] for _ in range(T)]
        self.state_widths = [sum(1 if x.dim() == 1 else int(x.shape[1]) for x in st) for st in self._states]
        with torch.no_grad():
            for w in self._weights:
                w.zero_()
            for st in self._states:
                for x in st:
                    x.zero_()
        self._end_write()

        # ---- directory: flat arrays over all tables, with per-table views ----
        self.key_base = np.concatenate([[0], np.cumsum(self.rows)]).astype(np.int64)  # global key = key_base[t] + row
        self.slot_base = np.concatenate([[0], np.cumsum(self.local_rows)]).astype(np.int64)
        self.free_base = np.concatenate([[0], np.cumsum(self.capacity)]).astype(np.int64)
        # per table, as arrays (index them with an array of tables)
        self.rows_arr = np.array(self.rows, dtype=np.int64)
        self.home_block_arr = np.array([home_block(r, world_size) for r in self.rows], dtype=np.int64)
        self._home_lo_arr = np.array(self.home_lo, dtype=np.int64)
        self._home_len_arr = np.array(self.home_len, dtype=np.int64)
        self.dims_arr = np.array(self.dims, dtype=np.int64)
        self.slot_of_all = np.full(int(self.key_base[-1]), -1, dtype=np.int32)  # local slot, -1 if not owned here
        self.key_of_all = np.full(int(self.slot_base[-1]), -1, dtype=np.int64)  # row held by a slot, -1 if empty
        self.owner_all = np.empty(int(self.key_base[-1]), dtype=np.int32)  # global
        self.guest_count_all = np.zeros((T, world_size), dtype=np.int64)  # global
        # free guest slots per table: a stack in free_all[free_base[t] : free_base[t] + free_top[t]], popped from the top
        self._free_all = np.zeros(int(self.free_base[-1]), dtype=np.int64)
        self._free_top = np.array(self.capacity, dtype=np.int64)
        self.slot_of: list[np.ndarray] = []  # views: int32 [rows]
        self.key_of: list[np.ndarray] = []  # views: int64 [local_rows]
        self.owner: list[np.ndarray] = []  # views: int32 [rows], global
        self.guest_count: list[np.ndarray] = []  # views: int64 [R], global
        for t, s in enumerate(self.tables):
            slot_of = self.slot_of_all[self.key_base[t] : self.key_base[t + 1]]
            lo, hl = self.home_lo[t], self.home_len[t]
            slot_of[lo : lo + hl] = np.arange(hl, dtype=np.int32)
            key_of = self.key_of_all[self.slot_base[t] : self.slot_base[t + 1]]
            key_of[:hl] = np.arange(lo, lo + hl, dtype=np.int64)
            owner = self.owner_all[self.key_base[t] : self.key_base[t + 1]]
            owner[:] = home_rank(s.rows, world_size, np.arange(s.rows))
            self.slot_of.append(slot_of)
            self.key_of.append(key_of)
            self.owner.append(owner)
            self.guest_count.append(self.guest_count_all[t])
            self._free_all[self.free_base[t] : self.free_base[t + 1]] = np.arange(self.local_rows[t] - 1, hl - 1, -1)
        self._flat = self._flat_layout()
        self._rows2d = self._row_layout()
        # every table has the same dim: index maps of the step's lookups and gradient sums are row-level (plan_exec)
        self.uniform_dim: int | None = self.dims[0] if len(set(self.dims)) == 1 else None
        # HBM cache (CUDA MANAGED_CACHING only): linear cache index of (table, slot) = slot_base[table] + slot, as
        # FBGEMM's cache_hash_size_cumsum numbers the cached tables' rows (every table here is cached)
        self._cached = self.tbe.lxu_cache_weights.numel() > 0
        if self._cached:
            total = self.tbe.total_cache_hash_size
            total = int(total.item()) if isinstance(total, torch.Tensor) else int(total)
            if total != int(self.slot_base[-1]):  # pragma: no cover - FBGEMM changed its cache numbering
                raise RuntimeError(f"RowStore: TBE cache hashes {total} rows, expected {int(self.slot_base[-1])}")

    def _flat_layout(self) -> list[tuple[torch.Tensor, np.ndarray, np.ndarray]] | None:
        """Flat views of the weights and of each optimizer-state tensor, each as (flat tensor over its whole storage,
        element offset of every table's block, row width of every table); None if the TBE's views do not all share
        one row-major storage per kind (then the per-table path is taken)."""
        kinds = [list(self._weights)] + [[self._states[t][j] for t in range(self.num_tables)] for j in range(len(self._states[0]))]
        if any(len(st) != len(self._states[0]) for st in self._states):
            return None
        out = []
        for views in kinds:
            v0 = views[0]
            width = np.array([1 if v.dim() == 1 else int(v.shape[1]) for v in views], dtype=np.int64)
            ok = all(
                v.untyped_storage().data_ptr() == v0.untyped_storage().data_ptr() and v.dtype == v0.dtype
                and v.is_contiguous() for v in views
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

    # ------------------------------------------------------------------ queries
    @property
    def num_tables(self) -> int:
        return len(self.tables)

    def row_width(self, t: int) -> int:
        """Floats per moved row: the row plus its optimizer state."""
        return self.dims[t] + self.state_widths[t]

    def is_home(self, t: int, keys: np.ndarray) -> np.ndarray:
        k = np.asarray(keys, dtype=np.int64)
        return (k >= self.home_lo[t]) & (k < self.home_lo[t] + self.home_len[t])

    def slots(self, t: int, keys: np.ndarray) -> np.ndarray:
        """Local slots of `keys` (int64; -1 where this rank does not own the key)."""
        return self.slot_of[t][np.asarray(keys, dtype=np.int64)].astype(np.int64)

    def owned_keys(self, t: int) -> np.ndarray:
        """Keys this rank owns (home rows still here, then guests), int64."""
        k = self.key_of[t]
        return k[k >= 0]

    def num_guests(self, t: int) -> int:
        return self.capacity[t] - int(self._free_top[t])

    def occupancy(self, t: int) -> float:
        return self.num_guests(t) / self.capacity[t]

    def check_keys(self, t: int, keys: np.ndarray, what: str = "ids") -> None:
        if keys.size and (int(keys.min()) < 0 or int(keys.max()) >= self.rows[t]):
            bad = keys[(keys < 0) | (keys >= self.rows[t])]
            raise ValueError(
                f"table {self.tables[t].name!r}: {what} out of range [0, {self.rows[t]}): "
                f"{bad[:5].tolist()}{' ...' if bad.size > 5 else ''}"
            )

    def gkeys(self, tables: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Global keys of (table, row) pairs: the index into the flat directory arrays."""
        return self.key_base[np.asarray(tables, dtype=np.int64)] + np.asarray(rows, dtype=np.int64)

    def check_keys_many(self, tables: np.ndarray, rows: np.ndarray, what: str = "ids") -> None:
        """`check_keys` for (table, row) pairs of any tables, in one pass."""
        bad = (rows < 0) | (rows >= self.rows_arr[tables])
        if bad.any():
            t = int(tables[np.argmax(bad)])
            self.check_keys(t, rows[tables == t], what)

    def packed_widths(self, tables: np.ndarray, with_state: bool = True) -> np.ndarray:
        """Floats per item of `read_packed` / `write_packed`: the row, plus its optimizer state if `with_state`."""
        w = self.dims_arr[tables]
        return w + np.asarray(self.state_widths, dtype=np.int64)[tables] if with_state else w

    # ------------------------------------------------------------- host access
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

    def read_slots(self, t: int, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of rows and optimizer state at local `slots`: ([n, dim], [n, state_width])."""
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
        floats, then (with_state) its optimizer state. One gather per kind for all tables (no per-table loop)."""
        tables, slots = np.asarray(tables, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        if self._rows2d is not None:  # one row gather per storage kind
            self._sync_rows(tables, slots)
            kinds = self._rows2d if with_state else self._rows2d[:1]
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
        if self._rows2d is not None:  # one row scatter per storage kind
            kinds = self._rows2d if with_state else self._rows2d[:1]
            block = data.view(tables.shape[0], sum(v.shape[1] for v, _ in kinds))
            col = 0
            with torch.no_grad():
                for v, base in kinds:
                    w = v.shape[1]
                    v.index_copy_(0, torch.from_numpy(base[tables] + slots).to(v.device), block[:, col : col + w].to(v.dtype))
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

    # ---------------------------------------------------------- slot lifecycle
    def allocate(self, t: int, keys: np.ndarray) -> np.ndarray:
        """Give arriving `keys` a local slot (home slot for home rows, else a free guest slot); returns the slots.

        Updates the local directory only (the global `owner` map is the caller's: `set_owner`)."""
        keys = np.asarray(keys, dtype=np.int64)
        return self.allocate_many(np.full(keys.shape[0], t, dtype=np.int64), keys)

    def allocate_many(self, tables: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """`allocate` for (table, row) pairs of any tables; within a table, guests take free slots in item order."""
        tables, keys = np.asarray(tables, dtype=np.int64), np.asarray(keys, dtype=np.int64)
        self.check_keys_many(tables, keys, "arriving keys")
        gk = self.key_base[tables] + keys
        owned = self.slot_of_all[gk] >= 0
        if owned.any():
            t = int(tables[np.argmax(owned)])
            raise ValueError(f"table {self.tables[t].name!r}: rank {self.rank} already owns {keys[owned & (tables == t)][:5]}")
        lo = self._home_lo_arr[tables]
        home = (keys >= lo) & (keys < lo + self._home_len_arr[tables])
        slots = np.empty(keys.shape[0], dtype=np.int64)
        slots[home] = keys[home] - lo[home]
        gt = tables[~home]
        n_guest = np.bincount(gt, minlength=self.num_tables)
        over = n_guest > self._free_top
        if over.any():
            t = int(np.argmax(over))
            raise ValueError(
                f"table {self.tables[t].name!r}: rank {self.rank} has {self._free_top[t]} free guest slots of "
                f"{self.capacity[t]}, {n_guest[t]} rows arrive"
            )
        k = rank_within_group(gt, self.num_tables)
        slots[~home] = self._free_all[self.free_base[gt] + self._free_top[gt] - 1 - k]
        self._free_top -= n_guest
        self.slot_of_all[gk] = slots.astype(np.int32)
        self.key_of_all[self.slot_base[tables] + slots] = keys
        return slots

    def release(self, t: int, keys: np.ndarray) -> np.ndarray:
        """Forget departing `keys` (their slots become empty / free); returns the slots they held."""
        keys = np.asarray(keys, dtype=np.int64)
        return self.release_many(np.full(keys.shape[0], t, dtype=np.int64), keys)

    def release_many(self, tables: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """`release` for (table, row) pairs of any tables; within a table, freed guest slots are pushed in reverse
        item order (so the next arrivals take them in item order)."""
        tables, keys = np.asarray(tables, dtype=np.int64), np.asarray(keys, dtype=np.int64)
        gk = self.key_base[tables] + keys
        slots = self.slot_of_all[gk].astype(np.int64)
        if (slots < 0).any():
            t = int(tables[np.argmax(slots < 0)])
            bad = keys[(slots < 0) & (tables == t)]
            raise ValueError(f"table {self.tables[t].name!r}: rank {self.rank} does not own departing keys {bad[:5]}")
        self.slot_of_all[gk] = -1
        self.key_of_all[self.slot_base[tables] + slots] = -1
        guest = slots >= self._home_len_arr[tables]
        gt, gs = tables[guest], slots[guest]
        n_out = np.bincount(gt, minlength=self.num_tables)
        k = rank_within_group(gt, self.num_tables)
        self._free_all[self.free_base[gt] + self._free_top[gt] + n_out[gt] - 1 - k] = gs
        self._free_top += n_out
        return slots

    def set_owner(self, t: int, keys: np.ndarray, ranks: np.ndarray) -> None:
        """Global ownership map + per-rank guest counts (every rank applies the same updates)."""
        keys = np.asarray(keys, dtype=np.int64)
        self.set_owner_many(np.full(keys.shape[0], t, dtype=np.int64), keys, ranks)

    def set_owner_many(self, tables: np.ndarray, keys: np.ndarray, ranks: np.ndarray) -> None:
        """`set_owner` for (table, row) pairs of any tables (each pair at most once)."""
        tables, keys = np.asarray(tables, dtype=np.int64), np.asarray(keys, dtype=np.int64)
        ranks = np.asarray(ranks, dtype=np.int64)
        gk = self.key_base[tables] + keys
        home = keys // self.home_block_arr[tables]
        old = self.owner_all[gk].astype(np.int64)
        T, R = self.num_tables, self.world_size
        was, now = old != home, ranks != home
        self.guest_count_all -= np.bincount(tables[was] * R + old[was], minlength=T * R).reshape(T, R)
        self.guest_count_all += np.bincount(tables[now] * R + ranks[now], minlength=T * R).reshape(T, R)
        self.owner_all[gk] = ranks.astype(np.int32)

    # ----------------------------------------------------------------- compute
    def lookup(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Pooled TBE forward over local slots (features laid out as `feature_table_map`); fused update in backward."""
        return self.tbe(indices, offsets)

    def apply_summed_gradients(self, slots: Sequence[np.ndarray | None], grads: Sequence[torch.Tensor | None]) -> None:
        """One fused-optimizer update of the given slots of each table with the given (already summed) gradients
        (`slots[t]`: local slots of table t, distinct; `grads[t]`: [len(slots[t]), dim]). See `apply_summed_gradients_packed`."""
        counts = [0 if s is None else len(s) for s in slots]
        if not any(counts):
            return
        tables = np.repeat(np.arange(self.num_tables, dtype=np.int64), counts)
        flat_slots = np.concatenate([np.asarray(s, dtype=np.int64) for s, n in zip(slots, counts) if n])
        flat_grads = torch.cat([g.reshape(-1) for g, n in zip(grads, counts) if n])
        self.apply_summed_gradients_packed(tables, flat_slots, flat_grads)

    def clip_pooled_gradient(self, pooled: torch.Tensor) -> torch.Tensor:
        """`pooled` (bags x columns), with its gradient clipped per bag element exactly as the TBE clips its own
        output's gradient under `gradient_clipping` (identity otherwise). For pooled values of rows updated through
        `apply_summed_gradients*`: their readers clip per bag, the owner sums and applies unclipped, so each row gets
        the sum of its clipped bag gradients, as in a fused backward."""
        return _ClipPooledGradient.apply(pooled, self.max_gradient) if self.gradient_clipping else pooled

    def one_row_bags(self, tables: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
        """Where a TBE call that updates given rows puts them, one row per bag: pair i (of table `tables[i]`) is bag
        k[i] of its table's first feature feat[i], k = its rank among the pairs of its table; n = bags per feature
        (the most pairs of one table). Returns (k, n, feat)."""
        k = rank_within_group(tables, self.num_tables)
        n = int(k.max()) + 1 if k.shape[0] else 0
        return k, n, np.asarray(self.first_feature, dtype=np.int64)[tables]

    def apply_summed_gradients_packed(self, tables: np.ndarray, slots: np.ndarray, grads: torch.Tensor) -> None:
        """One fused-optimizer update of (table, local slot) pairs with already summed gradients (`grads`: flat,
        dims[t] floats per pair, in pair order; slots distinct within a table). Under `gradient_clipping` the sums
        are taken as already clipped per bag (`clip_pooled_gradient`) and are not clipped again.

        A forward over one-row bags (table t's first feature, its k-th pair in bag k; other bags empty), then a
        backward with the gradients: FBGEMM's own kernel applies its optimizer exactly as in a fused backward where
        the row's contributions were summed."""
        tables, slots = np.asarray(tables, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        if tables.shape[0] == 0:
            return
        F = len(self.feature_table_map)
        k, n, feat = self.one_row_bags(tables)
        first = np.asarray(self.first_feature, dtype=np.int64)
        lengths = np.zeros(F * n, dtype=np.int64)
        lengths[feat * n + k] = 1
        # feature-major layout: the indices of features in order, table t's only in its first feature
        indices = slots[np.argsort(tables, kind="stable")]
        offsets = np.zeros(F * n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        feat_dims = self.dims_arr[np.asarray(self.feature_table_map, dtype=np.int64)]
        col_first = exclusive_cumsum(feat_dims)[first]  # output column of table t's first feature
        d = self.dims_arr[tables]
        dev = self._weights[0].device
        # the gradients are sums of per-bag gradients already clipped by their readers (clip_pooled_gradient): the
        # TBE must not clip the sum again (it reads optimizer_args at forward time)
        args = self.tbe.optimizer_args
        self.tbe.optimizer_args = args._replace(gradient_clipping=False)
        try:
            with torch.enable_grad():
                out = self.tbe(torch.from_numpy(indices).to(dev), torch.from_numpy(offsets).to(dev))
                g = torch.zeros_like(out)
                if self.uniform_dim is not None:  # row-level: bag k of feature f is row k * F + f of g [n * F, dim]
                    dim = self.uniform_dim
                    g.view(-1, dim).index_copy_(0, torch.from_numpy(k * F + feat).to(dev), grads.view(-1, dim).to(g))
                else:
                    pos = ragged_arange(k * int(feat_dims.sum()) + col_first[tables], d)
                    g.view(-1).index_copy_(0, torch.from_numpy(pos).to(dev), grads.to(g))
                out.backward(g)
        finally:
            self.tbe.optimizer_args = args
