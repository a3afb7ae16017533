"""Herald as a drop-in for a TorchRec user's own training loop, built only from TorchRec's pieces.

The loop below is what a TorchRec user already has: `torchrec.models.dlrm.DLRM` / `DLRMTrain`, multi-hot data from
`torchrec.datasets.random.RandomRecDataset` (empty bags included; one table read by two features), the embedding
optimizer set with `apply_optimizer_in_backward` (SGD, or row-wise Adagrad with eps 1e-3), the dense optimizer in
TorchRec's `KeyedOptimizerWrapper` idiom, DMP with its default planner, `TrainPipelineSparseDist`, and state read
through `DMP.state_dict()` + `torch.distributed.checkpoint`. The Herald loop differs in exactly the lines marked
`# <- herald` (the sharder and the pipeline class). Both end at the same tables, optimizer state and dense
parameters, and so does a one-process reference over the whole global batch.

The tables are large enough for DMP's default planner to pick TABLE_WISE on CPU: for small tables it picks
DATA_PARALLEL, and TorchRec then trains them with the *dense* optimizer, not the in-backward one (torchrec 1.8;
in_backward_optimizer_filter lists them): the stock loop itself would not train the model it was given.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import rank_result, run_ranks_sequence

STEPS = 30
B = 16  # per rank
KEYS = ["f0", "f1", "f2", "f3", "f4"]
ROWS = {
    "t0": 4000,
    "t1": 6000,
    "t2": 2300,
    "t3": 5000,
}  # large enough for the default planner to pick TABLE_WISE (t2 serves f2 and f4)
FEATURES = {"t0": ["f0"], "t1": ["f1"], "t2": ["f2", "f4"], "t3": ["f3"]}
HASH = [40, 300, 23, 120, 23]
MAX_IDS = [3, 2, 1, 4, 2]  # multi-hot; RandomRecDataset draws each bag's length in [0, max]: empty bags occur


def make_model():
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=t, embedding_dim=8, num_embeddings=ROWS[t], feature_names=FEATURES[t]) for t in ROWS
        ]
    )
    return DLRMTrain(DLRM(ebc, dense_in_features=4, dense_arch_layer_sizes=[8], over_arch_layer_sizes=[8, 1]))


def data(rank: int, world: int = 2, ref: bool = False):
    from torchrec.datasets.random import RandomRecDataset

    if ref:  # one process, the whole global batch
        return (concat_batches(parts) for parts in zip(*[data(q, world) for q in range(world)]))
    return RandomRecDataset(
        KEYS,
        B,
        hash_sizes=HASH,
        ids_per_features=MAX_IDS,
        min_ids_per_features=[0] * len(KEYS),
        num_dense=4,
        manual_seed=100 + rank,
        num_generated_batches=STEPS + 4,
    )


def concat_batches(parts):
    """One Batch of the samples of several (the global batch of a one-process reference)."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    dicts = [p.sparse_features.to_dict() for p in parts]
    keys = list(parts[0].sparse_features.keys())
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([d[k].values() for k in keys for d in dicts]),
        lengths=torch.cat([d[k].lengths() for k in keys for d in dicts]),
    )
    return Batch(torch.cat([p.dense_features for p in parts]), kjt, torch.cat([p.labels for p in parts]))


