"""FP16 tables (`data_type=DataType.FP16`) are Herald-managed and train as stock TorchRec trains them: rows kept,
moved, shared and checkpointed in float16 (FBGEMM's `weights_precision=SparseType.FP16`), updated by FBGEMM's
kernel in float32 and rounded back.

- in one process: which tables Herald manages (FP16 and FP32 alike; in one EBC of mixed precisions the tables of the
  most common one, the others go to TorchRec naming `weights_precision`; the module itself refuses the mix), what
  stays refused (other data types, a precision among the fused params, CUDA's stochastic rounding of FP16 rows), and
  a store's FP16 rows read and written back bit for bit;
- on 2 gloo ranks: a model with an FP16 EBC (t0, t1) and an FP32 one (t2), SGD and row-wise Adagrad (eps 1e-2),
  trained through HeraldTrainPipeline (rows moved and shared every few steps) equals stock TorchRec's TABLE_WISE and
  ROW_WISE training with TrainPipelineSparseDist: tables, row-wise Adagrad's state and the dense head. The state
  dict, `named_parameters()` and the DCP checkpoint hold the FP16 tables in float16, and a checkpoint loads back
  into a fresh model bit for bit.

Why a tolerance of a few FP16 ulps and not bit equality: a shared row's gradient is summed over its readers in
another order than stock's one backward (float32 sums, last-bit differences), and FBGEMM rounds the updated row to
float16, which turns such a last-bit difference into one float16 ulp (2**-10 relative) now and then; the dense head
and the FP32 table read those rows, so they carry the same small differences, well below 1e-3.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.distributed.train_pipeline.test_pipeline_edges import ROWS, TwoEBCModel, batches
from tests.helpers.ranks import rank_result, run_ranks, run_ranks_sequence

STEPS = 12
FP16_TABLES = ("t0", "t1")  # ebc_a; ebc_b's t2 stays FP32
OPTIMIZERS = ("sgd", "rowwise_adagrad")
FP16_ULP = 2.0**-10  # float16's spacing relative to a value in [1, 2)


class FP16Model(TwoEBCModel):
    """test_pipeline_edges' TwoEBCModel (ebc_a: t0 + t1 reading f0, f1; ebc_b: t2 reading f2; a dense head) with the
    tables of `fp16` in half precision."""

    def __init__(self, fp16: tuple[str, ...] = FP16_TABLES) -> None:
        from torchrec.modules.embedding_configs import DataType

        super().__init__(table_options={t: {"data_type": DataType.FP16} for t in fp16})


def make_ebc(dtypes: tuple[str, ...]):
    """An EBC of tables t0, t1, ... with the given data types ("fp16", "fp32", "int8")."""
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    kinds = {"fp16": DataType.FP16, "fp32": DataType.FP32, "int8": DataType.INT8}
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t{i}", embedding_dim=4, num_embeddings=40, feature_names=[f"f{i}"], data_type=kinds[d]
            )
            for i, d in enumerate(dtypes)
        ]
    )


# ------------------------------------------------------------------------------------------ one process
def test_fp16_tables_are_herald_managed_and_mixed_precisions_split() -> None:
    from torchrec.distributed.types import ShardingEnv

    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder, ShardedHeraldEmbeddingBagCollection

    sharder = HeraldEmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})
    split = sharder.split(make_ebc(("fp16", "fp16", "fp16")))
    assert split.managed == ("t0", "t1", "t2") and split.left == (), split
    # mixed precisions: one Herald TBE per EBC keeps the precision of the most tables, the others go to TorchRec
    split = sharder.split(make_ebc(("fp16", "fp32", "fp16")))
    assert split.managed == ("t0", "t2") and split.left == ("t1",), split
    reason = split.refused["t1"].reason
    assert reason.startswith("weights_precision: resolves to") and "one row precision" in reason, reason
    # the module alone refuses the mix in one line naming the setting
    with pytest.raises(ValueError, match="weights_precision: tables 't0' and 't1'"):
        ShardedHeraldEmbeddingBagCollection(make_ebc(("fp16", "fp32")), None, ShardingEnv(1, 0, None))
    sebc = ShardedHeraldEmbeddingBagCollection(make_ebc(("fp16", "fp16")), None, ShardingEnv(1, 0, None))
    assert sebc.store.row_dtype == torch.float16
    sd = sebc.state_dict()
    assert sd["embedding_bags.t0.weight"].dtype == torch.float16
    assert dict(sebc.named_parameters())["embedding_bags.t0.weight"].dtype == torch.float16
    with pytest.raises(ValueError, match="HET's cache runs FP32 tables only"):
        ShardedHeraldEmbeddingBagCollection(make_ebc(("fp16",)), None, ShardingEnv(1, 0, None), policy="het")
    # other precisions: left to TorchRec by name, as before
    split = sharder.split(make_ebc(("fp32", "int8")))
    assert split.left == ("t1",) and "data_type=INT8" in split.refused["t1"].reason
    # a row precision among the fused params would contradict the tables' data types
    with pytest.raises(ValueError, match="weights_precision=.*EmbeddingBagConfig.data_type"):
        HeraldEmbeddingBagCollectionSharder(fused_params={"weights_precision": "fp16"})


def test_cuda_stochastic_rounding_of_fp16_rows_is_refused() -> None:
    from fbgemm_gpu.split_embedding_configs import SparseType

    from herald_torchrec.distributed.storage.optimizer_params import check_settings

    fp16 = {"weights_precision": SparseType.FP16}
    with pytest.raises(ValueError, match="stochastic_rounding=True .*FP16 rows on CUDA"):
        check_settings(fp16, torch.device("cuda"))
    assert check_settings({**fp16, "stochastic_rounding": False}, torch.device("cuda"))["weights_precision"] == (
        SparseType.FP16
    )
    check_settings(fp16, torch.device("cpu"))  # FBGEMM's CPU kernels round to nearest
    with pytest.raises(ValueError, match="cache_precision=FP32"):
        check_settings({**fp16, "cache_precision": SparseType.FP32})


def test_fp16_rows_move_bit_for_bit() -> None:
    from fbgemm_gpu.split_embedding_configs import SparseType

    from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec

    st = RowStore(
        [TableSpec("a", 10, 4), TableSpec("b", 10, 4)],
        0,
        2,
        cache_ratio=0.5,
        tbe_settings={"weights_precision": SparseType.FP16},
    )
    assert st.row_dtype == torch.float16 and st.weights(0).dtype == torch.float16
    assert st.state_view(0).dtype == torch.float32  # row-wise Adagrad's state stays float32, as FBGEMM keeps it
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        st.weights(0).copy_(torch.randn(st.local_rows[0], 4, generator=g))
        st.state_view(0).copy_(torch.rand(st.local_rows[0], generator=g))
    packed = st.read_packed(np.array([0, 0]), np.array([1, 2]))
    assert packed.dtype == torch.float32 and packed.numel() == 2 * (4 // 2 + 1)  # float16 bits: 2 words a row
    assert list(st.packed_widths(np.array([0, 1]))) == [3, 3] and list(st.packed_widths(np.array([0]), False)) == [4]
    st.write_packed(np.array([1, 1]), np.array([3, 4]), packed)
    assert torch.equal(st.weights(1)[3:5], st.weights(0)[1:3])
    assert torch.equal(st.state_view(1)[3:5], st.state_view(0)[1:3])
    rows, state = st.unpack_rows(0, packed.view(2, 3))
    assert rows.dtype == torch.float16 and torch.equal(rows, st.weights(0)[1:3])
    # shared values (no state) are float32 values, exact: every float16 is a float32
    values = st.read_packed(np.array([0]), np.array([1]), with_state=False)
    assert torch.equal(values, st.weights(0)[1].float())
    # tables of different dims take the per-table path, with the same packing
    mixed = RowStore(
        [TableSpec("a", 10, 4), TableSpec("b", 10, 8)],
        0,
        2,
        cache_ratio=0.5,
        tbe_settings={"weights_precision": SparseType.FP16},
    )
    with torch.no_grad():
        mixed.weights(1).copy_(torch.randn(mixed.local_rows[1], 8, generator=g))
        mixed.state_view(1).copy_(torch.rand(mixed.local_rows[1], generator=g))
    packed = mixed.read_packed(np.array([1, 1]), np.array([0, 1]))
    assert packed.numel() == 2 * (8 // 2 + 1)
    mixed.write_packed(np.array([1, 1]), np.array([6, 7]), packed)
    assert torch.equal(mixed.weights(1)[6:8], mixed.weights(1)[0:2])
    assert torch.equal(mixed.state_view(1)[6:8], mixed.state_view(1)[0:2])


# ------------------------------------------------------------------------------------------ 2 ranks
def build(kind: str, opt: str, world: int = 2):
    """The model sharded by DMP: `herald` (Herald's sharder, default planner), `stock_rw` / `stock_tw` (TorchRec's
    sharder, every table ROW_WISE / TABLE_WISE), all from the same initial tables; and its pipeline class."""
    import torch.distributed as dist
    from torchrec.distributed import TrainPipelineSparseDist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from herald_torchrec import HeraldEmbeddingBagCollectionSharder, HeraldTrainPipeline
    from herald_torchrec.distributed.sharder import with_row_wise
    from tests.scenarios.test_dropin import set_tables

    class StockSharder(EmbeddingBagCollectionSharder):  # TorchRec offers ROW_WISE on CUDA only; it runs on CPU too
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return with_row_wise(super().sharding_types(compute_device_type))

    model = FP16Model()
    init = {n: b.weight.detach().clone() for e in (model.ebc_a, model.ebc_b) for n, b in e.embedding_bags.items()}
    for ebc in (model.ebc_a, model.ebc_b):
        if opt == "sgd":
            apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.2})
        else:
            apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.1, "eps": 1e-2})
    plan = None
    if kind == "herald":
        sharder = HeraldEmbeddingBagCollectionSharder(cache_ratio=0.05, lookahead=2)
    else:
        sharder = StockSharder()
        types = ["row_wise"] if kind == "stock_rw" else ["table_wise"]
        constraints = {t: ParameterConstraints(sharding_types=types) for t in ROWS}
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device="cpu"), constraints=constraints
        )
        plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder], plan=plan)
    set_tables(dmp, init)  # TorchRec's shards draw their own values: start from the unsharded model's
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda p: torch.optim.SGD(p, lr=0.1)
    )
    return dmp, dense, (HeraldTrainPipeline if kind == "herald" else TrainPipelineSparseDist)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(t, ShardedTensor):
        shards = t.local_shards()
        return shards[0].tensor if shards else torch.zeros(0, dtype=t.dtype)
    return t


def fp16_worker(rank: int, world: int, out_dir: str, kind: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import get_unwrapped_module

    out: dict = {}
    for opt in OPTIMIZERS:
        dmp, dense, pipeline_cls = build(kind, opt)
        pipeline = pipeline_cls(dmp, dense, torch.device("cpu"))
        it = iter(batches(rank, STEPS))
        for _ in range(STEPS):
            pipeline.progress(it)
        ckpt = Path(out_dir) / f"{opt}_ckpt"
        sd = dmp.state_dict()
        dcp.save({"model": sd, "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=str(ckpt))
        net = get_unwrapped_module(dmp)
        res = {
            "types": {n: type(getattr(net, n)).__name__ for n in ("ebc_a", "ebc_b")},
            "state_dict_dtypes": {k: _local(v).dtype for k, v in sd.items() if ".embedding_bags." in k},
            "param_dtypes": {k: p.dtype for k, p in dmp.named_parameters() if ".embedding_bags." in k},
        }
        if kind == "herald":
            res["fp16_counters"] = dict(getattr(net.ebc_a, "total_counters", {}))  # {}: not Herald's module
            res["wire"] = {  # this rank's rows and values sent, and their bytes on the wire
                n: (dict(getattr(getattr(net, n), "total_counters", {})), dict(getattr(net, n).comm_counter.bytes))
                for n in ("ebc_a", "ebc_b")
                if hasattr(getattr(net, n), "comm_counter")
            }
            pipeline.close()
            # the checkpoint loads into a fresh model (its initial tables) bit for bit, FP16 tables included
            fresh, _, _ = build(kind, opt)
            state = {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()}
            dcp.load(state, checkpoint_id=str(ckpt))
            fresh.load_state_dict(state["model"])
            fresh.fused_optimizer.load_state_dict(state["optim"])
            dcp.save(
                {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()},
                checkpoint_id=str(Path(out_dir) / f"{opt}_reloaded"),
            )
        out[opt] = res
    torch.save(out, rank_result(out_dir, rank))


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.scenarios.test_dropin import full_checkpoint

    got: dict = {}
    worker = "tests.distributed.test_fp16_tables:fp16_worker"
    kinds = ("herald", "stock_rw", "stock_tw")  # one after another in one pair of ranks: start-up paid once
    runs = run_ranks_sequence({k: (worker, {"kind": k}) for k in kinds}, tmp_path_factory.mktemp("fp16"), timeout=400)
    for kind, out in runs.items():
        got[kind] = {"rank0": torch.load(rank_result(out, 0), weights_only=False)}
        for opt in OPTIMIZERS:
            got[kind][opt] = full_checkpoint(out / f"{opt}_ckpt")
            if kind == "herald":
                got[kind][f"{opt}_reloaded"] = full_checkpoint(out / f"{opt}_reloaded")
    return got


def _fp16_close(a: torch.Tensor, b: torch.Tensor, ulps: int = 4) -> bool:
    """a and b (FP16 values) within `ulps` float16 ulps of b's magnitude (see the module doc for why not equal)."""
    a, b = a.double(), b.double()
    return bool(((a - b).abs() <= ulps * FP16_ULP * b.abs() + 1e-7).all())


