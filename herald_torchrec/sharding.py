"""Turn the app's model into a DistributedModelParallel + train pipeline for the chosen scheduler.

`scheduler=torchrec` is stock TorchRec: the planner (optionally restricted to some sharding types) with the stock
EmbeddingBagCollectionSharder and TrainPipelineSparseDist. The Herald schedulers plug in here with their own sharder
and pipeline, behind the same small `ShardedSetup` surface the trainer uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from herald_torchrec.data.batch import to_batch
from herald_torchrec.data.samples import Samples
from herald_torchrec.data.source import DataSource
from herald_torchrec.dist import DistContext
from herald_torchrec.models import FeatureSpec, TrainModel

SHARDING_TYPES = {
    "row_wise": ShardingType.ROW_WISE,
    "table_wise": ShardingType.TABLE_WISE,
    "column_wise": ShardingType.COLUMN_WISE,
    "data_parallel": ShardingType.DATA_PARALLEL,
}


class StockSharder(EmbeddingBagCollectionSharder):
    """TorchRec's EBC sharder, offering ROW_WISE on CPU too (stock offers it on CUDA only; it runs on CPU/gloo)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = super().sharding_types(compute_device_type)
        return types if ShardingType.ROW_WISE.value in types else [*types, ShardingType.ROW_WISE.value]


@dataclass
class ShardedSetup:
    """What the trainer drives: the sharded model, its pipeline, and how local samples become pipeline inputs."""

    name: str
    model: torch.nn.Module
    pipeline: Any
    batches: Callable[[Iterator[Samples]], Iterator[Any]]
    step_stats: Callable[[], dict[str, float]] = field(default=lambda: {})
    final_stats: Callable[[int], dict[str, Any]] = field(default=lambda steps: {})
    save_final: Callable[[Path, DictConfig], None] = field(default=lambda run_dir, cfg: None)


def fused_optimizer(cfg: DictConfig) -> tuple[type, dict[str, Any]]:
    t = cfg.trainer
    if t.embedding_optimizer == "rowwise_adagrad":
        return RowWiseAdagrad, {"lr": t.embedding_lr, "eps": t.get("embedding_eps", 1e-8)}
    return torch.optim.SGD, {"lr": t.embedding_lr}


def dense_optimizer(model: torch.nn.Module, cfg: DictConfig) -> KeyedOptimizerWrapper:
    t = cfg.trainer
    make = {
        "adam": lambda p: torch.optim.Adam(p, lr=t.dense_lr),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=t.dense_lr),
        "sgd": lambda p: torch.optim.SGD(p, lr=t.dense_lr),
    }[t.dense_optimizer]
    return KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())), make)


def batch_converter(features: FeatureSpec, source: DataSource) -> Callable[[Iterator[Samples]], Iterator[Any]]:
    cols = [list(source.feature_names).index(n) for n in features.names]
    keys = list(features.names)
    return lambda it: (to_batch(s, cols, keys) for s in it)


def _torchrec(model: TrainModel, features: FeatureSpec, source: DataSource, cfg: DictConfig, ctx: DistContext) -> ShardedSetup:
    opt_cls, opt_kw = fused_optimizer(cfg)
    apply_optimizer_in_backward(opt_cls, model.model.ebc.parameters(), opt_kw)
    types = cfg.sharding.get("types")
    constraints = None
    if types:
        bad = [t for t in types if t not in SHARDING_TYPES]
        if bad:
            raise ValueError(f"sharding.types: unknown {bad}; choose from {sorted(SHARDING_TYPES)}")
        constraints = {
            f"t_{n}": ParameterConstraints(sharding_types=[SHARDING_TYPES[t].value for t in types]) for n in features.names
        }
    sharders = [StockSharder()]
    pg = dist.GroupMember.WORLD
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=ctx.world_size, compute_device=ctx.device.type), constraints=constraints
    )
    plan = planner.collective_plan(model, sharders, pg)
    dmp = DistributedModelParallel(
        module=model, device=ctx.device, env=ShardingEnv.from_process_group(pg), plan=plan, sharders=sharders
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense_optimizer(dmp, cfg)])
    pipeline = TrainPipelineSparseDist(dmp, optimizer, ctx.device, execute_all_batches=True)
    return ShardedSetup("torchrec", dmp, pipeline, batch_converter(features, source))


SCHEDULERS: dict[str, Callable[..., ShardedSetup]] = {"torchrec": _torchrec}


def shard_model(model: TrainModel, features: FeatureSpec, source: DataSource, cfg: DictConfig, ctx: DistContext) -> ShardedSetup:
    name = cfg.scheduler.name
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {sorted(SCHEDULERS)}, got '{name}'")
    return SCHEDULERS[name](model, features, source, cfg, ctx)
