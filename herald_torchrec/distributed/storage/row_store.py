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

The fused optimizer lives in the TBE (EXACT_ROWWISE_ADAGRAD by default, EXACT_ADAGRAD or EXACT_SGD): exclusive rows are
updated
in the TBE's own backward; `apply_summed_gradients` applies an externally summed gradient to given slots through
the same kernel (a forward over one-row bags, then a backward) — bit-exact with the fused path
(REFERENCE.md in ../shared/docs, checked again in tests/distributed/storage/test_row_store.py).

Row precision: the TBE keeps the rows in the tables' `weights_precision` (FP32 or FP16, the EBC's `data_type`, as
stock TorchRec's TBE does; `row_dtype`), and FBGEMM updates an FP16 row in float32 and rounds it back. Optimizer
state stays float32 either way. A moved row (`read_packed` with its state) carries its float16 bits, two to a
float32 word, so it moves in half the bytes and arrives bit for bit; values without state (shared values, snapshots)
are read as float32, which is exact (every float16 is a float32), and written back without rounding anything
(shared values go on the wire as float16 bits again: step/dist_data.py `half_words`).

Optimizer state = the TBE's `split_optimizer_states()` views, laid out as `state_layout` says (`StateLayout`: none
for SGD, one float per row for row-wise Adagrad, one per element for Adagrad; all named `momentum1` by TorchRec),
packed with the row whenever a row moves. Weights = `split_embedding_weights()` views.

`RowStore` is this module's TBE, slot layout and directory, with two mixins in modules of their own: row_access.py
(host reads and writes of rows, many tables at once, with the cache coherence on CUDA) and summed_update.py
(`apply_summed_gradients*`); the layout arithmetic is row_layout.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn

from herald_torchrec.distributed import host_kernels
from herald_torchrec.distributed.storage.optimizer_params import StateLayout, check_settings, state_layout
from herald_torchrec.distributed.storage.row_access import RowAccessMixin
from herald_torchrec.distributed.storage.row_layout import (
    check_cache_ratio,
    guest_capacity,
    home_block,
    home_range,
    home_rank,
    rank_within_group,
)
from herald_torchrec.distributed.storage.summed_update import SummedUpdateMixin


@dataclass(frozen=True)
class TableSpec:
    name: str
    rows: int
    dim: int


