"""The replica region: rows replicated on every rank, read locally, updated from one all-reduce, executed exactly.

Herald replicates the rows every host reads (`HeraldPolicy(replicate=True)`, schedule/herald/replicas.py), and the
comparison systems `fae` / `p2res` replicate their hot rows (schedule/baselines/replicated.py); both run here, as the
step extension `ReplicaExtension` (step/extension.py) of the sharded module. A replica plan reads some keys of a step
*through replicas*: every reader reads its local copy and, after backward, the gradients of those rows are summed
over all ranks with ONE all-reduce and every rank applies the same summed update to its copy. The other keys of the
step go through the ordinary data plane (moves, `Plan.shared`), which this module does not touch.

Layout. The replicated rows live in a second FBGEMM TBE per rank (a `RowStore` with one "rank" holding every
replicated row: table t's k-th replicated row, in row order, is its slot k), built whenever a plan declares the
replicated set (`ReplicaSync.replicated_*`: the whole set, each time it gains rows) and filled from each row's
*owner copy*: its slot on the rank that owns it (`RowStore.slot_of_all`), which is its home slot for fae / p2res and,
under Herald, may be a guest slot. The owner keeps its copy current too: it applies the same summed gradient to its
own slot through its own TBE (exactly one rank owns a row, so exactly one rank applies it). So the owner copy is
always the latest value: a row may leave the set with no sync (Herald then moves it like any row), `to_home` syncs
cost nothing, checkpoints / `full_tables` / eval (which read the owners' rows) need no hook, and `to_replicas` (fae,
after cold batches updated hot rows at home) copies the owner's value + optimizer state to every replica.

Order within a step: a row read through replicas is neither moved nor shared in that step, and a declared row is not
moved in the step that declares it (Herald pins its replicated rows; fae / p2res never move rows): its owner slot,
read when the step begins, must still hold it when `finish` applies the update. A plan that breaks this is a
ValueError.

Exactness: both updates go through `RowStore.apply_summed_gradients_packed` — the same FBGEMM kernel, optimizer
state and summed gradient as the owner's single update of a shared row — so the trained model equals stock
TorchRec's (SGD and row-wise Adagrad). The gradients reaching the leaf values already carry the module's gradient
division (the caller adds them into the pooled output before `_DivideGrad`), as the shared path's do.

Collectives (every rank, same order): `begin` (declare: an all-reduce of the owners' rows, "replica_init";
to_replicas: "replica_sync"), `finish` (the gradient all-reduce, "allreduce"). The owners' rows are summed as int32
words: one rank contributes a row's words, every other rank zeros, and an integer sum of one addend and zeros is
that addend, so the copies are bit-identical to the owners' rows. A float32 sum is not: FP16 rows travel as their
bits two to a float32 word (storage/row_store.py), and such a word may read as -0.0 (+0.0 + -0.0 gives +0.0: a
float16 -0.0 lost), a subnormal (flushed where denormals are off) or a signalling NaN (quieted); float32 state's -0.0
too. The gradients are real float32 values, summed as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from herald_torchrec.distributed.comm import PlanComm, phase
from herald_torchrec.distributed.step.extension import ExtensionResources
from herald_torchrec.distributed.step.prepare import LocalInput
from herald_torchrec.distributed.storage.row_layout import exclusive_cumsum, ragged_arange, rank_within_group
from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec
from herald_torchrec.schedule.plan import Plan


@dataclass
class ReplicaStep:
    """One step's replica reads on this rank."""

    table: np.ndarray  # the step's all-reduced rows (every rank's replica reads), sorted by global key
    slot: np.ndarray  # their replica slots
    owner_slot: np.ndarray  # their slots in this rank's store (home or guest; -1 where this rank does not own them)
    off: np.ndarray  # float offset of each row in the all-reduce buffer
    size: int  # floats in the all-reduce buffer
    read: np.ndarray  # indices (into the rows above) of the rows read here, increasing
    via: np.ndarray | None = None  # bool over the local ids: read through replicas
    mark: np.ndarray | None = None  # for those ids, the index of their row among the rows above
    values: torch.Tensor | None = None  # their values, a leaf requiring grad when training


@dataclass(frozen=True)
class ReplicaJoins:
    """The rows a declaration added to the set, as this rank saw them: those whose copies it sent (it owned them),
    and of those the ones it held in a guest slot (Herald moved them here before they joined). `declared`: the step
    declared a set (the same on every rank, so every rank reports the counters of such a step)."""

    declared: bool = False
    sent: int = 0
    from_guest: int = 0


def drop_ids(local: LocalInput, keep: np.ndarray) -> LocalInput:
    """`local` without the ids where `keep` is False (bags keep their place, lengths shrink)."""
    F, B = local.lengths.shape
    seg = local.seg[keep]
    lengths = np.bincount(seg, minlength=F * B).astype(np.int64).reshape(F, B)
    weights = None if local.weights is None else local.weights[keep]
    return LocalInput(local.batch_size, local.values[keep], lengths, local.gkeys[keep], seg, weights)


