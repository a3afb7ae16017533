"""`HeraldLookup`: one rank's rows in a step: the moves applied, shared values shipped, the pooled lookup, and the
shared rows' single update.

As TorchRec's embedding_lookup.py sits between a sharded module and its kernels, this sits between
`ShardedHeraldEmbeddingBagCollection` (which orders a step: plans, error checks, counters) and the `RowStore`
(FBGEMM TBE + ownership directory). It reads and writes the store along the layouts that step/prepare.py and
lookup_layout.py prepared and ships the bytes with the dist objects of dist_data.py; every method is collective where
its dist object is, and every rank calls them in the same order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from herald_torchrec.distributed import host_kernels
from herald_torchrec.distributed.comm import PlanComm, phase
from herald_torchrec.distributed.step.dist_data import (
    ErrorCheck,
    RelayGradDist,
    RelayValueDist,
    RowMoveDist,
    SharedGradDist,
    StepExchangeDist,
)
from herald_torchrec.distributed.step.lookup_layout import (
    GradSumLayout,
    grad_send_order,
    grad_sum_layout,
    lookup_layout,
    value_items,
    with_owner_bags,
)
from herald_torchrec.distributed.step.prepare import LocalInput, MoveStep, SharedMarks, SharedStep, sent_by_kind
from herald_torchrec.distributed.step.static_plan import static_plan, static_plan_keys
from herald_torchrec.distributed.storage.row_store import RowStore
from herald_torchrec.schedule.plan import Plan


class OwnerUpdate:
    """A training lookup's TBE call whose backward (the fused optimizer) waits for the shared rows' summed gradients:
    the batch's bags, then one bag per shared row this rank owns (lookup_layout.with_owner_bags)."""

    def __init__(self, grads: GradSumLayout, bag_rows: np.ndarray) -> None:
        self.grads, self.bag_rows = grads, bag_rows
        self.tbe_out: torch.Tensor | None = None  # the TBE's output (its graph applies the optimizer)
        self.detached: torch.Tensor | None = None  # what the model reads, as a leaf (its .grad: the bags' gradients)
        self.bags_grad: torch.Tensor | None = None  # or the bags' gradient, handed over by `_AddSharedValues`

    def backward(self, summed: torch.Tensor) -> None:
        """One TBE backward: the model's gradients for the batch's bags (zeros if it did not backpropagate) and the
        summed gradient of each owned shared row [keys, dim] in its bag."""
        out, det, g = self.tbe_out, self.detached, self.bags_grad
        self.tbe_out = self.detached = self.bags_grad = None
        if g is None:
            g = det.grad if det is not None and det.grad is not None else torch.zeros_like(out)
        dim = summed.shape[1]
        g.view(-1, dim).index_copy_(0, torch.from_numpy(self.bag_rows).to(g.device), summed.to(g.dtype))
        out.backward(g)


class _AddSharedValues(torch.autograd.Function):
    """Pooled bags += received shared values, in place (no copy of the batch's pooled output):
    `bags.view(-1, width)[dst[i]] += values[i]`. Backward: the values' gradient is the bags' gradient at `dst`; the
    bags' own gradient passes on, or, for a TBE call whose backward waits for the owner's update (`sink`, an
    `OwnerUpdate`; `bags` is then a detached alias of the TBE's output), is handed to it."""

    @staticmethod
    def forward(
        ctx: Any, bags: torch.Tensor, values: torch.Tensor, dst: torch.Tensor, width: int, sink: "OwnerUpdate | None"
    ) -> torch.Tensor:
        bags.view(-1, width).index_add_(0, dst, values.to(bags.dtype))
        ctx.mark_dirty(bags)
        ctx.save_for_backward(dst)
        ctx.width, ctx.sink, ctx.values_dtype = width, sink, values.dtype
        return bags

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, None, None, None]:
        (dst,) = ctx.saved_tensors
        g_values = grad.reshape(-1, ctx.width).index_select(0, dst).to(ctx.values_dtype)
        if ctx.sink is not None:
            ctx.sink.bags_grad = grad
            return None, g_values, None, None, None
        return grad, g_values, None, None, None