def test_fp16_ebc_is_herald_managed_in_float16(fp16_runs: dict) -> None:
    r0 = fp16_runs["herald"]["rank0"]
    for opt in OPTIMIZERS:
        res = r0[opt]
        assert res["types"] == {
            "ebc_a": "ShardedHeraldEmbeddingBagCollection",
            "ebc_b": "ShardedHeraldEmbeddingBagCollection",
        }
        c = res["fp16_counters"]
        assert c["migrate"] + c["forward"] > 0 and c["shared_value"] > 0, c  # FP16 rows moved and were shared
        # on the wire (this rank's sends, dim 4): an FP16 row moves as 4 float16 + its float32 state (row-wise
        # Adagrad: 1), its shared value as 4 float16; its gradient stays float32; the FP32 table's in float32
        state = 4 if opt == "rowwise_adagrad" else 0
        for ebc, elem in (("ebc_a", 2), ("ebc_b", 4)):
            n, sent = res["wire"][ebc]
            rows = n["migrate"] + n["evict_home"] + n["forward"]
            assert rows and sent["moves"] == rows * (4 * elem + state), (ebc, n, sent)
            assert n["shared_value"] and sent["shared_value"] == n["shared_value"] * 4 * elem, (ebc, n, sent)
            assert sent["shared_grad"] == n["shared_grad"] * 4 * 4, (ebc, n, sent)
        for where in ("state_dict_dtypes", "param_dtypes"):
            got = {k.rsplit(".", 2)[-2]: v for k, v in res[where].items()}
            assert got == {"t0": torch.float16, "t1": torch.float16, "t2": torch.float32}, (where, got)
            stock = {k.rsplit(".", 2)[-2]: v for k, v in fp16_runs["stock_rw"]["rank0"][opt][where].items()}
            assert stock == got, (where, stock)


