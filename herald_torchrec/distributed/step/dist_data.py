"""The step's collectives as TorchRec-style dist objects: call one to issue its collective, `.wait()` the awaitable.

As in torchrec/distributed/dist_data.py (KJTAllToAll, PooledEmbeddingsAllToAll, ...), each object wraps one kind
of collective of the data plane over the module's `PlanComm` and returns a `torchrec.distributed.types.Awaitable`;
the all-to-alls are issued with async_op=True, so a caller may do host work between issuing and waiting. What to
send and the split sizes come from step/prepare.py (identical on every rank, so no size exchange precedes them); a
collective that moves nothing on any rank (`globally_empty`, known from the plan) is skipped by every rank.

- `StepExchangeDist`: the step's one forward all-to-all: the rows that move (value + optimizer state, counted as
  "moves") and the shared rows' values sent to their readers by the owners before the moves ("shared_value");
- `RowMoveDist`: rows + optimizer state alone (moves outside a training step: a checkpoint load sending rows home);
- `SharedGradDist`: readers return the shared rows' gradients to the owners after the moves ("shared_grad");
- `ErrorFlagDist`: a rank-local error raised on every rank ("control"). A step's error flag rides as one header
  element per block on the step's first all-to-all (`ErrorCheck`), so only a step without one pays an all-reduce.

This is the data plane: it may import torch.distributed (the control plane never does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.types import Awaitable

from herald_torchrec.distributed.comm import PendingAllToAll, PlanComm
from herald_torchrec.distributed.step.prepare import MoveStep, SharedStep

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
    """Completes a `PendingAllToAll`; with an `ErrorCheck`, raises the step's error on every rank first. With
    `recv_splits`, `done` gets the data from each rank as a list (views, no copy) instead of one tensor."""

    def __init__(
        self,
        pending: PendingAllToAll | None,
        check: ErrorCheck | None,
        done: Callable[[torch.Tensor], W],
        recv_splits: list[int] | None = None,
    ) -> None:
        super().__init__()
        self._pending, self._check, self._done, self._recv = pending, check, done, recv_splits

    def _wait_impl(self) -> W:
        if self._pending is None:  # globally empty: nothing was issued
            return self._done(None)  # type: ignore[arg-type]
        if self._check is not None:
            out, worst = self._pending.wait_flagged_parts() if self._recv is not None else self._pending.wait_flagged()
            raise_step_error(self._check.err, worst)
        else:
            out = self._pending.wait()
            if self._recv is not None:
                out = list(out.split(self._recv))
        return self._done(out)


class _PlanAllToAll:
    """An all-to-all of the data plane of one kind, over the module's counted process group."""

    kind = ""

    def __init__(self, comm: PlanComm) -> None:
        self._comm = comm

    def _start(
        self,
        send: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        check: ErrorCheck | None,
        kind: str | dict[str, int] | None = None,
    ) -> PendingAllToAll:
        """Issue the all-to-all, counted as `kind` (default: the class's; or {kind: off-rank bytes}); with `check`,
        it carries the step's error flags (then complete it with `wait_flagged`)."""
        kind = self.kind if kind is None else kind
        if check is not None:
            return self._comm.start_all_to_all_flagged(send, send_splits, recv_splits, kind, check.flag)
        return self._comm.start_all_to_all(send, send_splits, recv_splits, kind)


class RowMoveDist(_PlanAllToAll):
    """Every departing row (value + optimizer state, packed as `RowStore.read_packed` lays them out, in send order)
    goes to its destination; the awaitable gives the arriving rows in receive order (`MoveStep.recv_idx`), or None
    when no rank moves a row (nothing is issued). With `check`, any rank's error raises on every rank at `wait()`,
    before the caller changes anything."""

    kind = "moves"

    def __call__(
        self, send: torch.Tensor, ms: MoveStep, check: ErrorCheck | None = None
    ) -> Awaitable[torch.Tensor | None]:
        if ms.globally_empty:
            return _AllToAllAwaitable(None, None, lambda out: None)
        return _AllToAllAwaitable(self._start(send, ms.send_splits, ms.recv_splits, check), check, lambda out: out)


def half_words(values: torch.Tensor) -> torch.Tensor:
    """Float32 values that are float16 values (read from FP16 rows) as their float16 bits, two to a float32 word:
    what an FP16 row's shared value travels as (half the bytes, exact). The count must be even (dims are multiples
    of 4)."""
    return values.to(torch.float16).view(torch.float32)


def from_half_words(words: torch.Tensor) -> torch.Tensor:
    """The inverse of `half_words`: the float32 values (exact)."""
    return words.contiguous().view(torch.float16).to(torch.float32)


