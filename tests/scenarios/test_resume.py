"""Nothing lost on interruption: a run stopped after a checkpoint and resumed ends at the same model — every table,
optimizer state (fused and dense Adam) and dense parameter — as the same run done in one go. Herald with one table
left to TorchRec covers both ways tables are loaded back (owners' rows, TorchRec shards)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.app_runs import run_app, run_app_many
from tests.helpers.ranks import run_ranks
from tests.scenarios.test_app_exactness import _max_diff

COMMON = [
    "scheduler=herald",
    "scheduler.unscheduled=[c3]",
    "trainer.eval_interval=0",
    "data.val_batches=2",
    "trainer.embedding_eps=1e-3",
    "trainer.save_final=true",
    "trainer.checkpoint_interval=10",
]


def _read_checkpoint(ckpt: Path, tmp: Path) -> dict:
    """A DCP checkpoint directory as full tensors (one process), meta decoded."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt.parent.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(out, weights_only=False)
    state["meta"] = json.loads(state["meta"])
    return state


def test_resumed_run_equals_uninterrupted_run(tmp_path: Path) -> None:
    """The run in one go and the run stopped after step 10 share one pair of gloo ranks (tests/helpers/app_ranks.py);
    the resume is a fresh `torchrun train.py` launch, as after a real interruption."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    runs = {
        "whole": [*COMMON, "trainer.steps=20", f"run_dir={whole}"],
        "split": [*COMMON, "trainer.steps=10", f"run_dir={split}"],
    }  # "interrupted" after step 10
    run_ranks("tests.helpers.app_ranks:train_configs", tmp_path, world_size=2, timeout=900, runs=runs)
    assert (whole / "final_state.pt").exists(), f"see {tmp_path}/rank*.log"
    assert (split / "checkpoint" / ".metadata").exists(), f"see {tmp_path}/rank*.log"
    assert not (split / "checkpoint.tmp").exists() and not (split / "checkpoint.old").exists()
    at10 = _read_checkpoint(split / "checkpoint", tmp_path)
    assert at10["meta"]["step"] == 10 and at10["meta"]["identity"]["world_size"] == 2
    tables = {k for k in at10["model"] if ".embedding_bags." in k}  # TorchRec's keys, Herald and stock tables alike
    assert len(tables) >= 2 and all(k.endswith(".weight") for k in tables), sorted(at10["model"])
    assert at10["optim"]["fused"]["state"] and at10["optim"]["dense"]["state"]
    p = run_app([*COMMON, "trainer.steps=20", "trainer.resume=true", f"run_dir={split}"], nproc=2)
    assert "resumed from" in p.stdout and (split / "final_state.pt").exists(), p.stderr[-3000:]
    a, b = torch.load(whole / "final_state.pt"), torch.load(split / "final_state.pt")
    for part in ("tables", "optimizer_state", "dense"):
        assert _max_diff(a[part], b[part]) <= 1e-5, part
    first, second = _read_checkpoint(whole / "checkpoint", tmp_path), _read_checkpoint(split / "checkpoint", tmp_path)
    assert first["meta"]["step"] == second["meta"]["step"] == 20  # step 20's checkpoints of both runs
    assert _max_diff({k: first["model"][k] for k in tables}, {k: second["model"][k] for k in tables}) <= 1e-5


FAE = [o for o in COMMON if not o.startswith("scheduler")] + ["scheduler=fae", "scheduler.window=2"]


def test_resume_refuses_a_different_run(tmp_path: Path) -> None:
    old = tmp_path / "old"  # a run_dir with only the unsharded checkpoint of earlier versions: refused, not ignored
    old.mkdir()
    torch.save({"step": 10}, old / "checkpoint.pt")
    run = tmp_path / "run"
    first, other_batch, other_optim, from_old = run_app_many(
        [  # in order, in one process, each through train.py's CLI path
            [*COMMON, "trainer.steps=10", f"run_dir={run}"],
            [*FAE, "trainer.steps=20", "trainer.resume=true", "trainer.batch_size=128", f"run_dir={run}"],
            [*COMMON, "trainer.steps=20", "trainer.resume=true", "trainer.dense_optimizer=sgd", f"run_dir={run}"],
            [*COMMON, "trainer.steps=20", "trainer.resume=true", f"run_dir={old}"],
        ]
    )
    assert first.returncode == 0 and (run / "checkpoint" / ".metadata").exists(), first.stderr[-3000:]
    p = other_batch  # fae counts its place in whole reordered global batches: only the same global batch continues
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "scheduler fae reorders" in p.stderr and "this run makes 128" in p.stderr, p.stderr
    p = other_optim
    assert p.returncode == 2 and "is from a different run" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "trainer.dense_optimizer" in p.stderr
    p = from_old
    assert p.returncode == 2 and "old-format checkpoint" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


# well-conditioned (Adagrad eps 1e-2, dense SGD); a global batch's update does not depend on how it is split between
# ranks: DDP averages the dense gradients, TorchRec's gradient division scales the embedding gradients alike
RESHARD = [
    "scheduler=herald",
    "trainer.eval_interval=0",
    "data.val_batches=2",
    "trainer.embedding_eps=1e-2",
    "trainer.dense_optimizer=sgd",
    "trainer.dense_lr=0.05",
    "trainer.save_final=true",
    "trainer.checkpoint_interval=10",
]
TWO_RANKS = ["trainer.batch_size=128"]
ONE_RANK = ["trainer.batch_size=256"]  # the same global batch


@pytest.mark.slow
def test_resume_at_another_world_size(tmp_path: Path) -> None:
    """2 ranks -> 1 and 1 -> 2: a checkpoint of step 10 resumed at the other rank count (the same global batch of 256)
    ends at step 20 at the model of the uninterrupted run (tables, their Adagrad state, dense): DCP reshards the
    tables and their optimizer state (ROW_WISE layout) and the run skips exactly the samples already trained."""
    d = {name: tmp_path / name for name in ("whole2", "split2", "whole1", "split1")}
    runs = {
        "whole2": [*RESHARD, *TWO_RANKS, "trainer.steps=20", f"run_dir={d['whole2']}"],
        "split2": [*RESHARD, *TWO_RANKS, "trainer.steps=10", f"run_dir={d['split2']}"],
    }
    run_ranks("tests.helpers.app_ranks:train_configs", tmp_path, world_size=2, timeout=900, runs=runs)
    resumed = ["trainer.steps=20", "trainer.resume=true"]
    whole1, split1, to_one = run_app_many(
        [
            [*RESHARD, *ONE_RANK, "trainer.steps=20", f"run_dir={d['whole1']}"],
            [*RESHARD, *ONE_RANK, "trainer.steps=10", f"run_dir={d['split1']}"],
            [*RESHARD, *ONE_RANK, *resumed, f"run_dir={d['split2']}"],  # 2 ranks -> 1
        ]
    )
    assert whole1.returncode == 0 and split1.returncode == 0, (whole1.stderr[-2000:], split1.stderr[-2000:])
    assert to_one.returncode == 0 and "resumed from" in to_one.stdout, to_one.stderr[-3000:]
    assert "checkpoint of 2 rank(s) x batch 128, now 1 x 256" in to_one.stdout, to_one.stdout[-2000:]
    to_two = run_app([*RESHARD, *TWO_RANKS, *resumed, f"run_dir={d['split1']}"], nproc=2)  # 1 rank -> 2
    assert "checkpoint of 1 rank(s) x batch 256, now 2 x 128" in to_two.stdout, to_two.stderr[-3000:]
    for whole, split in (("whole2", "split2"), ("whole1", "split1")):
        a, b = torch.load(d[whole] / "final_state.pt"), torch.load(d[split] / "final_state.pt")
        assert json.loads((d[split] / "metrics.json").read_text())["resumed_from_step"] == 10
        for part in ("tables", "optimizer_state", "dense"):  # the rows' Adagrad state resharded too
            assert a[part] and _max_diff(a[part], b[part]) <= 1e-5, (whole, part, _max_diff(a[part], b[part]))
    # and the two uninterrupted runs agree: the same samples, the same updates, whatever the number of ranks
    a, b = torch.load(d["whole2"] / "final_state.pt"), torch.load(d["whole1"] / "final_state.pt")
    assert all(_max_diff(a[part], b[part]) <= 1e-5 for part in ("tables", "optimizer_state", "dense"))


def _meta_position(run_dir: Path, tmp: Path) -> dict:
    return _read_checkpoint(run_dir / "checkpoint", tmp)["meta"]["data_position"]


def test_resume_at_another_global_batch(tmp_path: Path) -> None:
    """2 ranks x 128 -> 1 x 96 and 1 x 192 -> 2 x 80: a checkpoint of step 10 resumed at another global batch trains
    exactly the training samples after the checkpoint's (asserted on the recorded sample counts) and ends at step 20
    at the model of one uninterrupted run over the same sample sequence — 10 global batches of the old size, then 10
    of the new — on one rank with stock TorchRec (tests/helpers/app_ranks.py train_schedules): every table, its
    Adagrad state and every dense parameter within 1e-5."""
    d = {n: tmp_path / n for n in ("split2", "split1", "ref2", "ref1")}
    split1 = run_app_many([[*RESHARD, "trainer.batch_size=192", "trainer.steps=10", f"run_dir={d['split1']}"]])[0]
    assert split1.returncode == 0, split1.stderr[-3000:]
    at1 = _meta_position(d["split1"], tmp_path)  # the checkpoint of step 10, before the resume replaces it
    resumed = ["trainer.steps=20", "trainer.resume=true"]
    runs2 = {
        "split2": [*RESHARD, "trainer.batch_size=128", "trainer.steps=10", f"run_dir={d['split2']}"],
        "to_two": [*RESHARD, "trainer.batch_size=80", *resumed, f"run_dir={d['split1']}"],  # 1 x 192 -> 2 x 80
    }
    run_ranks("tests.helpers.app_ranks:train_configs", tmp_path / "two", world_size=2, timeout=900, runs=runs2)
    at2 = _meta_position(d["split2"], tmp_path)
    reference = [
        "scheduler=torchrec",
        "sharding.types=[table_wise]",
        "trainer.steps=20",
        "trainer.checkpoint_interval=0",
    ]
    runs1 = {
        "to_one": [*RESHARD, "trainer.batch_size=96", *resumed, f"run_dir={d['split2']}"],  # 2 x 128 -> 1 x 96
        "ref2": [*RESHARD, *reference, "trainer.batch_size=256", f"run_dir={d['ref2']}"],
        "ref1": [*RESHARD, *reference, "trainer.batch_size=192", f"run_dir={d['ref1']}"],
    }
    schedules = {"ref2": [256] * 10 + [96] * 10, "ref1": [192] * 10 + [160] * 10}
    run_ranks(
        "tests.helpers.app_ranks:train_schedules",
        tmp_path / "one",
        world_size=1,
        timeout=900,
        runs=runs1,
        schedules=schedules,
    )
    # the checkpoints of step 10 stood after 10 global batches of the old size
    assert at2 == {"epoch": 0, "sample": 2560, "samples_trained": 2560, "reordered": False}
    assert at1 == {"epoch": 0, "sample": 1920, "samples_trained": 1920, "reordered": False}
    for name, old, new in (("split2", 2560, 96), ("split1", 1920, 160)):
        metrics = json.loads((d[name] / "metrics.json").read_text())
        assert metrics["resumed_from_step"] == 10 and metrics["steps"] == 20, name
        assert metrics["global_batch"] == new, name
        # the resumed run trained samples old .. old + 10 x new, no more, no fewer: the next ones after the checkpoint
        assert metrics["data_position"] == {
            "epoch": 0,
            "sample": old + 10 * new,
            "samples_trained": old + 10 * new,
            "reordered": False,
        }, name
        assert _meta_position(d[name], tmp_path)["samples_trained"] == old + 10 * new, name
    for split, ref in (("split2", "ref2"), ("split1", "ref1")):
        a, b = torch.load(d[split] / "final_state.pt"), torch.load(d[ref] / "final_state.pt")
        for part in ("tables", "optimizer_state", "dense"):
            assert a[part] and _max_diff(a[part], b[part]) <= 1e-5, (split, part, _max_diff(a[part], b[part]))
    log2 = (tmp_path / "two" / "rank0.log").read_text()
    assert "training sample 1920 of epoch 0" in log2 and "global batch 192 -> 160" in log2, log2[-3000:]
    log1 = (tmp_path / "one" / "rank0.log").read_text()
    assert "training sample 2560 of epoch 0" in log1 and "global batch 256 -> 96" in log1, log1[-3000:]
