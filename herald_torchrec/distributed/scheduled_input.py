"""The Herald input stage: from this rank's slice of each global batch to its *assigned* samples plus the Plan.

Per step, every rank: (1) all-gathers the ids of its slice, so every rank holds the ids of the whole global batch
(ids only — dense features and labels stay put); (2) runs the scheduler on the current global batch and the next L
(deterministic integer code: every rank computes the same plan, nothing is broadcast); (3) exchanges dense features,
labels and the ids of *unscheduled* tables (`carry`: tables left to TorchRec's own sharding) with one plan-sized
all-to-all of 4-byte words (bit-exact: nothing is converted), so it holds exactly the B samples the plan assigns it.
Ids of the managed tables come from the gathered global batch. All ranks agree on the end of data (each rank's ids slice starts with
a header word that says whether it holds data), so every rank stops at the same step.

One collective per step for all of it: (1) for the batch L+1 ahead and (3) for the current batch happen back to
back, so they travel as ONE all-to-all (each rank sends its ids slice to every rank, then the samples the plan
assigns to that rank); the same bytes as an all-gather plus an all-to-all. Only the first L+1 gathers (nothing to
exchange yet) and the last L exchanges (nothing left to gather) run alone.

The stage decides nothing: the policy (control plane) decides, this moves bytes.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from herald_torchrec.data.samples import Samples
from herald_torchrec.distributed.comm import PlanComm, phase
from herald_torchrec.schedule.batch import GlobalBatch
from herald_torchrec.schedule.plan import Plan
from herald_torchrec.schedule.policy import SchedulePolicy


class ScheduledInput:
    """Iterator adapter: local `Samples` slices in, (assigned local `Samples`, `Plan`) out, L batches ahead."""

    def __init__(self, policy: SchedulePolicy, comm: PlanComm, columns: list[int], carry: list[int] | None = None) -> None:
        self.policy = policy
        self.comm = comm
        self.columns = columns  # columns of Samples.ids that the managed tables read, in table order
        self.carry = list(carry or [])  # columns the model reads through TorchRec-sharded tables
        if set(self.columns) & set(self.carry):
            raise ValueError(f"ScheduledInput: columns {sorted(set(self.columns) & set(self.carry))} are both scheduled and carried")
        self.R, self.rank = comm.world_size, comm.rank
        self.B = policy.batch_per_rank
        if policy.num_ranks != self.R:
            raise ValueError(f"policy planned for {policy.num_ranks} ranks, but the process group has {self.R}")
        self.sched_ms: list[float] = []
        self._wire_dtype = np.int32 if max(policy.layout.table_rows) <= np.iinfo(np.int32).max else np.int64

    # header word of each rank's ids slice: what the rest of the slice holds
    _DATA, _END, _BAD = 1, 0, -1

    def _ids_wire(self, local: Samples | None) -> torch.Tensor:
        """This rank's ids slice for the gather: [header, B x C ids]. Ids travel as int32 when every table fits
        (exact: no float, no truncation), else as int64."""
        C = len(self.columns)
        wire = torch.zeros(1 + self.B * C, dtype=torch.int32 if self._wire_dtype == np.int32 else torch.int64)
        w = wire.numpy()
        if local is None:
            w[0] = self._END
        elif len(local) != self.B:
            w[0] = self._BAD
        else:
            w[0] = self._DATA
            w[1:].reshape(self.B, C)[:] = local.ids[:, self.columns]
        return wire

    def _count_gather(self, heads: np.ndarray, wire: torch.Tensor, call: bool) -> None:
        """Bytes of an ids gather: each slice goes to the R - 1 others; header as "control", ids as "sample_ids"
        (all "control" when a slice is only padding because some rank is out of data). `call`: the gather is a
        collective of its own (not riding on the sample exchange)."""
        elem, n = wire.element_size(), wire.numel()
        if (heads == self._DATA).all():
            self.comm.counter.add("control", elem * (self.R - 1), call=False)
            self.comm.counter.add("sample_ids", (n - 1) * elem * (self.R - 1), call=call)
        else:
            self.comm.counter.add("control", n * elem * (self.R - 1), call=call)

    def _gathered(self, local: Samples | None, slices: np.ndarray) -> tuple[Samples, GlobalBatch, np.ndarray] | None:
        """Every rank's ids slice [R, 1 + B*C] -> (local slice, global batch, its dense ids), or None at the end of
        data (some rank has none: all stop together). A malformed slice raises on every rank."""
        head = slices[:, 0]
        if (head == self._BAD).any():
            q = int(np.flatnonzero(head == self._BAD)[0])
            raise ValueError(self._bad_slice_msg(q, len(local) if q == self.rank and local is not None else None))
        if (head == self._END).any():
            return None
        ids = slices[:, 1:].reshape(self.R * self.B, len(self.columns)).astype(np.int64)
        return local, GlobalBatch.from_dense(ids, self.policy.layout), ids

    def _gather(self, local: Samples | None) -> tuple[Samples, GlobalBatch, np.ndarray] | None:
        """All-gather of the ids slices alone (the first L+1 batches, before anything is to be exchanged)."""
        if self.R == 1:
            if local is None:
                return None
            if len(local) != self.B:
                raise ValueError(self._bad_slice_msg(self.rank, len(local)))
            ids = np.ascontiguousarray(local.ids[:, self.columns]).astype(np.int64, copy=False)
            return local, GlobalBatch.from_dense(ids, self.policy.layout), ids
        wire = self._ids_wire(local)
        parts = [torch.empty_like(wire) for _ in range(self.R)]
        with phase("input.ids_all_gather"):
            dist.all_gather(parts, wire, group=self.comm.group)
        slices = torch.stack(parts).numpy()
        self._count_gather(slices[:, 0], wire, call=True)
        return self._gathered(local, slices)

    def _bad_slice_msg(self, rank: int, n: int | None) -> str:
        got = f"a slice of {n} samples" if n is not None else "a slice of the wrong size"
        return f"rank {rank} got {got}, expected batch_per_rank={self.B}"

    def _exchange_sends(self, local: Samples, plan: Plan) -> tuple[np.ndarray, list[int], list[int], np.ndarray]:
        """What the exchange sends: (payload rows = 4-byte words of dense, label and carried ids of this rank's
        samples, grouped by destination; send splits; receive splits; global indices of the samples this rank gets)."""
        owner_rank = np.arange(self.R * self.B) // self.B  # global sample g sits on rank g // B
        assign = plan.assignment()
        mine = plan.local_samples(self.rank)  # increasing global order
        lo = self.rank * self.B
        # what this rank sends to d: its own samples assigned to d, in global order
        dest = assign[lo : lo + self.B]
        order = np.argsort(dest, kind="stable")
        send_splits = np.bincount(dest, minlength=self.R).tolist()
        recv_splits = np.bincount(owner_rank[mine], minlength=self.R).tolist()
        words = [np.ascontiguousarray(local.dense, dtype=np.float32).view(np.int32),
                 np.ascontiguousarray(local.labels, dtype=np.float32)[:, None].view(np.int32)]
        if self.carry:  # int64 ids as two words each
            words.append(np.ascontiguousarray(local.ids[:, self.carry]).view(np.int32))
        payload = np.concatenate(words, axis=1)[order]
        return payload, send_splits, recv_splits, mine

    def _assigned(self, local: Samples, got: np.ndarray, ids: np.ndarray, mine: np.ndarray) -> Samples:
        """Received payload words [B, D + 1 (+ 2 per carried column)] + the gathered managed ids -> Samples."""
        D = local.dense.shape[1]
        full_ids = np.zeros((self.B, local.ids.shape[1]), dtype=np.int64)
        full_ids[:, self.columns] = ids[mine]
        if self.carry:
            full_ids[:, self.carry] = np.ascontiguousarray(got[:, D + 1 :]).view(np.int64)
        dense = np.ascontiguousarray(got[:, :D]).view(np.float32)
        labels = np.ascontiguousarray(got[:, D]).view(np.float32)
        return Samples(dense=dense, ids=full_ids, labels=labels)

    def exchange(self, local: Samples, batch: GlobalBatch, plan: Plan, ids: np.ndarray | None = None) -> Samples:
        """Dense features + labels to the ranks the plan assigns them to; ids from the gathered global batch (`ids`:
        its dense [R*B, T] form when at hand, which saves one gather per table)."""
        payload, send_splits, recv_splits, mine = self._exchange_sends(local, plan)
        got = self.comm.all_to_all(torch.from_numpy(payload), send_splits, recv_splits, "samples")
        if ids is None:
            ids = np.stack([batch.values[t] for t in range(batch.num_tables)], axis=1)
        return self._assigned(local, got.numpy(), ids, mine)

    def exchange_and_gather(
        self, local: Samples, plan: Plan, ids: np.ndarray, nxt: Samples | None
    ) -> tuple[Samples, tuple[Samples, GlobalBatch, np.ndarray] | None]:
        """`exchange` of the current batch and `_gather` of the next slice `nxt` as one all-to-all of bytes: to each
        rank d, this rank's ids slice, then the payload rows assigned to d (bit-exact: both only travel as bytes)."""
        if self.R == 1:
            return self.exchange(local, None, plan, ids), self._gather(nxt)  # type: ignore[arg-type]
        payload, send_splits, recv_splits, mine = self._exchange_sends(local, plan)
        wire = self._ids_wire(nxt)
        wire_b = wire.view(torch.uint8)
        pay = torch.from_numpy(np.ascontiguousarray(payload))
        row_b = pay.shape[1] * pay.element_size()
        pay_b = pay.view(torch.uint8).reshape(-1)
        off = np.concatenate([[0], np.cumsum(send_splits)]) * row_b
        send = torch.cat([x for d in range(self.R) for x in (wire_b, pay_b[off[d] : off[d + 1]])])
        n_id = wire_b.numel()
        s_spl = [n_id + n * row_b for n in send_splits]
        r_spl = [n_id + n * row_b for n in recv_splits]
        out = torch.empty(sum(r_spl), dtype=torch.uint8)
        self.comm.counter.add("samples", row_b * (sum(send_splits) - send_splits[self.rank]))
        with phase("input.samples_ids_all_to_all"):
            dist.all_to_all_single(out, send, r_spl, s_spl, group=self.comm.group)
        blocks = torch.split(out, r_spl)
        slices = torch.stack([b[:n_id].view(wire.dtype) for b in blocks]).numpy()
        got = torch.cat([b[n_id:] for b in blocks]).view(pay.dtype).reshape(-1, pay.shape[1]).numpy()
        self._count_gather(slices[:, 0], wire, call=False)
        return self._assigned(local, got, ids, mine), self._gathered(nxt, slices)

    def __call__(self, stream: Iterator[Samples]) -> Iterator[tuple[Samples, Plan]]:
        window: deque[tuple[Samples, GlobalBatch, np.ndarray]] = deque()
        exhausted = False
        for _ in range(self.policy.lookahead + 1):
            nxt = next(stream, None)
            with phase("input.gather"):
                got = self._gather(nxt)
            if got is None:
                exhausted = True
                break
            window.append(got)
        while window:
            local, batch, ids = window[0]
            with phase("input.plan"):
                plan = self.policy.plan([b for _, b, _ in window])
            self.sched_ms.append(plan.sched_seconds * 1e3)  # timed by the policy itself
            if exhausted:
                with phase("input.exchange"):
                    assigned = self.exchange(local, batch, plan, ids)
            else:
                nxt = next(stream, None)
                with phase("input.exchange_and_gather"):
                    assigned, got = self.exchange_and_gather(local, plan, ids, nxt)
                if got is None:
                    exhausted = True
                else:
                    window.append(got)
            window.popleft()
            yield assigned, plan
