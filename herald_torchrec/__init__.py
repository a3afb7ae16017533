"""herald_torchrec: Herald embedding scheduling as a TorchRec plugin.

    from herald_torchrec import HeraldEmbeddingBagCollectionSharder, HeraldTrainPipeline

The two names are imported lazily, so that the control plane (`herald_torchrec.schedule`, numpy only) can be used
without importing torch / torchrec.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HeraldEmbeddingBagCollectionSharder", "HeraldTrainPipeline"]


def __getattr__(name: str) -> Any:
    if name == "HeraldEmbeddingBagCollectionSharder":
        from herald_torchrec.distributed.sharder import HeraldEmbeddingBagCollectionSharder

        return HeraldEmbeddingBagCollectionSharder
    if name == "HeraldTrainPipeline":
        from herald_torchrec.distributed.train_pipeline.pipeline import HeraldTrainPipeline

        return HeraldTrainPipeline
    raise AttributeError(f"module 'herald_torchrec' has no attribute {name!r}")
