"""`SummedUpdateMixin`: one fused-optimizer update of a `RowStore`'s rows with gradients summed outside the TBE.

A shared row is read on several ranks and updated once, by its owner, with the sum of every reader's gradient. That
update must be the one FBGEMM's fused backward would have made, so it goes through the TBE's own kernel: a forward
over one-row bags, then a backward with the summed gradients (`apply_summed_gradients_packed`) — bit-exact with the
fused path (REFERENCE.md in ../shared/docs, checked again in tests/distributed/storage/test_row_store.py). Gradient
clipping follows FBGEMM's, per pooled bag: readers clip (`clip_pooled_gradient`) and the owner does not clip the sum
again. Mixed into `RowStore` (row_store.py), whose TBE and feature layout it drives; kept apart from the storage and the
directory because it is the exactness machinery of the update.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from herald_torchrec.distributed.storage.row_layout import exclusive_cumsum, ragged_arange, rank_within_group


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


class SummedUpdateMixin:
    """Summed-gradient updates of `RowStore` (see the module doc)."""

    def apply_summed_gradients(self, slots: Sequence[np.ndarray | None], grads: Sequence[torch.Tensor | None]) -> None:
        """One fused-optimizer update of the given slots of each table with the given (already summed) gradients
        (`slots[t]`: local slots of table t, distinct; `grads[t]`: [len(slots[t]), dim]). See
        `apply_summed_gradients_packed`."""
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