class _GatherAddSharedValues(torch.autograd.Function):
    """`_AddSharedValues` with the gather fused in, on the CPU: `bags.view(-1, w)[dst[i]] += values[src[i]]` by a
    compiled loop (host_kernels.gather_add), in index_add_'s order, so the sums are the same bit for bit; backward,
    the values' gradient is summed the same way (`g[src[i]] += grad[dst[i]]`, as index_select's backward would).
    No gathered copy of the values, and none of index_add_'s per-row dispatch, in either direction."""

    @staticmethod
    def forward(
        ctx: Any, bags: torch.Tensor, values: torch.Tensor, src: np.ndarray, dst: np.ndarray, sink: "OwnerUpdate | None"
    ) -> torch.Tensor:
        host_kernels.gather_add(bags.view(-1, values.shape[1]), dst, values, src)
        ctx.mark_dirty(bags)
        ctx.src, ctx.dst, ctx.sink, ctx.values_shape = src, dst, sink, values.shape
        return bags

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, None, None, None]:
        g_values = torch.zeros(ctx.values_shape, dtype=grad.dtype, device=grad.device)
        g = grad.reshape(-1, ctx.values_shape[1]).contiguous()
        if not host_kernels.gather_add(g_values, ctx.src, g, ctx.dst):  # pragma: no cover - checked in forward
            g_values.index_add_(0, torch.from_numpy(ctx.src), g.index_select(0, torch.from_numpy(ctx.dst)))
        if ctx.sink is not None:
            ctx.sink.bags_grad = grad
            return None, g_values, None, None, None
        return grad, g_values, None, None, None


