"""The replica region: rows replicated on every rank (the `fae` and `p2res` baselines), executed exactly.

A replica plan (schedule/baselines/replicated.py) reads some keys of a step *through replicas*: every reader reads its
local copy and, after backward, the gradients of those rows are summed over all ranks with ONE all-reduce and every rank
applies the same summed update to its copy. The other keys of the step go through the ordinary data plane (home
owner, `Plan.shared`), which this module does not touch.

Layout. The replicated rows live in a second FBGEMM TBE per rank (a `RowStore` with one "rank" holding every
replicated row: table t's k-th replicated row, in row order, is its slot k), built when a plan names the replicated
set (`ReplicaSync.replicated_*`) and filled from the home copies. The home rank keeps its home copy current too:
it applies the same summed gradient to its home slot through its own TBE. So the home copy is always the latest
value, `to_home` syncs cost nothing, checkpoints / `full_tables` / eval (which read home rows) need no hook, and
`to_replicas` (fae, after cold batches updated hot rows at home) copies home value + optimizer state to every
replica.

Exactness: both updates go through `RowStore.apply_summed_gradients_packed` — the same FBGEMM kernel, optimizer
state and summed gradient as the owner's single update of a shared row — so the trained model equals stock
TorchRec's (SGD and row-wise Adagrad). The gradients reaching the leaf values already carry the module's gradient
division (the caller adds them into the pooled output before `_DivideGrad`), as the shared path's do.

Collectives (every rank, same order): `begin` (declare: an all-reduce of the home rows, "replica_init";
to_replicas: "replica_sync"), `finish` (the gradient all-reduce, "allreduce"); a sum of one non-zero contribution
and zeros is exact, so the copies are bit-identical to the home rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from herald_torchrec.distributed.comm import PlanComm
from herald_torchrec.distributed.step.prepare import LocalInput
from herald_torchrec.distributed.storage.row_layout import exclusive_cumsum, ragged_arange, rank_within_group
from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec
from herald_torchrec.schedule.plan import Plan


@dataclass
class ReplicaStep:
    """One step's replica reads on this rank."""

    table: np.ndarray  # the step's all-reduced rows (every rank's replica reads), sorted by global key
    slot: np.ndarray  # their replica slots
    home_slot: np.ndarray  # their slots in the home store (-1 where this rank is not their home)
    off: np.ndarray  # float offset of each row in the all-reduce buffer
    size: int  # floats in the all-reduce buffer
    read: np.ndarray  # indices (into the rows above) of the rows read here, increasing
    via: np.ndarray | None = None  # bool over the local ids: read through replicas
    mark: np.ndarray | None = None  # for those ids, the index of their row among the rows above
    values: torch.Tensor | None = None  # their values, a leaf requiring grad when training


def drop_ids(local: LocalInput, keep: np.ndarray) -> LocalInput:
    """`local` without the ids where `keep` is False (bags keep their place, lengths shrink)."""
    F, B = local.lengths.shape
    seg = local.seg[keep]
    lengths = np.bincount(seg, minlength=F * B).astype(np.int64).reshape(F, B)
    return LocalInput(local.batch_size, local.values[keep], lengths, local.gkeys[keep], seg)


