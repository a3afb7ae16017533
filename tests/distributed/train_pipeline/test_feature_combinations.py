"""Features that landed apart, trained together: FP16 tables and weighted features with replicated rows (Herald's
`replicate` on 4 ranks as two machines, host relays on; fae and p2res on 2 ranks).

- one process: the replica region's owner-copy all-reduce (`ReplicaRegion.copy_from_owners`: the owning rank
  contributes a row's packed words, every other rank zeros) keeps float16 rows packed two per float32 word bit for
  bit — -0.0, subnormals, a NaN — with the sum simulated as gloo makes it, also under flush-to-zero. As float32
  words these patterns are -0.0 (which +0.0 turns into +0.0), subnormals (flushed where denormals are off) and
  signalling NaNs (quieted), so the region sums them as int32 words (exact: one non-zero addend);
- 4 gloo ranks on two "machines" (each rank reports its pair's host name, as test_herald_replicas.py does), the
  replica stream of test_herald_replicas.py: (a) FP16 tables end within a few float16 ulps of stock TorchRec's FP16
  model (TABLE_WISE through TrainPipelineSparseDist; >= 99.9 % of the elements bit-equal, as test_fp16_tables.py
  explains), the FP32 table and the dense head within 1e-5; (b) weighted features end at the one-process model
  (<= 1e-5), which the unweighted run does not; both with rows all-reduced, joining (from guest slots too), every
  copy bit-equal to its owner's row, rows relayed inside the machines, and the owner-copy all-reduce checked on
  real gloo with the bit patterns above;
- 2 gloo ranks, fae and p2res (replicated rows chosen from a profiled prefix): (c) FP16 tables against stock's FP16
  model on the same stream (2 ranks, TABLE_WISE), (d) weighted features against the one-process model and not the
  unweighted one; rows read through replicas (fae: its hot steps, with copies to the replicas on returning to them),
  through the home path beside them, copies bit-equal to their owners' rows at the end.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

# ------------------------------------------------------------------------------------------ one process
# float16 bit patterns, two per float32 word (element 2k in the low half, 2k + 1 in the high half), row by row
# (dim 4): each word named by what it is as a float32
FP16_ROWS = [
    [0x0000, 0x8000, 0x0000, 0x8000],  # +0.0 / -0.0 -> the word 0x80000000: float32 -0.0, twice
    [0x0001, 0x0000, 0x03FF, 0x8000],  # float16 subnormals under zero high halves: float32 subnormals, +/-
    [0x3C00, 0x8001, 0x8000, 0x7BFF],  # 1.0 under a negative float16 subnormal: a negative float32 subnormal
    [0x1234, 0x7F81, 0x0001, 0x0001],  # a float16 NaN whose word is a signalling float32 NaN; both halves subnormal
]
STATE_BITS = [0x80000000, 0x00000001, 0x807FFFFF, 0x3F000000]  # row-wise Adagrad state: -0.0, subnormals, 0.5


class SimulatedSum:
    """A PlanComm stand-in for one rank among `world`: its all-reduce is the sum gloo computes when this rank
    contributes the tensor and every other rank zeros, added in rank order in the tensor's own dtype; `owner` is
    this rank's place in that order. Records the dtypes it summed."""

    def __init__(self, world: int, owner: int) -> None:
        self.world, self.owner, self.dtypes = world, owner, []

    def all_reduce(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        self.dtypes.append(tensor.dtype)
        acc = torch.zeros_like(tensor)
        for r in range(self.world):
            acc = acc + (tensor if r == self.owner else torch.zeros_like(tensor))
        tensor.copy_(acc)
        return tensor


def fp16_store(world: int = 4):
    """Rank 0's row store of one FP16 table (dim 4, row-wise Adagrad) with FP16_ROWS / STATE_BITS in its first home
    rows; returns the store and those rows."""
    from fbgemm_gpu.split_embedding_configs import SparseType

    from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec

    st = RowStore(
        [TableSpec("t", 16, 4)], 0, world, cache_ratio=0.25, tbe_settings={"weights_precision": SparseType.FP16}
    )
    rows = np.arange(len(FP16_ROWS), dtype=np.int64)
    slots = st.slot_of_all[st.gkeys(np.zeros_like(rows), rows)].astype(np.int64)
    assert (slots >= 0).all()  # rank 0's home rows
    with torch.no_grad():
        st.weights(0)[torch.from_numpy(slots)] = (
            torch.tensor(FP16_ROWS, dtype=torch.int32).to(torch.int16).view(torch.float16)
        )
        st.state_view(0)[torch.from_numpy(slots)] = (
            torch.tensor(STATE_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
        )
    return st, rows, slots


def test_packed_fp16_rows_survive_the_owner_copy_all_reduce() -> None:
    """Replicas made from their owners' FP16 rows through the all-reduce's sum equal them bit for bit, value and
    optimizer state, wherever the owner sits in the sum and whether or not denormals flush to zero."""
    from fbgemm_gpu.split_embedding_configs import SparseType

    from herald_torchrec.distributed.step.replicas import ReplicaRegion

    st, rows, slots = fp16_store()
    owner_bits = st.weights(0)[torch.from_numpy(slots)].view(torch.int16).clone()
    state_bits = st.state_view(0)[torch.from_numpy(slots)].view(torch.int32).clone()
    # the patterns are what the module docstring says they are as float32 words
    words = st.read_packed(np.zeros_like(rows), slots)
    assert torch.equal(words.view(torch.int32)[:2], torch.tensor([-(2**31), -(2**31)], dtype=torch.int32))
    assert bool(torch.isnan(words).any())
    flush_before = torch.set_flush_denormal(False)
    try:
        for ftz in (False, True):
            if ftz and not torch.set_flush_denormal(True):
                continue  # this CPU cannot flush denormals
            for owner in (0, 2, 3):
                comm = SimulatedSum(st.world_size, owner)
                region = ReplicaRegion(
                    st, comm, torch.device("cpu"), st.optimizer, 0.1, 1e-2, {"weights_precision": SparseType.FP16}
                )
                joins = region.declare(np.zeros_like(rows), rows)
                assert joins.sent == len(FP16_ROWS) and comm.dtypes, (joins, comm.dtypes)
                copy = region.slot_of[st.gkeys(np.zeros_like(rows), rows)]
                got = region.copies.weights(0)[torch.from_numpy(copy)]
                assert got.dtype == torch.float16
                assert torch.equal(got.view(torch.int16), owner_bits), (ftz, owner, got.view(torch.int16))
                got_state = region.copies.state_view(0)[torch.from_numpy(copy)].view(torch.int32)
                assert torch.equal(got_state, state_bits), (ftz, owner, got_state)
    finally:
        torch.set_flush_denormal(flush_before)


# ------------------------------------------------------------------------------------------ the streams
REPLICA_STEPS, REPLICA_WORLD = 14, 4  # test_herald_replicas.py's stream on two machines of two ranks
BASELINE_STEPS, BASELINE_WORLD = 12, 2
HOT_STEPS = (0, 1, 2, 6, 7, 11)  # steps of the phase stream reading hot ids only (the first three: profiled)
PROFILED = 3


def with_weights(batches: list, rank: int) -> list:
    """The same batches with a weight in [0.2, 2) per id (id-score lists), drawn apart from the ids."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for b in batches:
        k = b.sparse_features
        w = torch.rand(k.values().shape[0], generator=g) * 1.8 + 0.2
        kjt = KeyedJaggedTensor(keys=k.keys(), values=k.values(), lengths=k.lengths(), weights=w)
        out.append(Batch(b.dense_features, kjt, b.labels))
    return out


def replica_stream(rank: int, n: int) -> list:
    from tests.distributed.train_pipeline.test_herald_replicas import replica_batches

    return replica_batches(rank, n)


def weighted_replica_stream(rank: int, n: int) -> list:
    return with_weights(replica_stream(rank, n), rank)


def phase_stream(rank: int, n: int) -> list:
    """n batches of this rank's slice of the two-EBC model's features (test_pipeline_edges.TwoEBCModel): in the
    steps of HOT_STEPS every id is one of a few hot ids (f0 0-3, f1 10-13, f2 0-2), in the others any id. fae reads
    the hot steps through its replicas and the others at home, with a copy to the replicas at each return to hot
    steps; p2res replicates the hot ids and reads them through replicas in every step."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tests.distributed.train_pipeline.test_pipeline_edges import B

    g = torch.Generator().manual_seed(20 + rank)
    out = []
    for i in range(n):
        lo, hi = ((0, 10, 0), (4, 14, 3)) if i in HOT_STEPS else ((0, 0, 0), (30, 50, 20))
        lens = torch.cat([torch.ones(B, dtype=torch.int32), torch.randint(1, 3, (B,), generator=g, dtype=torch.int32)])
        lens = torch.cat([lens, torch.ones(B, dtype=torch.int32)])
        counts = [B, int(lens[B : 2 * B].sum()), B]
        vals = torch.cat([torch.randint(lo[f], hi[f], (counts[f],), generator=g) for f in range(3)])
        kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=vals, lengths=lens)
        out.append(Batch(torch.randn(B, 3, generator=g), kjt, torch.randint(0, 2, (B,), generator=g).float()))
    return out


def weighted_phase_stream(rank: int, n: int) -> list:
    return with_weights(phase_stream(rank, n), rank)


STREAMS = {
    "replica": replica_stream,
    "weighted_replica": weighted_replica_stream,
    "phase": phase_stream,
    "weighted_phase": weighted_phase_stream,
}


def global_batches(stream, world: int, n: int) -> list:
    """The first n global batches of `stream` (every rank's slice in rank order) as one process holds them."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    slices = [stream(r, n) for r in range(world)]
    out = []
    for i in range(n):
        parts = [s[i] for s in slices]
        keys = parts[0].sparse_features.keys()
        jts = [[p.sparse_features[k] for p in parts] for k in keys]
        weighted = parts[0].sparse_features.weights_or_none() is not None
        kjt = KeyedJaggedTensor(
            keys=keys,
            values=torch.cat([jt.values() for per_key in jts for jt in per_key]),
            lengths=torch.cat([jt.lengths() for per_key in jts for jt in per_key]),
            weights=torch.cat([jt.weights() for per_key in jts for jt in per_key]) if weighted else None,
        )
        out.append(Batch(torch.cat([p.dense_features for p in parts]), kjt, torch.cat([p.labels for p in parts])))
    return out


# ------------------------------------------------------------------------------------------ the ranks
def keyed_fp16_model():
    """test_fp16_tables.FP16Model reading its pooled embeddings by feature name. Stock TABLE_WISE's KeyedTensor
    lists the features in sharding order (on 3 or 4 ranks the planner may put t1's rank before t0's: keys f1, f0),
    so `.values()` would feed the head another model's columns."""
    from tests.distributed.test_fp16_tables import FP16Model

    class KeyedFP16Model(FP16Model):
        def forward(self, batch):
            a = self.ebc_a(batch.sparse_features).to_dict()
            b = self.ebc_b(batch.sparse_features).to_dict()
            pooled = torch.cat([a["f0"], a["f1"], b["f2"]], dim=1).float()
            logit = self.head(torch.cat([batch.dense_features, pooled], dim=1)).squeeze(1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, batch.labels.float())
            return loss, (loss.detach(), logit.detach(), batch.labels)

    return KeyedFP16Model()


def build(kind: str, model: torch.nn.Module, options=None, profile_stream=None):
    """`model` sharded by DMP, SGD for the tables (lr 0.2, in backward) and the dense head (0.1), and its pipeline:
    `herald` (Herald's sharder with `options`; fae / p2res profile the first PROFILED global batches of
    `profile_stream`) or `stock_tw` (TorchRec's sharder, every table TABLE_WISE, TrainPipelineSparseDist), both
    from the model's initial tables."""
    import warnings

    import torch.distributed as dist
    from torchrec.distributed import TrainPipelineSparseDist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from herald_torchrec import HeraldEmbeddingBagCollectionSharder, HeraldTrainPipeline
    from herald_torchrec.distributed.train_pipeline.input_layout import one_process_global_batch
    from herald_torchrec.distributed.train_pipeline.pipeline import herald_modules, managed_tables
    from tests.distributed.train_pipeline.test_pipeline_edges import ROWS
    from tests.scenarios.test_dropin import set_tables

    init = {n: b.weight.detach().clone() for e in (model.ebc_a, model.ebc_b) for n, b in e.embedding_bags.items()}
    for ebc in (model.ebc_a, model.ebc_b):
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.2})
    plan = None
    if kind == "herald":
        sharder = HeraldEmbeddingBagCollectionSharder(options=options)
    else:
        sharder = EmbeddingBagCollectionSharder()
        constraints = {t: ParameterConstraints(sharding_types=["table_wise"]) for t in ROWS}
        topology = Topology(world_size=dist.get_world_size(), compute_device="cpu")
        plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
            model, [sharder], dist.group.WORLD
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder], plan=plan)
    if kind != "herald":
        set_tables(dmp, init)  # TorchRec's shards draw their own values: start from the unsharded model's
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda p: torch.optim.SGD(p, lr=0.1)
    )
    if kind != "herald":
        return dmp, TrainPipelineSparseDist(dmp, dense, torch.device("cpu"))
    profile = None
    if profile_stream is not None:
        tables = managed_tables(herald_modules(dmp))
        world = dist.get_world_size()
        profile = [
            one_process_global_batch(b, tables, i)
            for i, b in enumerate(global_batches(profile_stream, world, PROFILED))
        ]
    return dmp, HeraldTrainPipeline(dmp, dense, torch.device("cpu"), options=options, profile=profile)