class HeraldLookup:
    """The store-side work of a step, all tables at once. `marks` is the step's scratch by global key
    (plan_exec.SharedMarks): the caller marks a step's shared keys before `pooled` and resets them after."""

    def __init__(self, store: RowStore, comm: PlanComm, device: torch.device) -> None:
        self.store, self.device, self._comm = store, device, comm
        self.marks = SharedMarks(int(store.key_base[-1]))
        self._move_dist = RowMoveDist(comm)
        self._exchange_dist = StepExchangeDist(comm)
        self._grad_dist = SharedGradDist(comm)
        self.use_relay_comm(comm, np.arange(comm.world_size))

    def use_relay_comm(self, comm: PlanComm, members: np.ndarray) -> None:
        """The relay stages' group: this rank's host (`members`: its ranks in the module's group, in `comm`'s order),
        or the module's own group (every rank)."""
        self._relay_value_dist = RelayValueDist(comm, members)
        self._relay_grad_dist = RelayGradDist(comm, members)

    def apply_moves(self, ms: MoveStep, check: ErrorCheck | None) -> dict[str, int]:
        """The moves alone (outside a training step, e.g. a checkpoint load sending rows home): every row leaves, then
        every row arrives. With `check`, any rank's error raises on every rank before anything changes. Returns the
        rows this rank sent, by move kind."""
        if ms.globally_empty:
            return {}
        recv = self._move_dist(self._departing(ms), ms, check).wait()
        return self._land(ms, recv)

    def exchange(self, ms: MoveStep, sh: SharedStep, training: bool, check: ErrorCheck | None) -> dict[str, int]:
        """The step's moves and shared values in one all-to-all (values from the owners before the moves), then the
        moves applied and the values a new owner reads taken from its store (`SharedStep.n_fill`). Sets `sh.values`
        (value order; a leaf requiring grad when training). With `check`, the all-to-all carries the step's error
        flags and any rank's error raises on every rank before anything changes. Returns the rows this rank sent
        in the moves, by kind."""
        st = self.store
        if ms.globally_empty and sh.globally_empty:
            sh.values = None
            return {}
        slots = st.slot_of_all[sh.value_gkey].astype(np.int64)
        if (slots < 0).any():  # pragma: no cover - the plan checks guarantee ownership
            raise RuntimeError("shared value sent by a rank that does not own the row")
        values = st.read_packed(sh.value_table, slots, with_state=False)  # read before the moves
        half = st.row_dtype == torch.float16  # FP16 rows' values travel as their float16 bits
        rows, vals = self._exchange_dist(self._departing(ms), ms, values, sh, check, half).wait()
        moved = self._land(ms, rows) if not ms.globally_empty else {}
        if sh.relayed:  # relays hand the values they received to their host's other readers
            with phase("step.exchange.relay"):
                idx, width = value_items(sh, st, sh.fwd_idx)
                fwd = vals.view(-1, width).index_select(0, torch.from_numpy(idx).to(vals.device)).view(-1)
                vals = torch.cat([vals, self._relay_value_dist(fwd, sh, half).wait()])
        if sh.n_fill:  # reads of rows that arrived here in the moves
            k = sh.recv_gkey.shape[0] - sh.n_fill
            fill_slots = st.slot_of_all[sh.recv_gkey[k:]].astype(np.int64)
            vals = torch.cat([vals, st.read_packed(sh.recv_table[k:], fill_slots, with_state=False)])
        if training and not sh.globally_empty:
            vals.requires_grad_(True)
        sh.values = None if sh.globally_empty else vals
        return moved

    def _departing(self, ms: MoveStep) -> torch.Tensor:
        """The rows this rank sends in the moves (value + optimizer state), in send order."""
        st = self.store
        s_tab, s_row = ms.table[ms.send_idx], ms.row[ms.send_idx]
        s_slot = st.slot_of_all[st.gkeys(s_tab, s_row)].astype(np.int64)
        if (s_slot < 0).any():  # pragma: no cover - the plan checks guarantee ownership
            raise RuntimeError("a moved row sent by a rank that does not own it")
        return st.read_packed(s_tab, s_slot)

    def _land(self, ms: MoveStep, recv: torch.Tensor) -> dict[str, int]:
        """Apply the moves once the rows have travelled: departing rows released, ownership updated (every move of
        the plan, or of this rank's part of it: step/plan_part.py), arriving rows written to free slots."""
        st = self.store
        slots = st.land_moves(ms.table, ms.row, ms.dst, ms.send_idx, ms.recv_idx)  # every move it was given
        st.write_packed(ms.table[ms.recv_idx], slots, recv)
        return sent_by_kind(ms)

    def pooled(self, local: LocalInput, sh: SharedStep, training: bool = False) -> torch.Tensor:
        """Pooled embeddings [B, sum of dims]: the TBE over exclusive ids, plus the received values of shared ids
        summed into their bags (differentiable w.r.t. the received values), all features in one pass. Weighted
        features scale each id's row by its weight: FBGEMM's per-sample weights in the TBE, and torch ops (not the
        compiled gather-add, which has no weights) for the shared values.

        Training, where this rank owns shared rows after the moves (and the update can be fused, `_fuses_update`),
        the same TBE call also holds one extra bag per owned shared row and its backward waits for
        `apply_shared_grads`: one fused update for all rows once the readers' gradients are in, instead of the
        TBE's backward plus a second TBE pass for the shared rows (`sh.owner_update` holds that call)."""
        st = self.store
        lay = lookup_layout(local, sh, self.marks, st)
        update = None
        if training and sh.send_gkey.shape[0] and self._fuses_update():
            grads = grad_sum_layout(sh, st)
            lay, bag_rows = with_owner_bags(lay, grads, st, local.batch_size)
            update = OwnerUpdate(grads, bag_rows)
        psw = None if lay.weights is None else torch.from_numpy(lay.weights).to(self.device)
        out = st.lookup(
            torch.from_numpy(lay.indices).to(self.device), torch.from_numpy(lay.offsets).to(self.device), psw
        )
        values = lay.value_src.size > 0
        if update is not None:  # the model sees a detached alias of the batch's bags; the TBE's graph waits
            update.tbe_out = out
            sh.owner_update = update
            out = out.detach()
            if not values:  # a leaf whose .grad is the bags' gradient (else _AddSharedValues hands it over)
                update.detached = out.requires_grad_(True)
        if values and lay.value_weights is None and self._gathers_in_place(out, sh.values):  # (the loop: no weights)
            vals = sh.values.view(-1, lay.width)
            if torch.is_grad_enabled() and (vals.requires_grad or out.requires_grad):
                out = _GatherAddSharedValues.apply(out, vals, lay.value_src, lay.out_dst, update)
            else:
                host_kernels.gather_add(out.view(-1, lay.width), lay.out_dst, vals, lay.value_src)
        elif values:
            w = lay.width
            v = sh.values.view(-1, w).index_select(0, torch.from_numpy(lay.value_src).to(self.device))
            if lay.value_weights is not None:  # weighted features: w * value here, so w * the bag's grad in backward
                v = v * torch.from_numpy(lay.value_weights).to(v).view(-1, 1)
            v = st.clip_pooled_gradient(v)  # each bag's gradient clipped, as the TBE clips its own pooled output's
            dst = torch.from_numpy(lay.out_dst).to(self.device)
            if torch.is_grad_enabled() and (v.requires_grad or out.requires_grad):
                out = _AddSharedValues.apply(out, v, dst, w, update)
            else:
                out.view(-1, w).index_add_(0, dst, v.to(out.dtype))
        return out[: local.batch_size] if update is not None else out

    def _gathers_in_place(self, out: torch.Tensor, values: torch.Tensor) -> bool:
        """The shared values can be gathered and added by the compiled loop (`_GatherAddSharedValues`): host tensors
        of float32, contiguous, and no per-bag gradient clipping of the values (that needs the gathered copy)."""
        return not self.store.gradient_clipping and host_kernels.on_host(out, values)

    def _fuses_update(self) -> bool:
        """The owner's shared-row update can ride on the TBE's own backward: rows are items (one dim for all
        tables) and no gradient clipping (the readers clip their bags; the TBE would clip the sums again)."""
        return self.store.uniform_dim is not None and not self.store.gradient_clipping

    def apply_shared_grads(self, sh: SharedStep) -> None:
        """Readers return the shared rows' gradients (a reader that did not backpropagate returns zeros); each owner
        sums them per key and applies ONE update per row through its TBE (bit-exact with the fused path): in the
        step's own deferred TBE backward (`pooled`), or in a separate pass over one-row bags."""
        st = self.store
        vals, update = sh.values, sh.owner_update
        grad = vals.grad if vals is not None and vals.grad is not None else None
        if grad is None:
            grad = torch.zeros(int(st.dims_arr[sh.recv_table].sum()), dtype=torch.float32, device=self.device)
        grad = grad.detach()
        if sh.relayed:  # gradients to the host's relay first, which adds them to its own
            with phase("finish_step.relay"):
                grad = self._relay_grads(grad, sh)
        grad = self._in_grad_order(grad, sh)
        sh.values = sh.owner_update = None
        back = self._grad_dist(grad, sh).wait()  # laid out as send_off
        if sh.send_gkey.shape[0] == 0:
            return
        lay = update.grads if update is not None else grad_sum_layout(sh, st)  # one gradient per key: readers' sum
        summed = torch.zeros(lay.size // lay.width, lay.width, dtype=back.dtype, device=self.device)
        rows = back.view(-1, lay.width)
        if not host_kernels.gather_add(summed, lay.dst, rows, None):  # the same sums, in the same order, compiled
            summed.index_add_(0, torch.from_numpy(lay.dst).to(self.device), rows)
        with phase("finish_step.apply"):
            if update is not None:
                update.backward(summed)
            else:
                st.apply_summed_gradients_packed(lay.tables, lay.slots, summed.view(-1))

    def _relay_grads(self, grad: torch.Tensor, sh: SharedStep) -> torch.Tensor:
        """The value gradients (value order) after the relay stage: the gradients this rank's relays take are sent
        to them, and, as a relay, the ones received are added to its own pairs of the same rows."""
        st = self.store
        idx, width = value_items(sh, st, sh.relay_grad_idx)
        send = grad.view(-1, width).index_select(0, torch.from_numpy(idx).to(grad.device)).view(-1)
        back = self._relay_grad_dist(send.contiguous(), sh).wait()
        if sh.relay_add_idx.shape[0] == 0:
            return grad
        add, width = value_items(sh, st, sh.relay_add_idx)
        out = grad.clone().view(-1, width)
        out.index_add_(0, torch.from_numpy(add).to(grad.device), back.view(-1, width).to(out.dtype))
        return out.view(-1)

    def _in_grad_order(self, grad: torch.Tensor, sh: SharedStep) -> torch.Tensor:
        """The gradients of the values (value order: by sender before the moves) in send order (by owner after
        them); nothing is copied when the orders agree."""
        order = grad_send_order(sh, self.store)
        if order is None:
            return grad
        idx, width = order
        return grad.view(-1, width).index_select(0, torch.from_numpy(idx).to(grad.device)).view(-1)

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
                W[idx, : st.dims[t]] = w.to(W.dtype)  # float16 rows: exact in float32
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
            weights[name] = W[:, : st.dims[t]].to(st.row_dtype, copy=True)  # in the rows' precision (exact)
            if st.state_widths[t]:  # [rows] (per row) or [rows, dim] (per element), as TorchRec shapes it
                states[name] = W[:, st.dims[t] :].reshape(st.state_layout.shape(st.rows[t], st.dims[t])).clone()
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
                raise ValueError(
                    f"load_full_tables: {name!r} has shape {tuple(W.shape)}, expected {(st.rows[t], st.dims[t])}"
                )
            idx = torch.from_numpy(keys)
            rows = W[idx]
            s = None
            if states is not None and name in states and st.state_widths[t]:
                s = states[name][idx].reshape(keys.size, -1)
            st.write_slots(t, st.slots(t, keys), rows, s)