def set_tables(dmp, tables: dict[str, torch.Tensor]) -> None:
    """TorchRec's way to set sharded table values: through state_dict / load_state_dict."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    sd = dmp.state_dict()
    for k, v in sd.items():
        name = k.split(".")[-2]
        if isinstance(v, ShardedTensor) and name in tables:
            for sh in v.local_shards():
                o, n = sh.metadata.shard_offsets, sh.metadata.shard_sizes
                sh.tensor.copy_(tables[name][o[0] : o[0] + n[0], o[1] : o[1] + n[1]])
        elif k.endswith(f"{name}.weight") and name in tables:
            v.copy_(tables[name])
    dmp.load_state_dict(sd)


def dropin_worker(
    rank: int, world: int, out_dir: str, kind: str, opt: str, policy: str = "herald", ref_world: int | None = None
) -> None:
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed import TrainPipelineSparseDist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from herald_torchrec import HeraldEmbeddingBagCollectionSharder, HeraldTrainPipeline

    model = make_model()
    init = {
        n: b.weight.detach().clone() for n, b in model.model.sparse_arch.embedding_bag_collection.embedding_bags.items()
    }
    ebc_params = model.model.sparse_arch.embedding_bag_collection.parameters()
    if opt == "sgd":
        apply_optimizer_in_backward(torch.optim.SGD, ebc_params, {"lr": 0.1})
    else:
        apply_optimizer_in_backward(RowWiseAdagrad, ebc_params, {"lr": 0.1, "eps": 1e-3})
    herald = kind == "herald"
    sharder = (
        HeraldEmbeddingBagCollectionSharder(cache_ratio=0.2, lookahead=2, policy=policy)
        if herald
        else EmbeddingBagCollectionSharder()
    )  # <- herald
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder])
    set_tables(dmp, init)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda p: torch.optim.SGD(p, lr=0.05)
    )
    Pipeline = HeraldTrainPipeline if herald else TrainPipelineSparseDist  # <- herald
    pipeline = Pipeline(dmp, dense, torch.device("cpu"))
    batches = iter(data(rank, ref=ref_world is not None) if ref_world is None else data(rank, ref_world, ref=True))
    losses = []
    for _ in range(STEPS):
        loss, _logits, _labels = pipeline.progress(batches)  # DLRMTrain's output
        losses.append(float(loss))
    state = {"model": dmp.state_dict()}
    if opt != "sgd":
        state["optim"] = dmp.fused_optimizer.state_dict()
    dcp.save(state, checkpoint_id=str(Path(out_dir) / "ckpt"))
    extra = {}
    if herald:
        extra["plans_moved"] = sum(
            v for k, v in pipeline.trained_counters.items() if k in ("migrate", "evict_home", "forward")
        )
        extra["shared"] = pipeline.trained_counters.get("shared_value", 0)
        extra["shared_grad"] = pipeline.trained_counters.get("shared_grad", 0)
    torch.save({"losses": losses, **extra}, rank_result(out_dir, rank))


def full_checkpoint(ckpt: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / "full.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, torch.Tensor):
            flat[prefix] = v

    walk("", torch.load(out, weights_only=False))
    return flat


OPTIMIZERS = {"sgd": 1e-5, "rowwise_adagrad": 1e-4}  # optimizer -> tolerance


@pytest.fixture(scope="module")
def dropin_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """out/opt/kind for every optimizer: stock's and Herald's loops one after another in one pair of ranks, the
    one-process references in one process (each run takes a second or two; the ranks' start-up is paid once)."""
    out = tmp_path_factory.mktemp("dropin")
    worker = "tests.scenarios.test_dropin:dropin_worker"
    loops = {
        f"{opt}/{kind}": (worker, {"kind": kind, "opt": opt}) for opt in OPTIMIZERS for kind in ("stock", "herald")
    }
    run_ranks_sequence(loops, out / "loops", world_size=2)
    refs = {f"{opt}/reference": (worker, {"kind": "stock", "opt": opt, "ref_world": 2}) for opt in OPTIMIZERS}
    run_ranks_sequence(refs, out / "refs", world_size=1)
    return out


@pytest.mark.parametrize("opt,tol", list(OPTIMIZERS.items()))
def test_herald_dropin_equals_stock_torchrec(dropin_runs: Path, opt: str, tol: float) -> None:
    results = {}
    for kind in ("stock", "herald", "reference"):
        results[kind] = full_checkpoint(
            dropin_runs / ("refs" if kind == "reference" else "loops") / opt / kind / "ckpt"
        )
    loops = dropin_runs / "loops" / opt
    stock, herald = results["stock"], results["herald"]
    tables = [k for k in stock if ".embedding_bags." in k and k.startswith("model.")]
    assert len(tables) == len(ROWS)
    if opt != "sgd":
        assert sum("momentum1" in k for k in stock) == len(ROWS), sorted(stock)
    for other in ("stock", "reference"):
        want = results[other]
        assert sorted(want) == sorted(herald), sorted(set(want) ^ set(herald))
        worst = {k: float((want[k].float() - herald[k].float()).abs().max()) for k in want}
        bad = {k: v for k, v in worst.items() if v > tol}
        assert not bad, (other, bad)
    # the embeddings did train (the comparison is not between two untouched models)
    init = make_model().model.sparse_arch.embedding_bag_collection.embedding_bags
    moved = max(float((stock[k] - init[k.split(".")[-2]].weight).abs().max()) for k in tables)
    assert moved > 5e-4
    herald_r0 = torch.load(rank_result(loops / "herald", 0))
    assert herald_r0["shared"] > 0 and herald_r0["plans_moved"] > 0  # Herald's data plane did move and share rows
    # every shared value sent to a reader came back as a gradient within its step (the pipeline's counters hold both)
    herald_r1 = torch.load(rank_result(loops / "herald", 1))
    assert herald_r0["shared_grad"] + herald_r1["shared_grad"] == herald_r0["shared"] + herald_r1["shared"]
