"""Writes into a Herald model's tables take effect as they do in stock TorchRec: TorchRec's `copy_state_dict` idiom
(in-place writes into `dmp.state_dict()` / `fused_optimizer.state_dict()` tensors) and edits through
`named_parameters()`, made after training moved rows to other ranks as guests, change the model that trains on
exactly as the same writes change stock TorchRec ROW_WISE's.

Two gloo ranks, the model, batches and capacity-respecting random planner of test_module_parity.py (its plans
migrate, evict and forward rows, so rows live away from home when the writes are made). Both models are compared
tensor by tensor after training on (tables, optimizer state, dense parameters; <= 1e-5).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.ranks import rank_result, run_ranks_sequence
from tests.scenarios.test_checkpoint_dcp import (
    ADAGRAD,
    SGD,
    TABLES,
    _diff,
    full_from_state_dicts,
    herald_dmp,
    herald_part,
    init_tables,
    stock_dmp,
    train,
    unwrapped,
)
from tests.scenarios.test_module_parity import BATCH, DIM, TABLE_ROWS, RandomPlanner, dense_state, make_batches

WARM, MORE = 6, 6  # steps before the writes (rows move away), steps after


def _known(seed: int) -> tuple[dict, dict]:
    """Values to write: tables [rows, dim] and row-wise optimizer state [rows] (>= 0), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    w = {n: torch.rand(r, DIM, generator=g) - 0.5 for n, r in zip(TABLES, TABLE_ROWS)}
    s = {n: torch.rand(r, generator=g) + 0.1 for n, r in zip(TABLES, TABLE_ROWS)}
    return w, s


def _written_rows(rows: int) -> torch.Tensor:
    return torch.arange(0, rows, 3)  # a third of every table's rows, on every home block


def _stock_from_init(world: int, opt: str):
    """Stock ROW_WISE starting from the tables Herald starts from (TorchRec draws its own otherwise)."""
    s = stock_dmp(opt, world, "row_wise")
    full = init_tables()
    with torch.no_grad():
        for k, v in s.state_dict().items():
            if k.startswith("ebc.embedding_bags."):
                for sh in v.local_shards():
                    o, n = sh.metadata.shard_offsets, sh.metadata.shard_sizes
                    sh.tensor.copy_(full[k.split(".")[-2]][o[0] : o[0] + n[0], o[1] : o[1] + n[1]])
    return s


