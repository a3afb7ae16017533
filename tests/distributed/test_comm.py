"""The tensors of the package's collectives, held for gloo's worker threads until exit (comm.hold_for_gloo).

The abort this prevents is a race at interpreter exit (a gloo worker dropping a finished collective's tensors while
the interpreter finalizes); tests/scenarios/test_pipeline_close.py runs the loop that met it. Here: what
`release_gloo_tensors` waits for, and that it waits no longer than its timeout.
"""

from __future__ import annotations

import time

import torch

from herald_torchrec.distributed import comm


def test_release_waits_only_for_tensors_another_owner_still_holds() -> None:
    comm.release_gloo_tensors()
    free = torch.zeros(4)
    comm.hold_for_gloo(free, torch.zeros(2, device="meta"))  # meta / CUDA tensors are not gloo's: not held
    assert len(comm._held) == 1 and len(comm._held[0]) == 1
    t0 = time.monotonic()
    comm.release_gloo_tensors(timeout=5.0)
    assert time.monotonic() - t0 < 0.5 and not comm._held

    w = torch.ones(4, requires_grad=True)
    shared = torch.ones(4)
    y = (w * shared).sum()  # autograd saves `shared`: a second owner in C++, as a gloo work in flight would be
    assert shared._use_count() == 2
    comm.hold_for_gloo(shared)
    t0 = time.monotonic()
    comm.release_gloo_tensors(timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2.0 and not comm._held  # gave up after its timeout, and let go
    del y


def test_only_the_last_collectives_are_held() -> None:
    comm.release_gloo_tensors()
    kept = [torch.zeros(1) for _ in range(comm.GLOO_HELD + 3)]
    for t in kept:
        comm.hold_for_gloo(t)
    assert len(comm._held) == comm.GLOO_HELD
    assert all(h[0] is t for h, t in zip(comm._held, kept[-comm.GLOO_HELD :]))
    comm.release_gloo_tensors()
    assert not comm._held and all(t._use_count() == 1 for t in kept)


def test_without_a_use_count_exit_waits_one_grace(monkeypatch) -> None:
    """A torch without `Tensor._use_count`: one grace for every held collective together, not one per tensor."""
    comm.release_gloo_tensors()
    monkeypatch.setattr(comm, "_USE_COUNT", False)
    for _ in range(comm.GLOO_HELD):
        comm.hold_for_gloo(*[torch.zeros(1) for _ in range(64)])
    t0 = time.monotonic()
    comm.release_gloo_tensors()
    assert comm.GLOO_GRACE_S <= time.monotonic() - t0 < 0.5 and not comm._held


def test_phase_times_print_as_one_write_per_rank(monkeypatch) -> None:
    """Under `python -u` (how torchrun runs train.py in the benchmarks) print() writes a line and its newline apart;
    the ranks of one machine share the stream, so the record goes out in one write."""
    import json

    writes: list[str] = []

    class Stream:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(comm.sys, "stderr", Stream())
    monkeypatch.setattr(comm, "_phase_totals", {"input.plan": [0.5, 2, 0.25]})
    monkeypatch.setenv("RANK", "5")
    comm._print_phase_times()
    assert len(writes) == 1 and writes[0].endswith("}\n") and writes[0].count("\n") == 1
    tag, rank, payload = writes[0].split(" ", 2)
    assert (tag, rank) == (comm.PHASE_TIMES_TAG, "rank=5")
    assert json.loads(payload)["input.plan"]["calls"] == 2