class RowStore(RowAccessMixin, SummedUpdateMixin, nn.Module):
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
            {
                **dict(tbe_settings or {}),
                "optimizer": optimizer,
                "learning_rate": learning_rate,
                "eps": eps,
                "cache_load_factor": cache_load_factor,
            },
            self.device,
        )
        self.optimizer = settings.pop("optimizer")
        # the rows' precision (the tables' data_type, FP32 or FP16: check_precision), cached on CUDA in the same one
        self.weights_precision: SparseType = settings.setdefault("weights_precision", SparseType.FP32)
        settings.setdefault("cache_precision", self.weights_precision)
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
        self._weights = self.tbe.split_embedding_weights()  # views [local_rows, dim], in the rows' precision
        self.row_dtype: torch.dtype = self._weights[0].dtype  # float32 or float16 (optimizer state: float32)
        self.state_layout: StateLayout = state_layout(self.optimizer)
        states = self.tbe.split_optimizer_states() if self.state_layout != StateLayout.NONE else []
        # per table: list of state views, [local_rows] (PER_ROW) or [local_rows, dim] (PER_ELEMENT)
        self._states: list[list[torch.Tensor]] = [list(s) for s in states] if states else [[] for _ in range(T)]
        self.state_widths = [self.state_layout.width(d) for d in self.dims]  # floats of state per row
        for t, st in enumerate(self._states):
            want = self.state_layout.shape(self.local_rows[t], self.dims[t])
            got = [tuple(x.shape) for x in st]
            if got != ([want] if want else []) and self.local_rows[t]:  # pragma: no cover - FBGEMM changed its layout
                raise RuntimeError(
                    f"RowStore: {self.optimizer.name}'s optimizer state of table {self.tables[t].name!r} has shapes "
                    f"{got}, expected {[want] if want else []} ({self.state_layout.name})"
                )
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
        self.feature_table_arr = np.array(self.feature_table_map, dtype=np.int64)  # table of each feature
        self.home_block_arr = np.array([home_block(r, world_size) for r in self.rows], dtype=np.int64)
        self._home_lo_arr = np.array(self.home_lo, dtype=np.int64)
        self._home_len_arr = np.array(self.home_len, dtype=np.int64)
        self.dims_arr = np.array(self.dims, dtype=np.int64)
        self.slot_of_all = np.full(int(self.key_base[-1]), -1, dtype=np.int32)  # local slot, -1 if not owned here
        self.key_of_all = np.full(int(self.slot_base[-1]), -1, dtype=np.int64)  # row held by a slot, -1 if empty
        self.owner_all = np.empty(int(self.key_base[-1]), dtype=np.int32)  # global
        # owner_all and guest_count_all hold every rank's rows while every move of every step is applied here; a rank
        # that runs its parts of the plans applies only its own and its shared rows' moves: exact for its own rows,
        # and for the others after `rebuild_directory` (HeraldEmbeddingBagCollection.sync_directory)
        self.directory_exact = True
        self.guest_count_all = np.zeros((T, world_size), dtype=np.int64)  # global
        # free guest slots per table: a stack in free_all[free_base[t] : free_base[t] + free_top[t]], popped from the
        # top
        self._free_all = np.zeros(int(self.free_base[-1]), dtype=np.int64)
        self._free_top = np.array(self.capacity, dtype=np.int64)
        self.slot_of: list[np.ndarray] = []  # views: int32 [rows]
        self.key_of: list[np.ndarray] = []  # views: int64 [local_rows]
        self.owner: list[np.ndarray] = []  # views: int32 [rows], global
        self.guest_count: list[np.ndarray] = []  # views: int64 [R], global
        for t in range(len(self.tables)):
            slot_of = self.slot_of_all[self.key_base[t] : self.key_base[t + 1]]
            lo, hl = self.home_lo[t], self.home_len[t]
            slot_of[lo : lo + hl] = np.arange(hl, dtype=np.int32)
            key_of = self.key_of_all[self.slot_base[t] : self.slot_base[t + 1]]
            key_of[:hl] = np.arange(lo, lo + hl, dtype=np.int64)
            self.slot_of.append(slot_of)
            self.key_of.append(key_of)
            self.owner.append(self.owner_all[self.key_base[t] : self.key_base[t + 1]])
            self.guest_count.append(self.guest_count_all[t])
            self._free_all[self.free_base[t] : self.free_base[t + 1]] = np.arange(self.local_rows[t] - 1, hl - 1, -1)
        self._owners_at_home()
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

    def guest_gkeys(self) -> np.ndarray:
        """Global keys of the rows this rank holds away from their home rank (its guests), int64."""
        parts = []
        for t in range(self.num_tables):
            k = self.key_of[t][self.home_len[t] :]
            parts.append(self.key_base[t] + k[k >= 0])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def rebuild_directory(self, guests: Sequence[np.ndarray]) -> None:
        """The ownership map and guest counts from every rank's guests (`guests[q]`: rank q's `guest_gkeys()`); every
        other row is at home. Afterwards the map is exact for every row."""
        T = self.num_tables
        self._owners_at_home()
        self.guest_count_all[:] = 0
        for q, g in enumerate(guests):
            g = np.asarray(g, dtype=np.int64)
            self.owner_all[g] = q
            self.guest_count_all[:, q] = np.bincount(self.tables_of(g), minlength=T)
        self.directory_exact = True

    def _owners_at_home(self) -> None:
        """Every row's owner in the map: its home rank."""
        for t, s in enumerate(self.tables):
            self.owner[t][:] = home_rank(s.rows, self.world_size, np.arange(s.rows))

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

    def tables_of(self, gkeys: np.ndarray) -> np.ndarray:
        """The table of each global key (the inverse of `gkeys` for the table part)."""
        return np.searchsorted(self.key_base, gkeys, side="right").astype(np.int64) - 1

    def check_keys_many(self, tables: np.ndarray, rows: np.ndarray, what: str = "ids") -> None:
        """`check_keys` for (table, row) pairs of any tables, in one pass."""
        bad = (rows < 0) | (rows >= self.rows_arr[tables])
        if bad.any():
            t = int(tables[np.argmax(bad)])
            self.check_keys(t, rows[tables == t], what)

    # ---------------------------------------------------------- slot lifecycle
    def allocate(self, t: int, keys: np.ndarray) -> np.ndarray:
        """Give arriving `keys` a local slot (home slot for home rows, else a free guest slot); returns the slots.

        Updates the local directory only (the global `owner` map is the caller's: `set_owner`)."""
        keys = np.asarray(keys, dtype=np.int64)
        return self.allocate_many(np.full(keys.shape[0], t, dtype=np.int64), keys)

    def allocate_many(self, tables: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """`allocate` for (table, row) pairs of any tables; within a table, guests take free slots in item order."""
        tables, keys = np.asarray(tables, dtype=np.int64), np.asarray(keys, dtype=np.int64)
        fast = host_kernels.allocate(self, tables, keys)  # compiled; None: numpy below (it raises on bad input)
        if fast is not None:
            return fast
        self.check_keys_many(tables, keys, "arriving keys")
        gk = self.key_base[tables] + keys
        owned = self.slot_of_all[gk] >= 0
        if owned.any():
            t = int(tables[np.argmax(owned)])
            raise ValueError(
                f"table {self.tables[t].name!r}: rank {self.rank} already owns {keys[owned & (tables == t)][:5]}"
            )
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
        fast = host_kernels.release(self, tables, keys)  # compiled; None: numpy below (it raises on bad input)
        if fast is not None:
            return fast
        self.check_keys_many(tables, keys, "departing keys")
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
        """Global ownership map + per-rank guest counts (every rank applies the moves it was given: all of a plan's,
        or its part's, see `directory_exact`)."""
        keys = np.asarray(keys, dtype=np.int64)
        self.set_owner_many(np.full(keys.shape[0], t, dtype=np.int64), keys, ranks)

    def set_owner_many(self, tables: np.ndarray, keys: np.ndarray, ranks: np.ndarray) -> None:
        """`set_owner` for (table, row) pairs of any tables (each pair at most once)."""
        tables, keys = np.asarray(tables, dtype=np.int64), np.asarray(keys, dtype=np.int64)
        ranks = np.asarray(ranks, dtype=np.int64)
        if host_kernels.set_owner(self, tables, keys, ranks):  # compiled
            return
        gk = self.key_base[tables] + keys
        home = keys // self.home_block_arr[tables]
        old = self.owner_all[gk].astype(np.int64)
        T, R = self.num_tables, self.world_size
        was, now = old != home, ranks != home
        self.guest_count_all -= np.bincount(tables[was] * R + old[was], minlength=T * R).reshape(T, R)
        self.guest_count_all += np.bincount(tables[now] * R + ranks[now], minlength=T * R).reshape(T, R)
        self.owner_all[gk] = ranks.astype(np.int32)

    def land_moves(
        self, tables: np.ndarray, keys: np.ndarray, dst: np.ndarray, send_idx: np.ndarray, recv_idx: np.ndarray
    ) -> np.ndarray:
        """A step's moves once their rows have travelled (a `MoveStep`'s arrays): the rows this rank sent
        (`send_idx`) released, every move's owner set to its destination, the rows it received (`recv_idx`) given free
        slots, which are returned (in `recv_idx` order) for the caller to write their values into."""
        self.release_many(tables[send_idx], keys[send_idx])
        self.set_owner_many(tables, keys, dst)
        return self.allocate_many(tables[recv_idx], keys[recv_idx])

    # ----------------------------------------------------------------- compute
    def lookup(
        self, indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pooled TBE forward over local slots (features laid out as `feature_table_map`); fused update in backward.
        `per_sample_weights` (weighted features): each id's row is scaled by its weight in its bag, and its gradient
        by the same weight, as FBGEMM's weighted SUM pooling does."""
        if per_sample_weights is None:
            return self.tbe(indices, offsets)
        return self.tbe(indices, offsets, per_sample_weights=per_sample_weights)
