"""Plan-sized collectives and the byte counter behind the `comm_bytes_per_step` metric.

Every split size of the data plane's all-to-alls is known on every rank from the plan (the scheduler is
deterministic and runs everywhere), so no size exchange precedes them, and an all-to-all that moves nothing on any
rank is skipped by all ranks together (the caller passes `globally_empty`, also known from the plan).

`CommCounter` records, by kind, the payload bytes this rank hands to torch.distributed collectives for *other*
ranks (self-sends of an all-to-all are local copies and are not counted), plus the number of collectives issued.
The same counter wraps every scheduler's data plane, so traffic is compared on equal terms. Conventions:
- all_to_all: sum of the send splits to other ranks x element size;
- all_gather: input bytes x (R - 1) (each other rank gets a copy);
- all_reduce: input bytes (a ring all-reduce sends ~2(R-1)/R of that; reported as the nominal payload).

`phase(name)` is an opt-in per-phase wall-clock timer for the data plane (set HERALD_PHASE_TIMES=1): it tells where
a step's time goes without a sampling profiler, whose per-function shares are too thin to read here.

This is the data plane: it may import torch.distributed (the control plane never does).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import sys
import time
from collections import defaultdict, deque
from typing import ContextManager, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

PHASE_TIMES_ENV = "HERALD_PHASE_TIMES"
PHASE_TIMES_TAG = "[herald-phases]"
_PHASES_ON = os.environ.get(PHASE_TIMES_ENV, "") not in ("", "0")
_phase_totals: dict[str, list[float]] = {}  # name -> [wall seconds, calls, CPU seconds of the calling thread]
_NO_PHASE: ContextManager[None] = contextlib.nullcontext()


@contextlib.contextmanager
def _timed(name: str) -> Iterator[None]:
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        yield
    finally:
        acc = _phase_totals.setdefault(name, [0.0, 0, 0.0])
        acc[0] += time.perf_counter() - t0
        acc[1] += 1
        acc[2] += time.thread_time() - c0


def phase(name: str) -> ContextManager[None]:
    """`with phase("x"):` adds the block's wall time (and the CPU time of the calling thread: a collective's wait and
    gloo's own threads are not in it) to phase x when HERALD_PHASE_TIMES is set; else a shared no-op context (off by
    default: a step must not pay for its own measurement)."""
    return _timed(name) if _PHASES_ON else _NO_PHASE


def phase_times() -> dict[str, dict[str, float]]:
    """{phase: {"ms": total wall, "cpu_ms": total CPU of the thread, "calls": n, "ms_per_call": mean wall}}
    accumulated so far in this process."""
    return {
        k: {
            "ms": round(1e3 * s, 3),
            "cpu_ms": round(1e3 * c, 3),
            "calls": int(n),
            "ms_per_call": round(1e3 * s / max(n, 1), 4),
        }
        for k, (s, n, c) in sorted(_phase_totals.items())
    }


def _print_phase_times() -> None:
    if _phase_totals:
        rank = os.environ.get("RANK", "0")
        # one write for the whole line: under `python -u` print() writes the text and its newline apart, and the
        # ranks of one machine share the stream, so another rank's line could land between them
        sys.stderr.write(f"{PHASE_TIMES_TAG} rank={rank} {json.dumps(phase_times())}\n")
        sys.stderr.flush()


if _PHASES_ON:
    atexit.register(_print_phase_times)


GLOO_HELD = 8  # the collectives whose CPU tensors are held for gloo's worker threads (the last few suffice)
GLOO_EXIT_WAIT_S = 1.0  # at exit, how long to wait for gloo's threads to let go of them
GLOO_GRACE_S = 0.05  # a torch that cannot count a tensor's owners (no `Tensor._use_count`): one grace at exit instead
_USE_COUNT = hasattr(torch.Tensor, "_use_count")
_held: deque[tuple[torch.Tensor, ...]] = deque(maxlen=GLOO_HELD)
_release_registered = False


def hold_for_gloo(*tensors: torch.Tensor) -> None:
    """Keep a just-issued collective's CPU tensors alive until gloo's worker threads have let go of them.

    A gloo worker drops its work, and the tensors in it, a moment after the collective completes. If Python has
    dropped them first, that drop takes the GIL; if the interpreter is finalizing by then (a script that exits
    right after a collective, e.g. `model.state_dict()` or `pipeline.close()`, without `destroy_process_group()`),
    the worker thread is killed inside C++ and the process aborts ("terminate called without an active
    exception", pytorch/pytorch#190489). So every collective of this package hands its tensors here, and at exit
    (`release_gloo_tensors`) the last few are released only once gloo holds none of them."""
    global _release_registered
    cpu = tuple(t for t in tensors if t.device.type == "cpu")
    if not cpu:
        return
    _held.append(cpu)
    if not _release_registered:  # registered after the process group exists: runs before torch's own exit hooks
        _release_registered = True
        atexit.register(release_gloo_tensors)


def release_gloo_tensors(timeout: float = GLOO_EXIT_WAIT_S) -> None:
    """Wait (GIL released) until no gloo worker references the held tensors, at most `timeout` seconds, then drop
    them here, in a live interpreter. Called at exit (and by the pipeline's exit hook after it closes)."""
    if not _USE_COUNT:  # nothing to check: gloo's threads get one grace, GIL released
        if _held:
            time.sleep(min(GLOO_GRACE_S, timeout))
        _held.clear()
        return
    deadline = time.monotonic() + timeout
    while _held:
        if any(t._use_count() > 1 for t in _held[0]) and time.monotonic() < deadline:
            time.sleep(0.001)
            continue
        _held.popleft()


class CommCounter:
    """Bytes and calls by kind (e.g. "moves", "shared_value", "shared_grad", "control")."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: int, call: bool = True) -> None:
        """`call=False`: bytes that ride on a collective already counted under another kind (e.g. a header)."""
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += int(call)

    def total_bytes(self) -> int:
        return int(sum(self.bytes.values()))

    def snapshot(self, reset: bool = False) -> dict[str, int]:
        """{kind: bytes} (a copy); with reset=True the counter starts again from zero (e.g. once per step)."""
        out = dict(self.bytes)
        if reset:
            self.reset()
        return out

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


def default_group_timeout() -> datetime.timedelta:
    """The timeout the default process group was created with (what the user gave `init_process_group`), or torch's
    default for gloo where the group does not say (another backend, a torch that stores it elsewhere)."""
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        timeout = backend.options._timeout
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout
    except (AttributeError, RuntimeError, ValueError):
        pass
    return dist.default_pg_timeout


def host_subgroups(group: dist.ProcessGroup | None, host: np.ndarray) -> tuple[dist.ProcessGroup, np.ndarray] | None:
    """A process group over the ranks of this rank's host (`host`: the host id of every rank of `group`) and those
    ranks, as ranks of `group` in order; None where `group` does not span every process (torch creates groups with
    every process of the default group, which the other processes would not join). Collective: every rank calls it
    with the same `host`. The group waits as long as the default group does."""
    if not dist.is_initialized() or dist.get_world_size(group) != dist.get_world_size():
        return None
    R = dist.get_world_size(group)
    world = [dist.get_global_rank(group, r) if group is not None else r for r in range(R)]
    members = [np.flatnonzero(host == h) for h in range(int(host.max()) + 1)]
    mine, _ = dist.new_subgroups_by_enumeration(
        [[world[r] for r in m] for m in members if m.size],
        timeout=default_group_timeout(),
        backend=dist.get_backend(group),
    )
    return mine, members[int(host[dist.get_rank(group)])]


class PlanComm:
    """Collectives over one process group, counted in a `CommCounter`."""

    def __init__(self, group: dist.ProcessGroup | None = None, counter: CommCounter | None = None) -> None:
        self.group = group
        self.counter = counter if counter is not None else CommCounter()
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0

    def all_to_all(
        self,
        send: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        kind: str,
        globally_empty: bool = False,
    ) -> torch.Tensor:
        """Uneven all_to_all_single along dim 0 with split sizes known on every rank.

        `send` holds the blocks for ranks 0..R-1 in order (`send_splits[d]` rows for rank d); the result holds the
        blocks from ranks 0..R-1 (`recv_splits[s]` rows from rank s). `globally_empty` (every rank sends nothing,
        known from the plan) skips the collective on all ranks."""
        return self.start_all_to_all(send, send_splits, recv_splits, kind, globally_empty).wait()

    def start_all_to_all(
        self,
        send: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        kind: str | Mapping[str, int],
        globally_empty: bool = False,
    ) -> "PendingAllToAll":
        """`all_to_all`, issued with async_op=True: the returned handle's `wait()` gives the received tensor.
        `kind` may be {kind: off-rank bytes} for one collective that carries several kinds of data."""
        send_splits = [int(x) for x in send_splits]
        recv_splits = [int(x) for x in recv_splits]
        R = self.world_size
        if len(send_splits) != R or len(recv_splits) != R:
            raise ValueError(f"all_to_all: need {R} splits, got {len(send_splits)} / {len(recv_splits)}")
        if sum(send_splits) != send.shape[0]:
            raise ValueError(f"all_to_all: send splits sum to {sum(send_splits)}, tensor has {send.shape[0]} rows")
        out = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
        if globally_empty:
            if send.shape[0] or out.shape[0]:
                raise ValueError("all_to_all: globally_empty but this rank sends or receives data")
            return PendingAllToAll(out)
        if R == 1:
            out.copy_(send)
            return PendingAllToAll(out)
        row_bytes = send.element_size() * (send[0].numel() if send.dim() > 1 else 1)
        off_rank = sum(n for d, n in enumerate(send_splits) if d != self.rank)
        name = self._count(kind, off_rank * row_bytes)
        send = send.contiguous()
        work = dist.all_to_all_single(out, send, recv_splits, send_splits, group=self.group, async_op=True)
        hold_for_gloo(out, send)
        return PendingAllToAll(out, work, f"comm.all_to_all.{name}", keep=send)

    def _count(self, kind: str | Mapping[str, int], nbytes: int) -> str:
        """Count one collective's off-rank payload under `kind`, or under several kinds ({kind: bytes}, for one
        collective that carries several kinds of data); returns the name of its phase timer."""
        if isinstance(kind, str):
            self.counter.add(kind, nbytes)
            return kind
        for i, (k, b) in enumerate(kind.items()):
            self.counter.add(k, b, call=i == 0)
        return "+".join(kind)

    def all_to_all_flagged(
        self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], kind: str, flag: int
    ) -> tuple[torch.Tensor, int]:
        """`all_to_all` of a 1-D tensor that also carries a small non-negative integer from every rank (e.g. an error
        flag) and returns (received data, max of the flags over ranks): one header element in front of each block,
        so the flag needs no collective of its own. The data bytes count as `kind`, the headers as "control".
        The flag must be exact in send's dtype (float32: below 2**24)."""
        return self.start_all_to_all_flagged(send, send_splits, recv_splits, kind, flag).wait_flagged()

    def start_all_to_all_flagged(
        self,
        send: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        kind: str | Mapping[str, int],
        flag: int,
    ) -> "PendingAllToAll":
        """`all_to_all_flagged`, issued with async_op=True: the handle's `wait_flagged()` gives (data, max flag)."""
        send_splits = [int(x) for x in send_splits]
        if send.dim() != 1 or len(send_splits) != self.world_size or sum(send_splits) != send.shape[0]:
            raise ValueError(
                f"all_to_all_flagged: need a 1-D tensor and {self.world_size} splits that sum to its length"
            )
        return self.start_all_to_all_flagged_parts([[b] for b in send.split(send_splits)], recv_splits, kind, flag)

    def start_all_to_all_flagged_parts(
        self,
        parts: Sequence[Sequence[torch.Tensor]],
        recv_splits: Sequence[int],
        kind: str | Mapping[str, int],
        flag: int,
    ) -> "PendingAllToAll":
        """`start_all_to_all_flagged` with rank d's block given as the 1-D tensors `parts[d]` (one dtype): the header
        and every part go into the send buffer in one copy, so a caller that sends several kinds of data to each
        peer does not concatenate them first. `wait_flagged_parts()` gives the received blocks one by one."""
        recv_splits = [int(x) for x in recv_splits]
        R = self.world_size
        if len(parts) != R or len(recv_splits) != R or any(x.dim() != 1 for p in parts for x in p):
            raise ValueError(f"all_to_all_flagged: need {R} lists of 1-D tensors and {R} receive splits")
        sizes = [sum(int(x.shape[0]) for x in p) for p in parts]
        if R == 1:
            pending = self.start_all_to_all(torch.cat(list(parts[0])), sizes, recv_splits, kind)
            pending.flag = int(flag)
            return pending
        like = next(x for p in parts for x in p) if any(len(p) for p in parts) else None
        if like is None:
            raise ValueError("all_to_all_flagged: every rank's block needs at least one (possibly empty) tensor")
        # block d: [header, parts for rank d]: one cat, no per-element index maps
        head = like.new_full((R, 1), float(flag) if like.is_floating_point() else int(flag))
        buf = torch.cat([x for d in range(R) for x in (head[d], *parts[d])])
        r_spl = np.asarray(recv_splits, dtype=np.int64)
        out = like.new_empty(int(r_spl.sum()) + R)
        elem = like.element_size()
        name = self._count(kind, elem * (sum(sizes) - sizes[self.rank]))
        self.counter.add("control", elem * (R - 1), call=False)
        work = dist.all_to_all_single(
            out, buf, (r_spl + 1).tolist(), [n + 1 for n in sizes], group=self.group, async_op=True
        )
        hold_for_gloo(out, buf)
        return PendingAllToAll(out, work, f"comm.all_to_all.{name}", (r_spl + 1).tolist(), keep=buf)

    def all_reduce(self, tensor: torch.Tensor, kind: str, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce (a no-op on one rank)."""
        if self.world_size == 1:
            return tensor
        self.counter.add(kind, tensor.numel() * tensor.element_size())
        with phase(f"comm.all_reduce.{kind}"):
            dist.all_reduce(tensor, op=op, group=self.group)
        hold_for_gloo(tensor)
        return tensor

    def all_gather_uneven(self, tensor: torch.Tensor, kind: str) -> list[torch.Tensor]:
        """All-gather 1-D tensors of different lengths (one size exchange, then a padded all-gather)."""
        R = self.world_size
        if R == 1:
            return [tensor.clone()]
        n = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        sizes = [torch.zeros_like(n) for _ in range(R)]
        dist.all_gather(sizes, n, group=self.group)
        sizes_i = [int(s.item()) for s in sizes]
        m = max(sizes_i)
        padded = tensor.new_zeros(m)
        padded[: tensor.shape[0]] = tensor
        bufs = [tensor.new_empty(m) for _ in range(R)]
        self.counter.add(kind, (8 + m * tensor.element_size()) * (R - 1))
        dist.all_gather(bufs, padded, group=self.group)
        hold_for_gloo(n, padded, *sizes, *bufs)
        return [b[:s] for b, s in zip(bufs, sizes_i)]


class PendingAllToAll:
    """An all-to-all in flight (or already done: one rank, nothing to send). `wait()` returns the received tensor;
    for a flagged one (`start_all_to_all_flagged`), `wait_flagged()` returns (data, max of the flags over ranks).
    The phase timer, when on, times the wait (where an asynchronous collective's time is spent)."""

    def __init__(
        self,
        out: torch.Tensor,
        work: dist.Work | None = None,
        phase_name: str = "",
        blocks: list[int] | None = None,
        keep: torch.Tensor | None = None,
    ) -> None:
        self._out, self._work, self._phase = out, work, phase_name
        self._keep = keep  # the send buffer, alive until the collective has completed
        self._blocks = blocks  # flagged: the received block sizes, each [header, data...]
        self.flag = 0  # the flag's max when no headers travel (one rank)

    def _complete(self) -> torch.Tensor:
        if self._work is not None:
            with phase(self._phase):
                self._work.wait()
            self._work = self._keep = None
        return self._out

    def wait(self) -> torch.Tensor:
        if self._blocks is not None:
            raise ValueError("PendingAllToAll.wait: a flagged all-to-all is completed with wait_flagged()")
        return self._complete()

    def wait_flagged(self) -> tuple[torch.Tensor, int]:
        blocks, worst = self.wait_flagged_parts()
        return (blocks[0] if self._blocks is None else torch.cat(blocks)), worst  # one rank: the buffer itself

    def wait_flagged_parts(self) -> tuple[list[torch.Tensor], int]:
        """(the data received from each rank, in rank order, as views; max of the flags over ranks)."""
        out = self._complete()
        if self._blocks is None:  # one rank: no headers travelled
            return [out], int(self.flag)
        blocks = out.split(self._blocks)
        worst = int(torch.stack([b[0] for b in blocks]).max().item())  # one host read (a sync on CUDA), not R
        return [b[1:] for b in blocks], worst
