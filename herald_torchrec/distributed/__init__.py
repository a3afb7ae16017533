"""Data plane: the sharder and the cache-aware sharded EBC that executes the scheduler's plans, with its train
pipeline and input stage (train_pipeline/), one step (step/), row storage on an FBGEMM TBE (storage/), its state as
TorchRec presents it (state/) and the comparison systems' step extensions (comparison/). It never decides policy.

Imports torch / torchrec / fbgemm (unlike the control plane in herald_torchrec.schedule)."""

from herald_torchrec.distributed.comm import CommCounter, PlanComm
from herald_torchrec.distributed.embeddingbag import ShardedHeraldEmbeddingBagCollection
from herald_torchrec.distributed.sharder import HeraldEmbeddingBagCollectionSharder
from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec

__all__ = [
    "CommCounter",
    "HeraldEmbeddingBagCollectionSharder",
    "PlanComm",
    "RowStore",
    "ShardedHeraldEmbeddingBagCollection",
    "TableSpec",
]
