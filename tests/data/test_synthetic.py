"""The synthetic click log: deterministic, int64, skewed, temporally local, and learnable labels."""

from __future__ import annotations

import numpy as np
import pytest

from herald_torchrec.data.synthetic import CRITEO_KAGGLE_ROWS, SyntheticCTR, SyntheticSpec


def test_deterministic_and_random_access() -> None:
    a = SyntheticCTR(SyntheticSpec(seed=3)).global_batch(7, 512)
    b = SyntheticCTR(SyntheticSpec(seed=3)).global_batch(7, 512)
    c = SyntheticCTR(SyntheticSpec(seed=4)).global_batch(7, 512)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.labels, b.labels) and np.array_equal(a.dense, b.dense)
    assert not np.array_equal(a.ids, c.ids)
    assert a.ids.dtype == np.int64 and a.ids.shape == (512, 26)


def test_a_rank_makes_only_its_slice() -> None:
    """A slice equals the global batch cut, costs only its own samples, and a sample is the same at any batch size."""
    g = SyntheticCTR(SyntheticSpec(seed=2))
    whole = g.global_batch(7, 512)
    for lo, hi in [(0, 256), (256, 512), (100, 101), (3, 3)]:
        part = g.batch_slice(7, 512, lo, hi)
        assert len(part) == hi - lo
        assert np.array_equal(part.ids, whole.ids[lo:hi]) and np.array_equal(part.dense, whole.dense[lo:hi])
        assert np.array_equal(part.labels, whole.labels[lo:hi])
    halves = [g.global_batch(14, 256), g.global_batch(15, 256)]  # the same log positions, batched differently
    assert np.array_equal(np.concatenate([h.ids for h in halves]), whole.ids)
    with pytest.raises(ValueError, match="lo <= hi <= size"):
        g.batch_slice(7, 512, 300, 600)


def test_source_slices_match_the_global_batches() -> None:
    from herald_torchrec.data.source import DataSource, SyntheticSource

    src = SyntheticSource(SyntheticSpec(seed=1, val_block=64), epoch_batches=3, val_batches=2)
    for mine, full in [
        (src.train_slices(64, 32, 64), src.train_batches(64)),
        (src.val_slices(64, 32, 64), src.val_batches(64)),
    ]:
        got, want = list(mine), [b.take(slice(32, 64)) for b in full]
        assert len(got) == len(want) > 0
        assert all(np.array_equal(a.ids, b.ids) and np.array_equal(a.labels, b.labels) for a, b in zip(got, want))
    # the default for other sources: cut the global batches
    default = list(DataSource.train_slices(src, 64, 0, 16))
    assert [len(b) for b in default] == [16, 16, 16]
    assert np.array_equal(default[1].ids, list(src.train_batches(64))[1].ids[:16])


def test_table_sizes_follow_criteo() -> None:
    g = SyntheticCTR(SyntheticSpec(scale=0.01))
    assert g.table_rows[2] == int(np.ceil(CRITEO_KAGGLE_ROWS[2] * 0.01))
    assert g.table_rows[8] == 3  # tiny tables keep their size
    ids = g.global_batch(0, 4096).ids
    assert (ids >= 0).all() and (ids < np.array(g.table_rows)).all()


