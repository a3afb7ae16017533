"""Data plane: row store on an FBGEMM TBE, plan-sized collectives, the cache-aware sharded EBC and its sharder.

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