def replica_region(module):
    (region,) = [e.region for e in module._extensions if e.plan_part == "replicas"]
    return region


def copies_bit_equal(module) -> tuple[list[int], bool]:
    """The rows of the module's replica region (global keys) and whether this rank's copies equal their owners'
    rows bit for bit, value (float16 bits for FP16 tables) and optimizer state (collective: the owners' packed
    words summed as int32)."""
    import numpy as np
    import torch.distributed as dist

    region = replica_region(module)
    if region.copies is None:
        return [], True
    st = module.store
    gk = np.flatnonzero(region.slot_of >= 0)
    tables = st.tables_of(gk)
    width = st.packed_widths(tables)
    start = np.concatenate([[0], np.cumsum(width)[:-1]]).astype(np.int64)
    owners = torch.zeros(int(width.sum()), dtype=torch.int32)
    slot = st.slot_of_all[gk].astype(np.int64)
    for k in np.flatnonzero(slot >= 0):  # this rank's own rows
        owners[start[k] : start[k] + width[k]] = st.read_packed(tables[k : k + 1], slot[k : k + 1]).view(torch.int32)
    dist.all_reduce(owners)
    copies = region.copies.read_packed(tables, region.slot_of[gk]).view(torch.int32)
    return gk.tolist(), bool(torch.equal(owners, copies))


