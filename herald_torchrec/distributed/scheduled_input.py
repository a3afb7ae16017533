"""The Herald input stage: from this rank's slice of each global batch to its *assigned* samples plus the Plan.

Per step, every rank: (1) all-gathers the ids of its slice, so every rank holds the ids of the whole global batch
(ids only — dense features and labels stay put); (2) runs the scheduler on the current global batch and the next L
(deterministic integer code: every rank computes the same plan, nothing is broadcast); (3) exchanges dense features
and labels with one plan-sized all-to-all, so it holds exactly the B samples the plan assigns it. Ids of assigned
samples come from the gathered global batch. All ranks agree on the end of data (an all-reduce of a flag), so every
rank stops at the same step.

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

    def __init__(self, policy: SchedulePolicy, comm: PlanComm, columns: list[int]) -> None:
        self.policy = policy
        self.comm = comm
        self.columns = columns  # columns of Samples.ids that the managed tables read, in table order
        self.R, self.rank = comm.world_size, comm.rank
        self.B = policy.batch_per_rank
        if policy.num_ranks != self.R:
            raise ValueError(f"policy planned for {policy.num_ranks} ranks, but the process group has {self.R}")
        self.sched_ms: list[float] = []
        self._wire_dtype = np.int32 if max(policy.layout.table_rows) <= np.iinfo(np.int32).max else np.int64

    def _gather(self, local: Samples | None) -> tuple[Samples, GlobalBatch] | None:
        have = torch.tensor([0 if local is None else 1], dtype=torch.int64)
        with phase("input.eod_flag"):
            self.comm.all_reduce(have, "control", op=dist.ReduceOp.MIN)
        if int(have) == 0:
            return None
        if len(local) != self.B:
            raise ValueError(f"rank {self.rank} got a slice of {len(local)} samples, expected batch_per_rank={self.B}")
        ids = np.ascontiguousarray(local.ids[:, self.columns])
        if self.R > 1:
            # ids travel as int32 when every table fits (exact: no float, no truncation), else as int64
            wire = torch.from_numpy(ids.astype(self._wire_dtype))
            parts = [torch.empty_like(wire) for _ in range(self.R)]
            with phase("input.ids_all_gather"):
                dist.all_gather(parts, wire)
            self.comm.counter.add("sample_ids", wire.numel() * wire.element_size() * (self.R - 1))
            ids = torch.cat(parts).numpy().astype(np.int64)
        return local, GlobalBatch.from_dense(ids, self.policy.layout)

    def exchange(self, local: Samples, batch: GlobalBatch, plan: Plan) -> Samples:
        """Dense features + labels to the ranks the plan assigns them to; ids from the gathered global batch."""
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
        payload = torch.from_numpy(np.concatenate([local.dense, local.labels[:, None]], axis=1)[order])
        got = self.comm.all_to_all(payload, send_splits.tolist(), recv_splits.tolist(), "samples")
        got_np = got.numpy()
        ids = np.ascontiguousarray(np.stack([batch.values[t][mine] for t in range(batch.num_tables)], axis=1))
        full_ids = np.zeros((self.B, local.ids.shape[1]), dtype=np.int64)
        full_ids[:, self.columns] = ids
        return Samples(dense=got_np[:, :-1].copy(), ids=full_ids, labels=got_np[:, -1].copy())

    def __call__(self, stream: Iterator[Samples]) -> Iterator[tuple[Samples, Plan]]:
        window: deque[tuple[Samples, GlobalBatch]] = deque()
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
            local, batch = window[0]
            with phase("input.plan"):
                plan = self.policy.plan([b for _, b in window])
            self.sched_ms.append(plan.sched_seconds * 1e3)  # timed by the policy itself
            with phase("input.exchange"):
                assigned = self.exchange(local, batch, plan)
            window.popleft()
            pull()
            yield assigned, plan
