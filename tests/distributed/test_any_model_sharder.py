"""One `HeraldEmbeddingBagCollectionSharder` serves any model: tables Herald cannot train exactly as stock TorchRec
does are left to TorchRec's own sharding by the sharder itself (distributed/manageable.py), with a warning naming
them; an EBC none of whose tables Herald manages is TorchRec's `ShardedEmbeddingBagCollection`.

- in one process: which tables go where and why (an INT8 table, an in-backward optimizer Herald cannot honour,
  tables whose optimizers disagree), the refusals no sharding honours stay errors, and the planner is offered stock
  types for the tables `planner_constraints` leaves to TorchRec;
- on 2 gloo ranks: a model with an ordinary EBC and one Herald refuses (MEAN pooling with gradient clipping, which
  TorchRec trains), sharded with `[HeraldEmbeddingBagCollectionSharder]` alone by DMP's default planner and trained
  through HeraldTrainPipeline, equals the same model under TorchRec's sharder (ROW_WISE) and
  TrainPipelineSparseDist (<= 1e-5) and one process's on the global batches (max_gradient is large enough never to
  clip, so the reference needs no clipping); a model whose every EBC is left to TorchRec is refused by
  HeraldTrainPipeline, naming the tables. (FP16 tables are Herald's: test_fp16_tables.py.)
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.distributed.train_pipeline.test_pipeline_edges import ROWS, TwoEBCModel, batches, one_process_reference
from tests.helpers.ranks import rank_result, run_ranks

STEPS = 12


# gradient clipping that never clips these gradients: Herald refuses it with MEAN pooling, TorchRec trains it
CLIP = {"gradient_clipping": True, "max_gradient": 1e6}


class RefusedModel(TwoEBCModel):
    """test_pipeline_edges' TwoEBCModel (ebc_a: t0 + t1 reading f0, f1; ebc_b: t2 reading f2; a dense head) with
    the tables of `refused` pooled by MEAN: under `CLIP`, tables Herald leaves to TorchRec."""

    def __init__(self, refused: tuple[str, ...] = ("t2",)) -> None:
        from torchrec.modules.embedding_configs import PoolingType

        super().__init__(table_options={t: {"pooling": PoolingType.MEAN} for t in refused})


def make_ebc(int8: bool = False, weighted: bool = False, mean: bool = False):
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t,
                embedding_dim=4,
                num_embeddings=40,
                feature_names=[f"f{t}"],
                data_type=DataType.INT8 if int8 and t == "t1" else DataType.FP32,
                pooling=PoolingType.MEAN if mean and t == "t1" else PoolingType.SUM,
            )
            for t in ("t0", "t1", "t2")
        ],
        is_weighted=weighted,
    )


def test_the_sharder_leaves_what_herald_refuses_to_torchrec() -> None:
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder
    from herald_torchrec.distributed.manageable import split_tables

    sharder = HeraldEmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})
    # an INT8 table: the module's own refusal, now the reason it goes to TorchRec
    split = sharder.split(make_ebc(int8=True))
    assert split.managed == ("t0", "t2") and split.left == ("t1",), split
    assert "data_type=INT8" in split.refused["t1"].reason
    # an in-backward optimizer Herald cannot honour (Adam reads the TBE's step counter)
    ebc = make_ebc()
    apply_optimizer_in_backward(torch.optim.Adam, [ebc.embedding_bags["t2"].weight], {"lr": 0.1})
    split = sharder.split(ebc)
    assert split.managed == ("t0", "t1") and list(split.refused) == ["t2"]
    assert "optimizer" in split.refused["t2"].reason and "ADAM" in split.refused["t2"].reason
    # tables whose optimizers disagree: one Herald TBE per EBC keeps the settings of the most tables
    ebc = make_ebc()
    apply_optimizer_in_backward(RowWiseAdagrad, [ebc.embedding_bags["t1"].weight], {"lr": 0.1})
    split = sharder.split(ebc)
    assert split.managed == ("t0", "t2") and list(split.refused) == ["t1"]
    assert split.refused["t1"].reason.startswith("optimizer: resolves to"), split.refused["t1"].reason
    # unscheduled tables stay the user's, beside the refused ones
    split = split_tables(make_ebc(int8=True), sharder.fused_params, unscheduled=["t0"])
    assert split.managed == ("t2",) and split.left == ("t0", "t1") and list(split.refused) == ["t1"]
    # MEAN pooling with gradient clipping: refused per table
    clip = HeraldEmbeddingBagCollectionSharder(fused_params={"gradient_clipping": True, "max_gradient": 1.0})
    assert clip.split(make_ebc(mean=True)).left == ("t1",)
    assert sharder.split(make_ebc(mean=True)).left == ()
    # what no sharding trains as asked stays an error, never a table handed over
    with pytest.raises(ValueError, match="table 't1': a weighted EmbeddingBagCollection pools by SUM only"):
        sharder.split(make_ebc(weighted=True, mean=True))
    ebc = make_ebc()
    apply_optimizer_in_backward(torch.optim.SGD, [ebc.embedding_bags["t0"].weight], {"lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match="table 't0': momentum=0.9"):
        sharder.split(ebc)
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    wd = {"optimizer": "exact_rowwise_adagrad", "weight_decay": 0.1, "weight_decay_mode": WeightDecayMode.L2}
    with pytest.raises(ValueError, match="weight_decay=0.1: FBGEMM's CPU kernels"):
        HeraldEmbeddingBagCollectionSharder(fused_params=wd).split(make_ebc(), device=torch.device("cpu"))


def test_planner_constraints_give_refused_tables_stock_types() -> None:
    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder

    sharder = HeraldEmbeddingBagCollectionSharder()
    assert sharder.sharding_types("cpu") == ["row_wise"] and sharder.compute_kernels("row_wise", "cpu") == ["fused"]
    c = sharder.planner_constraints(make_ebc())  # nothing refused: only the home placement is offered
    assert all(v.sharding_types == ["row_wise"] for v in c.values()) and sharder.sharding_types("cpu") == ["row_wise"]
    c = sharder.planner_constraints(make_ebc(int8=True), ["table_wise"])
    assert c["t1"].sharding_types == ["table_wise"]
    assert c["t0"].sharding_types == ["row_wise"] and c["t0"].compute_kernels == ["fused"]
    offered = sharder.sharding_types("cpu")
    assert "table_wise" in offered and "row_wise" in offered and "data_parallel" not in offered
    assert "dense" not in sharder.compute_kernels("table_wise", "cpu")


def build(kind: str, refused: tuple[str, ...] = ("t2",)):
    """The model sharded by DMP with Herald's sharder alone and its default planner (`herald`), or with TorchRec's
    sharder planned ROW_WISE (`stock`: the placement Herald's tables and the tables it leaves get by default; TorchRec
    offers ROW_WISE on CUDA only, and runs it on CPU too), and the pipeline class to train it with."""
    import torch.distributed as dist
    from torchrec.distributed import TrainPipelineSparseDist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from herald_torchrec import HeraldEmbeddingBagCollectionSharder, HeraldTrainPipeline
    from herald_torchrec.distributed.sharder import with_row_wise
    from tests.scenarios.test_dropin import set_tables

    class RowWiseStock(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return with_row_wise(super().sharding_types(compute_device_type))

    model = RefusedModel(refused)
    init = {n: b.weight.detach().clone() for e in (model.ebc_a, model.ebc_b) for n, b in e.embedding_bags.items()}
    for ebc in (model.ebc_a, model.ebc_b):
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.2})
    herald = kind == "herald"
    plan = None
    if herald:
        sharder = HeraldEmbeddingBagCollectionSharder(cache_ratio=0.05, lookahead=2, fused_params=CLIP)
    else:
        sharder = RowWiseStock(fused_params=CLIP)
        rw = {t: ParameterConstraints(sharding_types=["row_wise"]) for t in ROWS}
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"), constraints=rw)
        plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder], plan=plan)
    set_tables(dmp, init)  # TorchRec's shards draw their own values: start from the unsharded model's
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda p: torch.optim.SGD(p, lr=0.1)
    )
    left = [str(w.message) for w in caught if "left to TorchRec" in str(w.message)]
    return dmp, dense, (HeraldTrainPipeline if herald else TrainPipelineSparseDist), left


def any_model_worker(rank: int, world: int, out_dir: str, kind: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import get_unwrapped_module

    dmp, dense, pipeline_cls, left = build(kind)
    pipeline = pipeline_cls(dmp, dense, torch.device("cpu"))
    it = iter(batches(rank, STEPS))
    for _ in range(STEPS):
        pipeline.progress(it)
    dcp.save({"model": dmp.state_dict()}, checkpoint_id=str(Path(out_dir) / "ckpt"))
    net = get_unwrapped_module(dmp)
    out = {"types": {n: type(getattr(net, n)).__name__ for n in ("ebc_a", "ebc_b")}, "warnings": left}
    if kind == "herald":
        out["counters"] = dict(pipeline.trained_counters)
        pipeline.close()
        dmp2, dense2, _, _ = build(kind, refused=("t0", "t1", "t2"))  # every EBC left to TorchRec
        try:
            pipeline_cls(dmp2, dense2, torch.device("cpu"))
            out["no_herald_error"] = None
        except ValueError as e:
            out["no_herald_error"] = str(e)
    torch.save(out, rank_result(out_dir, rank))


def test_one_herald_sharder_shards_a_refused_ebc_with_torchrec(tmp_path: Path) -> None:
    from tests.scenarios.test_dropin import full_checkpoint

    got = {}
    for kind in ("stock", "herald"):
        run_ranks("tests.distributed.test_any_model_sharder:any_model_worker", tmp_path / kind, world_size=2, kind=kind)
        got[kind] = full_checkpoint(tmp_path / kind / "ckpt")
    r0 = torch.load(rank_result(tmp_path / "herald", 0))
    assert r0["types"] == {"ebc_a": "ShardedHeraldEmbeddingBagCollection", "ebc_b": "ShardedEmbeddingBagCollection"}
    (warning,) = r0["warnings"]
    assert "['t2']" in warning and "gradient clipping with MEAN" in warning and "'ebc_b'" in warning, warning
    assert r0["counters"]["shared_value"] + r0["counters"]["migrate"] > 0  # ebc_a was scheduled
    err = r0["no_herald_error"]
    assert err and "no Herald-managed sharded module" in err and "'t2'" in err and "MEAN" in err, err
    stock, herald = got["stock"], got["herald"]
    assert sorted(stock) == sorted(herald)
    assert sum(".embedding_bags." in k for k in stock) == 3
    worst = max(float((stock[k] - herald[k]).abs().max()) for k in stock)
    assert worst <= 1e-5, worst
    t2 = next(k for k in stock if k.endswith("embedding_bags.t2.weight"))
    init = RefusedModel().ebc_b.embedding_bags["t2"].weight.detach()
    assert float((stock[t2] - init).abs().max()) > 1e-3  # t2 trained: the comparison is not vacuous
    # and one process on the global batches (torch's SGD on every table, unclipped: CLIP never clips here)
    ref = one_process_reference(2, STEPS, model=RefusedModel)
    worst = max(float((ref[k] - herald[k]).abs().max()) for k in stock)
    assert worst <= 1e-5, worst
