"""The input stage's background thread runs at a lower CPU priority than the training thread (`input_priority`).

The thread works ahead of the step; on cores shared with the training threads it should yield to them. These tests
read the priority the kernel really gave the thread (its nice value and scheduling policy by thread id), check that
the training thread keeps its own, that the batches come through unchanged, and that a bad value is a clear error.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from herald_torchrec.distributed.train_pipeline import INPUT_PRIORITIES, HeraldTrainPipeline, _Prefetched

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")


def _thread_priority() -> tuple[int, int]:
    tid = threading.get_native_id()
    return os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)


def _stage_reporting_priority(seen: list):
    """A stand-in for ScheduledInput: records the priority of the thread it runs in, then passes items through."""

    def stage(source):
        seen.append(_thread_priority())
        for x in source:
            yield x, None, 0

    return stage


@linux_only
@pytest.mark.parametrize("priority", INPUT_PRIORITIES)
def test_input_thread_runs_at_its_priority_and_the_training_thread_keeps_its_own(priority: str) -> None:
    before = _thread_priority()
    seen: list = []
    waits: list = []
    items = list(_Prefetched(_stage_reporting_priority(seen), iter(range(5)), 2, priority, waits))
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


def test_bad_input_priority_is_a_clear_error_before_any_set_up() -> None:
    with pytest.raises(ValueError, match=r"input_priority must be one of \['normal', 'low', 'idle'\].*'lowest'"):
        HeraldTrainPipeline(torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1)], lr=0.1), torch.device("cpu"),
                            input_priority="lowest")