def gloo_owner_copies(module, rank: int, world: int) -> bool:
    """On real gloo: every rank plants FP16_ROWS into 4 of its home rows of table 0 (FP16), the region copies every
    rank's planted rows from their owners (its owner-copy all-reduce), and each copy holds the planted bits. The
    rows are restored and the region emptied afterwards (training then starts as it would have)."""
    import numpy as np

    from herald_torchrec.distributed.storage.row_layout import home_range

    st, region = module.store, replica_region(module)
    per = len(FP16_ROWS)
    rows = np.concatenate([home_range(st.rows[0], world, q)[0] + 100 + np.arange(per) for q in range(world)])
    tables = np.zeros_like(rows)
    mine = rows[rank * per : (rank + 1) * per]
    slots = st.slot_of_all[st.gkeys(np.zeros_like(mine), mine)].astype(np.int64)
    assert (slots >= 0).all() and st.row_dtype == torch.float16
    saved = st.read_packed(np.zeros_like(mine), slots)
    planted = torch.tensor(FP16_ROWS, dtype=torch.int32).to(torch.int16)
    with torch.no_grad():
        st.weights(0)[torch.from_numpy(slots)] = planted.view(torch.float16)
    region.declare(tables, rows)
    copies = region.copies.weights(0)[torch.from_numpy(region.slot_of[st.gkeys(tables, rows)])].view(torch.int16)
    ok = bool(torch.equal(copies, planted.repeat(world, 1)))
    st.write_packed(np.zeros_like(mine), slots, saved)
    region.reset()
    return ok


