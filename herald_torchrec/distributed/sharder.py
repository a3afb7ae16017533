"""`HeraldEmbeddingBagCollectionSharder`: what a TorchRec user passes to DMP to get Herald-managed tables.

    model = DistributedModelParallel(
        model,
        sharders=[HeraldEmbeddingBagCollectionSharder(cache_ratio=0.1, policy="herald",
                                                      fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                                    "learning_rate": 0.05, "eps": 1e-8})],
        plan=plan,  # optional: EmbeddingShardingPlanner(topology=Topology(world_size, compute_device="cpu")) works
    )

Tables are planned ROW_WISE with the FUSED kernel (the home placement; DMP finds the sharder by the exact module
type, EmbeddingBagCollection) and sharded into `ShardedHeraldEmbeddingBagCollection`. Dense parts of the model go
through DMP's default DDP wrapper. Embedding gradients are divided by the world size exactly when TorchRec's own
sharded modules divide theirs (`torchrec.distributed.comm_ops.set_gradient_division`, on by default), so a model
trains the same under this sharder as under TorchRec's ROW_WISE sharding.

Herald's settings are one `HeraldOptions` (herald_torchrec/options.py), checked once when it is built:
`HeraldEmbeddingBagCollectionSharder(options=HeraldOptions(cache_ratio=0.1, policy="herald", lookahead=4))`, or the
same settings as keywords, as above. The sharded modules carry `cache_ratio` (their guest capacity), `policy` and
`lookahead` (for the pipeline that runs the scheduler: the data plane itself only executes plans), and a replica
region when the policy replicates (`policy_options={"replicate": True}`); the sharder keeps `unscheduled_tables` with
TorchRec; the pipeline takes the input stage's settings from the same options type.

The embedding optimizer is taken exactly as TorchRec's sharders take it (optimizer_params.py): `fused_params`, and
per table an optimizer set with `apply_optimizer_in_backward` on the unsharded EBC, which overrides them (FBGEMM's
defaults — EXACT_SGD, learning rate 0.01, as for a stock table — apply where neither names a setting). Every setting
FBGEMM applies per row (gradient clipping, row-wise Adagrad's eps / weight decay / max_norm) reaches the TBE; anything
else is a ValueError naming the setting, here and in the module.

Tables not worth scheduling can stay with TorchRec's own sharding: name them in `unscheduled_tables` and plan with
the sharder's constraints, so that the managed tables get their ROW_WISE home placement and the others whatever
the planner picks among the stock model-parallel types (DATA_PARALLEL is not offered: it would train those tables
with the dense optimizer instead of the fused one):

    sharder = HeraldEmbeddingBagCollectionSharder(unscheduled_tables=["t_c3", "t_c9"], fused_params=...)
    planner = EmbeddingShardingPlanner(topology=..., constraints=sharder.planner_constraints(model.ebc))
    model = DistributedModelParallel(model, sharders=[sharder], plan=planner.collective_plan(model, [sharder], pg))

The EBC is then sharded into a `ShardedMixedEmbeddingBagCollection` (mixed.py): Herald's module for the managed
tables and TorchRec's `ShardedEmbeddingBagCollection`, with the same fused optimizer, for the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Sequence

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from herald_torchrec.distributed.embeddingbag import ShardedHeraldEmbeddingBagCollection
from herald_torchrec.distributed.mixed import ShardedMixedEmbeddingBagCollection, sub_collection
from herald_torchrec.distributed.storage.optimizer_params import (
    DEFAULT_FUSED_PARAMS,
    resolve_table_settings,
    sharder_fused_params,
)
from herald_torchrec.options import HeraldOptions


def with_row_wise(types: list[str]) -> list[str]:
    """TorchRec's EBC sharder offers ROW_WISE only on CUDA; it runs on CPU / gloo too, so offer it everywhere."""
    return types if ShardingType.ROW_WISE.value in types else [*types, ShardingType.ROW_WISE.value]


__all__ = ["DEFAULT_FUSED_PARAMS", "HeraldEmbeddingBagCollectionSharder", "with_row_wise"]


class HeraldEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """DMP's sharder for Herald-managed EBCs (module docstring). Herald's settings come as `options`
    (`HeraldOptions`), or as the keywords `cache_ratio`, `policy`, `lookahead` and `unscheduled_tables`, which
    replace the options' (both checked by `HeraldOptions`); the rest are TorchRec's sharder arguments."""

    def __init__(
        self,
        cache_ratio: float | None = None,
        policy: str | None = None,
        lookahead: int | None = None,
        fused_params: dict[str, Any] | None = None,
        check_errors_globally: bool = True,
        gradient_division: bool | None = None,
        qcomm_codecs_registry: dict | None = None,
        unscheduled_tables: Collection[str] | None = None,
        options: HeraldOptions | None = None,
    ) -> None:
        given = {
            "cache_ratio": cache_ratio,
            "policy": policy,
            "lookahead": lookahead,
            "unscheduled_tables": unscheduled_tables,
        }
        self.options = dataclasses.replace(
            options if options is not None else HeraldOptions(), **{k: v for k, v in given.items() if v is not None}
        )
        # Herald's defaults under the user's settings, validated now (fail early); an optimizer set with
        # apply_optimizer_in_backward overrides them per table at shard time, as in TorchRec
        fp = sharder_fused_params(fused_params)
        super().__init__(fused_params=fp, qcomm_codecs_registry=qcomm_codecs_registry)
        self.check_errors_globally = check_errors_globally
        self.gradient_division = gradient_division

    @property
    def cache_ratio(self) -> float:
        return self.options.cache_ratio

    @property
    def policy(self) -> str:
        return self.options.policy

    @property
    def lookahead(self) -> int:
        return self.options.lookahead

    @property
    def unscheduled_tables(self) -> frozenset[str]:
        return frozenset(self.options.unscheduled_tables)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        if not self.unscheduled_tables:
            return [ShardingType.ROW_WISE.value]
        return [ShardingType.ROW_WISE.value, *self._stock_types(compute_device_type)]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        if not self.unscheduled_tables:
            return [EmbeddingComputeKernel.FUSED.value]
        return super().compute_kernels(sharding_type, compute_device_type)

    def _stock_types(self, compute_device_type: str) -> list[str]:
        """TorchRec's model-parallel types for unscheduled tables (ROW_WISE included on CPU, where it runs too)."""
        return with_row_wise(
            [t for t in super().sharding_types(compute_device_type) if t != ShardingType.DATA_PARALLEL.value]
        )

    def planner_constraints(
        self,
        module: EmbeddingBagCollection,
        stock_sharding_types: Sequence[str] | None = None,
        world_size: int | None = None,
        device_type: str = "cpu",
    ) -> dict[str, ParameterConstraints]:
        """Per-table planner constraints: managed tables ROW_WISE + FUSED (their home placement); unscheduled
        tables any of `stock_sharding_types` (default: every type this sharder offers them).

        With `world_size`, an unscheduled table with fewer rows than ranks is kept off ROW_WISE (when another type is
        allowed): its ROW_WISE sharding leaves a rank an empty shard, and where that is the rank's only TorchRec
        table, FBGEMM's CPU TBE takes its GPU path and fails."""
        names = [c.name for c in module.embedding_bag_configs()]
        self._check_unscheduled(names)
        allowed = list(stock_sharding_types) if stock_sharding_types else None
        small_ok = [t for t in (allowed or self.sharding_types(device_type)) if t != ShardingType.ROW_WISE.value]
        out = {}
        for c in module.embedding_bag_configs():
            if c.name not in self.unscheduled_tables:
                out[c.name] = ParameterConstraints(
                    sharding_types=[ShardingType.ROW_WISE.value], compute_kernels=[EmbeddingComputeKernel.FUSED.value]
                )
            elif world_size is not None and c.num_embeddings < world_size and small_ok:
                out[c.name] = ParameterConstraints(sharding_types=small_ok)
            else:
                out[c.name] = ParameterConstraints(sharding_types=allowed)
        return out

    def _check_unscheduled(self, tables: list[str]) -> None:
        unknown = sorted(self.unscheduled_tables - set(tables))
        if unknown:
            raise ValueError(f"unscheduled_tables: {unknown} are not tables of the EmbeddingBagCollection {tables}")
        if len(self.unscheduled_tables) == len(tables):
            raise ValueError(
                "unscheduled_tables names every table: leave at least one to Herald (or use TorchRec's own sharder)"
            )

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedHeraldEmbeddingBagCollection | ShardedMixedEmbeddingBagCollection:
        names = [c.name for c in module.embedding_bag_configs()]
        self._check_unscheduled(names)
        managed = [n for n in names if n not in self.unscheduled_tables]
        wrong = {
            n: params[n].sharding_type
            for n in managed
            if n in params and params[n].sharding_type != ShardingType.ROW_WISE.value
        }
        if wrong:
            raise ValueError(
                f"Herald-managed tables must be planned ROW_WISE (their home placement), got {wrong}: plan with "
                "`constraints=sharder.planner_constraints(ebc)`, or list them in unscheduled_tables"
            )
        herald = ShardedHeraldEmbeddingBagCollection(
            module=sub_collection(module, managed) if self.unscheduled_tables else module,
            table_name_to_parameter_sharding={n: params[n] for n in managed if n in params},
            env=env,
            fused_params=self.fused_params,
            device=device,
            cache_ratio=self.cache_ratio,
            policy=self.policy,
            lookahead=self.lookahead,
            module_fqn=module_fqn,
            check_errors_globally=self.check_errors_globally,
            gradient_division=self.gradient_division,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            replicate=self.options.replicates,
        )
        if not self.unscheduled_tables:
            return herald
        rest = [n for n in names if n in self.unscheduled_tables]
        missing = [n for n in rest if n not in params]
        if missing:
            raise ValueError(f"unscheduled tables {missing} have no sharding in the plan")
        # one fused optimizer over the whole EBC: the TorchRec part resolves (TorchRec's own way) from the same
        # fused params and in-backward settings, which must give its tables the Herald tables' settings
        resolve_table_settings(module, self.fused_params, None, device)
        stock_sharder = EmbeddingBagCollectionSharder(
            fused_params=self.fused_params, qcomm_codecs_registry=self.qcomm_codecs_registry
        )
        stock = stock_sharder.shard(sub_collection(module, rest), {n: params[n] for n in rest}, env, device, module_fqn)
        return ShardedMixedEmbeddingBagCollection(
            module, herald, stock, qcomm_codecs_registry=self.qcomm_codecs_registry
        )

    @property
    def sharded_module_type(self) -> type:
        return ShardedMixedEmbeddingBagCollection if self.unscheduled_tables else ShardedHeraldEmbeddingBagCollection
