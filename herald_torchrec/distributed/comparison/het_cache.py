"""HET's per-worker embedding cache, executed (the `het` baseline, staleness S >= 0; schedule/baselines/het.py).

The parameter server (PS) of a row is its home rank: the home block of the module's RowStore holds the PS value and
optimizer state, which only pushed gradients change. Every rank also holds a *cache*: a second FBGEMM TBE with
ceil(cache_ratio x rows) slots per table (the scheduler's capacity) for copies of rows (value + optimizer state),
plus, per slot, the gradient accumulated since the copy last pushed. The plan (`Plan.cache`, from the control
plane's model of HET's clocks) says, for every distinct (key, reader) pair of the step, what the reader does; this
module does exactly that:

1. evictions: the copies dropped to make room leave the cache; those with pending updates first push their
   accumulated gradient to the PS (all-to-all "evict_push"; the PS applies one update per row with the sum);
2. pulls: the PS sends value + optimizer state for MISS_PULL (then cached), MISS_UNCACHED (read once, not cached)
   and UPDATE_PULL pairs (the copy is overwritten and its pending gradient re-applied to it) — all-to-all "pull";
3. every read of the step is served from the cache (or the uncached pull) as a leaf tensor requiring grad, pooled
   into the output (the module's TBE reads nothing: the plan has no exclusive or shared keys);
4. `finish`: each reader applies its gradient to its copy through the cache TBE (the worker's own update) and adds
   it to the slot's pending gradient; readers the plan marks `push` send the pending gradient (uncached readers:
   the step's gradient) to the PS (all-to-all "update_push"), which sums them per row and applies one update
   through its TBE (`apply_summed_gradients_packed`).

With S = 0 every reader pushes every step and a copy is read only while no other worker has updated the row since
it was pulled (value *and* optimizer state), so a copy equals the PS row bit for bit and training is exact BSP: the
same model as stock TorchRec. With S > 0 copies may miss up to S updates of other workers (stale reads, counted by
the control plane) and pushes are batched: that is HET's trade. An UPDATE_PULL also carries the optimizer state
(the model counts it as a value-only pull): the bytes are measured as sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from herald_torchrec.distributed.comm import PlanComm
from herald_torchrec.distributed.step.prepare import LocalInput, routes
from herald_torchrec.distributed.step.replicas import drop_ids
from herald_torchrec.distributed.storage.row_layout import exclusive_cumsum, ragged_arange
from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec
from herald_torchrec.schedule.plan import HIT, MISS_PULL, MISS_UNCACHED, UPDATE_PULL, Plan


@dataclass
class CacheReads:
    """One step's reads on this rank (distinct keys, sorted by global key)."""

    gkey: np.ndarray
    table: np.ndarray
    slot: np.ndarray  # cache slot, -1 for uncached reads
    uncached: torch.Tensor  # values of the uncached reads (flat, in key order among them)
    push: np.ndarray  # bool: push after the step
    hit: np.ndarray  # bool: served by the cached copy without a pull
    counts: dict[str, int]  # this rank's part of the plan's counters
    local: LocalInput | None = None  # the full local input of the step
    values: torch.Tensor | None = None  # leaf: the values read, key after key