@pytest.mark.parametrize("stock", ["stock_rw", "stock_tw"])
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_fp16_tables_train_as_stock(fp16_runs: dict, opt: str, stock: str) -> None:
    h, s = fp16_runs["herald"][opt], fp16_runs[stock][opt]
    assert sorted(h) == sorted(s)
    init = {n: b.weight.detach() for e in (FP16Model().ebc_a, FP16Model().ebc_b) for n, b in e.embedding_bags.items()}
    weights = [k for k in s if k.startswith("model.") and ".embedding_bags." in k]
    assert len(weights) == 3
    for k in weights:
        t = k.rsplit(".", 2)[-2]
        assert h[k].dtype == s[k].dtype == (torch.float16 if t in FP16_TABLES else torch.float32), k
        assert float((s[k].float() - init[t].float()).abs().max()) > 1e-3, k  # trained: the comparison is not vacuous
        if t in FP16_TABLES:
            assert _fp16_close(h[k], s[k]), (k, float((h[k].float() - s[k].float()).abs().max()))
            same = float((h[k] == s[k]).float().mean())
            assert same >= 0.999, (k, same)  # rounding flips are rare: nearly every element is bit-equal
        else:
            assert float((h[k] - s[k]).abs().max()) <= 1e-5, k
    states = [k for k in s if k.startswith("optim.") and "momentum1" in k]
    assert len(states) == (3 if opt == "rowwise_adagrad" else 0), states
    for k in states:  # float32 state of rows that followed the same updates
        assert float(s[k].abs().max()) > 1e-4, k  # the state grew: the comparison is not vacuous
        assert torch.allclose(h[k], s[k], rtol=1e-5, atol=1e-8), (k, float((h[k] - s[k]).abs().max()))
    dense = [k for k in s if k.startswith("model.head")]
    assert dense and all(float((h[k] - s[k]).abs().max()) <= 1e-5 for k in dense)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_fp16_checkpoint_round_trip(fp16_runs: dict, opt: str) -> None:
    saved, reloaded = fp16_runs["herald"][opt], fp16_runs["herald"][f"{opt}_reloaded"]
    assert sorted(saved) == sorted(reloaded)
    for k in saved:
        assert saved[k].dtype == reloaded[k].dtype and torch.equal(saved[k], reloaded[k]), k
    assert any(v.dtype == torch.float16 for v in saved.values())