def test_skew_head_carries_most_accesses() -> None:
    g = SyntheticCTR(SyntheticSpec(locality=0.0))
    ids = np.concatenate([g.global_batch(i, 4096).ids[:, 2] for i in range(5)])
    _, counts = np.unique(ids, return_counts=True)
    counts = np.sort(counts)[::-1]
    top = counts[: max(1, g.table_rows[2] // 100)].sum() / counts.sum()  # hottest 1% of rows
    assert top > 0.5, f"hottest 1% of rows should take most accesses, got {top:.2f}"


def test_temporal_locality_knob() -> None:
    def reuse(locality: float) -> tuple[float, float]:
        g = SyntheticCTR(SyntheticSpec(locality=locality))
        now, nxt, far = (set(g.global_batch(i, 2048).ids[:, 2]) for i in (100, 101, 900))
        return len(now & nxt) / len(now), len(now & far) / len(now)

    near_loc, far_loc = reuse(0.5)
    near_iid, far_iid = reuse(0.0)
    assert near_loc > far_loc + 0.1, "with locality, the next batch shares more ids than a distant one"
    assert abs(near_iid - far_iid) < 0.05, "i.i.d. ids: reuse does not depend on distance"


def test_labels_carry_signal() -> None:
    g = SyntheticCTR(SyntheticSpec())
    s = g.global_batch(0, 20000)
    assert 0.2 < s.labels.mean() < 0.6
    # the ids alone (their hidden per-id effects) rank positives above negatives well beyond chance
    score = sum(g._table_w[t] * g._id_effect(t, s.ids[:, t]) for t in range(g.num_tables))
    pos, neg = score[s.labels == 1][:3000, None], score[s.labels == 0][None, :3000]
    auc = (pos > neg).mean() + 0.5 * (pos == neg).mean()
    assert auc > 0.62, auc


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        ({"zipf": 1.0}, "zipf"),
        ({"locality": 1.5}, "locality"),
        ({"scale": 0}, "scale"),
        ({"tail": 0.6, "locality": 0.6}, "tail \\+ locality"),
        ({"table_rows": (10, 0)}, "table_rows"),
    ],
)
def test_bad_spec(kwargs: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        SyntheticSpec(**kwargs)


def test_bad_batch_request() -> None:
    with pytest.raises(ValueError, match="index"):
        SyntheticCTR().global_batch(-1, 10)


def test_trainer_draws_only_this_ranks_slice() -> None:
    """trainer.local_samples asks the source for the rank's slice (the synthetic log then makes B samples, not R x B);
    a reorder (fae) still gets whole global batches."""
    import torch

    from herald_torchrec.app.runtime import DistContext
    from herald_torchrec.app.trainer import local_samples
    from herald_torchrec.data.source import SyntheticSource

    src = SyntheticSource(SyntheticSpec(seed=5, val_block=16), epoch_batches=4, val_batches=2)
    made = []
    samples_at = src.gen.samples_at
    src.gen.samples_at = lambda pos: made.append(len(pos)) or samples_at(pos)  # type: ignore[method-assign]
    ctx = DistContext(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"), backend="gloo")
    got = list(local_samples(src, 8, ctx, train=True, epochs=1))
    assert made == [8] * 4 and [len(b) for b in got] == [8] * 4
    assert np.array_equal(got[2].ids, src.gen.global_batch(2, 16).ids[8:])  # batch 2 of the log: not a val batch
    made.clear()
    reordered = list(local_samples(src, 8, ctx, train=True, epochs=1, reorder=lambda it: reversed(list(it))))
    assert made == [16] * 4 and np.array_equal(reordered[0].ids, got[-1].ids)


def _old_train_index(k: int, val_every: int = 10) -> int:
    """The k-th training global batch of earlier versions, which held out every val_every-th *global batch*."""
    return k // (val_every - 1) * val_every + k % (val_every - 1)


def test_default_global_batch_gives_the_earlier_batches() -> None:
    """At the default global batch (2 ranks x 256 = val_block) the blocks are the global batches: every training and
    held-out batch is the one of the old per-batch split, and an epoch is still 1000 global batches."""
    from herald_torchrec.data.source import SyntheticSource

    src = SyntheticSource(SyntheticSpec(), epoch_batches=1000, val_batches=20)
    gen = src.gen
    for k, got in zip(range(23), src.train_batches(512)):  # past two held-out batches (indices 9 and 19)
        want = gen.global_batch(_old_train_index(k), 512)
        assert np.array_equal(got.ids, want.ids) and np.array_equal(got.dense, want.dense), k
        assert np.array_equal(got.labels, want.labels), k
    vals = list(src.val_batches(512))
    assert len(vals) == 20
    for k in (0, 1, 19):
        assert np.array_equal(vals[k].ids, gen.global_batch(k * 10 + 9, 512).ids), k
    assert src.epoch_samples == 1000 * 512  # 1000 global batches of 512 per epoch, as before
    last = list(SyntheticSource(SyntheticSpec(), epoch_batches=12).train_batches(512))
    assert len(last) == 12 and np.array_equal(last[-1].ids, gen.global_batch(_old_train_index(11), 512).ids)


@pytest.mark.parametrize("g", [64, 100, 512, 768])
def test_split_does_not_depend_on_the_global_batch(g: int) -> None:
    """Whatever the global batch, its training batches are consecutive cuts of one training stream (and the held-out
    batches of one held-out stream): the split is fixed in samples, every val_every-th block of val_block."""
    from herald_torchrec.data.source import SyntheticSource

    spec = SyntheticSpec(seed=7, table_rows=(50, 400, 3000), val_every=4, val_block=96)
    src = SyntheticSource(spec, epoch_batches=20, val_batches=10)  # 1920 training, 960 held-out samples
    gen = src.gen
    train, val = list(src.train_batches(g)), list(src.val_batches(g))
    assert len(train) == 1920 // g and len(val) == 960 // g  # each epoch's incomplete tail dropped
    got = np.concatenate([b.ids for b in train])
    assert np.array_equal(got, gen.train_samples(0, len(got)).ids)
    got_val = np.concatenate([b.ids for b in val])
    assert np.array_equal(got_val, gen.val_samples(0, len(got_val)).ids)
    # the held-out blocks are blocks 3, 7, 11, ... of 96 log positions; training takes the rest, in log order
    pos = gen.train_positions(0, 1920)
    assert pos[287] == 287 and pos[288] == 384 and len(np.unique(pos // 96 % 4)) == 3 and (pos // 96 % 4 != 3).all()
    assert (gen.val_positions(0, 960) // 96 % 4 == 3).all() and gen.val_positions(96, 1)[0] == 7 * 96
    # a cut from training sample `start` on: the stream after exactly `start` samples
    start = 250
    rest = np.concatenate([b.ids for b in src.train_batches(g, start)])
    assert len(rest) == (1920 - start) // g * g and np.array_equal(rest, gen.train_samples(start, len(rest)).ids)
    mine = list(src.train_slices(g, g // 2, g, start))  # a rank's slice of the same cut
    assert np.array_equal(mine[0].ids, gen.train_samples(start + g // 2, g - g // 2).ids)


def test_bad_val_block() -> None:
    with pytest.raises(ValueError, match="val_block"):
        SyntheticSpec(val_block=0)
