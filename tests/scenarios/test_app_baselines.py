"""`train.py scheduler=fae|het|p2res`: the baselines run in Herald's engine, 2 gloo ranks, and report the same
metrics as Herald. p2res's exactness (same model as stock TorchRec) is in test_app_exactness.py.

Default: every model under fae and under het with staleness 2 (the eight runs share one pair of ranks:
tests/helpers/app_ranks.py), and one het run through `torchrun train.py`; `-m slow`: every model under het with
staleness 0, and het with staleness 0 ending at stock TorchRec's model (both fused optimizers).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers.app_runs import run_app
from tests.helpers.ranks import run_ranks

COMMON = ["trainer.eval_interval=0", "data.val_batches=2"]


def _run(tmp_path: Path, args: list[str]) -> dict:
    p = run_app([*args, *COMMON, f"run_dir={tmp_path}"], nproc=2)
    path = tmp_path / "metrics.json"
    assert path.exists(), f"exit {p.returncode}\n{p.stderr[-3000:]}"
    return json.loads(path.read_text())


def _check_common(m: dict, steps: int) -> None:
    assert m["steps"] == steps and m["world_size"] == 2
    assert math.isfinite(m["last_loss"]) and 0.0 < m["auc"] < 1.0 and math.isfinite(m["logloss"])
    assert m["comm_bytes_per_step"] > 0 and 0.0 <= m["hit_rate"] <= 1.0
    assert m["dropped_samples"] == 0


def _check_fae(m: dict, steps: int) -> None:
    _check_common(m, steps)
    plan, module = m["plan_rows_by_kind"], m["module_rows_by_kind"]
    pol = m["policy"]
    assert pol["name"] == "fae" and pol["replicated_rows"] > 0
    assert 0 < pol["hot_batches"] < steps  # hot batches (replicas) and cold ones (home) both ran
    # what the data plane executed is what the scheduler planned (R = 2: 2 rows per all-reduced row = one
    # row per rank)
    for k in ("hit", "shared_value", "shared_grad", "allreduce"):
        assert module[k] == plan[k], (k, module, plan)
    assert plan["allreduce"] > 0 and plan["shared_value"] > 0
    assert m["stale_reads"] == 0 and 0.0 < m["fae_hot_sample_share"] < 1.0


def _check_het(m: dict, steps: int, staleness: int) -> None:
    _check_common(m, steps)
    plan, module = m["plan_rows_by_kind"], m["module_rows_by_kind"]
    assert m["policy"]["name"] == "het" and m["policy"]["staleness"] == staleness
    assert plan["miss_pull"] > 0 and plan["hit"] > 0 and plan["update_push"] > 0
    # the data plane's caches did what HET's model planned: same hits, pulls and pushes
    for k in ("hit", "miss_pull", "update_pull", "update_push", "evict_push"):
        assert module[k] == plan[k], (k, module, plan)
    assert module["shared_value"] == 0  # every read went through the caches
    assert (m["stale_reads"] > 0) == (staleness > 0)


MODELS = ("wdl", "ncf", "deepfm", "dcn")
SETTINGS = {
    "fae": ["scheduler=fae", "scheduler.window=4", "scheduler.profile_fraction=0.5"],
    "het": ["scheduler=het"],
    "het_s2": ["scheduler=het", "scheduler.staleness=2"],
}


def _check(name: str, m: dict, steps: int) -> None:
    if name == "fae":
        _check_fae(m, steps)
    else:
        _check_het(m, steps, 2 if name == "het_s2" else 0)


def _every_model(tmp_path: Path, schedulers: tuple[str, ...], steps: int) -> dict[str, dict]:
    """Every model under each scheduler: all runs in one pair of gloo ranks (tests/helpers/app_ranks.py)."""
    runs = {
        f"{s}-{m}": [*SETTINGS[s], f"model={m}", f"trainer.steps={steps}", *COMMON] for s in schedulers for m in MODELS
    }
    run_ranks("tests.helpers.app_ranks:train_configs", tmp_path, world_size=2, timeout=900, runs=runs)
    out = {}
    for name in runs:
        path = tmp_path / name / "metrics.json"
        assert path.exists(), f"run {name} wrote no metrics.json (see {tmp_path}/rank*.log)"
        out[name] = json.loads(path.read_text())
    return out


def test_fae_and_het_run_every_model(tmp_path: Path) -> None:
    """`scheduler=fae` and `scheduler=het` (staleness 2) train all four models on 2 ranks and report Herald's
    metrics; the data plane executed what the scheduler planned."""
    steps = 12
    got = _every_model(tmp_path, ("fae", "het_s2"), steps)
    for name, m in got.items():
        sched, model = name.split("-")
        assert m["config"]["model"]["name"] == model
        _check(sched, m, steps)
    # NCF (two tables: many samples are all-hot) switches between hot and cold batches: a cold -> hot switch copied
    # home rows to the replicas
    assert got["fae-ncf"]["plan_rows_by_kind"]["replica_sync"] > 0
    assert got["het_s2-wdl"]["plan_rows_by_kind"]["evict_push"] > 0  # copies with pending updates were evicted


def test_het_staleness_runs_through_train_py(tmp_path: Path) -> None:
    """The command line path (torchrun train.py) of a baseline, as a user runs it."""
    m = _run(tmp_path, ["scheduler=het", "scheduler.staleness=2", "model=wdl", "trainer.steps=8"])
    _check_het(m, 8, 2)


@pytest.mark.slow  # ~55 s on 2 cores: nine 2-rank runs (herald's own resume stays in the default suite)
def test_exact_baselines_resume_to_the_same_model(tmp_path: Path) -> None:
    """Nothing lost on interruption under the baselines: p2res (replicas), HET-BSP (caches) and fae (reordered
    stream, replicas) stopped after a DCP checkpoint at step 10 and resumed end at the same tables, optimizer state
    and dense parameters as the same run done in one go (the replicas and caches are rebuilt from the home rows)."""
    from tests.scenarios.test_app_exactness import _max_diff

    base = [
        "model=wdl",
        "trainer.checkpoint_interval=10",
        "trainer.save_final=true",
        "trainer.embedding_eps=1e-3",
        *COMMON,
    ]
    # the "interrupted" run is one configured for 10 steps, and the profiled prefix is a share of the configured
    # steps: the default 5 % profiles ceil(0.5) = ceil(1.0) = 1 batch in both, as a real interruption would
    settings = {"p2res": ["scheduler=p2res"], "het": SETTINGS["het"], "fae": ["scheduler=fae", "scheduler.window=4"]}
    runs = {}
    for s in ("p2res", "het", "fae"):
        args = [*settings[s], *base]
        runs[f"{s}-whole"] = [*args, "trainer.steps=20"]
        runs[f"{s}-split"] = [*args, "trainer.steps=10"]  # "interrupted" after its checkpoint at step 10
        runs[f"{s}-resumed"] = [*args, "trainer.steps=20", "trainer.resume=true", f"run_dir={tmp_path / f'{s}-split'}"]
    run_ranks("tests.helpers.app_ranks:train_configs", tmp_path, world_size=2, timeout=900, runs=runs)
    for s in ("p2res", "het", "fae"):
        m = json.loads((tmp_path / f"{s}-split" / "metrics.json").read_text())
        assert m["resumed_from_step"] == 10 and m["steps"] == 20, s
        kinds = json.loads((tmp_path / f"{s}-whole" / "metrics.json").read_text())["plan_rows_by_kind"]
        assert kinds["miss_pull" if s == "het" else "allreduce"] > 0, (s, kinds)  # caches / replicas were used
        a = torch.load(tmp_path / f"{s}-whole" / "final_state.pt")
        b = torch.load(tmp_path / f"{s}-split" / "final_state.pt")
        for part in ("tables", "optimizer_state", "dense"):
            assert a[part] and _max_diff(a[part], b[part]) <= 1e-5, (s, part, _max_diff(a[part], b[part]))


@pytest.mark.slow
def test_het_bsp_runs_every_model(tmp_path: Path) -> None:
    steps = 12
    for name, m in _every_model(tmp_path, ("het",), steps).items():
        _check("het", m, steps)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, lr", [("rowwise_adagrad", 0.05), ("sgd", 0.5)])
def test_het_staleness_zero_trains_stock_model(tmp_path: Path, optimizer: str, lr: float) -> None:
    """HET with staleness 0 (HET-BSP) through real caches is exact BSP: the same tables, optimizer state and dense
    parameters as stock TorchRec ROW_WISE (eps 1e-2 for Adagrad, as in test_app_exactness.py, whose docstring says
    why: with 1e-3 one sample on a ReLU kink within float32 noise leaves 1.4e-4 in its rows after 30 steps, here
    too)."""
    eps = ["trainer.embedding_eps=1e-2"] if optimizer == "rowwise_adagrad" else []
    states = {}
    for name, args in (("het", ["scheduler=het"]), ("torchrec", ["scheduler=torchrec", "sharding.types=[row_wise]"])):
        m = _run(
            tmp_path / name,
            [
                *args,
                *eps,
                "trainer.steps=30",
                f"trainer.embedding_optimizer={optimizer}",
                f"trainer.embedding_lr={lr}",
                "trainer.dense_optimizer=sgd",
                "trainer.dense_lr=0.05",
                "data.locality=0.7",
                "trainer.save_final=true",
            ],
        )
        states[name] = torch.load(tmp_path / name / "final_state.pt")
    assert m["steps"] == 30
    for part in ("tables", "optimizer_state", "dense"):
        a, b = states["het"][part], states["torchrec"][part]
        assert set(a) == set(b) and (a or part == "optimizer_state")
        assert max((float((a[k].double() - b[k].double()).abs().max()) for k in a), default=0.0) <= 1e-5, part


def test_fae_reorder_moves_hot_samples_first_within_a_window() -> None:
    """FAE's stream step on hand-made batches: same samples and batch sizes, hot samples (stream order) first."""
    import numpy as np

    from herald_torchrec.app.baselines import FaeReorder
    from herald_torchrec.data.samples import Samples

    def batch(ids: list[int]) -> Samples:
        n = len(ids)
        return Samples(
            np.zeros((n, 1), np.float32), np.array(ids, dtype=np.int64)[:, None], np.arange(n, dtype=np.float32)
        )

    stream = [batch([9, 1, 8, 2]), batch([3, 7, 6, 4]), batch([0, 9, 9, 9]), batch([5, 5])]  # last: short
    fae = FaeReorder(2, lambda s: s.ids[:, 0] < 5)
    out = [b.ids[:, 0].tolist() for b in fae(iter(stream))]
    assert out == [[1, 2, 3, 4], [9, 8, 7, 6], [0, 9, 9, 9], [5, 5]]  # window 2: batches 0+1, then 2 (+ short 3)
    assert fae.hot_samples == 4 and fae.samples == 8  # the window of batch 2 was left as it is (a short batch in it)
    with pytest.raises(ValueError, match="window"):
        FaeReorder(0, lambda s: s.ids[:, 0] < 5)