def save_run(dmp, pipeline, out: Path, extra: dict | None = None) -> dict:
    """The run's DCP checkpoint under `out`/ckpt and what it ran: counters, bytes by kind of the FP16 / weighted
    EBC (ebc_a), every copy against its owner, the policy's description (where this rank planned)."""
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import get_unwrapped_module

    from herald_torchrec.distributed.train_pipeline.pipeline import herald_modules

    dcp.save({"model": dmp.state_dict()}, checkpoint_id=str(out / "ckpt"))
    res = dict(extra or {})
    if hasattr(pipeline, "trained_counters"):
        net = get_unwrapped_module(dmp)
        res.update(
            counters=dict(pipeline.trained_counters),
            bytes=dict(net.ebc_a.comm_counter.bytes),
            copies={n: copies_bit_equal(m) for n, m in zip(("ebc_a", "ebc_b"), herald_modules(dmp))},
            policy=pipeline.policy.describe() if pipeline.policy is not None else None,
        )
        pipeline.close()
    return res


def train(pipeline, stream: list) -> None:
    it = iter(stream)
    for _ in range(len(stream)):
        pipeline.progress(it)


def replica_worker(rank: int, world: int, out_dir: str) -> None:
    """Herald replicating on two "machines" of two ranks: the FP16 model (and stock TABLE_WISE's), the weighted
    model."""

    from torchrec.distributed.model_parallel import get_unwrapped_module

    from herald_torchrec import HeraldOptions
    from tests.distributed.train_pipeline.test_pipeline_edges import TwoEBCModel
    from tests.helpers.machines import on_machine
    from tests.helpers.ranks import rank_result

    out, res = Path(out_dir), {}
    with on_machine(f"machine-{rank // 2}"):
        options = HeraldOptions(
            cache_ratio=0.05, lookahead=2, policy_options={"replicate": True, "replica_interval": 2}
        )
        dmp, pipeline = build("herald", keyed_fp16_model(), options)
        gloo_ok = gloo_owner_copies(get_unwrapped_module(dmp).ebc_a, rank, world)
        train(pipeline, replica_stream(rank, REPLICA_STEPS))
        res["fp16"] = save_run(dmp, pipeline, out / "fp16", {"gloo_owner_copies": gloo_ok})
        dmp, pipeline = build("stock_tw", keyed_fp16_model())
        train(pipeline, replica_stream(rank, REPLICA_STEPS))
        res["stock_fp16"] = save_run(dmp, pipeline, out / "stock_fp16")
        dmp, pipeline = build("herald", TwoEBCModel(weighted=True), options)
        train(pipeline, weighted_replica_stream(rank, REPLICA_STEPS))
        res["weighted"] = save_run(dmp, pipeline, out / "weighted")
    torch.save(res, rank_result(out_dir, rank))


