"""ShardedHeraldEmbeddingBagCollection: argument/plan/input errors, the no-plan (static) path, comm counting.

One-rank cases run in-process (no process group needed); two-rank cases run on gloo through tests/helpers/ranks.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from herald_torchrec.schedule.plan import EVICT_HOME, MIGRATE, Plan, RowMoves, SharedRows
from tests.helpers.ranks import rank_result, run_ranks

ROWS = (20, 33)
DIMS = (4, 8)


def make_ebc(weighted: bool = False, pooling=None, data_type=None):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    kw = {} if pooling is None else {"pooling": pooling}
    kw.update({} if data_type is None else {"data_type": data_type})
    tables = [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=d, num_embeddings=r, feature_names=[f"f{t}"], **kw)
        for t, (r, d) in enumerate(zip(ROWS, DIMS))
    ]
    torch.manual_seed(3)
    return EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("cpu"))


def make_module(rank: int = 0, world: int = 1, cache_ratio: float = 0.1, ebc=None, fused_params=None):
    import torch.distributed as dist
    from torchrec.distributed.types import ShardingEnv

    from herald_torchrec.distributed import ShardedHeraldEmbeddingBagCollection

    env = ShardingEnv.from_process_group(dist.group.WORLD) if world > 1 else ShardingEnv(1, 0, None)
    return ShardedHeraldEmbeddingBagCollection(
        ebc if ebc is not None else make_ebc(),
        None,
        env,
        fused_params={"optimizer": "exact_rowwise_adagrad", "learning_rate": 0.1, **(fused_params or {})},
        cache_ratio=cache_ratio,
    )


def kjt(ids0: list[int], ids1: list[int]):
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor(
        keys=["f0", "f1"],
        values=torch.tensor(ids0 + ids1, dtype=torch.int64),
        lengths=torch.ones(len(ids0) + len(ids1), dtype=torch.int64),
    )


def empty_plan(
    world: int, batch: int, step: int = 0, moves: RowMoves | None = None, shared: SharedRows | None = None
) -> Plan:
    return Plan(
        step, world, batch, np.arange(world * batch, dtype=np.int64), moves or RowMoves(), shared or SharedRows()
    )


def moves(rows: list[tuple[int, int, int, int, int]]) -> RowMoves:
    a = np.array(rows, dtype=np.int64).reshape(-1, 5)
    return RowMoves(a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4].astype(np.int8))


def dense_pool(tables: dict, ids0: list[int], ids1: list[int]) -> torch.Tensor:
    return torch.cat([tables["t0"][ids0], tables["t1"][ids1]], dim=1)


# ----------------------------------------------------------------------------------------------- one rank
def test_bad_cache_ratio_and_unsupported_modules() -> None:
    from torchrec import PoolingType

    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder

    for bad in (0, 0.0, -1, 1.01, 2):
        with pytest.raises(ValueError, match="cache_ratio"):
            make_module(cache_ratio=bad)
        with pytest.raises(ValueError, match="cache_ratio"):
            HeraldEmbeddingBagCollectionSharder(cache_ratio=bad)
    with pytest.raises(ValueError, match="optimizer"):
        HeraldEmbeddingBagCollectionSharder(fused_params={"optimizer": "adam"})
    make_module(ebc=make_ebc(weighted=True))  # weighted features train (tests/distributed/test_weighted_features.py)
    with pytest.raises(ValueError, match="table 't0': a weighted EmbeddingBagCollection pools by SUM only"):
        make_module(ebc=make_ebc(weighted=True, pooling=PoolingType.MEAN))  # TorchRec's own EBC refuses it too
    make_module(ebc=make_ebc(pooling=PoolingType.MEAN))  # MEAN trains (tests/distributed/storage/...optimizer_params)
    with pytest.raises(ValueError, match="gradient clipping with MEAN pooling"):
        make_module(
            ebc=make_ebc(pooling=PoolingType.MEAN), fused_params={"gradient_clipping": True, "max_gradient": 1.0}
        )
    from torchrec.types import DataType

    # a precision other than FP32 / FP16 would train in another one than stock's: refused by name (FP16 tables are
    # Herald's: tests/distributed/test_fp16_tables.py)
    with pytest.raises(ValueError, match="data_type=INT8"):
        make_module(ebc=make_ebc(data_type=DataType.INT8))
    s = HeraldEmbeddingBagCollectionSharder(cache_ratio=1.0, policy="static", lookahead=3)
    assert s.sharding_types("cpu") == ["row_wise"] and s.compute_kernels("row_wise", "cpu") == ["fused"]


def test_one_rank_errors_and_no_plan_forward() -> None:
    m = make_module()
    ebc = make_ebc()
    tables, _ = m.full_tables()
    for t in range(2):
        assert torch.equal(tables[f"t{t}"], ebc.embedding_bags[f"t{t}"].weight.detach())  # copied at shard time
    ids0, ids1 = [1, 19, 1], [0, 32, 5]
    # no plan queued: the static plan (everything exclusive on one rank)
    out = m(kjt(ids0, ids1)).wait()
    assert out.keys() == ["f0", "f1"]
    assert torch.equal(out.values(), ebc(kjt(ids0, ids1)).values())
    assert m.step_counters["hit"] == 5 and m.hit_rate()["t0"] == 1.0  # distinct keys 1, 19 / 0, 32, 5
    for bad0, bad1 in (([1, 20, 1], ids1), (ids0, [0, -1, 5])):
        with pytest.raises(ValueError, match="out of range"):
            m(kjt(bad0, bad1))
    with pytest.raises(ValueError, match="plan is for 2 ranks"):
        m.set_plan(empty_plan(2, 3))
    m.set_plan(empty_plan(1, 4))
    with pytest.raises(ValueError, match="batch 4 per rank"):
        m(kjt(ids0, ids1))
    bad = empty_plan(1, 3)
    bad.sample_order = np.arange(2)
    with pytest.raises(ValueError, match="sample_order"):
        m.set_plan(bad)
    counting = empty_plan(1, 3)
    counting.executable = False
    with pytest.raises(ValueError, match="counting-only"):
        m.set_plan(counting)
    from torchrec import KeyedJaggedTensor

    with pytest.raises(ValueError, match="lacks features"):
        m(KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1]), lengths=torch.tensor([1])))
    # still works after the errors
    m.set_plan(empty_plan(1, 3))
    assert torch.equal(m(kjt(ids0, ids1)).wait().values(), out.values())
    assert m.queued_plans == 0


# ----------------------------------------------------------------------------------------------- two ranks
def _expect_error(fn, results: dict, name: str) -> None:
    try:
        fn()
        results[name] = None
    except ValueError as e:
        results[name] = str(e)


def module_worker(rank: int, world: int, out_dir: str) -> None:
    from herald_torchrec.distributed import CommCounter, PlanComm

    res: dict = {}
    m = make_module(rank, world)
    init, init_states = m.full_tables()
    B = 3
    # rank r reads these (global batch = rank 0's then rank 1's samples); home of t0: [0,10) r0, [10,20) r1
    ids = {0: ([1, 12, 12], [0, 20, 5]), 1: ([12, 13, 2], [30, 20, 32])}
    mine = ids[rank]

    # (1) eval forward with no plan: the static plan is built by an all-gather; values come from their owners
    m.eval()
    out = m(kjt(*mine)).wait().values()
    res["eval_matches_dense"] = bool(torch.equal(out, dense_pool(init, *mine)))
    res["eval_pending"] = m._pending is not None
    res["eval_counters"] = m.global_step_counters()
    m.train()

    # (2) rank-local error: rank 0 reads an out-of-range id; every rank must raise (no one left in a collective)
    m.set_plan(empty_plan(world, B))
    _expect_error(
        lambda: m(kjt([1, 99, 1], [0, 5, 5]) if rank == 0 else kjt([12, 13, 13], [30, 20, 32])), res, "out_of_range"
    )

    # (2b, 2c) the same error while the step has moves / only shared rows: the error flags ride on that step's first
    # all-to-all (moves, else shared values) instead of an all-reduce; every rank must still raise, nothing moves
    step8_moves = moves([(0, 2, 0, 1, MIGRATE)])  # the plan of the valid step (8) below
    step8_shared = SharedRows(
        np.array([0, 1]), np.array([12, 20]), np.array([1, 1]), np.array([0, 2, 4]), np.array([0, 1, 0, 1])
    )
    bad_input = kjt([1, 99, 1], [0, 5, 5]) if rank == 0 else kjt(*mine)
    # without the move, t0 row 2 (home r0) is a shared read of rank 1
    shared_only = SharedRows(
        np.array([0, 0, 1]),
        np.array([2, 12, 20]),
        np.array([0, 1, 1]),
        np.array([0, 1, 3, 5]),
        np.array([1, 0, 1, 0, 1]),
    )
    for name, plan_kw in (
        ("flag_on_moves", {"moves": step8_moves, "shared": step8_shared}),
        ("flag_on_shared", {"shared": shared_only}),
    ):
        m.set_plan(empty_plan(world, B, **plan_kw))
        _expect_error(lambda: m(bad_input), res, name)

    # (3) capacity: 3 guests of t0 (capacity 2) sent to rank 1
    m.set_plan(empty_plan(world, B, moves=moves([(0, k, 0, 1, MIGRATE) for k in (1, 2, 3)])))
    _expect_error(lambda: m(kjt(*mine)), res, "capacity")
    # (4) a move from a rank that does not own the row
    m.set_plan(empty_plan(world, B, moves=moves([(0, 12, 0, 1, MIGRATE)])))
    _expect_error(lambda: m(kjt(*mine)), res, "not_owner")
    # (5) evict_home of a row that is not a guest
    m.set_plan(empty_plan(world, B, moves=moves([(0, 1, 0, 1, EVICT_HOME)])))
    _expect_error(lambda: m(kjt(*mine)), res, "evict_home")
    # (6) batch and plan disagree: nothing shared although both ranks read rows of the other
    m.set_plan(empty_plan(world, B))
    _expect_error(lambda: m(kjt(*mine)), res, "mismatch")
    # (7) shared row with the wrong owner
    m.set_plan(
        empty_plan(
            world,
            B,
            shared=SharedRows(np.array([0]), np.array([12]), np.array([0]), np.array([0, 2]), np.array([0, 1])),
        )
    )
    _expect_error(lambda: m(kjt(*mine)), res, "shared_owner")
    res["owners_unchanged"] = bool((m.owners(0) == np.repeat([0, 1], 10)).all())

    # (8) a valid step after all that: migrate t0 row 12 to rank 0? no — rank 0 and 1 both read 12: shared.
    # t0: 1 (r0 only, home r0) hit; 12 (r0, r1) shared owner r1; 13 (r1) hit; 2 (r1 only, home r0) migrates to r1.
    # t1 (home [0,17) r0, [17,33) r1): 0, 5 (r0) hits; 20 (r0, r1) shared owner r1; 30, 32 (r1) hits.
    m.set_plan(empty_plan(world, B, moves=step8_moves, shared=step8_shared))
    out = m(kjt(*mine)).wait().values()
    res["train_forward_matches_dense"] = bool(torch.equal(out, dense_pool(init, *mine)))
    out.sum().backward()
    m.fused_optimizer.step()
    res["counters"] = m.global_step_counters()
    res["owner_of_t0_row2"] = int(m.owners("t0")[2])
    res["occupancy"] = m.guest_occupancy()
    res["hit_rate"] = m.hit_rate()
    after, after_states = m.full_tables()
    res["changed_rows"] = {
        name: sorted(torch.nonzero((after[name] != init[name]).any(dim=1)).flatten().tolist()) for name in after
    }
    res["momentum"] = {name: after_states[name].tolist() for name in after_states}

    # (9) PlanComm: uneven all_to_all with plan-known splits, bytes counted off-rank only
    c = CommCounter()
    pc = PlanComm(None, c)
    send_splits = [1, 3] if rank == 0 else [2, 0]
    recv_splits = [1, 2] if rank == 0 else [3, 0]
    got = pc.all_to_all(torch.arange(4.0).view(4, 1)[: sum(send_splits)] + 10 * rank, send_splits, recv_splits, "x")
    res["a2a"] = got.flatten().tolist()
    res["a2a_bytes"] = c.snapshot(reset=True)
    empty = pc.all_to_all(torch.zeros(0, 2), [0, 0], [0, 0], "y", globally_empty=True)
    res["a2a_empty"] = (tuple(empty.shape), c.snapshot())
    # flagged: one header element per block carries each rank's flag; blocks may be empty
    c.reset()
    got, worst = pc.all_to_all_flagged(
        torch.arange(4.0)[: sum(send_splits)] + 10 * rank, send_splits, recv_splits, "x", flag=3 * rank + 1
    )
    res["a2a_flagged"] = (got.tolist(), worst, c.snapshot())
    # flagged, per-peer parts (the step's moves + values): rank d's block is its parts in order, one copy to send;
    # received per rank as views. Rank 0 sends [0] + [100, 101] to itself and [1, 2] + [] to rank 1; rank 1 sends
    # [10, 11] + [110] to rank 0 and nothing to itself.
    c.reset()
    v = torch.tensor([100.0, 101.0]) + 10 * rank
    parts = (
        [[torch.tensor([0.0]), v], [torch.tensor([1.0, 2.0]), v[:0]]]
        if rank == 0
        else [[torch.tensor([10.0, 11.0]), v[:1]], [v[:0], v[:0]]]
    )
    pend = pc.start_all_to_all_flagged_parts(
        parts, [3, 3] if rank == 0 else [2, 0], {"moves": 8, "shared_value": 4}, flag=rank + 5
    )
    blocks, worst = pend.wait_flagged_parts()
    res["a2a_parts"] = ([b.tolist() for b in blocks], worst, c.snapshot())
    torch.save(res, rank_result(out_dir, rank))


def test_two_ranks_errors_static_path_and_one_step(tmp_path) -> None:
    files = run_ranks("tests.distributed.test_embeddingbag:module_worker", tmp_path, world_size=2, timeout=180)
    r0, r1 = [torch.load(f, weights_only=False) for f in files]
    for rank, r in enumerate((r0, r1)):
        assert r["eval_matches_dense"] and not r["eval_pending"]
        # eval batch: t0 keys {1,12,13,2}: 1 (r0), 13 (r1) exclusive, 12 shared (its owner r1 reads it too: a hit),
        # 2 shared (owner r0 does not read it); t1 {0,20,5,30,32}: 20 shared, read by its owner r1
        assert r["eval_counters"] == {
            "hit": 8,
            "migrate": 0,
            "evict_home": 0,
            "forward": 0,
            "shared_value": 3,
            "shared_grad": 0,
        }
        assert "capacity" in r["capacity"] and "rank 1 holds 3 guests" in r["capacity"]
        assert "owned by rank 1" in r["not_owner"]
        assert "evict_home" in r["evict_home"]
        assert "names owner 0" in r["shared_owner"]
        assert r["owners_unchanged"]
        assert r["train_forward_matches_dense"]
        # hits: t0 1 (r0), 13 (r1), 12 (owner r1 reads); 2 migrated (not a hit); t1 0, 5, 30, 32, 20 (owner r1)
        assert r["counters"] == {
            "hit": 8,
            "migrate": 1,
            "evict_home": 0,
            "forward": 0,
            "shared_value": 2,
            "shared_grad": 2,
        }
        assert r["owner_of_t0_row2"] == 1
        # the trained rows and only they changed (grad of out.sum() is 1 everywhere)
        assert r["changed_rows"] == {"t0": [1, 2, 12, 13], "t1": [0, 5, 20, 30, 32]}
        # row 12 (t0) was read twice by rank 0 and once by rank 1; with division by R=2, grad per element 1.5:
        # row-wise Adagrad momentum = mean(g^2) = 2.25 (a single update with the summed gradient)
        assert r["momentum"]["t0"][12] == pytest.approx(2.25)
        assert r["momentum"]["t0"][1] == pytest.approx(0.25)  # read once, by rank 0: (1 / 2)^2
    for case in ("out_of_range", "flag_on_moves", "flag_on_shared"):
        assert "out of range" in r0[case] and "step aborted: rank 0" in r1[case], (case, r0[case], r1[case])
    assert "does not match the batch" in r0["mismatch"] or "does not match the batch" in r1["mismatch"]
    assert r0["occupancy"] == {"t0": 0.0, "t1": 0.0} and r1["occupancy"]["t0"] == 0.5
    assert r0["hit_rate"]["t0"] == 0.5  # rank 0 reads rows 1 (its own) and 12 (rank 1's)
    assert r1["hit_rate"]["t0"] == 2 / 3  # rank 1 reads 12, 13 (its own) and 2 (migrated this step)
    assert r0["a2a"] == [0.0, 10.0, 11.0] and r1["a2a"] == [1.0, 2.0, 3.0]
    assert r0["a2a_bytes"] == {"x": 12} and r1["a2a_bytes"] == {"x": 8}
    assert r0["a2a_empty"] == ((0, 2), {})
    # same data as the plain all-to-all, the max flag (rank 1's 4) everywhere, one header float per peer as control
    assert r0["a2a_flagged"] == ([0.0, 10.0, 11.0], 4, {"x": 12, "control": 4})
    assert r1["a2a_flagged"] == ([1.0, 2.0, 3.0], 4, {"x": 8, "control": 4})
    assert r0["a2a_parts"][:2] == ([[0.0, 100.0, 101.0], [10.0, 11.0, 110.0]], 6)
    assert r1["a2a_parts"][:2] == ([[1.0, 2.0], []], 6)
    assert r0["a2a_parts"][2] == {"moves": 8, "shared_value": 4, "control": 4}  # the caller's off-rank bytes + headers


# ----------------------------------------------------------------------------------------------- TorchRec pipeline
def pipeline_worker(rank: int, world: int, out_dir: str) -> None:
    """DMP (default planner, no plan given) + TorchRec's TrainPipelineSparseDist, plans queued in step order."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel, get_unwrapped_module
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import tests.scenarios.test_module_parity as P
    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder
    from tests.helpers.pipeline import Batch, Wrap, drain

    batches = P.make_batches(world, 10)
    net = P.make_model()
    with torch.no_grad():
        for n, w in P.init_tables().items():
            net.ebc.embedding_bags[n].weight.copy_(w)
    sharder = HeraldEmbeddingBagCollectionSharder(cache_ratio=P.CACHE_RATIO, fused_params=P.fused_params("exact_sgd"))
    dmp = DistributedModelParallel(
        Wrap(net), env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"), sharders=[sharder]
    )
    sebc = get_unwrapped_module(dmp).net.ebc
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.SGD(ps, lr=P.LR_DENSE)
    )
    opt = CombinedOptimizer([dmp.fused_optimizer, dense])
    planner = P.RandomPlanner(world, P.BATCH, "random", seed=5)
    items = []
    for b in batches:
        p = planner.plan(b)
        sebc.set_plan(p)  # consumed one per forward, in order (input_dist may run a step ahead)
        s = p.local_samples(rank)
        items.append(Batch(torch.from_numpy(b["dense"][s]), P.local_kjt(b, s), torch.from_numpy(b["labels"][s])))
    pipe = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
    steps = drain(pipe, items)
    weights, _ = sebc.full_tables()
    ref = P.run_reference("exact_sgd", batches, world, True)
    torch.save(
        {
            "steps": steps,
            "queued": sebc.queued_plans,
            "pipelined": type(sebc.forward).__name__,
            "diff": P._max_diff(weights, ref["weights"]),
            "dense": P._max_diff(P.dense_state(net), ref["dense"]),
        },
        rank_result(out_dir, rank),
    )


def test_torchrec_train_pipeline(tmp_path) -> None:
    for f in run_ranks("tests.distributed.test_embeddingbag:pipeline_worker", tmp_path, world_size=2, timeout=180):
        r = torch.load(f, weights_only=False)
        assert r["steps"] == 10 and r["queued"] == 0 and r["pipelined"] == "PipelinedForward"
        assert r["diff"] <= 1e-5 and r["dense"] <= 1e-5, r
