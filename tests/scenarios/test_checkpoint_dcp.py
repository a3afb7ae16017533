"""Checkpoints the TorchRec way: a Herald DMP's `state_dict()` / `fused_optimizer.state_dict()` have the
keys, shapes and ShardedTensor metadata of TorchRec's ROW_WISE sharding and hold the *current* rows wherever they
live; `torch.distributed.checkpoint` save + load into a fresh model is exact and resets ownership to home; stock
TorchRec checkpoints (ROW_WISE, TABLE_WISE) load into Herald and back; a mixed EBC checkpoints like a stock one.
Row-wise Adagrad's state is [rows]; Adagrad's (EXACT_ADAGRAD) is per element, [rows, dim], sharded as the weight.

Two gloo ranks, the model and the capacity-respecting random planner of test_module_parity.py (its plans
migrate, evict and forward rows, so guests exist when the checkpoint is taken). Truth is read independently of the
checkpoint code: `full_tables()` (an all-reduce over owners) for Herald, local shards + all-reduce for TorchRec.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.ranks import rank_result, run_ranks_sequence
from tests.scenarios.test_module_parity import (
    BATCH,
    CACHE_RATIO,
    DIM,
    TABLE_ROWS,
    RandomPlanner,
    _dense_optimizer,
    _row_wise_plan,
    _train_step,
    dense_state,
    fused_params,
    init_tables,
    make_batches,
    make_model,
    table_configs,
)

TABLES = [f"t{t}" for t in range(len(TABLE_ROWS))]
ADAGRAD, SGD = "exact_rowwise_adagrad", "exact_sgd"
EXACT_ADAGRAD = "exact_adagrad"  # per-element state: [rows, dim]
STATEFUL = (ADAGRAD, EXACT_ADAGRAD)


def _fused_params(opt: str) -> dict:
    """The parity model's settings; Adagrad with eps 1e-2 (well conditioned: its state is a per-element sum of
    squared gradients, small for rarely read elements)."""
    if opt == EXACT_ADAGRAD:
        return {"optimizer": opt, "learning_rate": 0.05, "eps": 1e-2}
    return fused_params(opt)


# ------------------------------------------------------------------------------------------------ builders
def _env():
    import torch.distributed as dist
    from torchrec.distributed.types import ShardingEnv

    return ShardingEnv.from_process_group(dist.group.WORLD)


def herald_dmp(opt: str, world: int, mixed: bool = False):
    """Herald DMP over every table (manual ROW_WISE plan), or a mixed one with t3 left to TorchRec (TABLE_WISE)."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder

    model = make_model()
    with torch.no_grad():
        for name, w in init_tables().items():
            model.ebc.embedding_bags[name].weight.copy_(w)
    sharder = HeraldEmbeddingBagCollectionSharder(
        cache_ratio=CACHE_RATIO,
        policy="random",
        fused_params=_fused_params(opt),
        unscheduled_tables=["t3"] if mixed else (),
    )
    if mixed:
        cons = sharder.planner_constraints(model.ebc, ["table_wise"], world_size=world, device_type="cpu")
        plan = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device="cpu"), constraints=cons
        ).collective_plan(model, [sharder], dist.group.WORLD)
    else:
        plan = _row_wise_plan(model, sharder, world)
    return DistributedModelParallel(model, env=_env(), device=torch.device("cpu"), sharders=[sharder], plan=plan)


