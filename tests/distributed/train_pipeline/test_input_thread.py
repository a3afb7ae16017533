"""The input stage's background thread (herald_torchrec/distributed/train_pipeline/input_thread.py): it runs at a lower
CPU priority than the training thread (`input_priority`), records how long training waits for it, and says so once
when it does not keep ahead.

The priority tests read what the kernel really gave the thread (its nice value and scheduling policy by thread id),
and check that the training thread keeps its own and that the batches come through unchanged.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings

import pytest
import torch

from herald_torchrec.distributed.train_pipeline import input_thread
from herald_torchrec.distributed.train_pipeline.input_thread import PrefetchedInput
from herald_torchrec.distributed.train_pipeline.pipeline import HeraldTrainPipeline
from herald_torchrec.options import INPUT_PRIORITIES

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")


def _thread_priority() -> tuple[int, int]:
    tid = threading.get_native_id()
    return os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)


def _stage(seen: list | None = None, delay: float = 0.0):
    """A stand-in for ScheduledInput: records the priority of the thread it runs in, then passes items through
    (each `delay` seconds late)."""

    def stage(source):
        if seen is not None:
            seen.append(_thread_priority())
        for x in source:
            time.sleep(delay)
            yield x, None, 0

    return stage


@linux_only
@pytest.mark.parametrize("priority", INPUT_PRIORITIES)
def test_input_thread_runs_at_its_priority_and_the_training_thread_keeps_its_own(priority: str) -> None:
    before = _thread_priority()
    seen: list = []
    waits: list = []
    items = list(PrefetchedInput(_stage(seen), iter(range(5)), 2, priority, waits))
    assert [x for x, _, _ in items] == list(range(5))
    assert len(waits) == 5 and all(w >= 0.0 for w in waits)  # one wait per batch, none for the end
    nice, policy = seen[0]
    if priority == "normal":
        assert (nice, policy) == before
    elif priority == "low":
        assert (nice, policy) == (19, os.SCHED_OTHER)
    else:
        assert policy == os.SCHED_IDLE
    assert _thread_priority() == before  # only the input thread changed


def _consume(prefetched: PrefetchedInput, work: float) -> list:
    out = []
    for item in prefetched:
        time.sleep(work)  # the training step
        out.append(item)
    return out


def test_a_lagging_input_stage_is_reported_once_with_what_to_change(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(input_thread, "LAG_WINDOW", 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = _consume(PrefetchedInput(_stage(delay=0.02), iter(range(12)), 2, "low"), work=0.0)
    assert len(items) == 12
    lag = [str(w.message) for w in caught if "not keeping ahead" in str(w.message)]
    assert len(lag) == 1, lag  # two full windows lagged: one warning
    assert "input_priority='low'" in lag[0] and "input_priority='normal'" in lag[0]


def test_an_input_stage_that_keeps_ahead_is_not_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(input_thread, "LAG_WINDOW", 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        waits: list = []
        _consume(PrefetchedInput(_stage(delay=0.0), iter(range(12)), 2, "normal", waits), work=0.02)
    assert not [w for w in caught if "not keeping ahead" in str(w.message)]
    assert max(waits[1:]) < 10.0  # ms: the stage was ready each time


def test_lag_message_names_the_cause_for_each_priority() -> None:
    idle = input_thread.lag_message(5.0, 0.5, 100, "idle")
    assert "input_priority='normal'" in idle and "slower than a training step" in idle  # both causes named
    normal = input_thread.lag_message(5.0, 0.5, 100, "normal")
    assert "The user's iterator or the scheduler is slower than a training step" in normal
    assert "5.0 ms" in normal and "50%" in normal and "input_priority" not in normal


def test_bad_input_priority_is_a_clear_error_before_any_set_up() -> None:
    with pytest.raises(ValueError, match=r"input_priority must be one of \['normal', 'low', 'idle'\].*'lowest'"):
        HeraldTrainPipeline(
            torch.nn.Linear(1, 1),
            torch.optim.SGD([torch.zeros(1)], lr=0.1),
            torch.device("cpu"),
            input_priority="lowest",
        )


@pytest.mark.parametrize("prefetch", [-1, 2.5, "4", True])
def test_bad_prefetch_is_a_clear_error_before_any_set_up(prefetch) -> None:
    with pytest.raises(
        ValueError, match=r"prefetch must be an integer >= 0 .*got " + repr(prefetch).replace(".", r"\.")
    ):
        HeraldTrainPipeline(
            torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1)], lr=0.1), torch.device("cpu"), prefetch=prefetch
        )
