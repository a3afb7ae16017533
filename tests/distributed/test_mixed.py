"""Tables left unscheduled fall back to TorchRec's own sharding: the sharder's validation and planner constraints
(in-process), and a 2-rank run where Herald-managed and TABLE_WISE / COLUMN_WISE tables train together in one EBC
through TorchRec's stock TrainPipelineSparseDist and end at the single-process reference model."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import rank_result, run_ranks

UNSCHEDULED = {"t1": "table_wise", "t3": "column_wise"}  # t1 serves two features; t0, t2 (multi-hot) stay Herald's


def test_sharder_validates_unscheduled_tables() -> None:
    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder
    from tests.distributed.test_embeddingbag import make_ebc  # tables t0, t1

    ebc = make_ebc()
    with pytest.raises(ValueError, match="not tables of the EmbeddingBagCollection"):
        HeraldEmbeddingBagCollectionSharder(unscheduled_tables=["nope"]).planner_constraints(ebc)
    with pytest.raises(ValueError, match="names every table"):
        HeraldEmbeddingBagCollectionSharder(unscheduled_tables=["t0", "t1"]).planner_constraints(ebc)
    with pytest.raises(ValueError, match="collection of table names"):
        HeraldEmbeddingBagCollectionSharder(unscheduled_tables="t0")

    s = HeraldEmbeddingBagCollectionSharder(unscheduled_tables=["t1"])
    c = s.planner_constraints(ebc, ["table_wise"])
    assert c["t0"].sharding_types == ["row_wise"] and c["t0"].compute_kernels == ["fused"]
    assert c["t1"].sharding_types == ["table_wise"]
    # with more ranks than rows (t1 has 33), the table is kept off ROW_WISE: a rank would get an empty shard
    c = s.planner_constraints(ebc, ["row_wise", "table_wise"], world_size=40)
    assert c["t1"].sharding_types == ["table_wise"] and c["t0"].sharding_types == ["row_wise"]
    assert s.planner_constraints(ebc, ["row_wise", "table_wise"], world_size=2)["t1"].sharding_types == [
        "row_wise",
        "table_wise",
    ]
    offered = s.sharding_types("cpu")
    assert "row_wise" in offered and "table_wise" in offered and "data_parallel" not in offered
    # without unscheduled tables, the sharder offers only the home placement
    assert HeraldEmbeddingBagCollectionSharder().sharding_types("cpu") == ["row_wise"]


def mixed_worker(rank: int, world: int, out_dir: str, opt: str) -> None:
    import numpy as np
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed import TrainPipelineSparseDist
    from torchrec.distributed.model_parallel import DistributedModelParallel, get_unwrapped_module
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import tests.scenarios.test_module_parity as P
    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder
    from herald_torchrec.distributed.mixed import ShardedMixedEmbeddingBagCollection
    from herald_torchrec.distributed.train_pipeline.pipeline import herald_modules
    from tests.helpers.pipeline import Batch, Wrap, drain

    batches = P.make_batches(world, 12)
    net = P.make_model()
    with torch.no_grad():
        for n, w in P.init_tables().items():
            net.ebc.embedding_bags[n].weight.copy_(w)
    model = Wrap(net)
    sharder = HeraldEmbeddingBagCollectionSharder(
        cache_ratio=P.CACHE_RATIO, fused_params=P.fused_params(opt), unscheduled_tables=list(UNSCHEDULED)
    )
    constraints = sharder.planner_constraints(net.ebc)
    for t, kind in UNSCHEDULED.items():
        constraints[t] = ParameterConstraints(sharding_types=[kind])
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        sharders=[sharder],
        plan=plan,
    )
    sebc = get_unwrapped_module(dmp).net.ebc
    with torch.no_grad():  # TorchRec draws its own values for the stock shards: start them from the same tables
        for k, v in dmp.state_dict().items():
            if isinstance(v, ShardedTensor):
                full = P.init_tables()[k.split(".")[-2]]
                for sh in v.local_shards():
                    (r0, c0), (nr, nc) = sh.metadata.shard_offsets, sh.metadata.shard_sizes
                    sh.tensor.copy_(full[r0 : r0 + nr, c0 : c0 + nc])
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.SGD(ps, lr=P.LR_DENSE)
    )
    pipe = TrainPipelineSparseDist(dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), torch.device("cpu"))
    # no scheduler here: the Herald part serves each rank's own slice with static plans of its own
    items = []
    for b in batches:
        s = np.arange(rank * P.BATCH, (rank + 1) * P.BATCH)
        items.append(Batch(torch.from_numpy(b["dense"][s]), P.local_kjt(b, s), torch.from_numpy(b["labels"][s])))
    steps = drain(pipe, items)
    (herald,) = herald_modules(dmp)
    weights, _ = herald.full_tables()
    for k, v in dmp.state_dict().items():
        if isinstance(v, ShardedTensor):
            out = torch.zeros(v.size()) if rank == 0 else None
            v.gather(dst=0, out=out)
            weights[k.split(".")[-2]] = out
    if rank == 0:
        ref = P.run_reference(opt, batches, world, True)
        torch.save(
            {
                "steps": steps,
                "mixed": isinstance(sebc, ShardedMixedEmbeddingBagCollection),
                "kinds": {n: plan.plan["net.ebc"][n].sharding_type for n in ref["weights"]},
                "pipelined": type(sebc.forward).__name__,
                "tables": sorted(weights),
                "diff": P._max_diff(weights, ref["weights"]),
                "dense": P._max_diff(P.dense_state(net), ref["dense"]),
                "moved": P._max_diff(weights, P.init_tables()),
            },
            rank_result(out_dir, rank),
        )
    else:
        torch.save({}, rank_result(out_dir, rank))


@pytest.mark.parametrize("opt", ["exact_rowwise_adagrad", "exact_sgd"])
def test_mixed_tables_train_the_reference_model(tmp_path, opt: str) -> None:
    r = torch.load(
        run_ranks("tests.distributed.test_mixed:mixed_worker", tmp_path, world_size=2, timeout=240, opt=opt)[0],
        weights_only=False,
    )
    assert r["steps"] == 12 and r["mixed"] and r["pipelined"] == "PipelinedForward", r
    assert r["kinds"] == {"t0": "row_wise", "t1": "table_wise", "t2": "row_wise", "t3": "column_wise"}, r
    assert r["tables"] == ["t0", "t1", "t2", "t3"]
    assert r["diff"] <= 1e-5 and r["dense"] <= 1e-5, r
    assert r["moved"] > 1e-3, r  # training changed the tables: the comparison is not vacuous