class WorkerCache:
    """This rank's HET cache for one sharded module (`store`: its RowStore, whose home rows are the PS)."""

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
        cap = [int(c) for c in store.capacity]
        self.capacity = np.asarray(cap, dtype=np.int64)
        self.copies = RowStore(
            [TableSpec(s.name, max(1, c), s.dim) for s, c in zip(store.tables, cap)],
            rank=0,
            world_size=1,
            cache_ratio=1e-9,
            optimizer=optimizer,
            learning_rate=learning_rate,
            eps=eps,
            features_per_table=store.features_per_table,
            device=device,
            tbe_settings=dict(tbe_settings or {}),
        )
        self.slot_of = np.full(int(store.key_base[-1]), -1, dtype=np.int64)  # cache slot by global key
        self._free = [list(range(c - 1, -1, -1)) for c in cap]  # free slots per table (a stack)
        self.acc_base = exclusive_cumsum(np.maximum(self.capacity, 1) * store.dims_arr)
        self.acc = torch.zeros(int((np.maximum(self.capacity, 1) * store.dims_arr).sum()), device=device)

    def set_learning_rate(self, lr: float) -> None:
        self.copies.tbe.set_learning_rate(float(lr))

    def _acc_pos(self, tables: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        d = self.store.dims_arr[tables]
        return torch.from_numpy(ragged_arange(self.acc_base[tables] + slots * d, d)).to(self.device)

    def _to_ps(self, tables: np.ndarray, rows: np.ndarray, src: np.ndarray, grads: torch.Tensor, kind: str) -> None:
        """Gradients from `src` ranks (this rank's in `grads`, flat, in the order of its items) to the rows' home
        ranks; each home sums them per row and applies one update (collective; `tables`/`rows`/`src`: every rank's
        items, identical everywhere)."""
        st, R, r = self.store, self.store.world_size, self.store.rank
        home = rows // st.home_block_arr[tables]
        width = st.dims_arr[tables]
        send, recv, ss, rs = routes(src, home, width, r, R)
        mine = np.flatnonzero(src == r)  # this rank's items, in the order `grads` holds them
        pos_in_grads = exclusive_cumsum(width[mine])
        order = np.searchsorted(mine, send)  # send order -> index among mine
        buf = (
            grads.index_select(0, torch.from_numpy(ragged_arange(pos_in_grads[order], width[send])).to(self.device))
            if send.size
            else grads.new_zeros(0)
        )
        got = self.comm.all_to_all(buf, ss, rs, kind)
        if recv.size == 0:
            return
        gk = st.gkeys(tables[recv], rows[recv])
        keys, inv = np.unique(gk, return_inverse=True)
        kt = tables[recv][np.unique(inv, return_index=True)[1]]
        kd = st.dims_arr[kt]
        dst = ragged_arange(exclusive_cumsum(kd)[inv.reshape(-1)], width[recv])
        summed = torch.zeros(int(kd.sum()), device=self.device).index_add_(
            0, torch.from_numpy(dst).to(self.device), got
        )
        st.apply_summed_gradients_packed(kt, st.slot_of_all[keys].astype(np.int64), summed)

    # ------------------------------------------------------------------ before the step
    def begin(self, plan: Plan, local: LocalInput | None) -> tuple[LocalInput | None, CacheReads | None]:
        """Evictions, pulls (collective); every local id is then read from the cache: returns the (empty) input left
        to the ordinary data plane and this rank's reads."""
        cs = plan.cache
        if cs is None:
            return local, None
        st, r = self.store, self.store.rank
        tab, row, rank = (np.asarray(a, dtype=np.int64) for a in (cs.table, cs.row, cs.rank))
        action, push = np.asarray(cs.action), np.asarray(cs.push, dtype=bool)
        st.check_keys_many(tab, row, f"plan {plan.step}: cache reads")
        # 1. evictions (this rank's copies leave; dirty ones push first, to every PS)
        et, er, ek = (np.asarray(a, dtype=np.int64) for a in (cs.evict_table, cs.evict_row, cs.evict_rank))
        edirty = np.asarray(cs.evict_push, dtype=bool)
        mine_e = np.flatnonzero(ek == r)
        e_slots = self.slot_of[st.gkeys(et[mine_e], er[mine_e])]
        if (e_slots < 0).any():  # pragma: no cover - the control plane's caches mirror these (an internal error)
            raise RuntimeError(f"plan {plan.step}: evicts a row rank {r} does not cache")
        if edirty.any():
            d = mine_e[edirty[mine_e]]
            g = self.acc.index_select(0, self._acc_pos(et[d], self.slot_of[st.gkeys(et[d], er[d])]))
            self._to_ps(et[edirty], er[edirty], ek[edirty], g, "evict_push")
        if mine_e.size:
            self.acc.index_fill_(0, self._acc_pos(et[mine_e], e_slots), 0.0)
            self.slot_of[st.gkeys(et[mine_e], er[mine_e])] = -1
            for t in np.unique(et[mine_e]).tolist():  # one list operation per table
                self._free[t].extend(e_slots[et[mine_e] == t].tolist())
        # 2. pulls: the PS (home) sends value + state
        pulled = action != HIT
        home = row // st.home_block_arr[tab]
        width = st.packed_widths(tab)
        p_idx = np.flatnonzero(pulled)
        send, recv, ss, rs = routes(home[p_idx], rank[p_idx], width[p_idx], r, st.world_size)
        send, recv = p_idx[send], p_idx[recv]
        data = (
            st.read_packed(tab[send], st.slot_of_all[st.gkeys(tab[send], row[send])].astype(np.int64))
            if send.size
            else torch.zeros(0, device=self.device)
        )
        got = self.comm.all_to_all(data, ss, rs, "pull", globally_empty=p_idx.size == 0)
        goff = exclusive_cumsum(width[recv])
        mine = np.flatnonzero(rank == r)  # this rank's pairs (sorted by key: the plan lists pairs by key)
        gk = st.gkeys(tab[mine], row[mine])
        for_me = np.full(tab.shape[0], -1, dtype=np.int64)  # pair -> its place among the pulls received
        for_me[recv] = np.arange(recv.shape[0], dtype=np.int64)
        ins = mine[action[mine] == MISS_PULL]
        ins_g = st.gkeys(tab[ins], row[ins])
        for t in np.unique(tab[ins]).tolist():  # slots from the table's free stack, one list operation per table
            m = tab[ins] == t
            n, free = int(m.sum()), self._free[t]
            if n > len(free):  # pragma: no cover - same capacities as the control plane (an internal error)
                raise RuntimeError(
                    f"plan {plan.step}: rank {r} has {len(free)} free cache slots in table "
                    f"{st.tables[t].name!r}, {n} rows arrive"
                )
            self.slot_of[ins_g[m]] = free[len(free) - n :][::-1]
            del free[len(free) - n :]
        cached = mine[np.isin(action[mine], (MISS_PULL, UPDATE_PULL))]
        if cached.size:
            j = for_me[cached]
            pos = torch.from_numpy(ragged_arange(goff[j], width[cached])).to(self.device)
            c_tab, c_slot = tab[cached], self.slot_of[st.gkeys(tab[cached], row[cached])]
            self.copies.write_packed(c_tab, c_slot, got.index_select(0, pos))
            up = action[cached] == UPDATE_PULL  # re-apply the copy's pending updates on the fresh PS value
            if up.any():
                acc = self.acc.index_select(0, self._acc_pos(c_tab[up], c_slot[up]))
                self.copies.apply_summed_gradients_packed(c_tab[up], c_slot[up], acc)
        unc = mine[action[mine] == MISS_UNCACHED]
        if unc.size:
            j = for_me[unc]
            d = st.dims_arr[tab[unc]]
            uncached = got.index_select(0, torch.from_numpy(ragged_arange(goff[j], d)).to(self.device))
        else:
            uncached = torch.zeros(0, device=self.device)
        slots = self.slot_of[gk]
        a = action[mine]
        if (slots[a != MISS_UNCACHED] < 0).any():  # pragma: no cover - the control plane's caches mirror these
            raise RuntimeError(f"plan {plan.step}: rank {r} reads a cached copy it does not hold")
        counts = {
            "miss_pull": int(np.isin(a, (MISS_PULL, MISS_UNCACHED)).sum()),
            "update_pull": int((a == UPDATE_PULL).sum()),
            "update_push": int(push[mine].sum()),
            "evict_push": int(edirty[mine_e].sum()),
        }
        reads = CacheReads(gk, tab[mine], slots, uncached, push[mine], a == HIT, counts)
        if local is None:
            return None, reads
        u = np.unique(local.gkeys)
        if u.shape != gk.shape or (u != gk).any():
            raise ValueError(
                f"plan {plan.step} does not match the batch: rank {r} reads {u.shape[0]} distinct rows, "
                f"the plan's cache lists {gk.shape[0]}"
            )
        reads.local = local
        return drop_ids(local, np.zeros(local.gkeys.shape[0], dtype=bool)), reads

    # ------------------------------------------------------------------ the step
    def pooled(self, rd: CacheReads, out: torch.Tensor, training: bool) -> torch.Tensor:
        """`out` plus every read of the step (from the cache, or the uncached pull), summed into its bags."""
        st, local = self.store, rd.local
        cached = rd.slot >= 0
        d = st.dims_arr[rd.table]
        voff = exclusive_cumsum(d)
        vals = torch.zeros(int(d.sum()), device=self.device)
        if cached.any():
            vals.index_copy_(
                0,
                torch.from_numpy(ragged_arange(voff[cached], d[cached])).to(self.device),
                self.copies.read_packed(rd.table[cached], rd.slot[cached], with_state=False),
            )
        if (~cached).any():
            vals.index_copy_(0, torch.from_numpy(ragged_arange(voff[~cached], d[~cached])).to(self.device), rd.uncached)
        if training:
            vals.requires_grad_(True)
        rd.values = vals
        if local is None or local.gkeys.shape[0] == 0:
            return out
        B = local.batch_size
        f_dims = st.dims_arr[st.feature_table_arr]
        f_col = exclusive_cumsum(f_dims)
        f, bag = np.divmod(local.seg, B)
        fd = f_dims[f]
        src = ragged_arange(voff[np.searchsorted(rd.gkey, local.gkeys)], fd)
        dst = ragged_arange(bag * int(f_dims.sum()) + f_col[f], fd)
        v = vals.index_select(0, torch.from_numpy(src).to(self.device))
        extra = torch.zeros(out.numel(), dtype=v.dtype, device=self.device).index_add(
            0, torch.from_numpy(dst).to(self.device), v
        )
        return out + st.clip_pooled_gradient(extra.view(out.shape))

    def hits(self, rd: CacheReads) -> tuple[np.ndarray, np.ndarray]:
        """Per table: reads served by the cached copy without a pull, and distinct keys read."""
        T = self.store.num_tables
        return (
            np.bincount(rd.table[rd.hit], minlength=T).astype(np.int64),
            np.bincount(rd.table, minlength=T).astype(np.int64),
        )

    # ------------------------------------------------------------------ after backward
    def finish(self, rd: CacheReads, plan_cache) -> None:
        """Apply every reader's gradient to its copy, push where the plan says (collective)."""
        st = self.store
        vals, rd.values = rd.values, None
        d = st.dims_arr[rd.table]
        grad = (
            vals.grad.detach()
            if vals is not None and vals.grad is not None
            else torch.zeros(int(d.sum()), device=self.device)
        )
        voff = exclusive_cumsum(d)
        cached = rd.slot >= 0
        if cached.any():
            c_pos = torch.from_numpy(ragged_arange(voff[cached], d[cached])).to(self.device)
            g = grad.index_select(0, c_pos)
            self.copies.apply_summed_gradients_packed(rd.table[cached], rd.slot[cached], g)
            self.acc.index_add_(0, self._acc_pos(rd.table[cached], rd.slot[cached]), g)
        # this rank's pushes, in its pair order: the pending gradient (cached) or the step's (uncached)
        pushing = np.flatnonzero(rd.push)
        out_off = exclusive_cumsum(d[pushing])  # the buffer holds the pushes in pair order
        mine_push = torch.zeros(int(d[pushing].sum()), device=self.device)
        c = rd.slot[pushing] >= 0
        c_push, u_push = pushing[c], pushing[~c]
        if c_push.size:
            mine_push.index_copy_(
                0,
                torch.from_numpy(ragged_arange(out_off[c], d[c_push])).to(self.device),
                self.acc.index_select(0, self._acc_pos(rd.table[c_push], rd.slot[c_push])),
            )
        if u_push.size:
            mine_push.index_copy_(
                0,
                torch.from_numpy(ragged_arange(out_off[~c], d[u_push])).to(self.device),
                grad.index_select(0, torch.from_numpy(ragged_arange(voff[u_push], d[u_push])).to(self.device)),
            )
        if c_push.size:
            self.acc.index_fill_(0, self._acc_pos(rd.table[c_push], rd.slot[c_push]), 0.0)
        tab, row, rank = (np.asarray(a, dtype=np.int64) for a in (plan_cache.table, plan_cache.row, plan_cache.rank))
        p = np.asarray(plan_cache.push, dtype=bool)
        if p.any():
            self._to_ps(tab[p], row[p], rank[p], mine_push, "update_push")
