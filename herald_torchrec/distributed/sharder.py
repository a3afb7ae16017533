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
trains the same under this sharder as under TorchRec's ROW_WISE sharding. `policy` and `lookahead` are carried for the pipeline that runs the scheduler;
the data plane itself only executes plans.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from herald_torchrec.distributed.embeddingbag import ShardedHeraldEmbeddingBagCollection
from herald_torchrec.distributed.row_store import check_cache_ratio, parse_optimizer

DEFAULT_FUSED_PARAMS: dict[str, Any] = {"optimizer": "exact_rowwise_adagrad", "learning_rate": 0.01, "eps": 1e-8}


class HeraldEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    def __init__(
        self,
        cache_ratio: float = 0.1,
        policy: str = "herald",
        lookahead: int = 1,
        fused_params: dict[str, Any] | None = None,
        check_errors_globally: bool = True,
        gradient_division: bool | None = None,
        qcomm_codecs_registry: dict | None = None,
    ) -> None:
        self.cache_ratio = check_cache_ratio(cache_ratio)
        if not isinstance(policy, str) or not policy:
            raise ValueError(f"policy must be a non-empty string, got {policy!r}")
        if int(lookahead) < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        fp = dict(DEFAULT_FUSED_PARAMS)
        fp.update(fused_params or {})
        fp["optimizer"] = parse_optimizer(fp["optimizer"])  # fail early on unsupported optimizers
        if float(fp.get("weight_decay", 0.0)) != 0.0:
            raise ValueError("Herald-managed tables: weight_decay must be 0")
        super().__init__(fused_params=fp, qcomm_codecs_registry=qcomm_codecs_registry)
        self.policy, self.lookahead = policy, int(lookahead)
        self.check_errors_globally = check_errors_globally
        self.gradient_division = gradient_division

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ShardingType.ROW_WISE.value]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.FUSED.value]

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedHeraldEmbeddingBagCollection:
        return ShardedHeraldEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
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
        )

    @property
    def sharded_module_type(self) -> type[ShardedHeraldEmbeddingBagCollection]:
        return ShardedHeraldEmbeddingBagCollection
