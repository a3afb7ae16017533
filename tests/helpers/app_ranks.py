"""Several `train.py` runs in one set of gloo ranks (tests.helpers.ranks.run_ranks): the app's configurations are
composed with Hydra's compose API from conf/ and trained one after another in the same process group, so a test of
many models pays the ranks' start-up (imports, process group) once instead of once per run."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.ranks import REPO_ROOT, rank_result


def train_configs(rank: int, world_size: int, out_dir: str, runs: dict[str, list[str]]) -> None:
    """Train every run (name -> Hydra overrides) in order; run `name` writes its metrics.json to out_dir/name unless
    its overrides name a run_dir (e.g. a resumed run in an earlier run's directory)."""
    from hydra import compose, initialize_config_dir

    from herald_torchrec.app.runtime import init_distributed
    from herald_torchrec.app.trainer import train

    ctx = init_distributed("gloo")  # the harness's group
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        for name, overrides in runs.items():
            own_dir = [] if any(o.startswith("run_dir=") for o in overrides) else [f"run_dir={Path(out_dir) / name}"]
            train(compose("config", overrides=[*overrides, *own_dir]), ctx)
    torch.save({"runs": list(runs)}, rank_result(out_dir, rank))


def train_configs_on_machines(
    rank: int, world_size: int, out_dir: str, runs: dict[str, list[str]], ranks_per_machine: int
) -> None:
    """`train_configs` with the ranks as machines of `ranks_per_machine` the way torchrun tells TorchRec
    (LOCAL_WORLD_SIZE, LOCAL_RANK): its TABLE_ROW_WISE groups a table's shards by it."""
    import os

    os.environ.update(LOCAL_WORLD_SIZE=str(ranks_per_machine), LOCAL_RANK=str(rank % ranks_per_machine))
    train_configs(rank, world_size, out_dir, runs)


def train_schedules(rank: int, world_size: int, out_dir: str, runs: dict[str, list], schedules: dict) -> None:
    """`train_configs`, where a run named in `schedules` trains its own sequence of global batch sizes instead of
    the app's fixed one: the synthetic log's training samples in order, cut into global batches of the listed sizes
    (e.g. [256] * 10 + [96] * 10), all on this one rank. The uninterrupted reference of a run resumed at another global
    batch: the same samples, the same steps, in one go."""
    import herald_torchrec.app.trainer as trainer
    from herald_torchrec.app.trainer import DataPosition, TrainStream

    class ScheduledStream(TrainStream):
        sizes: list[int] = []

        def __iter__(self):
            assert self.ctx.world_size == 1, "a schedule is trained on one rank"
            first = 0
            for g in self.sizes:
                yield self.source.gen.train_samples(first, g)
                first += g

        def position_after(self, n: int) -> DataPosition:
            done = sum(self.sizes[:n])
            return DataPosition(0, done, done)

    from hydra import compose, initialize_config_dir

    from herald_torchrec.app.runtime import init_distributed

    ctx = init_distributed("gloo")
    plain = trainer.TrainStream
    try:
        with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
            for name, overrides in runs.items():
                ScheduledStream.sizes = list(schedules.get(name, []))
                trainer.TrainStream = ScheduledStream if name in schedules else plain
                own_dir = (
                    [] if any(o.startswith("run_dir=") for o in overrides) else [f"run_dir={Path(out_dir) / name}"]
                )
                trainer.train(compose("config", overrides=[*overrides, *own_dir]), ctx)
    finally:
        trainer.TrainStream = plain
    torch.save({"runs": list(runs)}, rank_result(out_dir, rank))
