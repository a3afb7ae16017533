"""The step's collectives as TorchRec-style dist objects: call one to issue its collective, `.wait()` the awaitable.

As in torchrec/distributed/dist_data.py (KJTAllToAll, PooledEmbeddingsAllToAll, ...), each object wraps one kind
of collective of the data plane over the module's `PlanComm` and returns a `torchrec.distributed.types.Awaitable`;
the all-to-alls are issued with async_op=True, so a caller may do host work between issuing and waiting. What to
send and the split sizes come from plan_exec.py (identical on every rank, so no size exchange precedes them); a
collective that moves nothing on any rank (`globally_empty`, known from the plan) is skipped by every rank.

- `RowMoveDist`: rows + optimizer state of the step's moves (bytes counted as "moves");
- `SharedValueDist`: owners send shared rows' values to their readers ("shared_value");
- `SharedGradDist`: readers return those rows' gradients to the owners, the reverse routes ("shared_grad");
- `ErrorFlagDist`: a rank-local error raised on every rank ("control"). A step's error flag rides as one header
  element per block on the step's first all-to-all (`ErrorCheck`), so only a step without one pays an all-reduce.

This is the data plane: it may import torch.distributed (the control plane never does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from torchrec.distributed.types import Awaitable

from herald_torchrec.distributed.comm import PendingAllToAll, PlanComm
from herald_torchrec.distributed.plan_exec import MoveStep, SharedStep

W = TypeVar("W")


@dataclass
class ErrorCheck:
    """A step's rank-local error (or None), to be raised on every rank by the first collective of the step, which
    carries `flag` (0, or this rank + 1) to the others."""

    err: Exception | None
    flag: int


def raise_step_error(err: Exception | None, worst_flag: int) -> None:
    """Raise this rank's own error, or a ValueError naming the failed rank (flag = rank + 1) if another failed."""
    if err is not None:
        raise err
    if worst_flag:
        raise ValueError(f"step aborted: rank {worst_flag - 1} rejected its input or the plan (see its error)")


class _AllToAllAwaitable(Awaitable[W]):
    """Completes a `PendingAllToAll`; with an `ErrorCheck`, raises the step's error on every rank first."""

    def __init__(self, pending: PendingAllToAll | None, check: ErrorCheck | None, done: Callable[[torch.Tensor], W]) -> None:
        super().__init__()
        self._pending, self._check, self._done = pending, check, done

    def _wait_impl(self) -> W:
        if self._pending is None:  # globally empty: nothing was issued
            return self._done(None)  # type: ignore[arg-type]
        if self._check is not None:
            out, worst = self._pending.wait_flagged()
            raise_step_error(self._check.err, worst)
        else:
            out = self._pending.wait()
        return self._done(out)


class _PlanAllToAll:
    """An all-to-all of the data plane of one kind, over the module's counted process group."""

    kind = ""

    def __init__(self, comm: PlanComm) -> None:
        self._comm = comm

    def _start(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], check: ErrorCheck | None
    ) -> PendingAllToAll:
        if check is not None:
            return self._comm.start_all_to_all_flagged(send, send_splits, recv_splits, self.kind, check.flag)
        return self._comm.start_all_to_all(send, send_splits, recv_splits, self.kind)


class _StepAllToAll(_PlanAllToAll):
    """The forward exchange of a step object (`MoveStep` / `SharedStep`: its send / recv splits): skipped by every
    rank when the step is globally empty (the awaitable then gives None); with `check`, any rank's error raises
    on every rank at `wait()`, before the caller changes anything."""

    def __call__(
        self, send: torch.Tensor | None, step: MoveStep | SharedStep, check: ErrorCheck | None = None
    ) -> Awaitable[torch.Tensor | None]:
        if step.globally_empty:
            return _AllToAllAwaitable(None, None, lambda out: None)
        return _AllToAllAwaitable(self._start(send, step.send_splits, step.recv_splits, check), check, lambda out: out)


class RowMoveDist(_StepAllToAll):
    """Every departing row (value + optimizer state, packed as `RowStore.read_packed` lays them out, in send order)
    goes to its destination; the awaitable gives the arriving rows in receive order (`MoveStep.recv_idx`)."""

    kind = "moves"


class SharedValueDist(_StepAllToAll):
    """Owners send the shared rows' values (laid out as `SharedStep.send_off`) to their readers, all tables in one
    all-to-all; the awaitable gives the received values laid out as `recv_off`."""

    kind = "shared_value"


class SharedGradDist(_PlanAllToAll):
    """Readers return the gradients of the values they received (laid out as `recv_off`) to the owners: the
    reverse routes of `SharedValueDist`; the awaitable gives them laid out as `send_off`."""

    kind = "shared_grad"

    def __call__(self, grad: torch.Tensor, sh: SharedStep) -> Awaitable[torch.Tensor]:
        return _AllToAllAwaitable(self._start(grad, sh.recv_splits, sh.send_splits, None), None, lambda out: out)


class ErrorFlagDist:
    """A step's rank-local errors raised on every rank together (so that no rank is left waiting in a collective),
    for steps whose data collectives cannot carry the flag: one 8-byte MAX all-reduce of (rank + 1 or 0). With one
    rank, or `globally=False`, only this rank's own error raises."""

    def __init__(self, comm: PlanComm, rank: int, world_size: int, device: torch.device) -> None:
        self._comm, self.rank, self.world_size, self.device = comm, rank, world_size, device

    def __call__(self, err: Exception | None, globally: bool = True) -> None:
        worst = 0
        if self.world_size > 1 and globally:
            flag = torch.tensor([0 if err is None else self.rank + 1], dtype=torch.int64, device=self.device)
            self._comm.all_reduce(flag, "control", op=dist.ReduceOp.MAX)  # on the device: NCCL needs CUDA tensors
            worst = int(flag.item())
        raise_step_error(err, worst)
