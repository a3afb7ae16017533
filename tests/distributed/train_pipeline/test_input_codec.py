"""Any Pipelineable through the input stage's bookkeeping, one process: two ranks' slices of a user's own batch type
(two KJTs, one weighted, keys of both in one table space; per-sample tensors of several dtypes and shapes, a list of
them; batch-independent fields) -> each rank's assigned samples, on a rank that plans and on one that does not, as
the user's type again with every field equal to the original samples'; and each refusal, one line naming its field."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from herald_torchrec.distributed.train_pipeline.input_layout import (
    ManagedTables,
    assigned_batch,
    assigned_kjt_parts,
    gather_ids,
    host_slice,
    managed_ids,
    sample_major_ids,
    slice_layout,
)
from tests.distributed.train_pipeline.test_input_layout import two_rank_exchange

B, R = 4, 2
# managed: a, b (idlist), w (idscore); x is in both KJTs and no table reads it (carried, renamed inside)
TABLES = ManagedTables(("ta", "tb", "tw"), (10, 7, 9), (("a",), ("b",), ("w",)), (0,))


@dataclass
class Sample(Pipelineable):
    float_features: torch.Tensor
    idlist: KeyedJaggedTensor
    idscore: Optional[KeyedJaggedTensor]
    label: torch.Tensor
    extra: list  # per-sample tensors in a list
    mask: torch.Tensor  # bool, per sample
    name: str = "train"  # batch-independent: passed through
    scale: torch.Tensor = torch.tensor(2.0)  # 0-dim: batch-independent
    nothing: None = None

    def to(self, device: torch.device, non_blocking: bool = False) -> "Sample":
        return self

    def record_stream(self, stream: torch.Stream) -> None:
        pass


def kjt(keys: list[str], rng: np.random.Generator, weighted: bool, n: int = B) -> KeyedJaggedTensor:
    lengths = rng.integers(0, 3, len(keys) * n)
    values = rng.integers(0, 7, int(lengths.sum()))
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(values, dtype=torch.int32),  # int32 ids: rebuilt as int32
        lengths=torch.tensor(lengths, dtype=torch.int64),
        weights=torch.rand(int(lengths.sum()), dtype=torch.float32) if weighted else None,
    )


def make_sample(seed: int, n: int = B) -> Sample:
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    return Sample(
        float_features=torch.rand(n, 3),
        idlist=kjt(["a", "x", "b"], rng, weighted=False, n=n),
        idscore=kjt(["w", "x"], rng, weighted=True, n=n),
        label=torch.rand(n).double(),
        extra=[torch.randint(-100, 100, (n, 2, 2), dtype=torch.int16), torch.rand(n, 0)],
        mask=torch.rand(n) > 0.5,
    )


def bags(k: KeyedJaggedTensor) -> dict[str, list[list[tuple]]]:
    """Per key, per sample: its ids (with their weights where weighted)."""
    out = {}
    for key, jt in k.to_dict().items():
        vals, lens = jt.values().tolist(), jt.lengths().tolist()
        wts = jt.weights().tolist() if jt.weights_or_none() is not None else [None] * len(vals)
        cuts = np.concatenate([[0], np.cumsum(lens)]).tolist()
        out[key] = [list(zip(vals[a:b], wts[a:b])) for a, b in zip(cuts[:-1], cuts[1:])]
    return out


def expected_kjt(slices: list[Sample], field: str, mine: np.ndarray) -> dict[str, list[list[tuple]]]:
    per = [bags(getattr(s, field)) for s in slices]
    return {key: [per[g // B][key][g % B] for g in mine] for key in per[0]}


def test_any_pipelineable_round_trips_on_planning_and_receiving_ranks() -> None:
    slices = [make_sample(1), make_sample(2)]
    layout = slice_layout(slices[0], TABLES)
    assert layout.codec is not None and layout.weighted
    # managed keys keep their names; the key both KJTs hold is renamed by field
    assert layout.keys == ("a", "idlist/x", "b", "w", "idscore/x")
    assert [layout.keys[i] for i in layout.managed] == ["a", "b", "w"]
    dest = [np.array([1, 0, 1, 1]), np.array([0, 1, 1, 0])]  # rank 0 plans, rank 1 does not
    mine, planned, received = two_rank_exchange(slices, layout, dest)
    for r, out in ((0, planned), (1, received)):
        assert type(out) is Sample
        for name in ("float_features", "label", "mask"):
            want = torch.cat([getattr(s, name) for s in slices])[mine[r]]
            have = getattr(out, name)
            assert have.dtype == want.dtype and torch.equal(have, want), (r, name)
        assert isinstance(out.extra, list) and len(out.extra) == 2
        for i in range(2):
            want = torch.cat([s.extra[i] for s in slices])[mine[r]]
            assert out.extra[i].dtype == want.dtype and out.extra[i].shape == want.shape
            assert torch.equal(out.extra[i], want)
        for field in ("idlist", "idscore"):
            k = getattr(out, field)
            assert k.keys() == getattr(slices[0], field).keys()
            assert k.values().dtype == torch.int32 and k.lengths().dtype == torch.int64
            assert bags(k) == expected_kjt(slices, field, mine[r]), (r, field)
        assert out.idlist.weights_or_none() is None and out.idscore.weights_or_none() is not None
        assert out.name == "train" and out.nothing is None and torch.equal(out.scale, torch.tensor(2.0))
    # the first slice's object is untouched (the codec keeps a copy of its own)
    assert isinstance(slices[0].idlist, KeyedJaggedTensor)


def test_ranks_disagreeing_on_a_batch_independent_value_differ_in_signature() -> None:
    a = slice_layout(make_sample(1), TABLES)
    b = slice_layout(replace(make_sample(1), name="eval"), TABLES)
    c = slice_layout(replace(make_sample(1), scale=torch.tensor(3.0)), TABLES)
    assert not np.array_equal(a.signature(), b.signature())
    assert not np.array_equal(a.signature(), c.signature())
    assert np.array_equal(a.signature(), slice_layout(make_sample(2), TABLES).signature())


def test_what_the_stage_cannot_carry_is_one_line_naming_the_field() -> None:
    first = make_sample(1)
    rng = np.random.default_rng(0)

    def refused(obj: object, match: str, tables: ManagedTables = TABLES, first_slice: Sample | None = None) -> None:
        with pytest.raises(ValueError, match=match) as e:
            if first_slice is None:
                slice_layout(obj, tables)
            else:
                host_slice(obj, slice_layout(first_slice, tables))
        assert "\n" not in str(e.value)

    refused(
        replace(first, idscore=kjt(["a", "x"], rng, weighted=True)),
        r"managed feature 'a' is in two KeyedJaggedTensors, fields idlist and idscore",
    )
    refused(
        first,
        r"managed features \['z'\] are in none of the batch's KeyedJaggedTensors \(idlist \['a', 'x', 'b'\]",
        ManagedTables(("tz",), (5,), (("z",),), (0,)),
    )
    refused(replace(first, name=np.arange(B)), r"field name \(ndarray\) cannot be carried")
    refused(replace(first, extra=[first.extra[0], ["s"] * B]), r"field extra\[1\] \(list\) cannot be carried")
    vbe = KeyedJaggedTensor(
        keys=["w", "x"],
        values=torch.arange(3),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=[[2], [1]],
    )  # VBE without inverse_indices: no bag per sample (with them, each sample gets its bag: test_variable_batch)
    refused(
        replace(first, idscore=vbe),
        r"field idscore: a KeyedJaggedTensor with a variable batch size per feature .* needs inverse_indices",
    )
    k64 = first.idscore
    refused(
        replace(first, idscore=KeyedJaggedTensor(["w", "x"], k64.values(), k64.weights().double(), k64.lengths())),
        r"field idscore: weights of dtype torch.float64",
    )
    refused(torch.zeros(B, 2), "a bare Tensor is not a batch")
    refused(replace(first, idlist=None, idscore=None), "Sample has no KeyedJaggedTensor field")
    refused(object(), "has neither dataclass fields nor attributes")
    # later slices, against the first
    refused(replace(make_sample(2), name="eval"), r"field name changed from the first batch's", first_slice=first)
    refused(
        replace(make_sample(2), float_features=torch.rand(B, 4)), r"field float_features: \(4, 4\)", first_slice=first
    )
    refused(replace(make_sample(2), idscore=None), r"fields .* differ|field idscore: a NoneType", first_slice=first)
    refused(replace(make_sample(2), idlist=first.idscore), r"field idlist: keys \['w', 'x'\] differ", first_slice=first)
    refused(make_sample(2, n=B + 1), r"a batch of 5 samples, more than the first batch's 4", first_slice=first)
    as_batch = Batch(first.float_features, first.idlist, first.label)
    refused(as_batch, r"a Batch batch after a first batch of Sample", first_slice=first)
    with pytest.raises(ValueError, match=r"a Sample batch after a first batch of torchrec.datasets.utils.Batch"):
        host_slice(first, slice_layout(as_batch, ManagedTables(("ta", "tb"), (10, 7), (("a",), ("b",)), (0,))))
    refused(
        replace(make_sample(2), idlist=kjt(["a", "x", "b"], rng, weighted=True)),
        r"field idlist: weights, the first batch's KJT had none",
        first_slice=first,
    )


@dataclass
class TaggedBatch(Batch):
    """A user's subclass of torchrec's Batch with a per-sample field of its own."""

    sample_id: Optional[torch.Tensor] = None


def test_a_batch_subclass_comes_back_as_itself_with_its_own_fields() -> None:
    """torchrec's Batch keeps its own path; a subclass travels through the codec, so its extra field is not lost."""
    plain = make_sample(3)
    kjt3 = plain.idlist
    b = TaggedBatch(plain.float_features, kjt3, plain.label.float(), sample_id=torch.arange(B) * 10)
    tables = ManagedTables(("ta", "tb"), (10, 7), (("a",), ("b",)), (0,))
    layout = slice_layout(b, tables)
    assert layout.codec is not None
    assert slice_layout(Batch(b.dense_features, kjt3, b.labels), tables).codec is None  # Batch itself: no codec
    hs = host_slice(b, layout)
    ids = gather_ids(hs.lengths[None], [managed_ids(hs, layout)], layout)
    mine = np.array([2, 0, 3, 1])
    lengths, values = assigned_kjt_parts(ids, layout, mine, sample_major_ids(hs, layout.carried, mine))
    out = assigned_batch(lengths, values, hs.fixed[mine], layout)
    assert type(out) is TaggedBatch
    assert torch.equal(out.sample_id, b.sample_id[mine]) and torch.equal(out.labels, b.labels[mine])
    assert torch.equal(out.dense_features, b.dense_features[mine])
    assert bags(out.sparse_features) == {k: [v[i] for i in mine] for k, v in bags(kjt3).items()}