def fp16_relay_worker(rank: int, world: int, out_dir: str) -> None:
    """4 ranks on two "machines" of two: the FP16 model trained with host relays (shared FP16 values forwarded inside
    a machine, as float16 bits) and without."""
    import socket

    from torchrec.distributed.model_parallel import get_unwrapped_module

    from herald_torchrec import HeraldTrainPipeline

    socket.gethostname = lambda: f"machine-{rank // 2}"  # this process only: the ranks sit on two "machines"
    out = {}
    for relay in (True, False):
        dmp, dense, _ = build("herald", "sgd", world=world)
        pipeline = HeraldTrainPipeline(dmp, dense, torch.device("cpu"), host_relay=relay)
        it = iter(batches(rank, STEPS))
        for _ in range(STEPS):
            pipeline.progress(it)
        pipeline.close()
        net = get_unwrapped_module(dmp)
        tables = {}
        for n in ("ebc_a", "ebc_b"):
            weights, _ = getattr(net, n).full_tables()
            tables.update(weights)
        out[relay] = {"tables": tables, "bytes": dict(net.ebc_a.comm_counter.bytes)}
    torch.save(out, rank_result(out_dir, rank))


def test_fp16_values_relayed_inside_a_machine(tmp_path: Path) -> None:
    run_ranks("tests.distributed.test_fp16_tables:fp16_relay_worker", tmp_path, world_size=4, timeout=400)
    res = torch.load(rank_result(tmp_path, 0), weights_only=False)
    on, off = res[True], res[False]
    assert on["bytes"].get("relay_value", 0) > 0 and not off["bytes"].get("relay_value", 0)  # relays ran for FP16
    init = {n: b.weight.detach() for e in (FP16Model().ebc_a, FP16Model().ebc_b) for n, b in e.embedding_bags.items()}
    for t, w in on["tables"].items():
        assert w.dtype == (torch.float16 if t in FP16_TABLES else torch.float32), t
        assert float((w.float() - init[t].float()).abs().max()) > 1e-3, t  # trained
        if t in FP16_TABLES:  # gradients summed per machine first: another float32 order (module doc)
            assert _fp16_close(w, off["tables"][t]), (t, float((w.float() - off["tables"][t].float()).abs().max()))
        else:
            assert float((w - off["tables"][t]).abs().max()) <= 1e-5, t