def _words(splits: list[int], half: bool) -> list[int]:
    """Split sizes in float32 words of values in floats: halved when the values travel as float16 bits."""
    return [s // 2 for s in splits] if half else list(splits)


def _per_peer(a: torch.Tensor, a_splits: list[int], b: torch.Tensor, b_splits: list[int]) -> list[list[torch.Tensor]]:
    """Per peer, a's block then b's block (1-D tensors cut by their splits, as views): two kinds in one send."""
    return [list(x) for x in zip(a.split(a_splits), b.split(b_splits))]


def _deinterleave(blocks: list[torch.Tensor], a_splits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The receiving side of `_per_peer`: from each peer's block (a's part, then b's), (a's parts, b's parts), each
    in peer order: one copy each."""
    heads = [blk[:n] for blk, n in zip(blocks, a_splits)]
    tails = [blk[n:] for blk, n in zip(blocks, a_splits)]
    return torch.cat(heads), torch.cat(tails)


class StepExchangeDist(_PlanAllToAll):
    """The step's one forward all-to-all: to each peer, the rows that move there (packed as `RowStore.read_packed`
    lays them out, in `MoveStep` send order) then the shared values its reads need from this rank (in `SharedStep`
    value order). A shared value is sent by the row's owner *before* the moves, so values need not wait for the
    moves to land: one collective (one synchronisation of the ranks) where moves and values took two. The awaitable
    gives (arriving rows in `MoveStep.recv_idx` order, received values in value order), or None when the step moves
    and shares nothing on any rank (nothing is issued). With `half`, the values (of FP16 rows) travel as their
    float16 bits (`half_words`) and arrive as float32 values."""

    def __call__(
        self,
        rows: torch.Tensor,
        ms: MoveStep,
        values: torch.Tensor,
        sh: SharedStep,
        check: ErrorCheck | None = None,
        half: bool = False,
    ) -> Awaitable[tuple[torch.Tensor, torch.Tensor] | None]:
        if ms.globally_empty and sh.globally_empty:
            return _AllToAllAwaitable(None, None, lambda out: None)
        value_splits, value_recv = _words(sh.value_splits, half), _words(sh.recv_splits, half)
        if half:
            values = half_words(values)
        parts = _per_peer(rows, ms.send_splits, values, value_splits)
        recv_splits = [a + b for a, b in zip(ms.recv_splits, value_recv)]
        r, elem = self._comm.rank, values.element_size()
        kinds = {}  # off-rank bytes by kind, for the kinds this step has on some rank
        if not ms.globally_empty:
            kinds["moves"] = elem * (sum(ms.send_splits) - ms.send_splits[r])
        if not sh.globally_empty:
            kinds["shared_value"] = elem * (sum(value_splits) - value_splits[r])
        if check is not None:  # the flag headers and both kinds go into the send buffer in one copy
            pending = self._comm.start_all_to_all_flagged_parts(parts, recv_splits, kinds, check.flag)
        else:
            send_splits = [a + b for a, b in zip(ms.send_splits, value_splits)]
            pending = self._start(torch.cat([x for p in parts for x in p]), send_splits, recv_splits, None, kinds)

        def done(blocks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            moved, vals = _deinterleave(blocks, ms.recv_splits)
            return moved, (from_half_words(vals) if half else vals)

        return _AllToAllAwaitable(pending, check, done, recv_splits)


class SharedGradDist(_PlanAllToAll):
    """Readers return the gradients of the values they read (in `SharedStep.grad_idx` order) to the owners after
    the moves; the awaitable gives them laid out as `send_off`."""

    kind = "shared_grad"

    def __call__(self, grad: torch.Tensor, sh: SharedStep) -> Awaitable[torch.Tensor]:
        return _AllToAllAwaitable(self._start(grad, sh.grad_splits, sh.send_splits, None), None, lambda out: out)


class _RelayAllToAll(_PlanAllToAll):
    """An all-to-all among the ranks of one host (`comm` over them; `members`: their ranks in the module's group, in
    the host group's order): the relay stages' splits are zero outside the host, so only the host's peers take
    part. Over the module's own group (`members` all its ranks) where no host group could be made."""

    def __init__(self, comm: PlanComm, members: np.ndarray) -> None:
        super().__init__(comm)
        self._members = np.asarray(members, dtype=np.int64)

    def _local(self, splits: list[int]) -> list[int]:
        return [splits[m] for m in self._members]


class RelayValueDist(_RelayAllToAll):
    """Host relays forward the values they received to the other readers of their host (host_relay.py); the
    awaitable gives the forwarded values in receive order (after the owners' values in value order)."""

    kind = "relay_value"

    def __call__(self, values: torch.Tensor, sh: SharedStep, half: bool = False) -> Awaitable[torch.Tensor]:
        """`half`: values of FP16 rows, sent as their float16 bits (`half_words`), given back as float32."""
        send, recv = _words(self._local(sh.fwd_splits), half), _words(self._local(sh.fwd_recv_splits), half)
        if half:
            return _AllToAllAwaitable(
                self._start(half_words(values), send, recv, None), None, lambda out: from_half_words(out)
            )
        return _AllToAllAwaitable(self._start(values, send, recv, None), None, lambda out: out)


class RelayGradDist(_RelayAllToAll):
    """Readers send the gradients of rows their host's relay returns for them (host_relay.py), inside the host; the
    awaitable gives them in receive order, for the relay to add to its own before the sums go to the owners."""

    kind = "relay_grad"

    def __call__(self, grad: torch.Tensor, sh: SharedStep) -> Awaitable[torch.Tensor]:
        send, recv = self._local(sh.relay_grad_splits), self._local(sh.relay_grad_recv_splits)
        return _AllToAllAwaitable(self._start(grad, send, recv, None), None, lambda out: out)


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
