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
tables and TorchRec's `ShardedEmbeddingBagCollection`, with the same fused params, for the rest.

One sharder serves any model (DMP keeps one sharder per module type): a table Herald cannot train exactly as stock
TorchRec does (an INT8 table, an in-backward optimizer setting Herald cannot honour, an FP16 table beside more FP32
ones of its EBC, ...; manageable.py, the same predicate the sharded module refuses it by) is left to TorchRec as if
named in `unscheduled_tables`, and an EBC none of whose tables Herald can manage is sharded entirely by TorchRec's
`EmbeddingBagCollectionSharder` with the same fused params. FP16 tables are Herald's, kept in float16 as stock keeps
them. A warning names such tables and the reason, once per EBC; the math is never changed. With no plan,
DMP's default planner gives them this sharder's ROW_WISE + FUSED (stock ROW_WISE); `planner_constraints(ebc)` lets
the planner give them any stock model-parallel type, as for unscheduled tables.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Collection, Sequence

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from herald_torchrec.distributed.embeddingbag import ShardedHeraldEmbeddingBagCollection
from herald_torchrec.distributed.manageable import TableSplit, split_tables
from herald_torchrec.distributed.mixed import ShardedMixedEmbeddingBagCollection, sub_collection
from herald_torchrec.distributed.storage.optimizer_params import DEFAULT_FUSED_PARAMS, sharder_fused_params
from herald_torchrec.options import HeraldOptions

ROW_SPLIT_TYPES = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)


def with_row_wise(types: list[str]) -> list[str]:
    """TorchRec's EBC sharder offers ROW_WISE and TABLE_ROW_WISE (rows over a machine's ranks) only on CUDA; both run
    on CPU / gloo too, so offer them everywhere."""
    return [*types, *(t for t in ROW_SPLIT_TYPES if t not in types)]


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
        # tables `planner_constraints` gave stock types because Herald refuses them: the sharder then offers those
        # types to the planner, as it does for unscheduled tables
        self._planned_stock: set[str] = set()
        self._warned: set[tuple[str, ...]] = set()  # the refusals already warned about (once per EBC)

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

    @property
    def offers_stock_types(self) -> bool:
        """Whether the planner is offered TorchRec's types beside ROW_WISE: with unscheduled tables, or once
        `planner_constraints` left tables to TorchRec (then plan with those constraints: they pin Herald's tables
        to ROW_WISE + FUSED). Otherwise every table is planned ROW_WISE + FUSED, which TorchRec runs too."""
        return bool(self.unscheduled_tables or self._planned_stock)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        if not self.offers_stock_types:
            return [ShardingType.ROW_WISE.value]
        return [ShardingType.ROW_WISE.value, *self._stock_types(compute_device_type)]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        if not self.offers_stock_types:
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
        tables and those Herald leaves to TorchRec any of `stock_sharding_types` (default: every type this sharder
        offers them).

        With `world_size`, an unscheduled table with fewer rows than ranks is kept off ROW_WISE (when another type is
        allowed): its ROW_WISE sharding leaves a rank an empty shard, and where that is the rank's only TorchRec
        table, FBGEMM's CPU TBE takes its GPU path and fails."""
        names = [c.name for c in module.embedding_bag_configs()]
        self._check_unscheduled(names)
        split = self.split(module, device=torch.device(device_type))
        self._planned_stock |= set(split.refused)
        allowed = list(stock_sharding_types) if stock_sharding_types else None
        small_ok = [t for t in (allowed or self.sharding_types(device_type)) if t != ShardingType.ROW_WISE.value]
        out = {}
        for c in module.embedding_bag_configs():
            if c.name in split.managed:
                out[c.name] = ParameterConstraints(
                    sharding_types=[ShardingType.ROW_WISE.value], compute_kernels=[EmbeddingComputeKernel.FUSED.value]
                )
            elif world_size is not None and c.num_embeddings < world_size and small_ok:
                out[c.name] = ParameterConstraints(sharding_types=small_ok)
            else:
                out[c.name] = ParameterConstraints(sharding_types=allowed)
        return out

    def split(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding] | None = None,
        device: torch.device | None = None,
    ) -> TableSplit:
        """Which of `module`'s tables Herald manages and which go to TorchRec (unscheduled or refused, with the
        reasons): manageable.split_tables with this sharder's fused params and unscheduled tables."""
        return split_tables(module, self.fused_params, self.unscheduled_tables, params, device)

    def _warn_refused(self, split: TableSplit, module_fqn: str | None) -> None:
        key = (module_fqn or "", *split.refused)
        if not split.refused or key in self._warned:
            return
        self._warned.add(key)
        where = f"EmbeddingBagCollection {module_fqn!r}" if module_fqn else "an EmbeddingBagCollection"
        whole = "the whole EBC is sharded by TorchRec" if not split.managed else "the others stay Herald's"
        reasons = "; ".join(f"{t!r}: {r.reason}" for t, r in split.refused.items())
        warnings.warn(
            f"HeraldEmbeddingBagCollectionSharder: tables {list(split.refused)} of {where} are left to TorchRec's own "
            f"sharding, which trains them as stock does, without embedding scheduling ({whole}): {reasons}",
            stacklevel=3,
        )

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
    ) -> ShardedHeraldEmbeddingBagCollection | ShardedMixedEmbeddingBagCollection | ShardedEmbeddingBagCollection:
        names = [c.name for c in module.embedding_bag_configs()]
        self._check_unscheduled(names)
        split = self.split(module, params, device)
        self._warn_refused(split, module_fqn)
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(f"tables {missing} have no sharding in the plan")
        stock_sharder = EmbeddingBagCollectionSharder(
            fused_params=self.fused_params, qcomm_codecs_registry=self.qcomm_codecs_registry
        )
        if not split.managed:  # nothing for Herald: TorchRec's own sharded EBC, as its sharder would build it
            stock = stock_sharder.shard(module, params, env, device, module_fqn)
            stock.herald_refusals = dict(split.refused)  # read by HeraldTrainPipeline to say why it has no module
            return stock
        wrong = {
            n: params[n].sharding_type for n in split.managed if params[n].sharding_type != ShardingType.ROW_WISE.value
        }
        if wrong:
            raise ValueError(
                f"Herald-managed tables must be planned ROW_WISE (their home placement), got {wrong}: plan with "
                "`constraints=sharder.planner_constraints(ebc)`, or list them in unscheduled_tables"
            )
        herald = ShardedHeraldEmbeddingBagCollection(
            module=sub_collection(module, list(split.managed)) if split.left else module,
            table_name_to_parameter_sharding={n: params[n] for n in split.managed},
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
        if not split.left:
            return herald
        # the TorchRec part resolves its tables' optimizer TorchRec's own way, from the same fused params and
        # in-backward settings: a table left to it trains as under TorchRec's sharder, whatever Herald's tables use
        rest = list(split.left)
        stock = stock_sharder.shard(sub_collection(module, rest), {n: params[n] for n in rest}, env, device, module_fqn)
        return ShardedMixedEmbeddingBagCollection(
            module, herald, stock, qcomm_codecs_registry=self.qcomm_codecs_registry
        )

    @property
    def sharded_module_type(self) -> type:
        return ShardedMixedEmbeddingBagCollection if self.unscheduled_tables else ShardedHeraldEmbeddingBagCollection
