"""herald_torchrec: Herald embedding scheduling as a TorchRec plugin.

    from herald_torchrec import HeraldEmbeddingBagCollectionSharder, HeraldOptions, HeraldTrainPipeline

    options = HeraldOptions(cache_ratio=0.1, policy="herald", lookahead=4)   # every Herald setting, checked once
    sharder = HeraldEmbeddingBagCollectionSharder(options=options, fused_params=...)
    pipeline = HeraldTrainPipeline(model, optimizer, device, options=options)

The sharder and the pipeline are imported lazily, so that the control plane (`herald_torchrec.schedule`, numpy only)
and `HeraldOptions` can be used without importing torch / torchrec.
"""

from __future__ import annotations

from typing import Any

from herald_torchrec.options import HeraldOptions

__all__ = ["HeraldEmbeddingBagCollectionSharder", "HeraldOptions", "HeraldTrainPipeline"]


def __getattr__(name: str) -> Any:
    if name == "HeraldEmbeddingBagCollectionSharder":
        from herald_torchrec.distributed.sharder import HeraldEmbeddingBagCollectionSharder

        return HeraldEmbeddingBagCollectionSharder
    if name == "HeraldTrainPipeline":
        from herald_torchrec.distributed.train_pipeline.pipeline import HeraldTrainPipeline

        return HeraldTrainPipeline
    raise AttributeError(f"module 'herald_torchrec' has no attribute {name!r}")