def baseline_worker(rank: int, world: int, out_dir: str) -> None:
    """fae and p2res on 2 ranks: the FP16 model and the weighted model; stock TABLE_WISE's FP16 model."""
    from herald_torchrec import HeraldOptions
    from tests.distributed.train_pipeline.test_pipeline_edges import TwoEBCModel
    from tests.helpers.ranks import rank_result

    out, res = Path(out_dir), {}
    for policy in ("fae", "p2res"):
        extra = {"window": 4} if policy == "fae" else {}
        options = HeraldOptions(
            cache_ratio=0.05, lookahead=2, policy=policy, policy_options={"hot_budget": 64, **extra}
        )
        for name, model, stream in (
            ("fp16", keyed_fp16_model, phase_stream),
            ("weighted", lambda: TwoEBCModel(weighted=True), weighted_phase_stream),
        ):
            dmp, pipeline = build("herald", model(), options, profile_stream=stream)
            train(pipeline, stream(rank, BASELINE_STEPS))
            res[f"{policy}_{name}"] = save_run(dmp, pipeline, out / f"{policy}_{name}")
    dmp, pipeline = build("stock_tw", keyed_fp16_model())
    train(pipeline, phase_stream(rank, BASELINE_STEPS))
    res["stock_fp16"] = save_run(dmp, pipeline, out / "stock_fp16")
    torch.save(res, rank_result(out_dir, rank))


