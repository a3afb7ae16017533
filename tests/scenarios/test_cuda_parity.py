"""CUDA data plane: FBGEMM `MANAGED_CACHING` tables (UVM + a small HBM cache), checked against references.

Marked `cuda`: deselected by default (pyproject addopts), run by `make test-gpu` on a machine with a GPU.

1. Cache coherence of host-side row access, one process: a `RowStore` on a tiny HBM cache and a twin whose tables
   sit in plain HBM (`EmbeddingLocation.DEVICE`, no cache) go through the same forwards/backwards, packed reads,
   packed writes and summed-gradient updates. Every read and the final tables must agree exactly: a read that missed
   a newer cache line (`_sync_rows`) or a write shadowed by a stale line (`_invalidate_rows`) shows up here.
2. Module parity: `ShardedHeraldEmbeddingBagCollection` with a small HBM cache (evictions every step) against the
   single-process reference of tests/scenarios/test_module_parity.py, for both fused optimizers, <= 1e-5:
   - world size 1 (static and random sample orders),
   - world size 2 on the one GPU (gloo over CUDA tensors; NCCL refuses two ranks on one device) with the random
     test planner, which migrates / evicts / forwards rows every step.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.ranks import rank_result, run_ranks
from tests.scenarios.test_module_parity import (
    BATCH,
    CACHE_RATIO,
    STEPS,
    RandomPlanner,
    _dense_optimizer,
    _max_diff,
    dense_state,
    fused_params,
    init_tables,
    local_kjt,
    make_batches,
    make_model,
    run_reference,
    table_configs,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with `make test-gpu` there)"),
]

CACHE_LOAD_FACTOR = 0.05  # ~30 of ~600 local rows: one 32-way cache set, far fewer lines than rows read per step
OPTIMIZERS = ("exact_rowwise_adagrad", "exact_sgd")


# ------------------------------------------------------------------------------------------ 1. RowStore coherence
def _twin_stores(opt: str):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec

    specs = [TableSpec("a", 300, 8), TableSpec("b", 500, 16)]
    kw = dict(
        rank=0,
        world_size=2,
        cache_ratio=0.2,
        optimizer=opt,
        learning_rate=0.05,
        features_per_table=[1, 2],
        device="cuda",
        cache_load_factor=0.02,
    )
    cached = RowStore(specs, location=EmbeddingLocation.MANAGED_CACHING, cache_stats=True, **kw)
    plain = RowStore(specs, location=EmbeddingLocation.DEVICE, **kw)
    assert cached._cached and not plain._cached
    return cached, plain


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_row_store_cache_coherence(opt: str) -> None:
    cached, plain = _twin_stores(opt)
    rng = np.random.default_rng(3)
    T = cached.num_tables
    g = torch.Generator().manual_seed(5)
    # same initial rows everywhere (a packed write of every slot)
    tabs = np.repeat(np.arange(T), cached.local_rows)
    slots = np.concatenate([np.arange(n) for n in cached.local_rows])
    init = torch.rand(int(cached.packed_widths(tabs).sum()), generator=g).cuda()
    for s in (cached, plain):
        s.write_packed(tabs, slots, init)
    lines = cached.tbe.lxu_cache_state.numel()
    for step in range(12):
        # a pooled lookup + backward over random slots (3 features: table a, then b twice): fused update in the cache
        F, B = 3, 32
        lengths = rng.integers(0, 4, size=F * B)
        idx = np.concatenate(
            [rng.integers(0, cached.local_rows[t], size=int(n)) for t, n in zip(np.repeat([0, 1, 1], B), lengths)]
        ).astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        grad = torch.randn(B, 8 + 16 + 16, generator=g).cuda()
        for s in (cached, plain):
            out = s.lookup(torch.from_numpy(idx).cuda(), torch.from_numpy(offsets).cuda())
            out.backward(grad)
        # read some rows (many of them now newer in the cache than in UVM), write others behind the TBE's back
        rt = rng.integers(0, T, size=40)
        rs = np.array([rng.integers(0, cached.local_rows[t]) for t in rt], dtype=np.int64)
        # (equal up to float noise of the kernels; a stale row would be off by O(0.1), the scale of the data)
        torch.testing.assert_close(
            cached.read_packed(rt, rs),
            plain.read_packed(rt, rs),
            rtol=0,
            atol=1e-6,
            msg=lambda m: f"step {step}: read_packed: {m}",
        )
        wt = rng.integers(0, T, size=30)
        ws = np.unique(np.stack([wt, [rng.integers(0, cached.local_rows[t]) for t in wt]]), axis=1)
        data = torch.rand(int(cached.packed_widths(ws[0]).sum()), generator=g).cuda()
        for s in (cached, plain):
            s.write_packed(ws[0], ws[1], data)
        # summed-gradient updates of some written rows (must see the new values, not a stale line)
        ut = ws[0][::2]
        ug = torch.randn(int(cached.dims_arr[ut].sum()), generator=g).cuda()
        for s in (cached, plain):
            s.apply_summed_gradients_packed(ut, ws[1][::2], ug)
        for t in range(T):
            r1, s1 = cached.read_slots(t, np.arange(cached.local_rows[t]))
            r2, s2 = plain.read_slots(t, np.arange(plain.local_rows[t]))
            torch.testing.assert_close((r1, s1), (r2, s2), rtol=0, atol=1e-6, msg=lambda m: f"step {step} t{t}: {m}")
    stats = cached.cache_stats()
    assert stats is not None and int(stats[3]) > lines, f"no evictions: {stats.tolist()} with {lines} cache lines"
    # the row-level paths kept the rest of the cache warm: lines are still valid after all those writes
    assert int((cached.tbe.lxu_cache_state >= 0).sum()) > 0


# ------------------------------------------------------------------------------------------ 2. module parity
def _plan(model, sharder, world: int):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    return ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                model.ebc,
                {c.name: row_wise(compute_kernel="fused") for c in table_configs()},
                sharder=sharder,
                local_size=world,
                world_size=world,
                device_type="cuda",
            )
        }
    )


def run_herald_cuda(opt: str, batches: list[dict], rank: int, world: int, mode: str) -> dict:
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel, get_unwrapped_module
    from torchrec.distributed.types import ShardingEnv

    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder, ShardedHeraldEmbeddingBagCollection

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    model = make_model()
    with torch.no_grad():
        for name, w in init_tables().items():
            model.ebc.embedding_bags[name].weight.copy_(w)
    fp = {**fused_params(opt), "cache_load_factor": CACHE_LOAD_FACTOR, "gather_uvm_cache_stats": True}
    sharder = HeraldEmbeddingBagCollectionSharder(cache_ratio=CACHE_RATIO, policy=mode, fused_params=fp)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    dmp = DistributedModelParallel(model, env=env, device=dev, sharders=[sharder], plan=_plan(model, sharder, world))
    sebc = get_unwrapped_module(dmp).ebc
    assert isinstance(sebc, ShardedHeraldEmbeddingBagCollection) and sebc._store._cached
    dense_opt = _dense_optimizer(dmp)
    planner = RandomPlanner(world, BATCH, mode, seed=11)
    losses, mismatches, totals = [], [], {}
    for b in batches:
        p = planner.plan(b)
        sebc.set_plan(p)
        s = p.local_samples(rank)
        logits = dmp(torch.from_numpy(b["dense"][s]).to(dev), local_kjt(b, s).to(dev))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(b["labels"][s]).to(dev))
        loss.backward()
        dense_opt.step()
        dmp.fused_optimizer.step()
        dense_opt.zero_grad()
        losses.append(loss.item())
        got = sebc.global_step_counters()
        if got != {k: p.counters.get(k, 0) for k in got}:
            mismatches.append(p.step)
        for k, v in got.items():
            totals[k] = totals.get(k, 0) + v
    weights, states = sebc.full_tables()
    return {
        "weights": {k: v.cpu() for k, v in weights.items()},
        "states": {k: v.cpu() for k, v in states.items()},
        "dense": {k: v.cpu() for k, v in dense_state(get_unwrapped_module(dmp)).items()},
        "losses": losses,
        "counter_mismatches": mismatches,
        "counter_totals": totals,
        "cache_stats": sebc._store.cache_stats().cpu().tolist(),
        "cache_lines": int(sebc._store.tbe.lxu_cache_state.numel()),
    }


def cuda_parity_worker(rank: int, world: int, out_dir: str, modes: list, steps: int = STEPS) -> None:
    from torchrec.distributed.comm_ops import set_gradient_division

    set_gradient_division(True)
    batches = make_batches(world, steps)
    result = {}
    for opt in OPTIMIZERS:
        res = {"reference": run_reference(opt, batches, world, True)}
        for mode in modes:
            res[mode] = run_herald_cuda(opt, batches, rank, world, mode)
        result[opt] = res
    torch.save(result, rank_result(out_dir, rank))


def _check(res: dict, opt: str, mode: str) -> None:
    ref, got = res["reference"], res[mode]
    assert all(math.isfinite(x) for x in got["losses"])
    for what in ("weights", "states", "dense"):
        d = _max_diff(got[what], ref[what])
        assert d <= 1e-5, f"{opt} {mode} {what}: max |diff| {d:.3g} vs the single-process reference"
    assert _max_diff(ref["weights"], init_tables()) > 1e-2  # the tables really trained
    assert got["counter_mismatches"] == []
    stats, lines = got["cache_stats"], got["cache_lines"]
    assert stats[3] > lines, f"{opt} {mode}: {stats[3]} unique misses on {lines} cache lines: no evictions"


def test_cuda_parity_one_rank(tmp_path: Path) -> None:
    (f,) = run_ranks(
        "tests.scenarios.test_cuda_parity:cuda_parity_worker",
        tmp_path,
        world_size=1,
        timeout=400,
        modes=["static", "random"],
    )
    result = torch.load(f, weights_only=False)
    for opt in OPTIMIZERS:
        for mode in ("static", "random"):
            _check(result[opt], opt, mode)


def test_cuda_parity_two_ranks_with_moves(tmp_path: Path) -> None:
    files = run_ranks(
        "tests.scenarios.test_cuda_parity:cuda_parity_worker", tmp_path, world_size=2, timeout=500, modes=["random"]
    )
    for f in files:
        result = torch.load(f, weights_only=False)
        for opt in OPTIMIZERS:
            _check(result[opt], opt, "random")
            tot = result[opt]["random"]["counter_totals"]
            assert all(tot[k] > 0 for k in ("migrate", "evict_home", "forward", "shared_value")), tot
