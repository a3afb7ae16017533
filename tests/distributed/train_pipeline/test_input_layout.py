"""The input stage's bookkeeping without a process group: two ranks' Batch slices -> the scheduler's global batch
(multi-hot, empty bags, a table read by two keys, a key no Herald table reads) -> any rank's assigned samples as a KJT
that equals the original samples' bags, key by key; weighted KJTs' weights travel with their ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from herald_torchrec.distributed.train_pipeline.input_layout import (
    ManagedTables,
    SampleRoute,
    assigned_batch,
    assigned_kjt_parts,
    gather_ids,
    global_batch,
    host_slice,
    managed_ids,
    planner_parts,
    received_samples,
    sample_blocks,
    sample_major_ids,
    slice_layout,
)

KEYS = ["a", "b", "c", "x"]  # x: carried (no Herald table reads it)
TABLES = ManagedTables(("ta", "tbc"), (10, 7), (("a",), ("b", "c")), (0,))
B, R = 4, 2


def make_slice(seed: int, length: int | None = None) -> tuple[Batch, list[list[list[int]]]]:
    """A slice with bags of random lengths 0..2, or all of one `length` (the layout's uniform fast paths)."""
    rng = np.random.default_rng(seed)
    bags = [
        [list(rng.integers(0, 7, rng.integers(0, 3) if length is None else length)) for _ in range(B)] for _ in KEYS
    ]  # bags[key][sample]
    lengths = torch.tensor([len(b) for k in bags for b in k], dtype=torch.int32)
    values = torch.tensor([v for k in bags for b in k for v in b], dtype=torch.int64)
    kjt = KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths)
    return Batch(
        torch.arange(B * 3, dtype=torch.float32).reshape(B, 3) + seed, kjt, torch.arange(B).float() + seed
    ), bags


def two_rank_exchange(slices: list, layout, dest: list[np.ndarray], uniform: int | None = None):
    """The stage's exchange between two ranks in one process: each rank's slice -> the gathered global batch ->
    the samples `dest` sends to each rank, assigned on rank 0, which plans (ids from the global batch, the rest from
    the samples' blocks), and on rank 1, which does not (everything from the blocks). `uniform`: every bag of that
    length (the blocks' fast path). Returns (each rank's global samples, rank 0's batch, rank 1's batch)."""
    B = layout.batch_size
    hs = [host_slice(s, layout) for s in slices]
    ids = gather_ids(np.stack([h.lengths for h in hs]), [managed_ids(h, layout) for h in hs], layout)
    with_ids = np.array([False, True])
    got: list[list[np.ndarray]] = [[], []]
    for q in range(R):
        blocks, _ = sample_blocks(hs[q], layout, SampleRoute.by_destination(dest[q], with_ids), uniform is not None)
        for d in range(R):
            got[d].append(blocks[d])
    n_to = [np.array([int((d == r).sum()) for d in dest]) for r in range(R)]
    mine = [np.array([q * B + i for q in range(R) for i in range(B) if dest[q][i] == r]) for r in range(R)]
    parts = planner_parts(got[0], n_to[0], ids, layout, mine[0])
    lengths, values = assigned_kjt_parts(ids, layout, mine[0], parts.carried)
    planned = assigned_batch(lengths, values, parts.fixed, layout, parts.weights)
    r1 = received_samples(got[1], n_to[1], np.array([-1 if uniform is None else uniform] * R), layout)
    received = assigned_batch(r1.lengths, r1.values, r1.fixed, layout, r1.weights)
    return mine, planned, received


