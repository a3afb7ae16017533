"""`HeraldLookup`: one rank's rows in a step: the moves applied, shared values shipped, the pooled lookup, and the
shared rows' single update.

As TorchRec's embedding_lookup.py sits between a sharded module and its kernels, this sits between
`ShardedHeraldEmbeddingBagCollection` (which orders a step: plans, error checks, counters) and the `RowStore`
(FBGEMM TBE + ownership directory). It reads and writes the store along the layouts that plan_exec.py prepared
and ships the bytes with the dist objects of dist_data.py; every method is collective where its dist object is, and
every rank calls them in the same order.
"""

from __future__ import annotations

import numpy as np
import torch

from herald_torchrec.distributed.comm import PlanComm, phase
from herald_torchrec.distributed.dist_data import ErrorCheck, RowMoveDist, SharedGradDist, SharedValueDist
from herald_torchrec.distributed.plan_exec import (
    LocalInput,
    MoveStep,
    SharedMarks,
    SharedStep,
    grad_sum_layout,
    lookup_layout,
    sent_by_kind,
    static_plan,
    static_plan_keys,
)
from herald_torchrec.distributed.row_store import RowStore
from herald_torchrec.schedule.plan import Plan


class HeraldLookup:
    """The store-side work of a step, all tables at once. `marks` is the step's scratch by global key
    (plan_exec.SharedMarks): the caller marks a step's shared keys before `pooled` and resets them after."""

    def __init__(self, store: RowStore, comm: PlanComm, device: torch.device) -> None:
        self.store, self.device, self._comm = store, device, comm
        self.marks = SharedMarks(int(store.key_base[-1]))
        self._move_dist = RowMoveDist(comm)
        self._value_dist = SharedValueDist(comm)
        self._grad_dist = SharedGradDist(comm)

    def apply_moves(self, ms: MoveStep, check: ErrorCheck | None) -> dict[str, int]:
        """Every row leaves, then every row arrives (one all-to-all of rows + optimizer state, all tables at once).
        With `check`, the all-to-all also carries the step's error flags, and any rank's error raises on every rank
        before anything changes. Returns the rows this rank sent, by move kind."""
        if ms.globally_empty:
            return {}
        st = self.store
        s_tab, s_row = ms.table[ms.send_idx], ms.row[ms.send_idx]
        s_slot = st.slot_of_all[st.gkeys(s_tab, s_row)].astype(np.int64)
        if (s_slot < 0).any():  # pragma: no cover - the plan checks guarantee ownership
            raise RuntimeError("a moved row sent by a rank that does not own it")
        send = st.read_packed(s_tab, s_slot)  # departing rows (value + optimizer state), in send order
        recv = self._move_dist(send, ms, check).wait()
        st.release_many(s_tab, s_row)
        st.set_owner_many(ms.table, ms.row, ms.dst)  # every rank applies every move to the global ownership map
        r_tab, r_row = ms.table[ms.recv_idx], ms.row[ms.recv_idx]
        st.write_packed(r_tab, st.allocate_many(r_tab, r_row), recv)
        return sent_by_kind(ms)

    def exchange_values(self, sh: SharedStep, training: bool, check: ErrorCheck | None) -> None:
        """Owners send the shared rows' values to their readers (one all-to-all, all tables at once) into
        `sh.values`, a leaf requiring grad when training. With `check`, it also carries the step's error flags."""
        if sh.globally_empty:
            sh.values = None
            return
        st = self.store
        slots = st.slot_of_all[sh.send_gkey].astype(np.int64)
        if (slots < 0).any():  # pragma: no cover - the plan checks guarantee ownership
            raise RuntimeError("shared row sent by a rank that does not own it")
        send = st.read_packed(sh.send_table, slots, with_state=False)  # laid out as send_off
        vals = self._value_dist(send, sh, check).wait()
        if training:
            vals.requires_grad_(True)
        sh.values = vals

    def pooled(self, local: LocalInput, sh: SharedStep) -> torch.Tensor:
        """Pooled embeddings [B, sum of dims]: the TBE over exclusive ids, plus the received values of shared ids
        summed into their bags (differentiable w.r.t. the received values), all features in one pass."""
        st = self.store
        lay = lookup_layout(local, sh, self.marks, st)
        out = st.lookup(torch.from_numpy(lay.indices).to(self.device), torch.from_numpy(lay.offsets).to(self.device))
        if lay.value_src.size:
            w = lay.width
            v = sh.values.view(-1, w).index_select(0, torch.from_numpy(lay.value_src).to(self.device))
            v = st.clip_pooled_gradient(v)  # each bag's gradient clipped, as the TBE clips its own pooled output's
            dst = torch.from_numpy(lay.out_dst).to(self.device)
            out = out.view(-1, w).index_add(0, dst, v.to(out.dtype)).view(out.shape)
        return out

    def apply_shared_grads(self, sh: SharedStep) -> None:
        """Readers return the shared rows' gradients (a reader that did not backpropagate returns zeros); each owner
        sums them per key and applies ONE update per row through its TBE (bit-exact with the fused path)."""
        st = self.store
        vals = sh.values
        grad = vals.grad if vals is not None and vals.grad is not None else None
        if grad is None:
            grad = torch.zeros(int(sum(sh.recv_splits)), dtype=torch.float32, device=self.device)
        grad = grad.detach()
        sh.values = None
        back = self._grad_dist(grad, sh).wait()  # laid out as send_off
        if sh.send_gkey.shape[0] == 0:
            return
        lay = grad_sum_layout(sh, st)  # one gradient per key: the readers' sum, in rank order
        summed = torch.zeros(lay.size // lay.width, lay.width, dtype=back.dtype, device=self.device)
        summed.index_add_(0, torch.from_numpy(lay.dst).to(self.device), back.view(-1, lay.width))
        with phase("finish_step.apply"):
            st.apply_summed_gradients_packed(lay.tables, lay.slots, summed.view(-1))

    def static_plan(self, local: LocalInput) -> Plan:
        """The plan of the `static` policy for this batch (collective: an all-gather of every rank's ids)."""
        mine = torch.from_numpy(static_plan_keys(local, self.store)).to(self.device)
        gathered = [g.cpu().numpy() for g in self._comm.all_gather_uneven(mine, "control")]
        return static_plan(gathered, self.store, local.batch_size)

    @torch.no_grad()
    def full_tables(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Unsharded tables (weights, optimizer states) by table name, assembled from their current owners on every
        rank (collective: one all-reduce, exact since each row is non-zero on one rank only)."""
        st = self.store
        parts, shapes = [], []
        for t in range(st.num_tables):
            W = torch.zeros(st.rows[t], st.row_width(t), dtype=torch.float32, device=self.device)
            keys = st.owned_keys(t)
            if keys.size:
                w, s = st.read_slots(t, st.slots(t, keys))
                idx = torch.from_numpy(keys).to(self.device)
                W[idx, : st.dims[t]] = w
                if s.shape[1]:
                    W[idx, st.dims[t] :] = s
            parts.append(W.reshape(-1))
            shapes.append(W.shape)
        flat = torch.cat(parts)
        self._comm.all_reduce(flat, "full_tables")
        weights, states = {}, {}
        off = 0
        for t, shp in enumerate(shapes):
            n = shp[0] * shp[1]
            W = flat[off : off + n].view(shp).cpu()
            off += n
            name = st.tables[t].name
            weights[name] = W[:, : st.dims[t]].clone()
            sw = st.state_widths[t]
            if sw:
                states[name] = W[:, st.dims[t] :].clone().squeeze(1) if sw == 1 else W[:, st.dims[t] :].clone()
        return weights, states

    @torch.no_grad()
    def load_full_tables(self, weights: dict[str, torch.Tensor], states: dict[str, torch.Tensor] | None = None) -> None:
        """Write the rows this rank owns from unsharded tables by table name (no communication)."""
        st = self.store
        for t, name in enumerate(spec.name for spec in st.tables):
            keys = st.owned_keys(t)
            if name not in weights or keys.size == 0:
                continue
            W = weights[name]
            if tuple(W.shape) != (st.rows[t], st.dims[t]):
                raise ValueError(f"load_full_tables: {name!r} has shape {tuple(W.shape)}, expected {(st.rows[t], st.dims[t])}")
            idx = torch.from_numpy(keys)
            rows = W[idx]
            s = None
            if states is not None and name in states and st.state_widths[t]:
                s = states[name][idx].reshape(keys.size, -1)
            st.write_slots(t, st.slots(t, keys), rows, s)