# ------------------------------------------------------------------------------------------ the checks
def _spawn(out: Path, worker: str, world: int) -> dict:
    """`worker` of this module on `world` ranks: its output folder and every rank's result."""
    from tests.helpers.ranks import rank_result, run_ranks

    run_ranks(
        f"tests.distributed.train_pipeline.test_feature_combinations:{worker}", out, world_size=world, timeout=400
    )
    return {"dir": out, "ranks": [torch.load(rank_result(out, q), weights_only=False) for q in range(world)]}


@pytest.fixture(scope="module")
def replica_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _spawn(tmp_path_factory.mktemp("replicas"), "replica_worker", REPLICA_WORLD)


@pytest.fixture(scope="module")
def baseline_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _spawn(tmp_path_factory.mktemp("baselines"), "baseline_worker", BASELINE_WORLD)


def tables_of(run_dir: Path) -> dict[str, torch.Tensor]:
    """The run's model from its DCP checkpoint, by state dict key."""
    from tests.scenarios.test_dropin import full_checkpoint

    got = full_checkpoint(run_dir / "ckpt")
    assert sum(".embedding_bags." in k for k in got) == 3
    return got


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b) or all(k in b for k in a)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def assert_fp16_trains_as_stock(herald: dict, stock: dict) -> None:
    """FP16 tables within a few float16 ulps of stock's and >= 99.9 % bit-equal (test_fp16_tables.py's module
    docstring says why not all), the FP32 table and the dense head within 1e-5; every table trained."""
    from tests.distributed.test_fp16_tables import FP16_TABLES, FP16Model, _fp16_close

    assert sorted(herald) == sorted(stock)
    model = FP16Model()
    init = {n: b.weight.detach() for e in (model.ebc_a, model.ebc_b) for n, b in e.embedding_bags.items()}
    for k in stock:
        if ".embedding_bags." not in k:
            assert float((herald[k] - stock[k]).abs().max()) <= 1e-5, k
            continue
        t = k.rsplit(".", 2)[-2]
        h, s = herald[k], stock[k]
        assert h.dtype == s.dtype == (torch.float16 if t in FP16_TABLES else torch.float32), k
        assert float((s.float() - init[t].float()).abs().max()) > 1e-3, k  # trained: the comparison is not vacuous
        if t in FP16_TABLES:
            assert _fp16_close(h, s), (k, float((h.float() - s.float()).abs().max()))
            same = float((h == s).float().mean())
            assert same >= 0.999, (k, same)
        else:
            assert float((h - s).abs().max()) <= 1e-5, k


def assert_herald_replicas_ran(ranks: list[dict], run: str) -> None:
    """test_herald_replicas.py's counts on its stream (the plans depend on the ids alone: the same with FP16 rows
    and with weights), every copy bit-equal to its owner's row, rows relayed inside the machines."""
    from tests.distributed.train_pipeline.test_herald_replicas import HOT_AFTER

    total = {k: sum(r[run]["counters"].get(k, 0) for r in ranks) for k in ("allreduce", "replica_join")}
    assert total["allreduce"] == REPLICA_WORLD * 38 and total["replica_join"] == 8, total
    assert sum(r[run]["counters"].get("replica_join_guest", 0) for r in ranks) >= 3
    for r in ranks:
        assert r[run]["copies"]["ebc_a"] == ([4000 + int(k) for k in HOT_AFTER], True), r[run]["copies"]
    assert sum(r[run]["counters"].get("cross_host", 0) for r in ranks) > 0
    assert sum(r[run]["bytes"].get("relay_value", 0) for r in ranks) > 0


