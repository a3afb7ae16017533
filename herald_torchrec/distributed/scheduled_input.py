"""The Herald input stage: from this rank's slice of each global batch to its *assigned* samples plus the Plan.

Per step, every rank: (1) all-gathers the ids of its slice, so every rank holds the ids of the whole global batch
(ids only — dense features and labels stay put); (2) runs the scheduler on the current global batch and the next L
(deterministic integer code: every rank computes the same plan, nothing is broadcast); (3) exchanges dense features,
labels and the ids of *unscheduled* tables (`carry`: tables left to TorchRec's own sharding) with one plan-sized
all-to-all of 4-byte words (bit-exact: nothing is converted), so it holds exactly the B samples the plan assigns it.
Ids of the managed tables come from the gathered global batch. All ranks agree on the end of data (each rank's
slice in the ids all-gather starts with a header word that says whether it holds data), so every rank stops at the
same step, with one collective per step for both.

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

    # header word of each rank's all-gather slice: what the rest of the slice holds
    _DATA, _END, _BAD = 1, 0, -1

    def _gather(self, local: Samples | None) -> tuple[Samples, GlobalBatch, np.ndarray] | None:
        """All-gather the ids of every rank's slice, with a header word per slice that tells whether the rank still
        has data: one collective per step, and every rank sees every header, so all stop at the same step (and a
        rank's malformed slice raises on every rank instead of leaving the others in the collective)."""
        bad = local is not None and len(local) != self.B
        if self.R == 1:
            if local is None:
                return None
            if bad:
                raise ValueError(self._bad_slice_msg(self.rank, len(local)))
            ids = np.ascontiguousarray(local.ids[:, self.columns]).astype(np.int64, copy=False)
            return local, GlobalBatch.from_dense(ids, self.policy.layout), ids
        # ids travel as int32 when every table fits (exact: no float, no truncation), else as int64
        C = len(self.columns)
        wire = torch.zeros(1 + self.B * C, dtype=torch.int32 if self._wire_dtype == np.int32 else torch.int64)
        w = wire.numpy()
        if local is None or bad:
            w[0] = self._END if local is None else self._BAD
        else:
            w[0] = self._DATA
            w[1:].reshape(self.B, C)[:] = local.ids[:, self.columns]
        parts = [torch.empty_like(wire) for _ in range(self.R)]
        with phase("input.ids_all_gather"):
            dist.all_gather(parts, wire, group=self.comm.group)
        got = torch.stack(parts).numpy()
        head = got[:, 0]
        elem = wire.element_size()
        if (head == self._DATA).all():
            self.comm.counter.add("control", elem * (self.R - 1), call=False)
            self.comm.counter.add("sample_ids", (wire.numel() - 1) * elem * (self.R - 1))
        else:  # nothing but the header carries information
            self.comm.counter.add("control", wire.numel() * elem * (self.R - 1))
        if (head == self._BAD).any():
            q = int(np.flatnonzero(head == self._BAD)[0])
            raise ValueError(self._bad_slice_msg(q, len(local) if q == self.rank else None))
        if (head == self._END).any():
            return None
        ids = got[:, 1:].reshape(self.R * self.B, C).astype(np.int64)
        return local, GlobalBatch.from_dense(ids, self.policy.layout), ids

    def _bad_slice_msg(self, rank: int, n: int | None) -> str:
        got = f"a slice of {n} samples" if n is not None else "a slice of the wrong size"
        return f"rank {rank} got {got}, expected batch_per_rank={self.B}"

    def exchange(self, local: Samples, batch: GlobalBatch, plan: Plan, ids: np.ndarray | None = None) -> Samples:
        """Dense features + labels to the ranks the plan assigns them to; ids from the gathered global batch (`ids`:
        its dense [R*B, T] form when at hand, which saves one gather per table)."""
        owner_rank = np.arange(self.R * self.B) // self.B  # global sample g sits on rank g // B
        assign = plan.assignment()
        mine = plan.local_samples(self.rank)  # increasing global order
        lo = self.rank * self.B
        # what this rank sends to d: its own samples assigned to d, in global order
        local_idx = np.arange(lo, lo + self.B)
        dest = assign[local_idx]
        order = np.argsort(dest, kind="stable")
        send_splits = np.bincount(dest, minlength=self.R)
        recv_splits = np.bincount(owner_rank[mine], minlength=self.R)
        D = local.dense.shape[1]
        words = [np.ascontiguousarray(local.dense, dtype=np.float32).view(np.int32),
                 np.ascontiguousarray(local.labels, dtype=np.float32)[:, None].view(np.int32)]
        if self.carry:  # int64 ids as two words each
            words.append(np.ascontiguousarray(local.ids[:, self.carry]).view(np.int32))
        payload = torch.from_numpy(np.concatenate(words, axis=1)[order])
        got = self.comm.all_to_all(payload, send_splits.tolist(), recv_splits.tolist(), "samples").numpy()
        if ids is None:
            ids = np.stack([batch.values[t] for t in range(batch.num_tables)], axis=1)
        full_ids = np.zeros((self.B, local.ids.shape[1]), dtype=np.int64)
        full_ids[:, self.columns] = ids[mine]
        if self.carry:
            full_ids[:, self.carry] = np.ascontiguousarray(got[:, D + 1 :]).view(np.int64)
        dense = np.ascontiguousarray(got[:, :D]).view(np.float32)
        labels = np.ascontiguousarray(got[:, D]).view(np.float32)
        return Samples(dense=dense, ids=full_ids, labels=labels)

    def __call__(self, stream: Iterator[Samples]) -> Iterator[tuple[Samples, Plan]]:
        window: deque[tuple[Samples, GlobalBatch, np.ndarray]] = deque()
        exhausted = False

        def pull() -> None:
            nonlocal exhausted
            if exhausted:
                return
            nxt = next(stream, None)
            with phase("input.gather"):
                got = self._gather(nxt)
            if got is None:
                exhausted = True
            else:
                window.append(got)

        for _ in range(self.policy.lookahead + 1):
            pull()
        while window:
            local, batch, ids = window[0]
            with phase("input.plan"):
                plan = self.policy.plan([b for _, b, _ in window])
            self.sched_ms.append(plan.sched_seconds * 1e3)  # timed by the policy itself
            with phase("input.exchange"):
                assigned = self.exchange(local, batch, plan, ids)
            window.popleft()
            pull()
            yield assigned, plan
