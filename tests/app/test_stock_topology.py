"""Stock TorchRec in the app across machines: the planner's topology has torchrun's ranks per machine, and
TABLE_ROW_WISE (TorchRec's sharding across machines) is offered on CPU as on CUDA."""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed.types import ShardingType

from herald_torchrec.app.model_setup import SHARDING_TYPES, StockSharder, planner_topology
from herald_torchrec.app.runtime import DistContext


def _ctx(world: int) -> DistContext:
    return DistContext(rank=0, world_size=world, local_rank=0, device=torch.device("cpu"), backend="gloo")


@pytest.mark.parametrize("local, want", [("2", 2), ("4", 4), (None, 4)])  # None: TorchRec's 8 does not divide 4
def test_planner_topology_takes_torchruns_ranks_per_machine(monkeypatch, local, want) -> None:
    """4 ranks as 2 machines of 2 (LOCAL_WORLD_SIZE=2): TorchRec's Topology would take all 4 for one machine, its
    cost model pricing every link as inside one, and its TABLE_ROW_WISE shards spanning machines (the sharding then
    fails to build: 'Number of local shards (0) does not match')."""
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    topo = planner_topology(_ctx(4))
    assert topo.world_size == 4 and topo.local_world_size == want


def test_table_row_wise_is_offered_on_cpu() -> None:
    """By the app's stock sharder and, for the tables Herald leaves to TorchRec, by Herald's (`with_row_wise`)."""
    from herald_torchrec.distributed.sharder import with_row_wise

    tw, rw, twrw = (t.value for t in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE))
    assert with_row_wise([tw]) == [tw, rw, twrw] and with_row_wise([twrw, rw]) == [twrw, rw]
    assert SHARDING_TYPES["table_row_wise"] == ShardingType.TABLE_ROW_WISE
    types = StockSharder().sharding_types("cpu")
    assert ShardingType.TABLE_ROW_WISE.value in types and ShardingType.ROW_WISE.value in types
    assert len(types) == len(set(types))
