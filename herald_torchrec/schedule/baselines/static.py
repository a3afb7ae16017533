"""`static`: owners never move (every row stays home), contiguous split. The no-cache floor, executable.

Rank r trains samples r*B .. (r+1)*B-1; every key read by a non-owner goes through the shared path (the owner sends
the value, gets the gradient back). This is TorchRec's ROW_WISE sharding expressed as a Plan.
"""

from __future__ import annotations

import numpy as np

from herald_torchrec.schedule.directory import OwnershipDirectory
from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.plan import Plan
from herald_torchrec.schedule.policy import SchedulePolicy, shared_rows


class StaticPolicy(SchedulePolicy):
    name = "static"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.directory = OwnershipDirectory(self.layout, self.num_ranks, self.cache_ratio)

    def _plan(self, batches: list[GlobalBatch]) -> Plan:
        b = batches[0]
        R, B = self.num_ranks, self.batch_per_rank
        order = self.contiguous_order()
        sample_rank = np.repeat(np.arange(R, dtype=np.int64), B)
        rd = self.reads(b, sample_rank)
        d = self.directory
        own = d.owner[rd.keys].astype(np.int64)
        pair_local = own[rd.pair_key] == rd.pair_rank
        exclusive = (rd.count == 1) & np.bincount(rd.pair_key, weights=pair_local, minlength=rd.keys.shape[0]).astype(
            bool
        )
        ids, offs, readers = rd.readers_csr(~exclusive)
        shared = shared_rows(self.layout, d.table, rd.keys[ids], own[ids], offs, readers)
        d.last_use[rd.keys] = self.step
        remote = shared.remote_reads()
        counters = {
            "hit": int(pair_local.sum()),
            "migrate": 0,
            "evict_home": 0,
            "forward": 0,
            "shared_value": remote,
            "shared_grad": remote,
        }
        return Plan(step=self.step, num_ranks=R, batch_per_rank=B, sample_order=order, shared=shared, counters=counters)