@pytest.mark.parametrize("length", [None, 1, 2, 0])
def test_global_batch_and_assigned_samples_round_trip(length: int | None) -> None:
    """Bags of mixed lengths (ragged index arithmetic), or all of one length (one reshape per step: single-hot data
    takes the scheduler's dense path): the same samples, key by key."""
    (b0, bags0), (b1, bags1) = make_slice(1, length), make_slice(2, length)
    layout = slice_layout(b0, TABLES)
    assert layout.managed.tolist() == [0, 1, 2] and layout.carried.tolist() == [3]
    s0, s1 = host_slice(b0, layout), host_slice(b1, layout)
    ids = gather_ids(np.stack([s0.lengths, s1.lengths]), [managed_ids(s0, layout), managed_ids(s1, layout)], layout)
    assert ids.uniform == (-1 if length is None else length)
    gb = global_batch(ids, layout, TABLES)
    bags = [bags0[k] + bags1[k] for k in range(len(KEYS))]  # global samples: rank 0's then rank 1's
    for g in range(R * B):
        assert gb.values[0][gb.offsets[0][g] : gb.offsets[0][g + 1]].tolist() == bags[0][g]
        assert gb.values[1][gb.offsets[1][g] : gb.offsets[1][g + 1]].tolist() == bags[1][g] + bags[2][g]
    # rank 1 is assigned global samples 0, 3, 5, 6 (some from each rank)
    mine = np.array([0, 3, 5, 6])
    carried = np.concatenate(
        [sample_major_ids(s, layout.carried, mine[mine // B == q] % B) for q, s in enumerate((s0, s1))]
    )
    lengths, values = assigned_kjt_parts(ids, layout, mine, carried)
    fixed = np.concatenate([s0.fixed, s1.fixed])[mine]
    out = assigned_batch(lengths, values, fixed, layout)
    got = out.sparse_features.to_dict()
    for k, key in enumerate(KEYS):
        want = [bags[k][g] for g in mine]
        jt = got[key]
        assert [len(w) for w in want] == jt.lengths().tolist()
        assert [v for w in want for v in w] == jt.values().tolist()
    assert torch.equal(out.dense_features, torch.cat([b0.dense_features, b1.dense_features])[mine])
    assert torch.equal(out.labels, torch.cat([b0.labels, b1.labels])[mine])


@pytest.mark.parametrize("uniform", [False, True, 2])
def test_samples_carry_their_ids_to_ranks_that_do_not_plan(uniform: bool | int) -> None:
    """A rank that does not plan never gathers the slices' ids: the samples sent to it bring their lengths (unless
    the header said every bag has one length) and managed ids, and it rebuilds exactly their bags; blocks to a
    planner carry only dense + label bytes and carried ids, as its gathered ids hold the rest."""
    slices = [make_slice(1), make_slice(2)]
    u = int(uniform)  # True: every bag of length 1; 2: of length 2
    if uniform is not False:
        slices = [make_slice(1, u), make_slice(2, u)]
    layout = slice_layout(slices[0][0], TABLES)
    hs = [host_slice(b, layout) for b, _ in slices]
    uniform_from = np.array([u if uniform is not False else -1] * R)
    dest = [np.array([1, 0, 1, 1]), np.array([0, 1, 1, 0])]  # each rank's samples -> rank; rank 1 does not plan
    with_ids = np.array([False, True])
    got: list[list[np.ndarray]] = [[], []]
    for q in range(R):
        blocks, id_bytes = sample_blocks(
            hs[q], layout, SampleRoute.by_destination(dest[q], with_ids), uniform is not False
        )
        n = np.bincount(dest[q], minlength=R)
        managed_n = [int(hs[q].lengths[layout.managed][:, dest[q] == d].sum()) for d in range(R)]
        carried_n = [int(hs[q].lengths[layout.carried][:, dest[q] == d].sum()) for d in range(R)]
        lens_bytes = 0 if uniform is not False else 4 * len(KEYS)
        assert id_bytes.tolist() == [0, n[1] * lens_bytes + managed_n[1] * 4]  # int32 ids on the wire
        assert [b.shape[0] for b in blocks] == [
            n[d] * layout.fixed_bytes() + id_bytes[d] + 8 * carried_n[d] for d in range(R)
        ]
        for d in range(R):
            got[d].append(blocks[d])
    # rank 1 rebuilds its samples: rank 0's then its own, each in local order
    mine = [(q, i) for q in range(R) for i in range(B) if dest[q][i] == 1]
    fixed, lengths, values, weights = received_samples(
        got[1], np.array([int((d == 1).sum()) for d in dest]), uniform_from, layout
    )
    assert weights is None  # unweighted KJTs
    out = assigned_batch(lengths, values, fixed, layout)
    jt = out.sparse_features.to_dict()
    for k, key in enumerate(KEYS):
        want = [slices[q][1][k][i] for q, i in mine]
        assert [len(w) for w in want] == jt[key].lengths().tolist()
        assert [v for w in want for v in w] == jt[key].values().tolist()
    assert torch.equal(out.dense_features, torch.stack([slices[q][0].dense_features[i] for q, i in mine]))
    assert torch.equal(out.labels, torch.stack([slices[q][0].labels[i] for q, i in mine]))


def test_single_hot_takes_the_dense_path_and_bad_input_is_named() -> None:
    kjt = KeyedJaggedTensor(
        keys=["a", "b", "c"], values=torch.arange(12) % 5, lengths=torch.ones(12, dtype=torch.int32)
    )
    b = Batch(torch.zeros(B, 2), kjt, torch.zeros(B))
    layout = slice_layout(b, ManagedTables(("ta", "tb", "tc"), (5, 5, 5), (("a",), ("b",), ("c",)), (0,)))
    s = host_slice(b, layout)
    gb = global_batch(
        gather_ids(s.lengths[None], [managed_ids(s, layout)], layout),
        layout,
        ManagedTables(("ta", "tb", "tc"), (5, 5, 5), (("a",), ("b",), ("c",)), (0,)),
    )
    assert gb.single_hot() and "dense" in gb._cache
    big = KeyedJaggedTensor(
        keys=["a", "b", "c"], values=torch.tensor([2**31 + 1] + [0] * 11), lengths=torch.ones(12, dtype=torch.int32)
    )
    with pytest.raises(ValueError, match=r"feature 'a': ids out of range \[2147483649\]"):
        host_slice(Batch(torch.zeros(B, 2), big, torch.zeros(B)), layout)
    # one pass checks every managed key against its own table; carried keys' ids are not Herald's to check
    two = ManagedTables(("ta", "tb", "tb2"), (5, 9, 6), (("a",), ("b",), ("b",)), (0,))  # b feeds 9 and 6 rows
    lay2 = slice_layout(b, two)
    vals = torch.tensor([0, 1, 2, 3, 4, 0, 5, 1, 2, 3, -7, 10**12])  # b has id 5 (ok) ; c (carried) anything
    assert (
        host_slice(
            Batch(
                torch.zeros(B, 2),
                KeyedJaggedTensor(keys=["a", "b", "c"], values=vals, lengths=torch.ones(12, dtype=torch.int32)),
                torch.zeros(B),
            ),
            lay2,
        ).n
        == B
    )
    vals[4] = 6  # b's bound is its smallest table's (6 rows)
    with pytest.raises(ValueError, match=r"feature 'b': ids out of range \[6\] \(its table has 6 rows\)"):
        host_slice(
            Batch(
                torch.zeros(B, 2),
                KeyedJaggedTensor(keys=["a", "b", "c"], values=vals, lengths=torch.ones(12, dtype=torch.int32)),
                torch.zeros(B),
            ),
            lay2,
        )
    with pytest.raises(ValueError, match="lacks the Herald-managed features"):
        slice_layout(b, ManagedTables(("tz",), (5,), (("z",),), (0,)))
    with pytest.raises(ValueError, match="torchrec.datasets.utils.Batch"):
        slice_layout(object(), ManagedTables(("ta",), (5,), (("a",),), (0,)))  # type: ignore[arg-type]


def test_who_plans_for_whom() -> None:
    from herald_torchrec.distributed.train_pipeline.input_round import planners

    hosts = np.array([5, 7, 5, 7, 9], dtype=np.int64)  # ranks 0 and 2 on one machine, 1 and 3 on another, 4 alone
    assert planners("host", hosts).tolist() == [0, 1, 0, 1, 4]
    assert planners("rank0", hosts).tolist() == [0] * 5
    assert planners("every_rank", hosts).tolist() == [0, 1, 2, 3, 4]


def test_host_key_tells_torchrun_agents_on_one_machine_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """One torchrun agent per host: agents sharing a host name (network namespaces emulating hosts, containers)
    are different hosts by GROUP_RANK; the ranks of one agent, and every rank without torchrun, share a key."""
    from herald_torchrec.distributed.train_pipeline import input_round
    from herald_torchrec.distributed.train_pipeline.input_round import host_key, planners

    monkeypatch.setattr(input_round.socket, "gethostname", lambda: "node-a")
    monkeypatch.delenv("GROUP_RANK", raising=False)
    plain = host_key()
    assert plain == host_key() and isinstance(plain, int) and -(2**63) <= plain < 2**63
    keys = []
    for group in ("0", "0", "1", "1"):  # --nnodes 2 --nproc_per_node 2 on one machine
        monkeypatch.setenv("GROUP_RANK", group)
        keys.append(host_key())
    assert keys[0] == keys[1] and keys[2] == keys[3] and keys[0] != keys[2]
    assert planners("host", np.array(keys, dtype=np.int64)).tolist() == [0, 0, 2, 2]  # one planner per host
    monkeypatch.setattr(input_round.socket, "gethostname", lambda: "node-b")
    assert host_key() != keys[2]  # the same group rank on another machine name: another host
    monkeypatch.delenv("GROUP_RANK")
    assert host_key() != plain  # without torchrun the host name alone decides


@pytest.mark.parametrize("u, ids64", [(1, False), (2, False), (1, True)])
def test_compiled_sample_blocks_match_numpy(u: int, ids64: bool) -> None:
    """The samples' blocks and their reassembly compiled (host_kernels.sample_blocks_uniform / received_uniform)
    against the numpy code: the same bytes per destination and the same received arrays, for one-length bags of
    length 1 and 2, int32 and int64 ids on the wire, blocks with and without managed ids."""
    import dataclasses

    from herald_torchrec import _native
    from herald_torchrec.distributed import host_kernels

    if host_kernels.lib() is None:
        pytest.skip("no C++ compiler here: the numpy path is the only one")
    slices = [make_slice(5, u), make_slice(6, u)]
    layout = slice_layout(slices[0][0], TABLES)
    if ids64:
        layout = dataclasses.replace(layout, ids_dtype=np.dtype(np.int64))
    hs = [host_slice(b, layout) for b, _ in slices]
    dest = [np.array([1, 1, 0, 1]), np.array([0, 1, 0, 0])]
    with_ids = np.array([False, True])
    n_to_1 = np.array([int((d == 1).sum()) for d in dest])
    results = []
    for compiled in (True, False):
        _native.set_mode(compiled)
        try:
            to_1 = []
            for q in range(R):
                blocks, id_bytes = sample_blocks(hs[q], layout, SampleRoute.by_destination(dest[q], with_ids), True)
                results.append(([b.copy() for b in blocks], id_bytes.copy()))
                to_1.append(blocks[1])
            results.append(tuple(received_samples(to_1, n_to_1, np.array([u, u]), layout))[:3])
        finally:
            _native.set_mode(True)
    half = len(results) // 2
    for got, want in zip(results[:half], results[half:]):
        for g, w in zip(got, want):
            if isinstance(g, list):
                assert len(g) == len(w) and all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(g, w))
            else:
                assert np.array_equal(g, w) and g.dtype == w.dtype and g.shape == w.shape
    assert results[half - 1][0].shape == (int(n_to_1.sum()), layout.fixed_bytes())


def weighted_slice(seed: int, length: int | None = None) -> tuple[Batch, list[list[list[tuple[int, float]]]]]:
    """`make_slice` with a distinct float32 weight per id (id-score lists): bags of (id, weight) pairs."""
    batch, bags = make_slice(seed, length)
    kjt = batch.sparse_features
    weights = (torch.arange(kjt.values().numel(), dtype=torch.float32) + 1) * 0.5 + seed * 100
    kjt = KeyedJaggedTensor(keys=KEYS, values=kjt.values(), lengths=kjt.lengths(), weights=weights)
    it = iter(weights.tolist())
    pairs = [[[(int(v), next(it)) for v in bag] for bag in key] for key in bags]
    return Batch(batch.dense_features, kjt, batch.labels), pairs


def bag_pairs(batch: Batch) -> dict[str, list[list[tuple[int, float]]]]:
    """Per key, per sample: the (id, weight) pairs of an assembled batch."""
    out = {}
    for key, jt in batch.sparse_features.to_dict().items():
        vals, wts, lens = jt.values().tolist(), jt.weights().tolist(), jt.lengths().tolist()
        cuts = np.concatenate([[0], np.cumsum(lens)]).tolist()
        out[key] = [list(zip(vals[a:b], wts[a:b])) for a, b in zip(cuts[:-1], cuts[1:])]
    return out


@pytest.mark.parametrize("length", [None, 1, 2])
def test_weights_travel_with_their_ids(length: int | None) -> None:
    """Weighted KJTs: two ranks' slices -> the global batch -> each rank's assigned samples, on a rank that plans
    (ids from the gathered batch, weights from the samples' blocks) and on one that does not (everything from the
    blocks): every id keeps its own weight, key by key and sample by sample."""
    slices = [weighted_slice(1, length), weighted_slice(2, length)]
    layout = slice_layout(slices[0][0], TABLES)
    assert layout.weighted and layout.weight_bytes == 4
    dest = [np.array([1, 0, 1, 1]), np.array([0, 1, 1, 0])]  # rank 0 plans, rank 1 does not
    mine, planned, received = two_rank_exchange([b for b, _ in slices], layout, dest, length)
    for r, out in ((0, planned), (1, received)):
        pairs = bag_pairs(out)
        for k, key in enumerate(KEYS):
            assert pairs[key] == [slices[g // B][1][k][g % B] for g in mine[r]], (r, key)
        assert torch.equal(out.labels, torch.cat([b.labels for b, _ in slices])[mine[r]])
    # every batch of a weighted stage has weights (and none of an unweighted one)
    with pytest.raises(ValueError, match="KJT is unweighted, the first batch's was weighted"):
        host_slice(make_slice(3, length)[0], layout)