class ReplicaRegion:
    """Every rank's copies of the replicated rows, for one sharded module (`store` is its home RowStore)."""

    def __init__(
        self,
        store: RowStore,
        comm: PlanComm,
        device: torch.device,
        optimizer: Any,
        learning_rate: float,
        eps: float,
        tbe_settings: Mapping[str, Any] | None = None,
    ) -> None:
        self.store, self.comm, self.device = store, comm, device
        self._settings = dict(
            optimizer=optimizer, learning_rate=learning_rate, eps=eps, tbe_settings=dict(tbe_settings or {})
        )
        self.copies: RowStore | None = None  # built by the first plan that names the replicated set
        # by global key, allocated with the first replicated set (a module that never replicates pays nothing):
        self.slot_of: np.ndarray | None = None  # replica slot
        self._mark: np.ndarray | None = None  # step scratch

    @property
    def num_rows(self) -> int:
        return 0 if self.slot_of is None else int((self.slot_of >= 0).sum())

    def set_learning_rate(self, lr: float) -> None:
        self._settings["learning_rate"] = float(lr)
        if self.copies is not None:
            self.copies.tbe.set_learning_rate(float(lr))

    # ------------------------------------------------------------------ syncs (before the step)
    def declare(self, tables: np.ndarray, rows: np.ndarray) -> None:
        """Build the region for this replicated set, every copy initialised from its home row (collective)."""
        st = self.store
        st.check_keys_many(tables, rows, "replicated rows")
        gk = st.gkeys(tables, rows)
        order = np.argsort(gk, kind="stable")
        tables, rows, gk = tables[order], rows[order], gk[order]
        if (gk[1:] == gk[:-1]).any():
            raise ValueError("replica plan: a replicated row is named twice")
        counts = np.bincount(tables, minlength=st.num_tables)
        specs = [TableSpec(s.name, max(1, int(n)), s.dim) for s, n in zip(st.tables, counts)]
        s = self._settings
        self.copies = RowStore(
            specs,
            rank=0,
            world_size=1,
            cache_ratio=1e-9,
            optimizer=s["optimizer"],
            learning_rate=s["learning_rate"],
            eps=s["eps"],
            features_per_table=st.features_per_table,
            device=self.device,
            tbe_settings=s["tbe_settings"],
        )
        if self.slot_of is None:
            self.slot_of = np.full(int(st.key_base[-1]), -1, dtype=np.int64)
            self._mark = np.full(int(st.key_base[-1]), -1, dtype=np.int64)
        self.slot_of[:] = -1
        self.slot_of[gk] = rank_within_group(tables, st.num_tables)
        self.copy_from_home(tables, rows, "replica_init")

    def copy_from_home(self, tables: np.ndarray, rows: np.ndarray, kind: str) -> None:
        """Every replica of these rows := the home row (value + optimizer state): one all-reduce in which only the
        home rank contributes each row (collective)."""
        st = self.store
        tables, rows = np.asarray(tables, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        if tables.shape[0] == 0:
            return
        gk = st.gkeys(tables, rows)
        slots = self.slot_of[gk] if self.slot_of is not None else np.full(gk.shape[0], -1, dtype=np.int64)
        if (slots < 0).any():
            raise ValueError(f"replica plan: rows {rows[slots < 0][:5].tolist()} are synced but not replicated")
        width = st.packed_widths(tables)
        start = exclusive_cumsum(width)
        buf = torch.zeros(int(width.sum()), dtype=torch.float32, device=self.device)
        home_slot = st.slot_of_all[gk].astype(np.int64)
        mine = np.flatnonzero(home_slot >= 0)
        if mine.size:
            pos = torch.from_numpy(ragged_arange(start[mine], width[mine])).to(self.device)
            buf.index_copy_(0, pos, st.read_packed(tables[mine], home_slot[mine]))
        if st.world_size > 1:
            self.comm.all_reduce(buf, kind)
        self.copies.write_packed(tables, slots, buf)

    # ------------------------------------------------------------------ the step
    def begin(self, plan: Plan, local: LocalInput | None) -> tuple[LocalInput | None, ReplicaStep | None]:
        """Apply the plan's syncs (collective) and take the ids read through replicas out of `local`: returns the
        ids left to the ordinary data plane and this rank's replica reads (None when the plan has no replicas)."""
        rs = plan.replicas
        if rs is None:
            return local, None
        if rs.replicated_row.shape[0]:
            self.declare(np.asarray(rs.replicated_table, dtype=np.int64), np.asarray(rs.replicated_row, dtype=np.int64))
        if rs.to_replicas_row.shape[0]:
            self.copy_from_home(rs.to_replicas_table, rs.to_replicas_row, "replica_sync")
        # to_home: nothing to do, the home copy is kept current by `finish`
        st = self.store
        tab = np.asarray(rs.allreduce_table, dtype=np.int64)
        row = np.asarray(rs.allreduce_row, dtype=np.int64)
        if tab.shape[0] == 0:
            return local, None
        st.check_keys_many(tab, row, f"plan {plan.step}: all-reduced rows")
        gk = st.gkeys(tab, row)
        order = np.argsort(gk, kind="stable")
        tab, gk = tab[order], gk[order]
        slot = self.slot_of[gk] if self.copies is not None else None
        if slot is None or (slot < 0).any():
            raise ValueError(f"plan {plan.step}: rows read through replicas are not in the replicated set")
        d = st.dims_arr[tab]
        off = exclusive_cumsum(d)
        step = ReplicaStep(tab, slot, st.slot_of_all[gk].astype(np.int64), off, int(d.sum()), np.zeros(0, np.int64))
        if local is None:
            return None, step
        self._mark[gk] = np.arange(gk.shape[0], dtype=np.int64)
        try:
            mark = self._mark[local.gkeys]
        finally:
            self._mark[gk] = -1
        via = mark >= 0
        step.read, step.via, step.mark = np.unique(mark[via]), via, mark[via]
        return drop_ids(local, ~via), step

    def pooled(self, local: LocalInput, step: ReplicaStep, out: torch.Tensor, training: bool) -> torch.Tensor:
        """`out` plus the replica reads of `local` (the full local input of the step) summed into their bags."""
        cp, st = self.copies, self.store
        via, mark = step.via, step.mark
        tab = step.table[step.read]
        vals = cp.read_packed(tab, step.slot[step.read], with_state=False)
        if training:
            vals.requires_grad_(True)
        step.values = vals
        if not mark.shape[0]:
            return out
        B = local.batch_size
        f_dims = st.dims_arr[st.feature_table_arr]
        f_col = exclusive_cumsum(f_dims)
        f, bag = np.divmod(local.seg[via], B)
        d = f_dims[f]
        voff = exclusive_cumsum(st.dims_arr[tab])
        src = ragged_arange(voff[np.searchsorted(step.read, mark)], d)
        dst = ragged_arange(bag * int(f_dims.sum()) + f_col[f], d)
        v = vals.index_select(0, torch.from_numpy(src).to(self.device))
        extra = torch.zeros(out.numel(), dtype=v.dtype, device=self.device).index_add(
            0, torch.from_numpy(dst).to(self.device), v
        )
        return out + st.clip_pooled_gradient(extra.view(out.shape))  # clipped per bag, as the TBE clips its own

    def hits(self, step: ReplicaStep) -> np.ndarray:
        """Distinct keys read here through replicas, per table (they are local reads: hits)."""
        return np.bincount(step.table[step.read], minlength=self.store.num_tables).astype(np.int64)

    def finish(self, step: ReplicaStep) -> None:
        """Sum the replica gradients over ranks (one all-reduce) and apply the same update to every copy, and to the
        home copy on the home rank (collective)."""
        st = self.store
        buf = torch.zeros(step.size, dtype=torch.float32, device=self.device)
        vals = step.values
        step.values = None
        if vals is not None and vals.grad is not None and step.read.shape[0]:
            d = st.dims_arr[step.table[step.read]]
            pos = torch.from_numpy(ragged_arange(step.off[step.read], d)).to(self.device)
            buf.index_copy_(0, pos, vals.grad.detach().to(buf.dtype))
        if st.world_size > 1:
            self.comm.all_reduce(buf, "allreduce")
        self.copies.apply_summed_gradients_packed(step.table, step.slot, buf)
        home = np.flatnonzero(step.home_slot >= 0)
        if home.size:
            pos = torch.from_numpy(ragged_arange(step.off[home], st.dims_arr[step.table[home]])).to(self.device)
            st.apply_summed_gradients_packed(step.table[home], step.home_slot[home], buf.index_select(0, pos))
