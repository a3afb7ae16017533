"""`ShardedMixedEmbeddingBagCollection`: one EmbeddingBagCollection whose Herald-managed tables run on Herald's data
plane and whose *unscheduled* tables stay with TorchRec's own sharding (TABLE_WISE, COLUMN_WISE, ROW_WISE, ...).

Why a wrapper and not two EBCs in the model: the user's model keeps its one EBC; which tables Herald manages is a
sharding decision (the sharder's `unscheduled_tables`), made without touching model code.

How the two parts share one TorchRec step:
* input_dist: the stock part distributes its features as usual (its KJT all-to-alls); the Herald part's input is
  already local (the permutation stage placed it), so it rides along as a no-op awaitable appended *after* the stock
  ones — TorchRec's awaitables zip the context's `sharding_contexts` positionally, so the stock pieces keep theirs.
  The returned `KJTListSplitsAwaitable` is the type TorchRec's pipelines fuse with other modules' input dists.
* compute + output_dist: both parts look up; the output is one KeyedTensor in the original EBC's key order.
* optimizer: one fused optimizer over both (the Herald part finishes its shared rows at `step()`).
Which rank trains which sample does not change the stock part's result (every id goes to its shard's owner), so the
Herald part's sample permutation keeps the whole module exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext, ShardedEmbeddingBagCollection
from torchrec.distributed.types import LazyAwaitable, LazyGetItemMixin, Multistreamable, NoWait, ShardedModule
from torchrec.modules.embedding_modules import EmbeddingBagCollection, get_embedding_names_by_table
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from herald_torchrec.distributed.embeddingbag import (
    HeraldEmbeddingBagCollectionContext,
    ShardedHeraldEmbeddingBagCollection,
)
from herald_torchrec.distributed.state.checkpoint import install_mixed_state_dict_hooks


@dataclass
class MixedEmbeddingBagCollectionContext(Multistreamable):
    stock: EmbeddingBagCollectionContext = field(default_factory=EmbeddingBagCollectionContext)
    herald: HeraldEmbeddingBagCollectionContext = field(default_factory=HeraldEmbeddingBagCollectionContext)

    # TorchRec's input-dist awaitables and pipelines read these attributes of a module context
    @property
    def sharding_contexts(self) -> list:
        return self.stock.sharding_contexts

    @property
    def early_releasable_inputs(self) -> list:
        return self.stock.early_releasable_inputs

    def record_stream(self, stream: torch.Stream) -> None:
        self.stock.record_stream(stream)
        self.herald.record_stream(stream)


class _MergedKeyedTensor(LazyGetItemMixin[str, torch.Tensor], LazyAwaitable[KeyedTensor]):
    """The stock part's output awaitable + the Herald part's local output -> one KeyedTensor in EBC key order."""

    def __init__(
        self, stock: LazyAwaitable[KeyedTensor], herald: KeyedTensor, keys: list[str], dims: list[int]
    ) -> None:
        super().__init__()
        self._stock, self._herald, self._keys, self._dims = stock, herald, keys, dims

    def _wait_impl(self) -> KeyedTensor:
        parts = {**self._stock.wait().to_dict(), **self._herald.to_dict()}
        values = torch.cat([parts[k] for k in self._keys], dim=1)
        return KeyedTensor(keys=self._keys, length_per_key=self._dims, values=values, key_dim=1)


def sub_collection(module: EmbeddingBagCollection, tables: list[str]) -> EmbeddingBagCollection:
    """An EBC over some of `module`'s tables that shares their parameters (so optimizer-in-backward settings and
    initial values carry over); built on meta, then the original `nn.EmbeddingBag`s are put in."""
    configs = [c for c in module.embedding_bag_configs() if c.name in set(tables)]
    sub = EmbeddingBagCollection(tables=configs, is_weighted=module.is_weighted(), device=torch.device("meta"))
    for c in configs:
        sub.embedding_bags[c.name] = module.embedding_bags[c.name]
    return sub


class ShardedMixedEmbeddingBagCollection(
    ShardedModule[KJTList, tuple, KeyedTensor, MixedEmbeddingBagCollectionContext],
    FusedOptimizerModule,
):
    """Herald-managed tables (`herald`) + TorchRec-sharded tables (`stock`) behind one EBC interface.

    Built by `HeraldEmbeddingBagCollectionSharder` when it is given `unscheduled_tables`; the Herald part is
    reachable as `.herald` (plans, hit rate, guest occupancy, full tables), the stock part as `.stock`."""

    def __init__(
        self,
        module: EmbeddingBagCollection,
        herald: ShardedHeraldEmbeddingBagCollection,
        stock: ShardedEmbeddingBagCollection,
        qcomm_codecs_registry: dict | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry=qcomm_codecs_registry)
        self.herald = herald
        self.stock = stock
        configs = module.embedding_bag_configs()
        names_by_table = get_embedding_names_by_table(configs)
        self._keys = [n for names in names_by_table for n in names]  # output keys in the EBC's order
        self._dims = [c.embedding_dim for c, names in zip(configs, names_by_table) for _ in names]
        self._herald_features = list(herald.feature_names)
        self._permute: tuple[tuple[str, ...], list[int]] | None = None
        self._optim = CombinedOptimizer([herald.fused_optimizer, stock.fused_optimizer])
        install_mixed_state_dict_hooks(self, herald.table_names)  # checkpoint keys as a stock EBC's

    def create_context(self) -> MixedEmbeddingBagCollectionContext:
        return MixedEmbeddingBagCollectionContext(self.stock.create_context(), self.herald.create_context())

    def _herald_input(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The Herald part's features, in their own storage (the stock part may free the batch's storage early)."""
        keys = tuple(features.keys())
        if self._permute is None or self._permute[0] != keys:
            missing = [f for f in self._herald_features if f not in keys]
            if missing:
                raise ValueError(f"input KeyedJaggedTensor lacks features {missing} (has {list(keys)})")
            self._permute = (keys, [keys.index(f) for f in self._herald_features])
        return features.permute(self._permute[1])

    def input_dist(
        self, ctx: MixedEmbeddingBagCollectionContext, features: KeyedJaggedTensor
    ) -> KJTListSplitsAwaitable:
        with torch.no_grad():
            herald_kjt = self._herald_input(features)
        ctx.herald.batch_size = herald_kjt.stride()
        stock = self.stock.input_dist(ctx.stock, features)  # selects its own features
        return KJTListSplitsAwaitable([*stock.awaitables, NoWait(NoWait(herald_kjt))], ctx)

    def _split(self, dist_input: KJTList) -> tuple[KJTList, KJTList]:
        n = len(dist_input) - 1
        return KJTList([dist_input[i] for i in range(n)]), KJTList([dist_input[n]])

    def compute(self, ctx: MixedEmbeddingBagCollectionContext, dist_input: KJTList) -> tuple:
        stock_in, herald_in = self._split(dist_input)
        return self.stock.compute(ctx.stock, stock_in), self.herald.compute(ctx.herald, herald_in)

    def output_dist(self, ctx: MixedEmbeddingBagCollectionContext, output: tuple) -> LazyAwaitable[KeyedTensor]:
        stock_out, herald_out = output
        herald_kt = self.herald.output_dist(ctx.herald, herald_out).wait()
        return _MergedKeyedTensor(self.stock.output_dist(ctx.stock, stock_out), herald_kt, self._keys, self._dims)

    def compute_and_output_dist(
        self, ctx: MixedEmbeddingBagCollectionContext, input: KJTList
    ) -> LazyAwaitable[KeyedTensor]:
        stock_in, herald_in = self._split(input)
        stock = self.stock.compute_and_output_dist(ctx.stock, stock_in)  # the stock path's own (pipelined) variant
        herald_kt = self.herald.output_dist(ctx.herald, self.herald.compute(ctx.herald, herald_in)).wait()
        return _MergedKeyedTensor(stock, herald_kt, self._keys, self._dims)

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        return self._optim

    @property
    def unsharded_module_type(self) -> type:
        return EmbeddingBagCollection

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        """As a stock EBC's: `embedding_bags.<table>.weight` of both parts (as the state dict names them)."""
        yield from self.herald.named_parameters(prefix)
        yield from self.stock.named_parameters(prefix)

    def sharded_parameter_names(self, prefix: str = "") -> Any:
        yield from (key for key, _ in nn.Module.named_parameters(self, prefix))  # both parts' internals (DDP)
        yield from (key for key, _ in self.named_parameters(prefix))
