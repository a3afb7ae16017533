"""Checkpoints of Herald-managed tables the TorchRec way: `state_dict` / `load_state_dict` and the fused optimizer's
state in TorchRec's ROW_WISE layout, so that `torch.distributed.checkpoint` (DCP) saves and restores them like any
TorchRec-sharded table, and checkpoints cross-load between Herald and stock TorchRec runs.

Why a translation layer: a Herald module keeps its rows in one FBGEMM TBE per rank, in *slot* order, and a row may
currently live on another rank (a guest there). The TBE's own tensors therefore mean nothing outside this run. What
a checkpoint holds instead, per table `<t>` (exactly TorchRec's ROW_WISE keys, shapes and ShardedTensor metadata):

* `<prefix>embedding_bags.<t>.weight`: ShardedTensor [rows, dim]; shard r = rank r's home block (the plan's
  sharding_spec), holding the *current* value of every home row, wherever it lives now;
* fused optimizer: `state["<fqn>.embedding_bags.<t>.weight"]["<t>.momentum1"]`: a ShardedTensor [rows] with the same
  row split for row-wise Adagrad (`StateLayout.PER_ROW`), [rows, dim] with the weight's shards for Adagrad
  (`PER_ELEMENT`); SGD keeps no state (an empty dict per table, as TorchRec's fused optimizer).

On CPU the local shards are views of the TBE's home slots (as TorchRec's FUSED tables alias their TBE), so
in-place writes (TorchRec's `copy_state_dict`, a DCP load, a user's edit) land in the table. A *refresh* makes them
current: rows away as guests are fetched from their owners into their home slot, which is unused while the row is
away (one all-to-all of the guest rows; none when no rank holds a guest); `settle()`, at the next step,
`full_tables()` or load, sends those slots back to the owners (one all-to-all; exact whether written or not), so
the placement stays as the scheduler left it. A refresh is therefore collective — every rank must call
`state_dict()` / `fused_optimizer.state_dict()` together, as DCP's save does anyway. It runs only when the module
changed since the last one (training step, load), so a write into the tensors is never overwritten before it is
applied. The tensors stay views, but a row that a later step moves away is no longer in them: take a new
`state_dict()` after training before reading or writing. `named_parameters()` gives the same storage without
communication (`expose_parameters`). On CUDA the shards are copies (the HBM cache holds rows that a view of the
UVM weights would not see): writes into them are not applied, and `settle()` warns when they were made.

Loading (TorchRec's idiom: `sd = dmp.state_dict(); dcp.load(sd, ...); dmp.load_state_dict(sd)`, same for
`dmp.fused_optimizer`) writes the values into the home rows after every guest has gone home (one all-to-all of the
guest rows with their optimizer state, so values not being loaded are kept): ownership is back at the home placement
on every rank, directories and guest counts coherent, queued plans are dropped with the pending step (its shared-row
gradients belong to the model being replaced), and `module.ownership_version` is incremented so that a train
pipeline rebuilds its scheduler from the home placement. Loading is collective too.

Costs and caveats: on CUDA the buffers are one extra copy of each rank's home blocks (and their optimizer state). Take
checkpoints between steps: a step whose shared-row update is pending is finished first (as the fused
optimizer's `step()` would), so a `state_dict()` between forward and backward would drop that step's shared-row
gradients. Optimizer wrappers that copy `.state` once at construction (torchrec's `OptimizerWrapper`) see the
buffers refreshed only by a later `dmp.state_dict()` / `dmp.fused_optimizer.state_dict()`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torchrec.distributed.types import ParameterSharding

from herald_torchrec.distributed.step.prepare import prepare_moves, routes
from herald_torchrec.distributed.storage.optimizer_params import StateLayout
from herald_torchrec.distributed.storage.row_layout import exclusive_cumsum, home_range, ragged_arange
from herald_torchrec.schedule.plan import EVICT_HOME, Plan, RowMoves

if TYPE_CHECKING:  # pragma: no cover
    from herald_torchrec.distributed.comm import PlanComm
    from herald_torchrec.distributed.step.embedding_lookup import HeraldLookup
    from herald_torchrec.distributed.storage.row_store import RowStore

STORE_PREFIX = "_store."  # the module's TBE internals: never in a state dict


@dataclass
class _DeadSlots:
    """The home slots of this rank's rows that live away as guests, and what they held when `named_parameters()`
    handed them out: a later difference is a write that cannot reach the row."""

    tables: np.ndarray  # int64 [n]
    rows: np.ndarray  # int64 [n], global row ids
    values: torch.Tensor  # [n] packed weights (read_packed without state)

    @staticmethod
    def of(st: RowStore) -> _DeadSlots:
        tabs, rows = [], []
        for t in range(st.num_tables):
            lo, hl = st.home_lo[t], st.home_len[t]
            away = np.flatnonzero(st.slot_of[t][lo : lo + hl] < 0)
            tabs.append(np.full(away.shape[0], t, dtype=np.int64))
            rows.append(away + lo)
        tab, row = np.concatenate(tabs), np.concatenate(rows)
        return _DeadSlots(
            tab, row, st.read_packed(tab, row - np.asarray(st.home_lo, dtype=np.int64)[tab], with_state=False).clone()
        )

    def written(self, st: RowStore) -> tuple[str, list[int]] | None:
        """(table, first rows) of the slots whose content changed, or None."""
        if self.tables.shape[0] == 0:
            return None
        now = st.read_packed(
            self.tables, self.rows - np.asarray(st.home_lo, dtype=np.int64)[self.tables], with_state=False
        )
        changed = (now != self.values).view(-1)
        if not bool(changed.any()):
            return None
        item = np.repeat(np.arange(self.tables.shape[0]), st.dims_arr[self.tables])[changed.cpu().numpy()]
        item = np.unique(item)
        t = int(self.tables[item[0]])
        return st.tables[t].name, self.rows[item[self.tables[item] == t]][:5].tolist()


class CheckpointedModule(Protocol):
    """The sharded module as its checkpoint and fused optimizer use it: its public surface only. They are built by
    the module and never import it, so neither depends on how it runs a step."""

    store: RowStore
    rank: int
    world_size: int
    device: torch.device
    table_names: list[str]
    learning_rate: float
    steps: int  # training steps run: with the two below, what a snapshot is current for
    ownership_version: int  # +1 by a load, which moves every row home

    @property
    def step_pending(self) -> bool: ...

    def finish_step(self) -> None: ...

    def drop_pending(self) -> None: ...

    def clear_plans(self) -> None: ...

    def sync_directory(self) -> None: ...

    def set_learning_rate(self, lr: float) -> None: ...


def weight_key(table: str) -> str:
    return f"embedding_bags.{table}.weight"


def state_key(table: str) -> str:
    """TorchRec's name of a table's optimizer state, per row or per element alike (EmbeddingFusedOptimizer:
    `<table>.momentum1`)."""
    return f"{table}.momentum1"


def _row_wise_shards(
    rows: int, dim: int, world_size: int, rank: int, device: torch.device, ps: ParameterSharding | None
) -> list[ShardMetadata]:
    """The table's ROW_WISE shards: the plan's sharding_spec if it has one, else the home blocks (TorchRec's split),
    placed where the ranks' home blocks really are (`_on_used_devices`)."""
    spec = getattr(ps, "sharding_spec", None) if ps is not None else None
    shards = getattr(spec, "shards", None)
    if shards:
        return _on_used_devices(list(shards), rank, device)
    out = []
    for r in range(world_size):
        lo, hi = home_range(rows, world_size, r)
        dev = f"cuda:{r}" if device.type == "cuda" else device.type
        out.append(ShardMetadata(shard_offsets=[lo, 0], shard_sizes=[hi - lo, dim], placement=f"rank:{r}/{dev}"))
    return _on_used_devices(out, rank, device)


def _on_used_devices(shards: list[ShardMetadata], rank: int, device: torch.device) -> list[ShardMetadata]:
    """Shards whose CUDA placements name GPUs that exist: this rank's own shard names `device` (where its home block
    is), another rank's names its planned GPU modulo the GPUs there are. A plan made for one GPU per rank (placement
    cuda:r) therefore fits ranks that share GPUs (`init_distributed` puts local rank r on GPU r % GPUs), where
    ShardedTensor would otherwise reject the home block ("Local shard tensor device does not match"). Where ranks
    follow that rule, every rank computes the same placements, so the global metadata agrees across ranks."""
    if device.type != "cuda":
        return shards
    gpus = max(torch.cuda.device_count(), 1)
    out = []
    for s in shards:
        p = s.placement
        if p is None or p.device().type != "cuda":
            out.append(s)
            continue
        idx = device.index if p.rank() == rank and device.index is not None else (p.device().index or 0) % gpus
        out.append(
            ShardMetadata(
                shard_offsets=list(s.shard_offsets),
                shard_sizes=list(s.shard_sizes),
                placement=f"rank:{p.rank()}/cuda:{idx}",
            )
        )
    return out


def _sharded(
    local: torch.Tensor, shards: list[ShardMetadata], size: tuple[int, ...], rank: int, pg: Any
) -> ShardedTensor:
    """A ShardedTensor over `shards` whose shard on this rank is `local` (no communication, as TorchRec builds its own).
    Without torch.distributed (a single-process module) the one home block is the whole table: `local` itself."""
    if not dist.is_initialized():
        return local  # type: ignore[return-value]
    mine = [s for s in shards if s.placement is not None and s.placement.rank() == rank]
    if len(mine) > 1:
        raise ValueError(f"ROW_WISE sharding lists {len(mine)} shards on rank {rank}; Herald's home block is one")
    meta = ShardedTensorMetadata(
        shards_metadata=shards, size=torch.Size(size), tensor_properties=TensorProperties(dtype=local.dtype)
    )
    local_shards = [Shard(tensor=local, metadata=mine[0])] if mine else []
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, meta, process_group=pg)


