"""The background thread that runs Herald's input stage ahead of training: its CPU priority, its queue, its lag.

The input stage (`ScheduledInput`: the user's iterator, the ids gather, the scheduler, the sample exchange) works a
few batches ahead of the training step and blocks on a full queue most of the time, so it has slack; the training
thread is the step's critical path. The thread therefore runs at a lower CPU priority (`input_priority`, default
"low" = nice 19): where ranks share cores with their input threads, the kernel runs the training threads first
and the input stage in their waits (collectives, the other ranks). Where every thread has a core of its own, the
priority changes nothing.

The queue is short (`HeraldOptions.prefetch`, 2 batches by default; `scheduler.prefetch` in the app). Deeper queues
(8, 16) gave the e2e benchmark a ~3 % shorter step in some alternating runs and none in others, and not the app's
own bound run (docs/performance.md, "Tried and dropped"). The plans do not depend on the depth.

`PrefetchedInput.close()` stops the stage early (`HeraldTrainPipeline.close()`): a daemon thread left inside a gloo
collective when the interpreter exits aborts the process (a user's loop over an endless iterator: 4 of 6 runs at
depth 2 and most at 16 did, before the pipeline closed itself at exit).

A stage that does not keep ahead (starved of CPU at its priority, or slower than a training step) makes the training
thread wait for its batches: `PrefetchedInput` records every wait and warns once when, over a window of batches,
the training thread spent a large share of its time waiting.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, MutableSequence, Optional

LAG_WINDOW = 100  # batches per check of whether the input stage keeps ahead of training
LAG_SHARE = 0.25  # warn (once) when the training thread waited this share of its time between batches
WAITS_KEPT = 100_000  # recent waits a pipeline keeps (a bounded record, however long the run)
CLOSE_TIMEOUT_S = 30.0  # how long close() waits for the stage to end (its last rounds need every rank to close)


def set_thread_priority(priority: str) -> None:
    """Lower the calling thread's CPU priority: "low" = nice 19, "idle" = SCHED_IDLE (runs when nothing else wants
    the core), "normal" = leave it. Linux only, where a thread has its own nice value and scheduling policy; elsewhere,
    or where the kernel refuses, the thread warns and keeps its priority (it must not stop training)."""
    if priority == "normal":
        return
    if not sys.platform.startswith("linux"):
        warnings.warn(
            f"herald input thread: input_priority={priority!r} needs Linux; the thread keeps its priority",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    tid = threading.get_native_id()
    try:
        if priority == "idle":
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.setpriority(os.PRIO_PROCESS, tid, 19)  # raising one's own nice value needs no privilege
    except OSError as e:
        warnings.warn(
            f"herald input thread: could not set input_priority={priority!r} ({e}); the thread keeps its priority",
            RuntimeWarning,
            stacklevel=2,
        )


OS_THREAD_NAME = "herald-input"  # what `top -H`, `ps -L` and /proc/<pid>/task/<tid>/comm show for the input thread


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the OS as well (Python's thread names are Python's only), so that per-thread
    CPU tools (`top -H`, benchmarks/e2e.py's thread split) can tell Herald's input thread from the training thread.
    Linux only (15 characters at most), best effort: naming never stops training."""
    if not sys.platform.startswith("linux"):
        return
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def lag_message(wait_ms: float, share: float, batches: int, priority: str) -> str:
    """What a lagging input stage means, and what to change."""
    head = (
        f"HeraldTrainPipeline: over the last {batches} batches the training thread waited {wait_ms:.1f} ms per "
        f"batch ({share:.0%} of its time) for the input stage, which is not keeping ahead of training. "
    )
    slow = (
        "the user's iterator or the scheduler is slower than a training step (see sched_ms, and sched_cpu_ms for "
        "the planner's own CPU)"
    )
    if priority != "normal":
        return head + (
            f"Its thread runs at input_priority={priority!r}: on cores busy with other work it may get "
            "too little CPU (try input_priority='normal', scheduler.input_priority=normal in the app), "
            f"or {slow}."
        )
    return head + slow[0].upper() + slow[1:] + "."


@dataclass
class LagWindow:
    """The consumer's waits since the last lag check: seconds waited, seconds elapsed between batches, batches."""

    waited: float = 0.0
    elapsed: float = 0.0
    batches: int = 0


class PrefetchedInput:
    """Runs `stage(source)` in a daemon thread at CPU `priority`, `depth` items ahead; yields its items (batch,
    plan, generation) in order and re-raises the thread's exception in the consumer. Safe for the input stage
    because its collectives use their own gloo group (no ordering to share with the data plane's) and every rank's
    thread issues the same sequence. `waits` (if given) gets the consumer's wait for each item, in ms; `stop` (if
    given) asks the stage to end early (`close`)."""

    _END = object()

    def __init__(
        self,
        stage: Callable[[Iterator], Iterator],
        source: Iterator,
        depth: int,
        priority: str = "normal",
        waits: Optional[MutableSequence[float]] = None,
        stop: Optional[Callable[[], None]] = None,
    ) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._waits, self._priority, self._stop = waits, priority, stop
        self._closed = False
        self._last: Optional[float] = None  # when the previous item was handed out
        self._window = LagWindow()
        self._warned = False
        self._thread = threading.Thread(
            target=self._run, args=(stage, source, priority), name="herald-input", daemon=True
        )
        self._thread.start()

    def _run(self, stage: Callable[[Iterator], Iterator], source: Iterator, priority: str) -> None:
        try:
            name_os_thread(OS_THREAD_NAME)
            set_thread_priority(priority)
            for item in stage(source):
                self._q.put(item)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._q.put(e)
            return
        self._q.put(self._END)

    def __iter__(self) -> "PrefetchedInput":
        return self

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Ask the stage to stop (`stop`), take and drop what it still hands over (so it never blocks on a full
        queue) until it ends, and wait for its thread: True if it ended within `timeout` seconds. The stage's last
        rounds are collectives, so this ends only where every rank closes its stream; an error the stage meets
        while stopping (a rank already gone) ends it too. Afterwards the iterator is exhausted."""
        self._closed = True
        if self._stop is not None:
            self._stop()
        deadline = time.monotonic() + timeout
        while self._thread.is_alive():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                item = self._q.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if item is self._END or isinstance(item, BaseException):
                break
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def __next__(self):
        if self._closed:
            raise StopIteration
        t0 = time.perf_counter()
        item = self._q.get()
        if item is self._END:
            self._q.put(self._END)  # stay exhausted
            raise StopIteration
        now = time.perf_counter()
        if self._waits is not None:
            self._waits.append((now - t0) * 1e3)
        self._watch(now - t0, now)
        if isinstance(item, BaseException):
            raise item
        return item

    def _watch(self, wait: float, now: float) -> None:
        """Warn once if, over LAG_WINDOW batches, waiting took LAG_SHARE of the time between batches. The first
        batch is left out: it waits for the stage to start, not for a lagging one."""
        if self._last is not None and not self._warned:
            w = self._window
            w.waited += wait
            w.elapsed += now - self._last
            w.batches += 1
            if w.batches >= LAG_WINDOW:
                share = w.waited / max(w.elapsed, 1e-9)
                if share >= LAG_SHARE:
                    self._warned = True
                    warnings.warn(
                        lag_message(1e3 * w.waited / w.batches, share, w.batches, self._priority),
                        RuntimeWarning,
                        stacklevel=3,
                    )
                self._window = LagWindow()
        self._last = now