def stock_dmp(opt: str, world: int, sharding: str):
    """Stock TorchRec DMP, every table ROW_WISE or TABLE_WISE (StockSharder offers ROW_WISE on CPU)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan

    from herald_torchrec.app.model_setup import StockSharder
    from herald_torchrec.distributed.storage.optimizer_params import parse_optimizer

    fp = _fused_params(opt)
    fp["optimizer"] = parse_optimizer(fp["optimizer"])
    sharder = StockSharder(fused_params=fp)
    model = make_model()
    types = {
        c.name: (
            row_wise(compute_kernel="fused")
            if sharding == "row_wise"
            else table_wise(rank=i % world, compute_kernel="fused")
        )
        for i, c in enumerate(table_configs())
    }
    plan = ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                model.ebc, types, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
            )
        }
    )
    return DistributedModelParallel(model, env=_env(), device=torch.device("cpu"), sharders=[sharder], plan=plan)


def unwrapped(dmp):
    from torchrec.distributed.model_parallel import get_unwrapped_module

    return get_unwrapped_module(dmp)


def herald_part(dmp):
    from herald_torchrec.distributed.mixed import ShardedMixedEmbeddingBagCollection

    m = unwrapped(dmp).ebc
    return m.herald if isinstance(m, ShardedMixedEmbeddingBagCollection) else m


def herald_tables_only(plan, num_tables: int):
    """The plan restricted to the first `num_tables` tables (a mixed EBC's Herald part; its planner plans all)."""
    from herald_torchrec.schedule.plan import Plan, RowMoves, SharedRows

    mv, sh = plan.moves, plan.shared
    keep = np.asarray(mv.table) < num_tables
    moves = RowMoves(*(np.asarray(getattr(mv, f))[keep] for f in ("table", "row", "src", "dst", "kind")))
    counts = np.diff(sh.reader_offsets)
    ks = np.asarray(sh.table) < num_tables
    readers = np.asarray(sh.readers)[np.repeat(ks, counts)]
    shared = SharedRows(
        np.asarray(sh.table)[ks],
        np.asarray(sh.row)[ks],
        np.asarray(sh.owner)[ks],
        np.concatenate([[0], np.cumsum(counts[ks])]).astype(np.int64),
        readers,
    )
    return Plan(plan.step, plan.num_ranks, plan.batch_per_rank, plan.sample_order, moves, shared)


def train(dmp, batches: list[dict], rank: int, world: int, planner: RandomPlanner | None) -> None:
    """Herald: the planner's plans (moves + shared rows); stock (planner None): the natural sample split."""
    dense_opt = _dense_optimizer(dmp)
    for b in batches:
        if planner is not None:
            p = planner.plan(b)
            m = herald_part(dmp)
            m.set_plan(p if len(m.table_names) == len(TABLES) else herald_tables_only(p, len(m.table_names)))
            samples = p.local_samples(rank)
        else:
            samples = np.arange(rank * BATCH, (rank + 1) * BATCH)
        _train_step(dmp, dense_opt, b, samples)


def full_from_state_dicts(dmp, opt: str = ADAGRAD) -> tuple[dict, dict]:
    """Full tables + momentum from `dmp.state_dict()` / `dmp.fused_optimizer.state_dict()` (collective: local
    shards, then one all-reduce; a rank may lack a table's optimizer key under TABLE_WISE). The momentum is [rows]
    (row-wise Adagrad) or [rows, dim] (`EXACT_ADAGRAD`)."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    w = {n: torch.zeros(r, DIM) for n, r in zip(TABLES, TABLE_ROWS)}
    s = {n: torch.zeros((r, DIM) if opt == EXACT_ADAGRAD else (r,)) for n, r in zip(TABLES, TABLE_ROWS)}

    def fill(out: torch.Tensor, st: ShardedTensor) -> None:
        for sh in st.local_shards():
            idx = tuple(slice(o, o + n) for o, n in zip(sh.metadata.shard_offsets, sh.metadata.shard_sizes))
            out[idx] = sh.tensor.reshape(out[idx].shape)

    for k, v in dmp.state_dict().items():
        if isinstance(v, ShardedTensor):
            fill(w[k.split(".")[-2]], v)
    for k, v in dmp.fused_optimizer.state_dict()["state"].items():
        for sv in v.values():
            fill(s[k.split(".")[-2]], sv)
    flat = torch.cat([w[n].reshape(-1) for n in TABLES] + [s[n].reshape(-1) for n in TABLES])
    dist.all_reduce(flat)
    off, wo, so = 0, {}, {}
    for n in TABLES:
        wo[n] = flat[off : off + w[n].numel()].view(w[n].shape).clone()
        off += w[n].numel()
    for n in TABLES:
        so[n] = flat[off : off + s[n].numel()].view(s[n].shape).clone()
        off += s[n].numel()
    return wo, so


def dcp_save(dmp, path: str, with_optim: bool) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"model": dmp.state_dict()}
    if with_optim:
        state["optim"] = dmp.fused_optimizer.state_dict()
    dcp.save(state, checkpoint_id=path)


def dcp_load(dmp, path: str, with_optim: bool) -> None:
    """TorchRec's idiom: the model's own state dicts, filled in place by DCP, then loaded."""
    import torch.distributed.checkpoint as dcp

    state = {"model": dmp.state_dict()}
    if with_optim:
        state["optim"] = dmp.fused_optimizer.state_dict()
    dcp.load(state, checkpoint_id=path)
    dmp.load_state_dict(state["model"])
    if with_optim:
        dmp.fused_optimizer.load_state_dict(state["optim"])


def _diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max([float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in a] + [0.0])


def _metadata(v) -> tuple:
    """What must equal between Herald's and stock's ShardedTensors: global metadata and this rank's shard metadata."""
    return (v.metadata(), [sh.metadata for sh in v.local_shards()], [tuple(sh.tensor.shape) for sh in v.local_shards()])


def _state(dmp) -> dict:
    return dmp.fused_optimizer.state_dict()["state"]


def _layout(dmp) -> dict:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for k, v in dmp.state_dict().items():
        out[k] = _metadata(v) if isinstance(v, ShardedTensor) else ("dense", tuple(v.shape))
    for k, v in dmp.fused_optimizer.state_dict()["state"].items():
        out[f"optim:{k}"] = {kk: _metadata(vv) for kk, vv in v.items()}
    return out


def _ownership(dmp) -> dict:
    m = herald_part(dmp)
    st = m.store
    home = [np.arange(r) // st.home_block_arr[t] for t, r in enumerate(st.rows)]
    return {
        "guests": int(st.guest_count_all.sum()),
        "local_guests": sum(st.num_guests(t) for t in range(st.num_tables)),
        "away": int(sum((st.owner[t] != home[t]).sum() for t in range(st.num_tables))),
        "version": m.ownership_version,
        "queued": m.queued_plans,
        "owns_home_only": all(
            np.array_equal(np.sort(st.owned_keys(t)), np.arange(st.home_lo[t], st.home_lo[t] + st.home_len[t]))
            for t in range(st.num_tables)
        ),
    }


# -------------------------------------------------------------------------------------------------- workers
def roundtrip_worker(rank: int, world: int, out_dir: str, opt: str) -> None:
    """Herald trained with moves -> DCP save -> DCP load into a fresh Herald DMP (and into the trained one itself);
    then both train on with the same fresh plans."""
    ckpt = str(Path(out_dir) / "herald_ckpt")
    batches = make_batches(world, steps=14, seed=3)
    a = herald_dmp(opt, world)
    train(a, batches[:8], rank, world, RandomPlanner(world, BATCH, "random", seed=5))
    before = _ownership(a)
    herald_part(a).set_plan(RandomPlanner(world, BATCH, "random", seed=99).plan(batches[8]))  # queued, then dropped
    truth_w, truth_s = herald_part(a).full_tables()
    truth_dense = dense_state(unwrapped(a))
    dcp_save(a, ckpt, with_optim=opt in STATEFUL)
    b = herald_dmp(opt, world)
    fresh_w, _ = herald_part(b).full_tables()
    dcp_load(b, ckpt, with_optim=opt in STATEFUL)
    got_w, got_s = herald_part(b).full_tables()
    via_sd_w, via_sd_s = full_from_state_dicts(b, opt)
    dense_diff = _diff(dense_state(unwrapped(b)), truth_dense)
    dcp_load(a, ckpt, with_optim=opt in STATEFUL)  # the trained model back at its home placement
    after_a, after_b = _ownership(a), _ownership(b)
    a_w, a_s = herald_part(a).full_tables()
    # train on with the same fresh plans (from the home placement)
    train(a, batches[8:], rank, world, RandomPlanner(world, BATCH, "random", seed=17))
    train(b, batches[8:], rank, world, RandomPlanner(world, BATCH, "random", seed=17))
    fa, fb = herald_part(a).full_tables(), herald_part(b).full_tables()
    torch.save(
        {
            "before": before,
            "after_a": after_a,
            "after_b": after_b,
            "fresh_differs": _diff(fresh_w, truth_w),
            "loaded_w": _diff(got_w, truth_w),
            "loaded_s": _diff(got_s, truth_s) if truth_s else 0.0,
            "n_states": len(got_s),
            "via_sd_w": _diff(via_sd_w, truth_w),
            "via_sd_s": _diff(via_sd_s, truth_s) if truth_s else 0.0,
            "self_w": _diff(a_w, truth_w),
            "self_s": _diff(a_s, truth_s) if truth_s else 0.0,
            "dense": dense_diff,
            "trained_on_w": _diff(fa[0], fb[0]),
            "trained_on_s": _diff(fa[1], fb[1]) if fa[1] else 0.0,
            "moved_on": _diff(fa[0], a_w),
            "optim_sd": {k: sorted(v) for k, v in b.fused_optimizer.state_dict()["state"].items()},
            "truth_w": truth_w,
            "truth_s": truth_s,
            "ckpt": ckpt,
        },
        rank_result(out_dir, rank),
    )


def cross_worker(rank: int, world: int, out_dir: str, opt: str = ADAGRAD) -> None:
    """Layout equal to stock ROW_WISE; stock ROW_WISE / TABLE_WISE checkpoints -> Herald; Herald checkpoint -> stock."""
    out: dict = {}
    batches = make_batches(world, steps=8, seed=4)
    h = herald_dmp(opt, world)
    out["layout_equal"] = _layout(h) == _layout(stock_dmp(opt, world, "row_wise"))
    lh, ls = _layout(h), _layout(stock_dmp(opt, world, "row_wise"))
    out["layout_diff"] = [k for k in sorted(set(lh) | set(ls)) if lh.get(k) != ls.get(k)]
    out["state_shapes"] = {k: {kk: tuple(vv.size()) for kk, vv in v.items()} for k, v in _state(h).items()}
    stock_groups = stock_dmp(opt, world, "row_wise").fused_optimizer.param_groups
    out["groups"] = (
        [(sorted(g), len(g["params"]), float(g["lr"])) for g in h.fused_optimizer.param_groups],
        [(sorted(g), len(g["params"]), float(g["lr"])) for g in stock_groups],
    )
    train(h, batches, rank, world, RandomPlanner(world, BATCH, "random", seed=6))
    out["guests"] = _ownership(h)["guests"]
    hw, hs = herald_part(h).full_tables()
    dcp_save(h, str(Path(out_dir) / "herald"), with_optim=True)
    for sharding in ("row_wise", "table_wise"):
        s = stock_dmp(opt, world, sharding)
        dcp_load(s, str(Path(out_dir) / "herald"), with_optim=True)  # Herald -> stock
        sw, ss = full_from_state_dicts(s, opt)
        out[f"herald_to_{sharding}"] = (_diff(sw, hw), _diff(ss, hs))
        s = stock_dmp(opt, world, sharding)
        with torch.no_grad():  # the stock run starts from the same tables (TorchRec draws its own otherwise)
            full = init_tables()
            for k, v in s.state_dict().items():
                if k.startswith("ebc.embedding_bags."):
                    for sh in v.local_shards():
                        o, n = sh.metadata.shard_offsets, sh.metadata.shard_sizes
                        sh.tensor.copy_(full[k.split(".")[-2]][o[0] : o[0] + n[0], o[1] : o[1] + n[1]])
        train(s, batches, rank, world, None)
        sw, ss = full_from_state_dicts(s, opt)
        path = str(Path(out_dir) / f"stock_{sharding}")
        dcp_save(s, path, with_optim=True)
        g = herald_dmp(opt, world)
        dcp_load(g, path, with_optim=True)  # stock -> Herald
        gw, gs = herald_part(g).full_tables()
        out[f"{sharding}_to_herald"] = (_diff(gw, sw), _diff(gs, ss), float(ss["t0"].abs().max()))
    torch.save(out, rank_result(out_dir, rank))


def mixed_worker(rank: int, world: int, out_dir: str) -> None:
    """A mixed EBC (t3 TABLE_WISE with TorchRec) checkpoints under a stock EBC's keys and round-trips exactly."""
    ckpt = str(Path(out_dir) / "mixed")
    batches = make_batches(world, steps=6, seed=8)
    a = herald_dmp(ADAGRAD, world, mixed=True)
    keys = sorted(a.state_dict())
    okeys = sorted(a.fused_optimizer.state_dict()["state"])
    stock = stock_dmp(ADAGRAD, world, "table_wise")
    train(a, batches, rank, world, RandomPlanner(world, BATCH, "random", seed=2))
    tw, ts = full_from_state_dicts(a)
    hw, hs = herald_part(a).full_tables()
    dcp_save(a, ckpt, with_optim=True)
    b = herald_dmp(ADAGRAD, world, mixed=True)
    dcp_load(b, ckpt, with_optim=True)
    bw, bs = full_from_state_dicts(b)
    torch.save(
        {
            "keys": keys,
            "stock_keys": sorted(stock.state_dict()),
            "okeys": okeys,
            "stock_okeys": sorted(stock.fused_optimizer.state_dict()["state"]),
            "herald_vs_sd": _diff({k: tw[k] for k in hw}, hw),
            "herald_vs_sd_s": _diff({k: ts[k] for k in hs}, hs),
            "roundtrip_w": _diff(bw, tw),
            "roundtrip_s": _diff(bs, ts),
            "t3_state": float(ts["t3"].abs().max()),
            "ownership": _ownership(b),
        },
        rank_result(out_dir, rank),
    )


def in_memory_worker(rank: int, world: int, out_dir: str) -> None:
    """The bug on main: `fresh.load_state_dict(trained.state_dict())` after training with moves (no DCP) left
    tables wrong, without any missing key. Uses only API that main has too."""
    batches = make_batches(world, steps=8, seed=9)
    a = herald_dmp(ADAGRAD, world)
    train(a, batches, rank, world, RandomPlanner(world, BATCH, "random", seed=12))
    truth, _ = herald_part(a).full_tables()
    b = herald_dmp(ADAGRAD, world)
    res = b.load_state_dict(a.state_dict())
    got, _ = herald_part(b).full_tables()
    torch.save(
        {
            "diff": _diff(got, truth),
            "missing": list(res.missing_keys),
            "guests": int(herald_part(a).store.guest_count_all.sum()),
        },
        rank_result(out_dir, rank),
    )


# ---------------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def dcp_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every two-rank run of this file, one after another in one pair of ranks (each takes a second or two; the
    ranks' start-up is paid once): out/roundtrip_<opt>, out/cross_<opt>, out/mixed, out/in_memory."""
    worker = "tests.scenarios.test_checkpoint_dcp:{}_worker".format
    runs = {f"roundtrip_{opt}": (worker("roundtrip"), {"opt": opt}) for opt in (ADAGRAD, SGD, EXACT_ADAGRAD)}
    runs.update({f"cross_{opt}": (worker("cross"), {"opt": opt}) for opt in (ADAGRAD, EXACT_ADAGRAD)})
    runs.update(mixed=(worker("mixed"), {}), in_memory=(worker("in_memory"), {}))
    out = tmp_path_factory.mktemp("dcp")
    run_ranks_sequence(runs, out, world_size=2)
    return out


def rank_results(run_dir: Path) -> list[dict]:
    return [torch.load(rank_result(run_dir, q), weights_only=False) for q in range(2)]


@pytest.mark.parametrize("opt", [ADAGRAD, SGD, EXACT_ADAGRAD])
def test_dcp_roundtrip_into_fresh_herald_model_is_exact(dcp_runs: Path, opt: str) -> None:
    tmp_path = dcp_runs / f"roundtrip_{opt}"
    res = rank_results(tmp_path)
    r = res[0]
    assert r["before"]["guests"] > 0 and r["before"]["away"] > 0  # the checkpoint was taken with rows away from home
    assert r["fresh_differs"] > 1e-3  # the fresh model really starts elsewhere
    for key in ("loaded_w", "loaded_s", "via_sd_w", "via_sd_s", "self_w", "self_s", "dense"):
        assert r[key] == 0.0, (key, r[key])
    assert r["n_states"] == (len(TABLE_ROWS) if opt in STATEFUL else 0)
    for rr in res:
        for who in ("after_a", "after_b"):
            own = rr[who]
            assert own["guests"] == own["local_guests"] == own["away"] == own["queued"] == 0, own
            assert own["owns_home_only"], own
        assert rr["after_b"]["version"] >= 1 and rr["after_a"]["version"] > rr["after_b"]["version"] - 1
    # both models trained on with the same fresh plans from the home placement: identical
    assert r["trained_on_w"] <= 1e-7 and r["trained_on_s"] <= 1e-7, (r["trained_on_w"], r["trained_on_s"])
    assert r["moved_on"] > 1e-4
    want = {f"ebc.embedding_bags.{t}.weight": ([f"{t}.momentum1"] if opt in STATEFUL else []) for t in TABLES}
    assert r["optim_sd"] == want
    # the checkpoint itself, read in one process: the trained model's current rows, not slot-ordered internals
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(r["ckpt"], str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    assert _diff({t: full["model"][f"ebc.embedding_bags.{t}.weight"] for t in TABLES}, r["truth_w"]) == 0.0
    if opt in STATEFUL:
        got = {t: full["optim"]["state"][f"ebc.embedding_bags.{t}.weight"][f"{t}.momentum1"] for t in TABLES}
        assert _diff(got, r["truth_s"]) == 0.0 and max(float(v.abs().max()) for v in got.values()) > 0
        per_element = opt == EXACT_ADAGRAD
        assert [tuple(got[t].shape) for t in TABLES] == [(n, DIM) if per_element else (n,) for n in TABLE_ROWS]
    assert not any("_store" in k for k in full["model"])


@pytest.mark.parametrize("opt", [ADAGRAD, EXACT_ADAGRAD])
def test_stock_and_herald_checkpoints_cross_load(dcp_runs: Path, opt: str) -> None:
    r = rank_results(dcp_runs / f"cross_{opt}")[0]
    assert r["layout_equal"], r["layout_diff"]
    want = {(n, DIM) if opt == EXACT_ADAGRAD else (n,) for n in TABLE_ROWS}
    assert {shape for v in r["state_shapes"].values() for shape in v.values()} == want
    (hg,), (sg,) = r["groups"]
    assert hg[:2] == sg[:2] and hg[2] == pytest.approx(sg[2]), r["groups"]
    assert r["guests"] > 0
    for k in ("herald_to_row_wise", "herald_to_table_wise"):
        assert r[k] == (0.0, 0.0), (k, r[k])
    for k in ("row_wise_to_herald", "table_wise_to_herald"):
        w, s, s_max = r[k]
        assert w == 0.0 and s == 0.0 and s_max > 0, (k, r[k])


def test_mixed_ebc_checkpoints_like_a_stock_ebc(dcp_runs: Path) -> None:
    res = rank_results(dcp_runs / "mixed")
    r = res[0]
    assert r["keys"] == r["stock_keys"], (r["keys"], r["stock_keys"])
    # fused-optimizer keys: TorchRec's; a TABLE_WISE table's state is listed by its owning rank only (as stock)
    want = {f"ebc.embedding_bags.{t}.weight" for t in TABLES}
    assert set().union(*(x["okeys"] for x in res)) == want == set().union(*(x["stock_okeys"] for x in res))
    assert all({f"ebc.embedding_bags.{t}.weight" for t in TABLES[:3]} <= set(x["okeys"]) for x in res)
    assert r["herald_vs_sd"] == 0.0 and r["herald_vs_sd_s"] == 0.0
    assert r["roundtrip_w"] == 0.0 and r["roundtrip_s"] == 0.0 and r["t3_state"] > 0
    assert r["ownership"]["guests"] == 0 and r["ownership"]["version"] >= 1


def test_in_memory_state_dict_load_after_moves(dcp_runs: Path) -> None:
    """Fails on main: its state dict held slot-ordered TBE internals, so rows living as guests came back wrong."""
    res = rank_results(dcp_runs / "in_memory")
    assert res[0]["guests"] > 0
    for r in res:
        assert r["missing"] == [] and r["diff"] == 0.0, (r["missing"], r["diff"])


def test_single_process_state_dict_and_bad_input() -> None:
    """One process, no process group: plain full tensors under TorchRec's keys; a load of the wrong shape or of
    FBGEMM internals (main's layout) is refused with a message naming the table / the key."""
    from tests.distributed.test_embeddingbag import make_module

    m = make_module()
    sd = m.state_dict()
    assert sorted(sd) == ["embedding_bags.t0.weight", "embedding_bags.t1.weight"]
    tables, _ = m.full_tables()
    assert torch.equal(sd["embedding_bags.t0.weight"], tables["t0"])
    new = {k: torch.full_like(v, 0.5) for k, v in sd.items()}
    assert not m.load_state_dict(new).missing_keys
    assert bool((m.full_tables()[0]["t1"] == 0.5).all()) and m.ownership_version == 1
    with pytest.raises(RuntimeError, match="table 't0'.*shape"):
        m.load_state_dict({**new, "embedding_bags.t0.weight": torch.zeros(3, 4)})
    with pytest.raises(RuntimeError, match="FBGEMM internals"):
        m.load_state_dict({**new, "_store.tbe.weights_host": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="Missing key.*embedding_bags.t1.weight"):
        m.load_state_dict({"embedding_bags.t0.weight": new["embedding_bags.t0.weight"]})
    opt = m.fused_optimizer.state_dict()["state"]
    assert sorted(opt) == ["embedding_bags.t0.weight", "embedding_bags.t1.weight"]
    assert sorted(opt["embedding_bags.t0.weight"]) == ["t0.momentum1"]


def test_shard_placements_name_the_gpus_ranks_use() -> None:
    """A plan made for one GPU per rank (placement cuda:r) on ranks that share one GPU: every placement names a GPU
    that exists, this rank's own names its device, so ShardedTensor accepts the home block (seen failing on an H200
    with two ranks on one GPU). CPU placements are left as they are."""
    from torch.distributed._shard.metadata import ShardMetadata

    from herald_torchrec.distributed.state.checkpoint import _on_used_devices

    gpus = max(torch.cuda.device_count(), 1)
    planned = [
        ShardMetadata(shard_offsets=[10 * r, 0], shard_sizes=[10, 4], placement=f"rank:{r}/cuda:{r}")
        for r in range(gpus + 2)
    ]
    for rank in range(gpus + 2):
        own = torch.device("cuda", rank % gpus)
        placed = _on_used_devices(planned, rank, own)
        assert [str(s.placement) for s in placed] == [f"rank:{r}/cuda:{r % gpus}" for r in range(gpus + 2)]
        assert [s.shard_offsets for s in placed] == [s.shard_offsets for s in planned]
        assert [s.shard_sizes for s in placed] == [s.shard_sizes for s in planned]
    cpu = [ShardMetadata(shard_offsets=[0, 0], shard_sizes=[10, 4], placement="rank:0/cpu")]
    assert _on_used_devices(cpu, 0, torch.device("cpu")) is cpu
