"""TorchRec's own test model under Herald: `TestSparseNN` (torchrec.distributed.test_utils.test_model: an unweighted
EBC and a weighted EBC, both Herald-managed) fed TorchRec's `ModelInput` (float features, an id-list KJT, a weighted
id-score KJT, labels: a Pipelineable, not a `Batch`) by `HeraldTrainPipeline`, against stock
`TrainPipelineSparseDist` with the sharder TorchRec's `create_test_sharder` builds (its `fused_params`, learning rate
0.1 added as it adds it), on 2 gloo ranks, in three of the harness's configurations (optimizer / stock sharding
type: `CONFIGS`; every run in one pair of ranks). TorchRec's harness idiom: one global model's weights copied into
each sharded model (`copy_state_dict`), the same `ModelInput.generate` batches, then every table, the optimizer
state and the dense parameters compared (<= 1e-5), and each rank's eval predictions on its own eval batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.pipeline import drain
from tests.helpers.ranks import rank_result, run_ranks_sequence
from tests.scenarios.test_dropin import full_checkpoint
from tests.scenarios.test_table_writes import copy_state_dict

STEPS = 8
B = 8  # per rank
NUM_FLOAT = 10
TOL = 1e-5


def table_configs():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    tables = [
        EmbeddingBagConfig(
            num_embeddings=60 + 20 * i, embedding_dim=8, name=f"table_{i}", feature_names=[f"feature_{i}"]
        )
        for i in range(2)
    ]
    weighted = [
        EmbeddingBagConfig(
            num_embeddings=40 + 10 * i, embedding_dim=4, name=f"weighted_table_{i}", feature_names=[f"weighted_{i}"]
        )
        for i in range(2)
    ]
    return tables, weighted


def make_global_model():
    from torchrec.distributed.test_utils.test_model import TestSparseNN

    tables, weighted = table_configs()
    torch.manual_seed(0)
    return TestSparseNN(tables=tables, weighted_tables=weighted, num_float_features=NUM_FLOAT)


def user_bags(mi):
    """`mi` with its id-list KJT made VBE: feature_0 holds one bag per pair of samples (a request's user features,
    deduplicated), the samples of a pair pointing at it by `inverse_indices`; the pooled values are those of
    ModelInput's first sample of each pair for both."""
    import dataclasses

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = mi.idlist_features
    parts, lengths, strides, inverse = [], [], [], []
    for k, jt in kjt.to_dict().items():
        bags = range(0, B, 2) if k == "feature_0" else range(B)
        off = jt.offsets()
        for b in bags:
            parts.append(jt.values()[off[b] : off[b + 1]])
            lengths.append(int(off[b + 1] - off[b]))
        strides.append([len(bags)])
        inverse.append(torch.arange(B) // 2 if k == "feature_0" else torch.arange(B))
    vbe = KeyedJaggedTensor(
        keys=kjt.keys(),
        values=torch.cat(parts),
        lengths=torch.tensor(lengths, dtype=kjt.lengths().dtype),
        stride_per_key_per_rank=strides,
        inverse_indices=(kjt.keys(), torch.stack(inverse)),
    )
    return dataclasses.replace(mi, idlist_features=vbe)


def inputs(rank: int, world: int, seed: int, steps: int, vbe: bool = False):
    """This rank's ModelInput of each step (TorchRec's generator: the global batch split by rank), with a VBE id-list
    KJT if `vbe` (`user_bags`)."""
    from torchrec.distributed.test_utils.test_model import ModelInput

    tables, weighted = table_configs()
    out = []
    for s in range(steps):
        _, local = ModelInput.generate(
            batch_size=B,
            world_size=world,
            num_float_features=NUM_FLOAT,
            tables=tables,
            weighted_tables=weighted,
            pooling_avg=3,
            random_seed=seed + s,
        )
        out.append(user_bags(local[rank]) if vbe else local[rank])
    return out


# the harness's configurations run here: name -> (the optimizer in fused_params, stock's sharding type)
CONFIGS = {
    "rowwise_adagrad-table_wise": ("EXACT_ROWWISE_ADAGRAD", "TABLE_WISE"),
    "adagrad-row_wise": ("EXACT_ADAGRAD", "ROW_WISE"),
    "sgd-column_wise": ("EXACT_SGD", "COLUMN_WISE"),
}


def sharder_fused_params(optimizer: str = "EXACT_ROWWISE_ADAGRAD") -> dict:
    """What `create_test_sharder` hands its sharder: the caller's fused_params with learning_rate 0.1 added."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    fused = {"optimizer": EmbOptimType[optimizer]}
    if "ADAGRAD" in optimizer:
        fused["eps"] = 1e-2
    else:  # plain SGD at 0.1 moves these tables by ~3e-5, too little for a <= 1e-5 comparison to mean anything
        fused["learning_rate"] = 5.0
    if "learning_rate" not in fused:
        fused["learning_rate"] = 0.1
    return fused


def sparse_nn_worker(
    rank: int, world: int, out_dir: str, kind: str, vbe: bool = False, config: str = "rowwise_adagrad-table_wise"
) -> None:
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed import TrainPipelineSparseDist
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.test_utils.emb_sharder import TestEBCSharder
    from torchrec.distributed.test_utils.test_model import TestSparseNN
    from torchrec.distributed.types import ShardingType
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from herald_torchrec import HeraldEmbeddingBagCollectionSharder, HeraldTrainPipeline

    herald = kind == "herald"
    optimizer, sharding = CONFIGS[config]
    fused = sharder_fused_params(optimizer)
    if herald:
        sharder = HeraldEmbeddingBagCollectionSharder(fused_params=fused, cache_ratio=0.2, lookahead=2)
    else:
        sharder = TestEBCSharder(ShardingType[sharding].value, EmbeddingComputeKernel.FUSED.value, fused)
    tables, weighted = table_configs()
    torch.manual_seed(1)  # another init than the global model's: the copy below must set every weight
    local = TestSparseNN(tables=tables, weighted_tables=weighted, num_float_features=NUM_FLOAT)
    dmp = DistributedModelParallel(local, device=torch.device("cpu"), sharders=[sharder])
    copy_state_dict(dmp.state_dict(), make_global_model().state_dict())
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda p: torch.optim.SGD(p, lr=0.1)
    )
    Pipeline = HeraldTrainPipeline if herald else TrainPipelineSparseDist
    pipeline = Pipeline(dmp, dense, torch.device("cpu"))
    steps = drain(pipeline, inputs(rank, world, 100, STEPS, vbe))
    pipeline.detach()
    dmp.eval()
    with torch.no_grad():
        preds = torch.cat([dmp(x).detach().clone() for x in inputs(rank, world, 900, 2, vbe)])
    dcp.save(
        {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()},
        checkpoint_id=str(Path(out_dir) / "ckpt"),
    )
    extra = {}
    if herald:
        c = pipeline.trained_counters
        extra = {
            "moved": sum(c.get(k, 0) for k in ("migrate", "evict_home", "forward")),
            "shared": c.get("shared_value", 0),
        }
        pipeline.close()
    torch.save({"steps": steps, "preds": preds, **extra}, rank_result(out_dir, rank))


# the test's cases: id -> (configuration, VBE id-list KJT or not)
CASES = {
    **{c: (c, False) for c in CONFIGS},
    "rowwise_adagrad-table_wise-vbe_user_bags": ("rowwise_adagrad-table_wise", True),
}


@pytest.fixture(scope="module")
def case_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case's stock run and Herald run (out/case/kind), one after another in one pair of ranks: each trains in
    a fraction of a second, the ranks' start-up is paid once."""
    out = tmp_path_factory.mktemp("sparse_nn")
    worker = "tests.scenarios.test_pipelineable_inputs:sparse_nn_worker"
    runs = {
        f"{case}/{kind}": (worker, {"kind": kind, "vbe": vbe, "config": config})
        for case, (config, vbe) in CASES.items()
        for kind in ("stock", "herald")
    }
    run_ranks_sequence(runs, out, world_size=2)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_torchrec_test_sparse_nn_with_model_input_trains_stocks_model(case_runs: Path, case: str) -> None:
    """Each configuration: the optimizer in both sharders' fused_params, stock's sharding type (CONFIGS). With `vbe`,
    each rank's id-list KJT is VBE (`user_bags`): stock's sharded EBC pools the distinct bags and selects them per
    sample, Herald's input stage gives each sample its bag (variable_batch.py)."""
    config, vbe = CASES[case]
    if vbe:  # the inputs really are VBE, and not the plain ones: the pair's second sample reads the first's bag
        x, plain = inputs(0, 2, 100, 1, vbe=True)[0].idlist_features, inputs(0, 2, 100, 1)[0].idlist_features
        assert x.variable_stride_per_key() and x.stride_per_key() == [B // 2, B]
        assert not torch.equal(x.values(), plain.values())
    results, per_rank = {}, {}
    for kind in ("stock", "herald"):
        run_dir = case_runs / case / kind
        results[kind] = full_checkpoint(run_dir / "ckpt")
        per_rank[kind] = [torch.load(rank_result(run_dir, r)) for r in range(2)]
    stock, herald = results["stock"], results["herald"]
    assert sorted(stock) == sorted(herald), sorted(set(stock) ^ set(herald))
    tables = [k for k in stock if ".embedding_bags." in k and k.endswith(".weight")]
    assert len(tables) == 4, sorted(stock)  # both EBCs' tables
    stateful = CONFIGS[config][0] != "EXACT_SGD"
    assert sum("momentum1" in k for k in stock) == (4 if stateful else 0), sorted(stock)  # Adagrad's state per table
    assert any("dense" in k for k in stock) and any("over" in k for k in stock)  # the dense parameters too
    worst = {k: float((stock[k].float() - herald[k].float()).abs().max()) for k in stock}
    assert not {k: v for k, v in worst.items() if v > TOL}, worst
    # Adagrad's state sums squared gradients (row-wise: their mean, ~1e-7 here): compared relative to its size
    for k in (k for k in stock if "momentum1" in k):
        size = float(stock[k].abs().max())
        assert size > 0 and worst[k] <= TOL * size, (k, worst[k], size)
    # the comparison is between trained models: tables and dense parameters moved from the global model's
    init = make_global_model().state_dict()
    for k in tables + [k for k in stock if "dense" in k and k.endswith("weight")]:
        name = k.removeprefix("model.")
        assert float((stock[k] - init[name]).abs().max()) > 1e-4, k  # 100x the tolerance
    for r in range(2):
        s, h = per_rank["stock"][r], per_rank["herald"][r]
        assert s["steps"] == h["steps"] == STEPS
        assert s["preds"].shape == (2 * B,) and torch.allclose(s["preds"], h["preds"], atol=TOL, rtol=0)
    assert sum(p["moved"] for p in per_rank["herald"]) > 0  # Herald's scheduler did move rows between ranks
