"""schedule/plan_wire.py: a plan survives its trip to the other ranks field for field (dtypes included), for every
policy the data plane runs, in far fewer bytes than its int64 arrays; a malformed buffer is an error."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from herald_torchrec.schedule import GlobalBatch, make_policy
from herald_torchrec.schedule.plan import Plan, RowMoves
from herald_torchrec.schedule.plan_wire import FLAT_FIELDS_MATCH, decode_plan, encode_plan

ROWS = [5000, 300, 40, 7000]
R, B, L = 4, 16, 2


def trace(n: int, seed: int = 0) -> list[GlobalBatch]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):  # a skewed trace with repeats, so rows move and are shared
        ids = np.stack([(rng.zipf(1.3, R * B) - 1) % r for r in ROWS], axis=1)
        out.append(GlobalBatch.from_dense(ids, ROWS, index=i))
    return out


def assert_same(a, b, where: str = "plan") -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), where
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    else:
        assert type(a) is type(b) and a == b, where


@pytest.mark.parametrize("name", ["herald", "static", "fae", "p2res", "het"])
def test_every_executable_policy_round_trips(name):
    batches = trace(10)
    policy = make_policy(name, ROWS, R, B, cache_ratio=0.1, lookahead=L)
    if name in ("fae", "p2res"):
        policy.profile(batches[:3])
    sent = wide = 0
    for i in range(len(batches) - L):
        plan = policy.plan(batches[i : i + L + 1])
        buf = encode_plan(plan)
        assert buf.dtype == np.uint8 and buf.ndim == 1
        got = decode_plan(buf.copy())
        assert_same(plan, got)
        if name == "herald" and len(plan.shared):
            assert short_forms(buf) == {"as", "rm"}
        sent += buf.shape[0]
        wide += sum(a.nbytes for a in _arrays(plan))
    assert sent < 0.5 * wide, (sent, wide)  # narrow integers: far less than the plan's own arrays


def _arrays(v):
    if isinstance(v, np.ndarray):
        yield v
    elif dataclasses.is_dataclass(v):
        for f in dataclasses.fields(v):
            yield from _arrays(getattr(v, f.name))


def test_values_at_the_type_limits_survive():
    big = np.array([0, 2**31 + 5, -(2**40)], dtype=np.int64)  # needs int64
    plan = Plan(
        step=3,
        num_ranks=2,
        batch_per_rank=2,
        sample_order=np.array([3, 0, 1, 2], dtype=np.int64),
        moves=RowMoves(
            table=np.array([0, 1, 2]),
            row=big,
            src=np.array([0, 1, 1]),
            dst=np.array([1, 0, 0]),
            kind=np.array([0, 1, 2], dtype=np.int8),
        ),
        counters={"migrate": 1, "hit": 0},
        sched_seconds=0.125,
    )
    assert_same(plan, decode_plan(encode_plan(plan)))


def test_plans_outside_the_short_forms_travel_as_they_are():
    """The sample order as ranks and the readers as bitmasks only where they say the same: an order whose slices are
    not increasing, readers unsorted, repeated or beyond bit 62 still arrive exactly."""
    from herald_torchrec.schedule.plan import SharedRows

    def shared(offsets, readers):
        n = len(offsets) - 1
        return SharedRows(
            np.arange(n), np.arange(n) * 7, np.zeros(n, dtype=np.int64), np.array(offsets), np.array(readers)
        )

    cases = [
        (np.array([1, 0, 2, 3]), shared([0, 2, 3], [0, 1, 1])),  # rank 0's slice not increasing; CSR fine
        (np.array([0, 1, 2, 3]), shared([0, 2, 3], [1, 0, 1])),  # readers unsorted
        (np.array([0, 1, 2, 3]), shared([0, 2, 3], [1, 1, 0])),  # a reader twice
        (np.array([0, 1, 2, 3]), shared([0, 1, 2], [63, 0])),  # a rank beyond the mask's bits
        (np.array([0, 0, 2, 3]), shared([0, 0, 1], [0])),  # not a permutation; a row without readers
    ]
    for order, sh in cases:
        plan = Plan(step=1, num_ranks=2, batch_per_rank=2, sample_order=order, shared=sh)
        assert_same(plan, decode_plan(encode_plan(plan)))
    short = Plan(
        step=1, num_ranks=2, batch_per_rank=2, sample_order=np.array([0, 3, 1, 2]), shared=shared([0, 2, 3], [0, 1, 1])
    )
    assert_same(short, decode_plan(encode_plan(short)))
    assert short_forms(encode_plan(short)) == {"as", "rm"} and short_forms(encode_plan(plan)) == set()


def short_forms(buf: np.ndarray) -> set[str]:
    """Which short forms a buffer uses: "as" (sample order as ranks), "rm" (readers as bitmasks); the flat form
    (first byte 1) uses both."""
    if buf[0] == 1:
        return {"as", "rm"}
    n = int(buf[1:5].view("<u4")[0])
    text = bytes(buf[5 : 5 + n]).decode()
    return {k for k in ("as", "rm") if f'"{k}":' in text}


def test_the_flat_form_knows_every_plan_field():
    """The flat form writes Plan / RowMoves / SharedRows field by field: a new field must be added to it (until
    then such plans would silently take the general form, and this fails)."""
    assert FLAT_FIELDS_MATCH
    plan = make_policy("herald", ROWS, R, B, lookahead=0).plan(trace(1))
    assert encode_plan(plan)[0] == 1  # an ownership plan takes the flat form


def test_malformed_buffers_are_errors():
    buf = encode_plan(make_policy("herald", ROWS, R, B, lookahead=0).plan(trace(1)))
    with pytest.raises(ValueError, match="malformed"):
        decode_plan(np.concatenate([buf, np.zeros(3, dtype=np.uint8)]))
    with pytest.raises(ValueError, match="malformed"):
        decode_plan(np.concatenate([[7], buf[1:]]).astype(np.uint8))  # an unknown form
    with pytest.raises(ValueError, match="1-D"):
        encode_plan(Plan(step=0, num_ranks=1, batch_per_rank=1, sample_order=np.zeros((1, 1), dtype=np.int64)))


def test_compiled_wire_gives_the_same_bytes_and_plans():
    """The flat form's compiled passes (schedule/native.py: the assignment, the reader masks, the narrowing and its
    inverse) against the numpy code: the same bytes from every plan, and the same plan back, dtypes included (the
    scheduler's plans, values at the type limits, empty moves and shared rows, narrow original dtypes); where a short
    form does not apply, both paths agree on the general form."""
    from herald_torchrec import _native
    from herald_torchrec.schedule import native
    from herald_torchrec.schedule.plan import SharedRows

    if not native.enabled():
        pytest.skip("no C++ compiler here: the numpy path is the only one")
    policy = make_policy("herald", ROWS, R, B, cache_ratio=0.1, lookahead=L)
    batches = trace(8, seed=4)
    plans = [policy.plan(batches[i : i + L + 1]) for i in range(len(batches) - L)]
    big = np.array([0, 2**31 + 5, -(2**40)], dtype=np.int64)
    plans.append(
        Plan(
            step=3,
            num_ranks=2,
            batch_per_rank=2,
            sample_order=np.array([3, 0, 1, 2], dtype=np.int32),
            moves=RowMoves(
                table=np.array([0, 1, 2], dtype=np.uint8),
                row=big,
                src=np.array([0, 1, 1]),
                dst=np.array([1, 0, 0]),
                kind=np.array([0, 1, 2], dtype=np.int8),
            ),
            shared=SharedRows(
                np.array([1, 4]),
                np.array([-300, 70000]),
                np.array([1, 0], dtype=np.int16),
                np.array([0, 2, 3], dtype=np.int32),
                np.array([0, 1, 1], dtype=np.int16),
            ),
            counters={"migrate": 1},
        )
    )
    plans.append(Plan(step=4, num_ranks=2, batch_per_rank=2, sample_order=np.array([0, 3, 1, 2])))  # nothing moves
    plans.append(Plan(step=5, num_ranks=2, batch_per_rank=2, sample_order=np.array([1, 0, 2, 3])))  # general form
    assert sum(len(p.shared) for p in plans) > 20 and sum(len(p.moves) for p in plans) > 5
    for i, plan in enumerate(plans):
        got = encode_plan(plan)
        _native.set_mode(False)
        try:
            want = encode_plan(plan)
            back_np = decode_plan(want)
        finally:
            _native.set_mode(True)
        assert np.array_equal(got, want), f"plan {i}: the compiled encoding differs"
        back = decode_plan(got)
        assert_same(plan, back, f"plan {i}")
        assert_same(back_np, back, f"plan {i}")
    assert encode_plan(plans[0])[0] == 1 and encode_plan(plans[-1])[0] == 0


def test_a_host_plan_round_trips():
    """A herald_hier host's own plan (HostPlan: its moves, shared rows, sample order, ranks and table lists) in the
    general form: what the simulator hashes into host_plans_digest."""
    from herald_torchrec.schedule.plan import HostPlan

    R16 = 16
    rows = [40, 30, 20, 10]
    rng = np.random.default_rng(4)
    batches = [GlobalBatch.from_dense(rng.integers(0, 10, (R16 * B, 4)), rows, i) for i in range(6)]
    pol = make_policy("herald_hier", rows, R16, B, cache_ratio=0.1, lookahead=L, hosts=8)
    for i in range(len(batches) - L):
        pol.plan(batches[i : i + L + 1])
        for hp in pol.last_host_plans.values():
            assert type(hp) is HostPlan
            got = decode_plan(encode_plan(hp).copy())
            assert type(got) is HostPlan and got.host == hp.host
            assert_same(hp, got)