class ReplicaRegion:
    """Every rank's copies of the replicated rows, for one sharded module (`store` is its RowStore: the owners'
    copies)."""

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

    def reset(self) -> None:
        """Forget the set (a load rewrote the owners' rows: the copies are stale until a plan declares a set)."""
        self.copies = None
        if self.slot_of is not None:
            self.slot_of[:] = -1

    # ------------------------------------------------------------------ syncs (before the step)
    def declare(self, tables: np.ndarray, rows: np.ndarray) -> ReplicaJoins:
        """Build the region for this replicated set (it replaces the previous one), every copy initialised from its
        owner's row (collective). Returns the rows this rank sent that were not in the previous set."""
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
        new = self.slot_of[gk] < 0  # not in the previous set
        self.slot_of[:] = -1
        self.slot_of[gk] = rank_within_group(tables, st.num_tables)
        owner_slot = self.copy_from_owners(tables, rows, "replica_init")
        sent = new & (owner_slot >= 0)
        guest = owner_slot >= np.asarray(st.home_len, dtype=np.int64)[tables]
        return ReplicaJoins(True, int(sent.sum()), int((sent & guest).sum()))

    def copy_from_owners(self, tables: np.ndarray, rows: np.ndarray, kind: str) -> np.ndarray:
        """Every replica of these rows := the owner's row (value + optimizer state): one all-reduce in which only the
        rank owning each row contributes it, from its slot there (home or guest) (collective). Returns this rank's
        slots of the rows (-1 where another rank owns them)."""
        st = self.store
        tables, rows = np.asarray(tables, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        if tables.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        gk = st.gkeys(tables, rows)
        slots = self.slot_of[gk] if self.slot_of is not None else np.full(gk.shape[0], -1, dtype=np.int64)
        if (slots < 0).any():
            raise ValueError(f"replica plan: rows {rows[slots < 0][:5].tolist()} are synced but not replicated")
        width = st.packed_widths(tables)
        start = exclusive_cumsum(width)
        buf = torch.zeros(int(width.sum()), dtype=torch.float32, device=self.device)
        owner_slot = st.slot_of_all[gk].astype(np.int64)  # the owner's copy: exactly one rank holds each row
        mine = np.flatnonzero(owner_slot >= 0)
        if mine.size:
            pos = torch.from_numpy(ragged_arange(start[mine], width[mine])).to(self.device)
            buf.index_copy_(0, pos, st.read_packed(tables[mine], owner_slot[mine]))
        if st.world_size > 1:  # summed as int32 words: exact for any bits (module docstring, "Collectives")
            self.comm.all_reduce(buf.view(torch.int32), kind)
        self.copies.write_packed(tables, slots, buf)
        return owner_slot

    # ------------------------------------------------------------------ the step
    def check_order(self, plan: Plan) -> None:
        """ValueError if the plan moves a row it reads through replicas or declares, or shares a row it reads
        through replicas (module docstring: the owner slot read at `begin` must still hold the row at `finish`, and
        a row read both ways would be updated twice). The same on every rank: it depends on the plan alone."""
        rs, st = plan.replicas, self.store
        ar = st.gkeys(np.asarray(rs.allreduce_table, dtype=np.int64), np.asarray(rs.allreduce_row, dtype=np.int64))
        pinned = np.concatenate(
            [ar, st.gkeys(np.asarray(rs.replicated_table, dtype=np.int64), np.asarray(rs.replicated_row, np.int64))]
        )
        for what, part, rows in (("moves", plan.moves, pinned), ("shares", plan.shared, ar)):
            if not rows.shape[0] or not part.row.shape[0]:
                continue
            both = np.intersect1d(st.gkeys(part.table, part.row), rows)
            if both.shape[0]:
                t = st.tables_of(both[:1])
                raise ValueError(
                    f"plan {plan.step} {what} replicated rows (e.g. table {st.tables[int(t[0])].name!r} row "
                    f"{int(both[0] - st.key_base[t[0]])}, {both.shape[0]} in all): a row read through replicas or "
                    "declared in a step is never moved or shared in it"
                )

    def begin(self, plan: Plan, local: LocalInput | None) -> tuple[LocalInput | None, ReplicaStep | None, ReplicaJoins]:
        """Apply the plan's syncs (collective) and take the ids read through replicas out of `local`: returns the
        ids left to the ordinary data plane, this rank's replica reads (None when the plan reads none) and the rows
        that joined the set here."""
        rs = plan.replicas
        joins = ReplicaJoins()
        if rs is None:
            return local, None, joins
        self.check_order(plan)
        if rs.replicated_row.shape[0]:
            joins = self.declare(
                np.asarray(rs.replicated_table, dtype=np.int64), np.asarray(rs.replicated_row, dtype=np.int64)
            )
        if rs.to_replicas_row.shape[0]:
            self.copy_from_owners(rs.to_replicas_table, rs.to_replicas_row, "replica_sync")
        # to_home: nothing to do, the owner's copy is kept current by `finish`
        st = self.store
        tab = np.asarray(rs.allreduce_table, dtype=np.int64)
        row = np.asarray(rs.allreduce_row, dtype=np.int64)
        if tab.shape[0] == 0:
            return local, None, joins
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
            return None, step, joins
        self._mark[gk] = np.arange(gk.shape[0], dtype=np.int64)
        try:
            mark = self._mark[local.gkeys]
        finally:
            self._mark[gk] = -1
        via = mark >= 0
        step.read, step.via, step.mark = np.unique(mark[via]), via, mark[via]
        return drop_ids(local, ~via), step, joins

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
        if local.weights is not None:  # weighted features: w * value (and w * the bag's gradient in backward)
            v = v * torch.from_numpy(np.repeat(local.weights[via], d)).to(v)
        extra = torch.zeros(out.numel(), dtype=v.dtype, device=self.device).index_add(
            0, torch.from_numpy(dst).to(self.device), v
        )
        return out + st.clip_pooled_gradient(extra.view(out.shape))  # clipped per bag, as the TBE clips its own

    def hits(self, step: ReplicaStep) -> np.ndarray:
        """Distinct keys read here through replicas, per table (they are local reads: hits)."""
        return np.bincount(step.table[step.read], minlength=self.store.num_tables).astype(np.int64)

    def finish(self, step: ReplicaStep) -> None:
        """Sum the replica gradients over ranks (one all-reduce) and apply the same update to every copy, and to the
        owner's copy on the rank that owns the row (its home or a guest slot; collective)."""
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
        mine = np.flatnonzero(step.owner_slot >= 0)
        if mine.size:
            pos = torch.from_numpy(ragged_arange(step.off[mine], st.dims_arr[step.table[mine]])).to(self.device)
            st.apply_summed_gradients_packed(step.table[mine], step.owner_slot[mine], buf.index_select(0, pos))


# --------------------------------------------------------------------------------------- the step extension
@dataclass
class ReplicaPart:
    """One step's reads through the replicas on this rank (`reads` None: the plan reads none)."""

    region: ReplicaRegion
    full_local: LocalInput | None  # the step's ids before the replicas took theirs
    remaining: LocalInput | None
    reads: ReplicaStep | None
    joins: ReplicaJoins = field(default_factory=ReplicaJoins)

    def pooled(self, out: torch.Tensor, training: bool) -> torch.Tensor:
        if self.reads is None:
            return out
        return self.region.pooled(self.full_local, self.reads, out, training)  # type: ignore[arg-type]

    def count(self, hits: np.ndarray, reads: np.ndarray, counters: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """Replica reads are local reads (hits); `allreduce` counts the rows this rank all-reduces, `replica_join`
        the rows joining the set whose copies this rank sent (`replica_join_guest`: from a guest slot)."""
        if self.joins.declared:
            counters["replica_join"] = self.joins.sent
            counters["replica_join_guest"] = self.joins.from_guest
        if self.reads is None:
            return hits, reads
        rh = self.region.hits(self.reads)
        counters["allreduce"] = int(self.reads.table.shape[0])
        return hits + rh, reads + rh

    @property
    def pending(self) -> bool:
        return self.reads is not None

    def finish(self) -> None:
        if self.reads is not None:
            with phase("finish_step.replicas"):
                self.region.finish(self.reads)


class ReplicaExtension:
    """Rows replicated on every rank: Herald's modules whose policy replicates (`HeraldOptions.replicates`), fae,
    p2res. The region is built at once: it is empty until a plan declares rows, and emptied when a load rewrote the
    owners' rows (`ownership_version` changed: the policy is rebuilt and declares its set again)."""

    plan_part = "replicas"

    def __init__(self, res: ExtensionResources) -> None:
        self.region = ReplicaRegion(
            res.store, res.comm, res.device, res.optimizer, res.learning_rate, res.eps, res.tbe_settings
        )
        self._version = 0  # the ownership version the region's copies were made at

    def begin(self, plan: Plan, local: LocalInput | None, ownership_version: int) -> ReplicaPart:
        if ownership_version != self._version:
            self.region.reset()
            self._version = ownership_version
        remaining, reads, joins = self.region.begin(plan, local)
        return ReplicaPart(self.region, local, remaining, reads, joins)

    def set_learning_rate(self, lr: float) -> None:
        self.region.set_learning_rate(float(lr))
