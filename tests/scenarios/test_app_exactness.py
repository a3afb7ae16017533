"""The central claim at the application level: `train.py` ends at the same model — every table, its optimizer state
(row-wise Adagrad, Adagrad, SGD) and every dense parameter (final_state.pt) — under scheduler=herald, scheduler=static,
scheduler=p2res, stock TorchRec ROW_WISE on 2 gloo ranks, Herald with some tables left to TorchRec's own sharding, and
an unscheduled one-process run over the same global batches (the reference).

Why `embedding_eps=1e-2` for row-wise Adagrad: with the default 1e-8, a row read by one or two very confident
samples takes a step of ~lr * g/|g|, so float32 summation-order noise in g (~1e-4 relative where sigmoid(z) - y is
tiny) becomes a ~1e-3 absolute difference in that row — between any two mathematically equal runs (2 vs 4 ranks of
the *same* static schedule differ as much as herald vs static do). A larger eps keeps the math and the code path
and removes the ill-conditioning, so the 1e-5 comparison tests the protocol, not float32. 1e-3 was not enough: on
the synthetic log, sample 197 of step 2 has a deep-MLP ReLU whose input is -2.9e-8, inside the ~1e-8 noise that
the ranks' different partial sums of the dense gradient leave in the weights, so the unit is on in one correct run
and off in another; that sample's embedding gradients then differ by ~1 %, which eps=1e-3 turns into 1.4e-4 in
its 26 rows after 30 steps (every other sample's gradient agrees to float32). eps=1e-2 bounds a row's step to
lr * |g| / eps, so such a flip stays under 1e-5, while a stale or lost row still shows as ~lr.
tests/scenarios/test_module_parity.py checks the sharded module itself, default eps, on a small model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.app_runs import run_app_many
from tests.helpers.ranks import REPO_ROOT, run_ranks

RUNS = {  # name: (extra args, ranks)
    "herald": (["scheduler=herald"], 2),
    # LAIA's stream first pass (the default from 8 ranks; 2 ranks bid): another assignment, the same model
    "herald_stream": (["scheduler=herald", "scheduler.first_pass=stream"], 2),
    "static": (["scheduler=static"], 2),
    # P²RES: replicated rows all-reduced on every rank (distributed/step/replicas.py), the rest read from home
    "p2res": (["scheduler=p2res"], 2),
    "torchrec": (["scheduler=torchrec", "sharding.types=[row_wise]"], 2),
    # four tables (tiny, mid-sized, large) left to TorchRec's TABLE_WISE / COLUMN_WISE sharding, the rest Herald's
    "herald_mixed": (
        ["scheduler=herald", "scheduler.unscheduled=[c3,c8,c9,c20]", "sharding.types=[table_wise,column_wise]"],
        2,
    ),
    "reference": (["scheduler=torchrec", "sharding.types=[table_wise]", "trainer.batch_size=512"], 1),
}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a) if a else 0.0


OPTIMIZERS = {"rowwise_adagrad": 0.05, "sgd": 0.5, "adagrad": 0.05}  # the embedding optimizer -> its learning rate


def common_args(optimizer: str, lr: float) -> list[str]:
    eps = ["trainer.embedding_eps=1e-2"] if optimizer != "sgd" else []
    return [
        *eps,
        "trainer.steps=30",
        "trainer.eval_interval=0",
        "data.val_batches=2",
        f"trainer.embedding_optimizer={optimizer}",
        f"trainer.embedding_lr={lr}",
        "trainer.dense_optimizer=sgd",
        "trainer.dense_lr=0.05",
        "trainer.save_final=true",
        "data.locality=0.7",
    ]


# Every scheduler under row-wise Adagrad (TorchRec's default for DLRM tables); under SGD and Adagrad the schedulers
# whose optimizer state travels differently (herald: with guest rows, p2res: all-reduced replicas, stock TorchRec).
# The other cells of the matrix run in `make test-slow` (test_every_scheduler_under_every_optimizer).
DEFAULT_CELLS = {
    "rowwise_adagrad": tuple(RUNS),
    "sgd": ("herald", "p2res", "torchrec", "reference"),
    "adagrad": ("herald", "p2res", "torchrec", "reference"),
}
SLOW_CELLS = {
    opt: ("reference", *rest) for opt in OPTIMIZERS if (rest := tuple(s for s in RUNS if s not in DEFAULT_CELLS[opt]))
}


def _train(out, cells: dict[str, tuple[str, ...]]) -> dict:
    """out/<optimizer>/<run> for the given cells: the 2-rank runs one after another in one pair of gloo ranks
    (tests/helpers/app_ranks.py: train.py's job, without paying the start-up per run), the one-rank references as a
    user runs them (`python train.py ARGS`, each through the CLI path), in one process."""
    two = {
        f"{opt}/{s}": [*RUNS[s][0], *common_args(opt, OPTIMIZERS[opt])]
        for opt, names in cells.items()
        for s in names
        if RUNS[s][1] == 2
    }
    run_ranks("tests.helpers.app_ranks:train_configs", out, world_size=2, timeout=900, runs=two)
    one = [(opt, s, RUNS[s][0]) for opt, names in cells.items() for s in names if RUNS[s][1] == 1]
    done = run_app_many(
        [[*extra, *common_args(opt, OPTIMIZERS[opt]), f"run_dir={out / opt / s}"] for opt, s, extra in one]
    )
    return {"dir": out, "cells": cells, "one_rank": {(opt, s): p for (opt, s, _), p in zip(one, done)}}


@pytest.fixture(scope="module")
def exactness_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _train(tmp_path_factory.mktemp("exactness"), DEFAULT_CELLS)


@pytest.mark.parametrize("optimizer, lr", list(OPTIMIZERS.items()))
def test_schedulers_train_the_same_model(exactness_runs: dict, optimizer: str, lr: float) -> None:
    _check_same_model(exactness_runs, optimizer)


@pytest.mark.slow
def test_every_scheduler_under_every_optimizer(tmp_path: Path) -> None:
    runs = _train(tmp_path, SLOW_CELLS)
    assert set(SLOW_CELLS) == {"sgd", "adagrad"}
    for optimizer in SLOW_CELLS:
        _check_same_model(runs, optimizer)


@pytest.mark.slow
def test_table_row_wise_across_machines_trains_the_same_model(tmp_path: Path) -> None:
    """Stock TorchRec's sharding across machines, TABLE_ROW_WISE, on 4 ranks as 2 machines of 2 (each table's rows
    over one machine's ranks; the planner's topology from LOCAL_WORLD_SIZE), 128 samples a rank: the reference's
    global batch and model; and Herald with four tables left to it."""
    opt = "rowwise_adagrad"
    args = [*common_args(opt, OPTIMIZERS[opt]), "sharding.types=[table_row_wise]", "trainer.batch_size=128"]
    runs = {
        "twrw": [*args, "scheduler=torchrec"],
        "herald_twrw": [*args, "scheduler=herald", "scheduler.unscheduled=[c3,c8,c9,c20]"],
    }
    run_ranks(
        "tests.helpers.app_ranks:train_configs_on_machines",
        tmp_path,
        world_size=4,
        timeout=900,
        runs=runs,
        ranks_per_machine=2,
    )
    (ref,) = run_app_many([[*RUNS["reference"][0], *common_args(opt, OPTIMIZERS[opt]), f"run_dir={tmp_path / 'ref'}"]])
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = torch.load(tmp_path / "ref" / "final_state.pt")
    assert len(want["tables"]) == 26 and len(want["optimizer_state"]) == 26
    for name in runs:
        got = torch.load(tmp_path / name / "final_state.pt")
        for part in ("tables", "optimizer_state", "dense"):
            assert _max_diff(got[part], want[part]) <= 1e-5, (name, part)
        assert _max_diff(got["tables"], _initial_tables()) > 1e-3  # trained


def _check_same_model(runs: dict, optimizer: str) -> None:
    tmp_path = runs["dir"] / optimizer
    names = runs["cells"][optimizer]
    for s in names:
        if RUNS[s][1] != 2:
            p = runs["one_rank"][optimizer, s]
            assert (tmp_path / s / "final_state.pt").exists(), f"{s}: exit {p.returncode}\n{p.stderr[-3000:]}"
    states = {}
    for s in names:
        path = tmp_path / s / "final_state.pt"
        assert path.exists(), f"{s} wrote no final_state.pt (see {runs['dir']}/rank*.log)"
        states[s] = torch.load(path)
    ref = states["reference"]
    assert len(ref["tables"]) == 26 and ref["tables"]["t_c2"].shape == (101313, 16)
    assert len(ref["optimizer_state"]) == (26 if optimizer != "sgd" else 0)
    if optimizer == "adagrad":  # torch.optim.Adagrad: FBGEMM's EXACT_ADAGRAD, one float of state per element
        assert ref["optimizer_state"]["t_c2"].shape == (101313, 16)
    assert ref["dense"], "dense parameters missing"
    for s in names:
        assert _max_diff(states[s]["tables"], ref["tables"]) <= 1e-5, s
        assert _max_diff(states[s]["optimizer_state"], ref["optimizer_state"]) <= 1e-5, s
        assert _max_diff(states[s]["dense"], ref["dense"]) <= 1e-5, s
    if (
        "p2res" in names
    ):  # p2res really read rows through replicas (all-reduced) and the rest through home, no stale read
        m = json.loads((tmp_path / "p2res" / "metrics.json").read_text())
        assert m["module_rows_by_kind"]["allreduce"] > 0 and m["module_rows_by_kind"]["shared_value"] > 0, m
        assert m["stale_reads"] == 0 and m["comm_bytes_per_step"] > 0
    # and training moved the tables away from their (shared) initial values: the comparison is not vacuous
    moved = next(s for s in names if s != "reference")
    assert _max_diff(states[moved]["tables"], _initial_tables()) > 1e-3


def _initial_tables() -> dict[str, torch.Tensor]:
    """The tables train.py starts from (seed 0, default config), built the way the trainer builds them."""
    from hydra import compose, initialize_config_dir

    from herald_torchrec.app.trainer import model_features, model_kwargs
    from herald_torchrec.data import build_source
    from herald_torchrec.models import TrainModel, build_model

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["data.locality=0.7"])
    source = build_source(cfg.data)
    torch.manual_seed(cfg.seed)
    model = TrainModel(build_model(cfg.model.name, model_features(cfg, source), **model_kwargs(cfg)))
    return {n: b.weight.detach().clone() for n, b in model.model.ebc.embedding_bags.items()}