def test_fp16_tables_with_herald_replicas_train_as_stock(replica_runs: dict) -> None:
    """(a) FP16 tables, rows replicated across two machines: stock TorchRec's FP16 model; the owner-copy all-reduce
    keeps -0.0, subnormals and NaN bits on real gloo."""
    ranks = replica_runs["ranks"]
    assert all(r["fp16"]["gloo_owner_copies"] for r in ranks)
    assert_herald_replicas_ran(ranks, "fp16")
    d = replica_runs["dir"]
    assert_fp16_trains_as_stock(tables_of(d / "fp16"), tables_of(d / "stock_fp16"))


def test_weighted_features_with_herald_replicas_train_the_one_process_model(replica_runs: dict) -> None:
    """(b) Weighted features, rows replicated across two machines: the one-process model, and not the unweighted
    one (the weights reached the replica reads and their gradients)."""
    from tests.distributed.train_pipeline.test_pipeline_edges import one_process_reference

    assert_herald_replicas_ran(replica_runs["ranks"], "weighted")
    got = tables_of(replica_runs["dir"] / "weighted")
    ref = one_process_reference(REPLICA_WORLD, REPLICA_STEPS, data=weighted_replica_stream, weighted=True)
    assert max_diff(got, ref) <= 1e-5
    unweighted = one_process_reference(REPLICA_WORLD, REPLICA_STEPS, data=replica_stream)
    assert max_diff(got, unweighted) > 1e-3


def assert_baseline_ran(ranks: list[dict], run: str) -> None:
    """Rows read through replicas every step that reads hot ids (fae: its hot steps, and the copies to the replicas
    when it returns to them), copies bit-equal to their owners' rows (fae's too: the stream ends on a hot step, so
    the rows its cold steps updated at home were copied to the replicas)."""
    policy = ranks[0][run]["policy"]
    assert policy is not None and policy["replicated_rows"] > 0, policy
    reads = sum(r[run]["counters"].get("allreduce", 0) for r in ranks)
    if run.startswith("fae"):
        assert policy["hot_batches"] == len(HOT_STEPS), policy
        assert reads > 0 and sum(r[run]["bytes"].get("replica_sync", 0) for r in ranks) > 0
    else:
        assert reads >= BASELINE_WORLD * BASELINE_STEPS, reads  # hot ids are read in every step
    assert sum(r[run]["counters"].get("shared_value", 0) for r in ranks) > 0  # the home path ran beside
    for r in ranks:
        keys, equal = r[run]["copies"]["ebc_a"]
        assert keys and equal, r[run]["copies"]


@pytest.mark.parametrize("policy", ["fae", "p2res"])
def test_fp16_tables_under_replica_baselines_train_as_stock(baseline_runs: dict, policy: str) -> None:
    """(c) FP16 tables under fae / p2res: stock TorchRec's FP16 model."""
    assert_baseline_ran(baseline_runs["ranks"], f"{policy}_fp16")
    d = baseline_runs["dir"]
    assert_fp16_trains_as_stock(tables_of(d / f"{policy}_fp16"), tables_of(d / "stock_fp16"))


@pytest.mark.parametrize("policy", ["fae", "p2res"])
def test_weighted_features_under_replica_baselines_train_the_one_process_model(
    baseline_runs: dict, policy: str
) -> None:
    """(d) Weighted features under fae / p2res: the one-process model, not the unweighted one."""
    from tests.distributed.train_pipeline.test_pipeline_edges import one_process_reference

    assert_baseline_ran(baseline_runs["ranks"], f"{policy}_weighted")
    got = tables_of(baseline_runs["dir"] / f"{policy}_weighted")
    ref = one_process_reference(BASELINE_WORLD, BASELINE_STEPS, data=weighted_phase_stream, weighted=True)
    assert max_diff(got, ref) <= 1e-5
    assert max_diff(got, one_process_reference(BASELINE_WORLD, BASELINE_STEPS, data=phase_stream)) > 1e-3