class HeraldCheckpoint:
    """The checkpoint view of one `ShardedHeraldEmbeddingBagCollection`: home-block snapshot buffers wrapped in
    ROW_WISE ShardedTensors, their refresh (collective) and the load into the store (collective).

    Built by the module with what it needs: the module's public surface, its lookup (to send guests home as a plan
    of evictions), its collectives and process group. `install_state_dict_hooks` makes the module's `state_dict` /
    `load_state_dict` go through it, `HeraldFusedOptimizer` takes its params and state from it."""

    def __init__(
        self,
        module: CheckpointedModule,
        lookup: HeraldLookup,
        comm: PlanComm,
        process_group: Any,
        sharding: dict[str, ParameterSharding] | None,
    ) -> None:
        self.module, self._lookup, self._comm = module, lookup, comm
        st = module.store
        R, r = module.world_size, module.rank
        pg = process_group
        self.state_layout: StateLayout = st.state_layout
        self.has_state = self.state_layout != StateLayout.NONE
        # CPU: the state dicts' local shards are views of the home slots (TorchRec's FUSED tables alias their TBE the
        # same way). CUDA: copies, since the HBM cache holds rows a view of the UVM weights would not see
        self.views = module.device.type == "cpu" and all(st.flat_weights(t) is not None for t in range(st.num_tables))
        self._copies_pending = False  # home slots of rows away hold refreshed copies: push them to their owners
        self._exposed: _DeadSlots | None = None  # away rows' home slots as named_parameters() handed them out
        self._copy_sums: torch.Tensor | None = None  # CUDA: what the copies summed to when the refresh filled them
        self._warned: set[str] = set()
        self.home_w: list[torch.Tensor] = []
        self.home_s: list[torch.Tensor] = []
        self.weights: list[ShardedTensor | torch.Tensor] = []  # <t>.weight, [rows, dim]
        self.states: list[ShardedTensor | torch.Tensor] = []  # <t>.momentum1, [rows] or [rows, dim] (has_state)
        for t, name in enumerate(module.table_names):
            rows, dim, hl = st.rows[t], st.dims[t], st.home_len[t]
            shards = _row_wise_shards(rows, dim, R, r, module.device, (sharding or {}).get(name))
            mine = [s for s in shards if s.placement is not None and s.placement.rank() == r]
            if mine and (int(mine[0].shard_offsets[0]), int(mine[0].shard_sizes[0])) != (st.home_lo[t], hl) and hl:
                raise ValueError(f"table {name!r}: the plan's shard on rank {r} is not its home block")
            # the home block's state: [hl] or [hl, dim] (an unused [hl] placeholder without state)
            state_shape = self.state_layout.shape(hl, dim) or (hl,)
            if self.views:  # the TBE's own home slots: in-place writes land in the table
                w = st.weights(t)[:hl]
                state = st.state_view(t)
                s = state[:hl] if state is not None else torch.zeros(state_shape, device=module.device)
            else:
                w = torch.zeros(hl, dim, dtype=st.row_dtype, device=module.device)  # float16 for FP16 tables
                s = torch.zeros(state_shape, dtype=torch.float32, device=module.device)
            self.home_w.append(w)
            self.weights.append(_sharded(w, shards, (rows, dim), r, pg))
            self.home_s.append(s)
            if self.state_layout == StateLayout.PER_ROW:  # TorchRec: the weight's row split, one float per row
                row_shards = [
                    ShardMetadata(
                        shard_offsets=[int(x.shard_offsets[0])],
                        shard_sizes=[int(x.shard_sizes[0])],
                        placement=x.placement,
                    )
                    for x in shards
                ]
                self.states.append(_sharded(s, row_shards, (rows,), r, pg))
            elif self.state_layout == StateLayout.PER_ELEMENT:  # TorchRec: the weight's own shards
                self.states.append(_sharded(s, shards, (rows, dim), r, pg))
        self._fresh: tuple | None = None  # module version of the buffers' snapshot (None: never taken)
        self.load_prefix = ""  # the state-dict prefix of the last load (its post hook filters the keys under it)
        self.table_parameters = [self._table_parameter(t) for t in range(st.num_tables)]

    def _table_parameter(self, t: int) -> nn.Parameter:
        """Table t's entry of `named_parameters()`: as TorchRec's FUSED tables, a `TableBatchedEmbeddingSlice`
        [home rows, dim] of the TBE's weights, marked as trained by an in-backward (fused) optimizer. The same
        storage as the state dict's local shard on CPU."""
        from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
        from torchrec.optim.fused import EmptyFusedOptimizer

        st = self.module.store
        hl, dim = st.home_len[t], st.dims[t]
        flat = st.flat_weights(t)
        if flat is not None:
            base, off = flat
            p = TableBatchedEmbeddingSlice(base, off, off + hl * dim, hl, dim)
        else:
            p = nn.Parameter(st.weights(t)[:hl], requires_grad=False)
        p._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
        return p

    # ------------------------------------------------------------------ snapshot
    def _version(self) -> tuple:
        m = self.module
        return (m.steps, m.ownership_version, not m.step_pending)

    def invalidate(self) -> None:
        """The store was written behind the module's step counter (e.g. `load_full_tables`): refresh next time."""
        self._fresh = None

    @torch.no_grad()
    def refresh(self) -> None:
        """Fill the home-block buffers with the current rows and optimizer state (collective; see the module doc).
        A no-op when nothing changed since the last refresh or load."""
        m = self.module
        if m.step_pending:
            m.finish_step()  # the step's shared rows get their update first (collective, like the step itself)
        m.sync_directory()  # which rows are away, and where (collective; a no-op where every move was applied here)
        if self._fresh == self._version():
            return
        self._check_exposed_globally()  # before the fetch overwrites the home slots of rows away
        st = m.store
        if not self.views:
            for t in range(st.num_tables):
                hl = st.home_len[t]
                if hl == 0:
                    continue
                w, s = st.read_slots(t, np.arange(hl))  # rows away leave stale slots: overwritten below
                self.home_w[t].copy_(w)
                if self.has_state:
                    self.home_s[t].copy_(s.reshape(self.home_s[t].shape))
        self._fetch_guests()
        # views: the home slots of rows away now hold their current values; what is written there before the next
        # step (copy_state_dict, a DCP load, an edit) goes to the owners then (`settle`)
        self._copies_pending = self.views and bool(st.guest_count_all.any())
        if not self.views:
            self._copy_sums = self._sums()
        self._fresh = self._version()

    # ------------------------------------------------------------ in-place writes
    def _sums(self) -> torch.Tensor:
        """Per table, the float64 sum of the copies (weights, then state): how a write into them is noticed on CUDA."""
        parts = [w.double().sum() for w in self.home_w] + [s.double().sum() for s in self.home_s]
        return torch.stack(parts) if parts else torch.zeros(0, dtype=torch.float64)

    @torch.no_grad()
    def settle(self) -> None:
        """Before anything reads or moves rows (a step, `full_tables`, a load): the values written in place into the
        state dicts' tensors reach the rows (collective when copies are pending, a state every rank shares).

        CPU: home rows present are the tensors themselves; rows away as guests have a refreshed copy in their home
        slot, which goes to the owner (one all-to-all, home rank -> owner, sizes known from the ownership map); an
        unwritten copy equals the owner's value, so this is exact either way. CUDA: the tensors are copies and
        writes into them are not applied; a write is detected (their sums changed) and warned about."""
        if self._copies_pending:
            self._copies_pending = False
            self._push_copies()
        if self._copy_sums is not None:
            sums, self._copy_sums = self._copy_sums, None
            if not torch.equal(self._sums(), sums):
                self._warn(
                    "copies",
                    "Herald on CUDA: values written in place into state_dict() / fused_optimizer.state_dict() "
                    "tensors are not applied to the tables (they are copies there: the HBM cache holds rows a view "
                    "could not see); load them with load_state_dict() / fused_optimizer.load_state_dict()",
                )

    def _push_copies(self) -> None:
        m, st = self.module, self.module.store
        tab, row, owner, home = self._guests()
        if tab.shape[0] == 0:
            return
        width = st.packed_widths(tab)
        send, recv, send_splits, recv_splits = routes(home, owner, width, m.rank, m.world_size)
        buf = st.read_packed(
            tab[send], row[send] - np.asarray(st.home_lo, dtype=np.int64)[tab[send]]
        )  # the home slots of rows away
        got = self._comm.all_to_all(buf, send_splits, recv_splits, "checkpoint")
        if recv.shape[0]:
            st.write_packed(tab[recv], st.slot_of_all[st.gkeys(tab[recv], row[recv])].astype(np.int64), got)

    # ------------------------------------------------------------ named_parameters
    def expose_parameters(self) -> list[nn.Parameter]:
        """The tables' parameters for `named_parameters()` (no communication). Rows living as guests on other ranks
        are not in them, unless a `state_dict()` since the last step put their values there (then writes to them
        apply, as through the state dict). Otherwise their entries are stale: a warning says so once, and a write
        into them is an error at the next step or state_dict() on every rank, never dropped silently."""
        st = self.module.store
        if self.views and not self._copies_pending and self._exposed is None:
            dead = _DeadSlots.of(st)
            if dead.tables.shape[0]:
                self._exposed = dead
                self._warn(
                    "stale",
                    f"named_parameters() of a Herald-managed EBC: {dead.tables.shape[0]} rows of rank "
                    f"{self.module.rank}'s home blocks live on other ranks now (the scheduler moved them); their "
                    "entries here are stale and writes to them are refused. Call dmp.state_dict() first (collective): "
                    "it puts every row's current value into these tensors, and writes to them then take effect",
                )
        return self.table_parameters

    def exposed_writes(self) -> str | None:
        """This rank's check of `expose_parameters` (local): a message naming the rows away that were written."""
        dead, self._exposed = self._exposed, None
        if dead is None:
            return None
        written = dead.written(self.module.store)
        if not written:
            return None
        name, rows = written
        return (
            f"table {name!r}: rows {rows} were written through named_parameters() while they lived on other ranks "
            "(the scheduler had moved them), where the write cannot reach them. Call dmp.state_dict() (on every "
            "rank) before writing tables in place: it brings every row's current value into those tensors"
        )

    def _check_exposed_globally(self) -> None:
        """`exposed_writes` on every rank, raised on every rank (one flag all-reduce, only when rows are away)."""
        st = self.module.store
        if not self.views or not st.guest_count_all.any():
            self._exposed = None
            return
        msg = self.exposed_writes()
        if dist.is_initialized() and self.module.world_size > 1:
            flag = torch.tensor([0 if msg is None else self.module.rank + 1], dtype=torch.int64)
            self._comm.all_reduce(flag, "control")
            if msg is None and int(flag.item()):
                msg = f"rank {int(flag.item()) - 1}: rows living on other ranks were written through named_parameters()"
        if msg is not None:
            raise ValueError(msg)

    def _warn(self, kind: str, msg: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _guests(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every row living away from home, in global-key order: (table, row, owner, home rank) — the same on every
        rank (the ownership map is global). O(rows) numpy work per table holding guests, only at checkpoint time."""
        st = self.module.store
        parts = []
        for t in np.flatnonzero(st.guest_count_all.sum(axis=1)).tolist():
            home = np.arange(st.rows[t], dtype=np.int64) // st.home_block_arr[t]
            away = np.flatnonzero(st.owner[t] != home)
            parts.append(
                (np.full(away.shape[0], t, dtype=np.int64), away, st.owner[t][away].astype(np.int64), home[away])
            )
        if not parts:
            z = np.zeros(0, dtype=np.int64)
            return z, z, z, z
        return tuple(np.concatenate(x) for x in zip(*parts))  # type: ignore[return-value]

    def _fetch_guests(self) -> None:
        """Copy every guest row (value + state) from its owner into its home rank's buffers (no ownership change):
        one all-to-all, owner -> home rank, split sizes known everywhere."""
        m, st = self.module, self.module.store
        if not st.guest_count_all.any():
            return
        tab, row, owner, home = self._guests()
        width = st.packed_widths(tab)
        send, recv, send_splits, recv_splits = routes(owner, home, width, m.rank, m.world_size)
        buf = st.read_packed(tab[send], st.slot_of_all[st.gkeys(tab[send], row[send])].astype(np.int64))
        got = self._comm.all_to_all(buf, send_splits, recv_splits, "checkpoint")
        r_tab, r_row, r_width = tab[recv], row[recv], width[recv]
        start = exclusive_cumsum(r_width)
        for t in np.unique(r_tab).tolist():
            sel = np.flatnonzero(r_tab == t)
            w = int(r_width[sel[0]])
            block = got[torch.from_numpy(ragged_arange(start[sel], r_width[sel])).to(got.device)].view(-1, w)
            idx = torch.from_numpy(r_row[sel] - st.home_lo[t]).to(got.device)
            rows, state = st.unpack_rows(t, block)  # float16 rows travel as their bits (read_packed)
            self.home_w[t].index_copy_(0, idx, rows.to(self.home_w[t].dtype))
            if self.has_state:
                self.home_s[t].index_copy_(0, idx, state.reshape((-1,) + self.home_s[t].shape[1:]))

    # ---------------------------------------------------------------------- load
    def send_guests_home(self) -> None:
        """Every guest row (value + optimizer state) moves back to its home rank, as a plan of evictions executed
        by the module itself (collective; no communication when no rank holds a guest)."""
        m, st = self.module, self.module.store
        if not st.guest_count_all.any():
            return
        tab, row, owner, home = self._guests()
        moves = RowMoves(table=tab, row=row, src=owner, dst=home, kind=np.full(tab.shape[0], EVICT_HOME, dtype=np.int8))
        plan = Plan(
            step=-1, num_ranks=m.world_size, batch_per_rank=0, sample_order=np.zeros(0, dtype=np.int64), moves=moves
        )
        self._lookup.apply_moves(prepare_moves(plan, st), None)

    @torch.no_grad()
    def load(
        self, weights: dict[int, torch.Tensor] | None = None, states: dict[int, torch.Tensor] | None = None
    ) -> None:
        """Write home blocks (table index -> [home_len, dim] / [home_len]) into the store and reset ownership to
        home (collective). Tables not given keep their current values."""
        m, st = self.module, self.module.store
        m.drop_pending()  # its gradients belong to the model being replaced
        m.clear_plans()
        m.sync_directory()  # which rows are away, and where (collective)
        self.settle()  # the state dicts' tensors, written in place by DCP, are what goes home and is loaded
        self._exposed = None
        if self.views:  # a given tensor that is a home block itself is in place already; one overlapping it is read
            weights = {t: _unaliased(w, self.home_w[t]) for t, w in (weights or {}).items()}
            states = {t: _unaliased(s, self.home_s[t]) for t, s in (states or {}).items()}
        self.send_guests_home()
        for t in range(st.num_tables):
            hl = st.home_len[t]
            w = (weights or {}).get(t)
            s = (states or {}).get(t) if self.has_state else None
            if hl == 0 or (w is None and s is None):
                continue
            slots = np.arange(hl)
            if w is None:  # only the optimizer state: the weights stay (the buffers keep what DCP put there)
                st.write_slots(t, slots, st.read_slots(t, slots)[0], s.reshape(hl, -1))
            else:
                st.write_slots(t, slots, w, None if s is None else s.reshape(hl, -1))
                if w is not self.home_w[t] and not self.views:
                    self.home_w[t].copy_(w)
            if s is not None and s is not self.home_s[t] and not (self.views and self.has_state):
                self.home_s[t].copy_(s.reshape(self.home_s[t].shape))
        m.ownership_version += 1
        # the buffers now hold the loaded rows (and, for tables not loaded, their last snapshot): a DCP load of the
        # optimizer state into them right after a model load must survive until it is applied
        self._fresh = self._version()

    def home_block(self, t: int, value: Any, what: str) -> torch.Tensor:
        """This rank's home block of table t from a state-dict value: a ShardedTensor whose local shard is exactly
        the home block (DCP reshards into Herald's own state dict, so that is what a DCP load gives), or a full
        unsharded tensor (e.g. from `dcp_to_torch_save` or an unsharded EBC)."""
        st = self.module.store
        name = self.module.table_names[t]
        lo, hl = st.home_lo[t], st.home_len[t]
        full = (st.rows[t], st.dims[t]) if what == "weight" else self.state_layout.shape(st.rows[t], st.dims[t])
        if tuple(value.shape) != full:
            raise ValueError(f"table {name!r}: checkpoint {what} has shape {tuple(value.shape)}, expected {full}")
        if isinstance(value, ShardedTensor):
            shards = value.local_shards()
            got = [(int(s.metadata.shard_offsets[0]), int(s.metadata.shard_sizes[0])) for s in shards]
            if hl == 0 and all(n == 0 for _, n in got):
                return torch.zeros((0,) + full[1:], device=self.module.device)
            if got != [(lo, hl)]:
                raise ValueError(
                    f"table {name!r}: the {what} ShardedTensor's local shards {got} are not rank "
                    f"{self.module.rank}'s home block {(lo, hl)}; "
                    "load it through DCP into this model's own state_dict()"
                )
            return shards[0].tensor.reshape((hl,) + full[1:])
        return value.detach()[lo : lo + hl]


def _unaliased(given: torch.Tensor | None, home: torch.Tensor) -> torch.Tensor | None:
    """`given` to be written into the home block `home`: None when it is `home` itself (nothing to write: the
    guests sent home land in it), a copy when it shares `home`'s storage otherwise (a write must not read what it
    overwrites), else `given`."""
    if given is None or given.untyped_storage().data_ptr() != home.untyped_storage().data_ptr():
        return given
    if given.data_ptr() == home.data_ptr() and given.numel() == home.numel() and given.is_contiguous():
        return None
    return given.clone()


# ------------------------------------------------------------------------------------------------ module hooks
def install_state_dict_hooks(module: nn.Module, ck: HeraldCheckpoint) -> None:
    """`state_dict()` gives TorchRec's keys (no TBE internals); `load_state_dict()` writes home rows and resets
    ownership. `_FORCE_STATE_DICT_LOAD` makes DMP call the module's own `load_state_dict` (with its hooks). The
    hooks are bound to `ck`, so they read nothing of the module but the state dict."""
    module._FORCE_STATE_DICT_LOAD = True
    module._register_state_dict_hook(partial(_state_dict_hook, ck))
    module._register_load_state_dict_pre_hook(partial(_load_pre_hook, ck), with_module=True)
    module.register_load_state_dict_post_hook(partial(_load_post_hook, ck))


def _state_dict_hook(
    ck: HeraldCheckpoint, module: nn.Module, destination: dict, prefix: str, local_metadata: Any
) -> None:
    for k in [k for k in destination if k.startswith(prefix + STORE_PREFIX)]:
        del destination[k]
    ck.refresh()
    for name, w in zip(ck.module.table_names, ck.weights):
        destination[prefix + weight_key(name)] = w


def _load_pre_hook(
    ck: HeraldCheckpoint,
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
) -> None:
    ck.load_prefix = prefix
    internals = [k for k in state_dict if k.startswith(prefix + STORE_PREFIX)]
    for k in internals:
        del state_dict[k]  # slot-ordered FBGEMM internals: loading them would scramble the tables
    if internals:
        error_msgs.append(
            f"{prefix or 'the module'}: the state dict holds FBGEMM internals of a Herald module "
            f"({internals[0]}, ...), "
            f"which are in slot order; save with this version (keys {prefix}embedding_bags.<table>.weight)"
        )
    weights = {}
    for t, name in enumerate(ck.module.table_names):
        key = prefix + weight_key(name)
        if key not in state_dict:
            missing_keys.append(key)
            continue
        try:
            weights[t] = ck.home_block(t, state_dict.pop(key), "weight")
        except ValueError as e:
            error_msgs.append(str(e))
    if weights and not error_msgs:
        ck.load(weights=weights)


def _load_post_hook(ck: HeraldCheckpoint, module: nn.Module, incompatible_keys: Any) -> None:
    internal = ck.load_prefix + STORE_PREFIX
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if not k.startswith(internal)]


# -------------------------------------------------------------------------------------------------- mixed EBC
@dataclass
class _MixedKeys:
    """What the mixed module's hooks share: which tables are Herald's, and the prefix of the load under way."""

    herald_tables: frozenset[str]
    load_prefix: str = ""


def install_mixed_state_dict_hooks(module: nn.Module, herald_tables: list[str]) -> None:
    """A `ShardedMixedEmbeddingBagCollection` keeps its parts under `herald.` / `stock.`; its state dict shows
    neither, so a mixed model's checkpoint has the keys of a stock one (`embedding_bags.<t>.weight`)."""
    keys = _MixedKeys(frozenset(herald_tables))
    module._FORCE_STATE_DICT_LOAD = True
    module._register_state_dict_hook(_mixed_state_dict_hook)
    module._register_load_state_dict_pre_hook(partial(_mixed_load_pre_hook, keys), with_module=True)
    module.register_load_state_dict_post_hook(partial(_mixed_load_post_hook, keys))


_PARTS = ("herald.", "stock.")


def _mixed_state_dict_hook(module: nn.Module, destination: dict, prefix: str, local_metadata: Any) -> None:
    for k in list(destination):
        for part in _PARTS:
            if k.startswith(prefix + part):
                destination[prefix + k[len(prefix + part) :]] = destination.pop(k)


def _mixed_load_pre_hook(keys: _MixedKeys, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    keys.load_prefix = prefix
    for k in list(state_dict):
        rest = k[len(prefix) :] if k.startswith(prefix) else None
        if rest is None or not rest.startswith("embedding_bags."):
            continue
        table = rest.split(".")[1]
        state_dict[prefix + ("herald." if table in keys.herald_tables else "stock.") + rest] = state_dict.pop(k)


def _mixed_load_post_hook(keys: _MixedKeys, module: nn.Module, incompatible_keys: Any) -> None:
    prefix = keys.load_prefix
    for names in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        for i, k in enumerate(names):
            for part in _PARTS:
                if k.startswith(prefix + part):
                    names[i] = prefix + k[len(prefix + part) :]