def _away_rows(dmp) -> int:
    st = herald_part(dmp).store
    return sum(int((st.owner[t] != np.arange(st.rows[t]) // st.home_block_arr[t]).sum()) for t in range(st.num_tables))


def copy_state_dict(loc: dict, glob: dict) -> None:
    """TorchRec's `test_utils.test_sharding.copy_state_dict` idiom, which the torchrec wheel cannot import (its
    module imports `torchrec.distributed.tests`, not shipped): each local shard of a ShardedTensor, and each plain
    tensor, gets its part of the global tensor by an in-place `copy_`."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for name, tensor in loc.items():
        g = glob[name].detach()
        if isinstance(tensor, ShardedTensor):
            for shard in tensor.local_shards():
                idx = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
                shard.tensor.copy_(g[idx])
        else:
            tensor.copy_(g)


def _copy_state_dict_writes(dmp, opt: str) -> None:
    """TorchRec's harness idiom: global tensors copied into the model's own state dicts, in place."""
    from tests.scenarios.test_module_parity import make_model

    cur_w, cur_s = full_from_state_dicts(dmp)  # collective: every row's current value
    known_w, known_s = _known(31)
    glob = {k: v.detach().clone() * 0.5 for k, v in make_model().state_dict().items() if not k.startswith("ebc.")}
    glob_s = {}
    for n in TABLES:
        rows = _written_rows(cur_w[n].shape[0])
        w, s = cur_w[n].clone(), cur_s[n].clone()
        w[rows], s[rows] = known_w[n][rows], known_s[n][rows]
        glob[f"ebc.embedding_bags.{n}.weight"] = w
        glob_s[f"ebc.embedding_bags.{n}.weight/{n}.momentum1"] = s
    copy_state_dict(dmp.state_dict(), glob)
    if opt == ADAGRAD:
        state = dmp.fused_optimizer.state_dict()["state"]
        copy_state_dict({f"{k}/{kk}": vv for k, v in state.items() for kk, vv in v.items()}, glob_s)


def _full(dmp) -> tuple[dict, dict, dict]:
    w, s = full_from_state_dicts(dmp)
    return w, s, dense_state(unwrapped(dmp))


def _compare(h: tuple, s: tuple, opt: str) -> dict:
    return {
        "tables": _diff(h[0], s[0]),
        "state": _diff(h[1], s[1]) if opt == ADAGRAD else 0.0,
        "dense": _diff(h[2], s[2]),
    }


# -------------------------------------------------------------------------------------------------- workers
def state_dict_writes_worker(rank: int, world: int, out_dir: str, opt: str) -> None:
    """Train, write through the state dicts (copy_state_dict), train on: Herald and stock, the same writes."""
    batches = make_batches(world, steps=WARM + MORE, seed=21)
    h = herald_dmp(opt, world)
    s = _stock_from_init(world, opt)
    planner = RandomPlanner(world, BATCH, "random", seed=5)  # one planner throughout: it tracks where rows live
    train(h, batches[:WARM], rank, world, planner)
    train(s, batches[:WARM], rank, world, None)
    before = _compare(_full(h), _full(s), opt)
    away = _away_rows(h)
    _copy_state_dict_writes(h, opt)
    _copy_state_dict_writes(s, opt)
    written = _compare(_full(h), _full(s), opt)  # read back through each model's own state dicts
    hw, hs = herald_part(h).full_tables()  # Herald's rows themselves, wherever they live
    sw, ss = full_from_state_dicts(s)
    in_rows = (_diff(hw, sw), _diff(hs, ss) if opt == ADAGRAD else 0.0)
    train(h, batches[WARM:], rank, world, planner)
    train(s, batches[WARM:], rank, world, None)
    after = _compare(_full(h), _full(s), opt)
    torch.save(
        {"before": before, "away": away, "written": written, "in_rows": in_rows, "after": after},
        rank_result(out_dir, rank),
    )


def _write_through_parameters(dmp, known: dict) -> list:
    """An edit as a user makes it: rows of every table set in place through `named_parameters()`."""
    seen = []
    sd_offsets = {}
    for k, v in dmp.state_dict().items():  # where each rank's local rows start (the ShardedTensor metadata)
        if k.startswith("ebc.embedding_bags."):
            sd_offsets[k] = int(v.local_shards()[0].metadata.shard_offsets[0])
    with torch.no_grad():
        for name, p in dmp.named_parameters():
            if not name.startswith("ebc.embedding_bags."):
                continue
            table = name.split(".")[-2]
            lo = sd_offsets[name]
            rows = _written_rows(TABLE_ROWS[TABLES.index(table)])
            rows = rows[(rows >= lo) & (rows < lo + p.shape[0])]
            p[rows - lo] = known[table][rows]
            seen.append(name)
    return seen


def _parameter_view(dmp) -> list:
    """What `named_parameters()` lists for the EBC: names, types, shapes, whether marked fused (in-backward), and
    whether each aliases the state dict's local shard."""
    sd = dmp.state_dict()
    out = []
    for n, p in dmp.named_parameters():
        if n.startswith("ebc."):
            shard = sd[n].local_shards()[0].tensor if n in sd else None
            alias = shard is not None and shard.data_ptr() == p.data_ptr() and shard.shape == p.shape
            out.append((n, type(p).__name__, tuple(p.shape), hasattr(p, "_in_backward_optimizers"), alias))
    return out


def parameter_writes_worker(rank: int, world: int, out_dir: str, opt: str) -> None:
    """named_parameters() as stock's; edits through it, at start (every row home) and after training (rows away,
    after a state_dict()), change Herald's model as they change stock's."""
    batches = make_batches(world, steps=WARM + MORE, seed=22)
    h = herald_dmp(opt, world)
    s = _stock_from_init(world, opt)
    out: dict = {"herald_params": _parameter_view(h), "stock_params": _parameter_view(s)}
    known0, _ = _known(41)
    out["seen0"] = _write_through_parameters(h, known0)
    _write_through_parameters(s, known0)
    out["start"] = _compare(_full(h), _full(s), opt)
    planner = RandomPlanner(world, BATCH, "random", seed=5)  # one planner throughout: it tracks where rows live
    train(h, batches[:WARM], rank, world, planner)
    train(s, batches[:WARM], rank, world, None)
    out["away"] = _away_rows(h)
    known1, _ = _known(42)
    _write_through_parameters(h, known1)  # takes a state_dict() first: every row's value comes home to the views
    _write_through_parameters(s, known1)
    out["written"] = _compare(_full(h), _full(s), opt)
    train(h, batches[WARM:], rank, world, planner)
    train(s, batches[WARM:], rank, world, None)
    out["after"] = _compare(_full(h), _full(s), opt)
    torch.save(out, rank_result(out_dir, rank))


def stale_parameter_write_worker(rank: int, world: int, out_dir: str) -> None:
    """A write through named_parameters() into a row living on another rank, with no state_dict() since training
    moved it: a warning when the parameters are handed out, a ValueError on every rank at the next step."""
    batches = make_batches(world, steps=WARM + 1, seed=23)
    h = herald_dmp(SGD, world)
    planner = RandomPlanner(world, BATCH, "random", seed=5)
    train(h, batches[:WARM], rank, world, planner)
    st = herald_part(h).store
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params = dict(h.named_parameters())
    away = [
        t for t in range(st.num_tables) if (st.slot_of[t][st.home_lo[t] : st.home_lo[t] + st.home_len[t]] < 0).any()
    ]
    out = {"warned": [str(w.message) for w in caught], "away_tables": away}
    if rank == 0 and away:
        t = away[0]
        lo = st.home_lo[t]
        row = int(np.flatnonzero(st.slot_of[t][lo : lo + st.home_len[t]] < 0)[0])
        with torch.no_grad():
            params[f"ebc.embedding_bags.{TABLES[t]}.weight"][row] = 7.0
    try:
        train(h, batches[WARM:], rank, world, planner)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    torch.save(out, rank_result(out_dir, rank))


# ---------------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def write_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every run of this file, one after another in one pair of ranks (each takes a second or two; the ranks'
    start-up is paid once): out/state_dict_<opt>, out/parameters_<opt>, then out/stale (the refused write last)."""
    worker = "tests.scenarios.test_table_writes:{}_worker".format
    runs = {f"state_dict_{opt}": (worker("state_dict_writes"), {"opt": opt}) for opt in (ADAGRAD, SGD)}
    runs.update({f"parameters_{opt}": (worker("parameter_writes"), {"opt": opt}) for opt in (ADAGRAD, SGD)})
    runs["stale"] = (worker("stale_parameter_write"), {})
    out = tmp_path_factory.mktemp("writes")
    run_ranks_sequence(runs, out, world_size=2)
    return out


def rank_results(run_dir: Path) -> list[dict]:
    return [torch.load(rank_result(run_dir, q), weights_only=False) for q in range(2)]


@pytest.mark.parametrize("opt", [ADAGRAD, SGD])
def test_copy_state_dict_writes_take_effect(write_runs: Path, opt: str) -> None:
    res = rank_results(write_runs / f"state_dict_{opt}")
    for r in res:
        assert r["away"] > 0  # the writes were made with rows living away from home
        for stage in ("before", "written", "after"):
            for k, v in r[stage].items():
                assert v <= 1e-5, (stage, k, v)
        assert r["in_rows"][0] <= 1e-5 and r["in_rows"][1] <= 1e-5, r["in_rows"]


@pytest.mark.parametrize("opt", [ADAGRAD, SGD])
def test_named_parameters_are_stocks_and_writes_take_effect(write_runs: Path, opt: str) -> None:
    res = rank_results(write_runs / f"parameters_{opt}")
    for r in res:
        assert r["herald_params"] == r["stock_params"], (r["herald_params"], r["stock_params"])
        assert [n for n, *_ in r["herald_params"]] == [f"ebc.embedding_bags.{t}.weight" for t in TABLES]
        assert all(alias for *_, alias in r["herald_params"])
        assert r["seen0"] == [f"ebc.embedding_bags.{t}.weight" for t in TABLES]
        assert r["away"] > 0
        for stage in ("start", "written", "after"):
            for k, v in r[stage].items():
                assert v <= 1e-5, (stage, k, v)


def test_write_to_a_row_away_is_refused_loudly(write_runs: Path) -> None:
    res = rank_results(write_runs / "stale")
    assert res[0]["away_tables"], "the test needs rows living away from rank 0"
    for r in res:
        assert any("live on other ranks" in m for m in r["warned"]), r["warned"]
    assert res[0]["error"] is not None and "named_parameters()" in res[0]["error"], res[0]["error"]
    assert res[1]["error"] is not None and "rank 0" in res[1]["error"], res[1]["error"]  # every rank stops
