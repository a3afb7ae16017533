"""The Hydra app end to end, as a user runs it: torchrun, 2 gloo ranks, metrics.json and TensorBoard."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from herald_torchrec.app.runtime import cpu_blocks
from tests.helpers.app_runs import run_app, run_app_many


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def test_two_rank_training_learns(tmp_path: Path) -> None:
    run_dir = tmp_path / "dcn"
    p = run_app(["trainer.steps=200", "trainer.log_interval=50", f"run_dir={run_dir}"], nproc=2)
    m_path = run_dir / "metrics.json"
    assert m_path.exists(), f"no metrics.json; exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    m = _metrics(run_dir)
    assert m["steps"] == 200 and m["world_size"] == 2 and m["global_batch"] == 512
    assert m["last_loss"] < m["first_loss"] - 0.05, (m["first_loss"], m["last_loss"])
    assert m["auc"] >= 0.70, m["auc"]
    assert 0 < m["logloss"] < 0.69
    assert m["samples_per_s"] > 0
    assert list((run_dir / "tb").glob("events.out.tfevents.*")), "TensorBoard events missing"
    assert "step    200" in p.stdout and "auc" in p.stdout
    # cpu_affinity=auto (the default) binds CPU ranks where it can; where a GPU is visible, dist_backend=auto puts both
    # ranks on it, and GPU runs are not bound to cores
    if torch.cuda.is_available():
        assert "bound to cores" not in p.stdout, p.stdout[:2000]
    else:
        blocks = cpu_blocks(list(os.sched_getaffinity(0)), 2)
        assert f"rank 0 bound to cores {blocks[0]}" in p.stdout, p.stdout[:2000]


ONE_RANK_MODELS = ["wdl", "deepfm", "ncf"]
BAD_CONFIGS = [
    (["trainer.batch_size=0"], "trainer.batch_size must be an integer >= 1"),
    (["trainer.embedding_optimizer=adam"], "embedding_optimizer"),
    (["trainer.epochs=2"], "exactly one of trainer.steps and trainer.epochs"),
    (["data=criteo"], "needs a file"),
    (["data.locality=2"], "locality must be in"),
    (["scheduler.name=bogus"], "scheduler must be one of"),
    (["cpu_affinity=yes"], "cpu_affinity must be one of"),
    (["dist_timeout_s=0"], "dist_timeout_s must be a positive number of seconds"),
]


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Every one-rank CLI run of this module, in one process (helpers.app_runs.run_app_many): the models through the
    app, the bad configurations, the missing data file. Returns (root of their run_dirs, {name: finished run})."""
    root = tmp_path_factory.mktemp("one_rank")
    runs = {
        m: [f"model={m}", "trainer.steps=30", "trainer.log_interval=10", "data.val_batches=4", f"run_dir={root / m}"]
        for m in ONE_RANK_MODELS
    }
    runs.update({f"bad{i}": [*args, f"run_dir={root / f'bad{i}'}"] for i, (args, _) in enumerate(BAD_CONFIGS)})
    runs["missing"] = ["data=criteo", f"data.path={root / 'nope.tsv'}", f"run_dir={root / 'missing'}"]
    runs["eval"] = ["trainer.steps=40", "trainer.eval_interval=20", "data.val_batches=2", f"run_dir={root / 'eval'}"]
    return root, dict(zip(runs, run_app_many(list(runs.values()))))


@pytest.mark.parametrize("model", ONE_RANK_MODELS)
def test_each_model_runs_in_the_app(one_rank_runs: tuple[Path, dict], model: str) -> None:
    root, runs = one_rank_runs
    p = runs[model]
    assert p.returncode == 0, p.stderr[-3000:]
    m = _metrics(root / model)
    assert m["steps"] == 30 and m["config"]["model"]["name"] == model and 0.5 < m["auc"] <= 1.0
    assert "step     30" in p.stdout and "loss" in p.stdout  # progress lines, as the CLI prints them


def test_eval_interval_records_history(one_rank_runs: tuple[Path, dict]) -> None:
    root, runs = one_rank_runs
    assert runs["eval"].returncode == 0, runs["eval"].stderr[-3000:]
    assert [h["step"] for h in _metrics(root / "eval")["eval_history"]] == [20, 40]


@pytest.mark.parametrize("case", range(len(BAD_CONFIGS)), ids=[a[0] for a, _ in BAD_CONFIGS])
def test_bad_configuration_is_a_clear_error(one_rank_runs: tuple[Path, dict], case: int) -> None:
    p, msg = one_rank_runs[1][f"bad{case}"], BAD_CONFIGS[case][1]
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert msg in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "data, file, model",
    [
        ("criteo", "criteo_sample.tsv", "dcn"),
        ("avazu", "avazu_sample.csv", "deepfm"),
        ("movielens", "movielens_ratings_sample.csv", "ncf"),
    ],
)
def test_real_format_samples_train(tmp_path: Path, shared_data: Path, data: str, file: str, model: str) -> None:
    p = run_app(
        [
            f"data={data}",
            f"data.path={shared_data / file}",
            "data.val_fraction=0.2",
            f"model={model}",
            "trainer.batch_size=8",
            "trainer.steps=12",
            "trainer.log_interval=4",
            f"run_dir={tmp_path}",
        ],
        nproc=2,
    )
    assert (tmp_path / "metrics.json").exists(), p.stderr[-3000:]
    m = _metrics(tmp_path)
    assert m["steps"] == 12 and m["config"]["data"]["name"] == data


def test_missing_data_file_is_a_clear_error(one_rank_runs: tuple[Path, dict]) -> None:
    p = one_rank_runs[1]["missing"]
    assert p.returncode == 2 and "nope.tsv" in p.stderr and "Traceback" not in p.stderr
