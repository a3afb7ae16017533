"""The training stream a resumed run continues: positions in samples, not steps (app/trainer.py TrainStream,
DataPosition, check_data_position). One process, no process group: each rank's slices are drawn by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from herald_torchrec.app.runtime import DistContext
from herald_torchrec.app.trainer import ConfigError, DataPosition, TrainStream, check_data_position
from herald_torchrec.data.source import SyntheticSource
from herald_torchrec.data.synthetic import SyntheticSpec

# an epoch of 5 blocks of 16 training samples = 80 samples
SPEC = SyntheticSpec(seed=3, table_rows=(40, 300), val_every=4, val_block=16)


def _ctx(rank: int, world_size: int) -> DistContext:
    return DistContext(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"), backend="gloo")


def _global_ids(src, batch: int, world_size: int, epochs: int | None, start: DataPosition, n: int | None = None):
    """The global batches the ranks of a run train (their slices side by side), and rank 0's stream."""
    streams = [TrainStream(src, batch, _ctx(r, world_size), epochs, start) for r in range(world_size)]
    parts = [list(s)[:n] if n is not None else list(s) for s in streams]
    return [np.concatenate([p[i].ids for p in parts]) for i in range(len(parts[0]))], streams[0]


def test_resumed_stream_continues_after_exactly_the_trained_samples() -> None:
    """1 rank x 24 trains 2 global batches (training samples 0..47 of epoch 0); 2 ranks x 4 continue at sample 48:
    the rest of epoch 0 (48..79), then epoch 1 from its start, and the positions count samples, not steps."""
    src = SyntheticSource(SPEC, epoch_batches=5, val_batches=2)
    gen = src.gen
    first, stream = _global_ids(src, 24, 1, epochs=2, start=DataPosition())
    assert len(first) == 6  # 3 per epoch: 72 of 80 samples, the tail of 8 dropped (a batch never spans epochs)
    at = stream.position_after(2)
    assert at == DataPosition(epoch=0, sample=48, samples_trained=48)
    rest, resumed = _global_ids(src, 4, 2, epochs=2, start=at)
    assert len(rest) == 4 + 10 and all(len(b) == 8 for b in rest)
    got = np.concatenate(rest)
    want = np.concatenate([gen.train_samples(48, 32).ids, gen.train_samples(0, 80).ids])
    assert np.array_equal(got, want)
    assert resumed.position_after(0) == at
    assert resumed.position_after(4) == DataPosition(0, 80, 80)  # epoch 0 done: the position stays in it
    assert resumed.position_after(5) == DataPosition(1, 8, 88)
    assert resumed.position_after(14) == DataPosition(1, 80, 160)


def test_an_epoch_end_position_continues_with_the_tail_a_smaller_batch_fits() -> None:
    """After an epoch's last global batch of 24 the position is sample 72 of that epoch: a run resumed at 8 trains the
    8 samples the batch of 24 could not (never trained before: nothing is skipped twice nor trained twice)."""
    src = SyntheticSource(SPEC, epoch_batches=5, val_batches=2)
    _, stream = _global_ids(src, 24, 1, epochs=2, start=DataPosition())
    at = stream.position_after(3)
    assert at == DataPosition(0, 72, 72)
    rest, _ = _global_ids(src, 8, 1, epochs=2, start=at)
    assert np.array_equal(rest[0], src.gen.train_samples(72, 8).ids) and len(rest) == 1 + 10
    same, _ = _global_ids(src, 24, 1, epochs=2, start=at)  # the same batch: straight to the next epoch
    assert len(same) == 3 and np.array_equal(same[0], src.gen.train_samples(0, 24).ids)
    with pytest.raises(ConfigError, match="no complete global batch of 96"):  # a whole epoch without a batch
        _global_ids(src, 96, 1, epochs=2, start=at)


def test_a_reordered_stream_counts_whole_reordered_batches() -> None:
    """Under a reorder (fae) the position is a count of the epoch's reordered global batches: resumed at the same
    global batch, the stream skips that many reordered batches."""
    src = SyntheticSource(SPEC, epoch_batches=5, val_batches=2)
    rev = lambda it: reversed(list(it))  # noqa: E731 - a stand-in for fae's reorder
    whole = list(TrainStream(src, 24, _ctx(0, 1), 1, reorder=rev))
    stream = TrainStream(src, 24, _ctx(0, 1), 1, reorder=rev)
    list(stream)
    at = stream.position_after(1)
    assert at == DataPosition(0, 24, 24, reordered=True)
    rest = list(TrainStream(src, 24, _ctx(0, 1), 1, at, reorder=rev))
    assert len(rest) == 2 and all(np.array_equal(a.ids, b.ids) for a, b in zip(rest, whole[1:]))


def _identity(world_size: int, batch: int, data: dict | None = None) -> dict:
    return {
        "world_size": world_size,
        "trainer.batch_size": batch,
        "global_batch": world_size * batch,
        "data": data or {"name": "synthetic", "val_block": 512},
    }


def test_which_resumes_are_refused() -> None:
    path = Path("run/checkpoint")
    mid = DataPosition(0, 2560, 2560)
    check_data_position(path, _identity(2, 128), _identity(1, 100), mid, reorders=False)  # another global batch: fine
    with pytest.raises(ConfigError, match="scheduler fae reorders.*use ranks x trainer.batch_size = 256"):
        check_data_position(path, _identity(2, 128), _identity(1, 100), mid, reorders=True)
    reordered = DataPosition(0, 2560, 2560, reordered=True)
    with pytest.raises(ConfigError, match="were reordered"):
        check_data_position(path, _identity(2, 128), _identity(1, 100), reordered, reorders=False)
    with pytest.raises(ConfigError, match="in log order"):  # the same global batch, fae now but not then
        check_data_position(path, _identity(2, 128), _identity(1, 256), mid, reorders=True)
    check_data_position(path, _identity(2, 128), _identity(1, 256), reordered, reorders=True)
    # a checkpoint of an earlier version (no position): only its own global batch, and its block of the split
    with pytest.raises(ConfigError, match="earlier version, which records steps and not samples"):
        check_data_position(path, _identity(2, 128), _identity(1, 100), None, reorders=False)
    old = _identity(2, 128, {"name": "synthetic"})
    with pytest.raises(ConfigError, match="resume it with data.val_block=256 \\(now 512\\)"):
        check_data_position(path, old, _identity(1, 256), None, reorders=False)
    check_data_position(path, old, _identity(1, 256, {"name": "synthetic", "val_block": 256}), None, reorders=False)
    assert old["data"] == {"name": "synthetic", "val_block": 256}  # now compares equal with the run's data
    check_data_position(path, _identity(2, 256, {"name": "synthetic"}), _identity(2, 256), None, reorders=False)
