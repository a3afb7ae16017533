"""The Herald input stage: from this rank's `Batch` slice of each global batch to its *assigned* samples plus the Plan.

(A slice of another `Pipelineable` type travels as the `Batch` that input_codec.py makes of it, and its assigned
samples come back as that type: everything below speaks of the `Batch`.)

Per step, every rank:
(1) learns every rank's header: 6 words (status, samples, managed ids, uniform bag length, plan bytes, the
    planning level its planner asks for: schedule/herald/budget.py) and the bytes of this round's samples it sends
    to this rank — end of data, short batches, rank-local input errors and a failed scheduler become known to every
    rank here, so all ranks stop or raise together. In steady state the 6 words came with the previous round's
    all-to-all (a 48-byte trailer per rank: each slice is parsed a round before it is gathered, each plan made a
    round before it travels) and the sample bytes are computed by the receiver from the plan (every bag of one
    length: a fixed size per sample), so the round is one collective; otherwise (the first rounds, slices whose
    lengths travel) an all-to-all of 7 words per pair of ranks comes first (the 6, then the bytes the sender's
    samples bring the receiver: 56 (R - 1) bytes per rank, never the R x R words of every header);
(2) sends the lengths (unless every bag has the same length) and the ids of the Herald-managed features of its slice
    to the ranks that plan (below), so each of them holds the ids of the whole global batch (dense features, labels
    and the other features stay put);
(3) plans: the scheduler is deterministic, so any rank can plan for any other. With `plan_on="host"` (the
    default) the lowest rank on each machine (by host name: the ranks that share its cores) runs it on the global
    batch and the next L and sends each other rank of its machine its own part of the plan (step/plan_part.py, in
    schedule/plan_wire.py's bytes: the header's plan word is per receiving rank; where ranks span machines or number
    9+, `parts_pay`, else the whole plan, as small there), so a machine running R ranks plans once, not R times (~5
    ms of CPU per step each), each rank receives what it executes (21 KB per step at R=16, 25 KB at R=256 on the
    synthetic default, where the whole plan is 81 KB / 1.45 MB), and no plan crosses to another machine; the
    planner executes its own part too; `plan_on="rank0"`: rank 0 plans for every rank, wherever it runs;
    `plan_on="every_rank"`: every rank plans for itself and nothing is sent. Where several ranks plan, each plans
    every batch at the planning level they agree on from the level words of (1) (schedule/herald/budget.py).
    `scheduler=herald_hier` with one planner per machine (`plan_on="host"`, several machines): each rank sends its
    ids to its own machine's planner only (2 sends nothing to other machines), and the planners plan their machines'
    parts together through a gloo group of the planners (planner_transport.py; schedule/herald/hierarchy.py's
    phases); each planner receives only its machine's plan (`HostPlan`) and sends its ranks their parts of it as
    above: no process holds the whole plan.
    Samples then never leave their machine (a plan that sends one elsewhere is an error);
(4) exchanges dense features, labels and the ids of the *carried* features (those no Herald table reads: tables left
    to TorchRec's sharding, other sparse modules) with one plan-sized all-to-all of bytes (bit-exact), so it holds
    exactly the B samples the plan assigns it, as a TorchRec `Batch` with the slices' KJT keys. Samples sent to a
    rank that does not plan also bring their lengths and managed ids (input_layout.sample_blocks), which it never
    gathered; its header words told it how many bytes come. So a slice's managed ids cross the network once to each
    planner and once with the samples that leave, instead of to every rank: with one planner per machine, (R - 1)
    copies per step become at most H + 1 for H machines.

One all-to-all per step carries (2) for the batch L+3 ahead, the plan of the next batch, (4) for the current
batch and the next round's header words: a batch's plan travels one round before its samples, so every rank knows
it when it cuts its send blocks (the plan is computed two rounds ahead, from batches already gathered). Only the
first L+2 gathers and the last exchanges run alone. Each rank holds L+3 gathered global batches (one more than
the lookahead needs, for the plans made a round early) and one parsed slice of its own.

The cut thread (`cut_thread`, on by default): a planner that sends parts would cut and encode them on its own
thread after each plan (2.8 ms per step for a machine's 8 parts at R=64, 4.5 ms on full Criteo tables; the plan
itself 5-9 ms), and a round's trailer announces the sizes of the plan the next round carries, so the cut must be
done before that trailer. So where parts are sent, each plan is made one round earlier still (batch L+4 ahead is
gathered, the first L+3 gathers run alone, each rank holds L+4 batches) and its parts are cut on a thread of their
own (a second core) while the stage makes the next plan; the stage waits for them only to announce them, and that
wait counts in the planning budget as the cut's cost. An early plan is made only once its whole lookahead is
gathered (or the data ended), so every plan sees the batches it would see a round later: the same plans, the same
model. Measured on one host's planner replayed alone at R=64: 9.8-10.2 -> 7.2-7.3 ms per step (scale 0.01),
15.6-15.8 -> 11.0-11.3 ms (full tables): the GIL costs next to nothing (the kernels and numpy release it). Multi-hot and
variable-length bags, empty bags, a key read by several tables and tables of several EBCs are all handled: the
scheduler gets one CSR per managed table (input_layout.py).

Example: R=2 ranks on one machine (`plan_on="host"`: rank 0 plans for both), B=2 samples per rank, one
Herald-managed feature "f" (single-hot, table "t" of 8 rows: rows 0-3 live on rank 0, 4-7 on rank 1), lookahead
L=0, no carried features. Global sample g = q * B + i is sample i of rank q's slice. The numbers are those of a run.

    # Before: each rank's iterator yields its slice of batch 0 (dense d_g = [g], label g % 2)
    # rank 0: Batch(dense=[d0, d1], f=[[5], [2]], labels=[0., 1.])    # samples g0, g1
    # rank 1: Batch(dense=[d2, d3], f=[[1], [6]], labels=[0., 1.])    # samples g2, g3

    # (1) header words of the round that gathers batch 0, from every rank (by an all-to-all in the first rounds;
    #     later they ride on the round before, as its 48-byte trailer, and the sample bytes are computed):
    #          status  samples  ids  uniform  plan bytes  level  sample bytes to the receiver
    # rank 0:  DATA    2        2    1        0           0      0
    # rank 1:  DATA    2        2    1        0           0      0
    # (2) ids to the planner, in the same round's all-to-all (int32; no lengths: every bag has length 1):
    # rank 0 -> rank 0: f = [5, 2]     rank 1 -> rank 0: f = [1, 6]     rank 1 receives no ids
    # after: rank 0 holds batch 0's ids f = [5, 2, 1, 6] (g0..g3, the scheduler's GlobalBatch);
    #        rank 1 holds its own slice only

    # (3) rank 0 plans batch 0 (from batches 0..L): samples g1, g2 on rank 0, g0, g3 on rank 1 (the rows they
    #     read live there), no rows move. It cuts rank 1's part of the plan and encodes it (~410 bytes with its
    #     generation: a tiny plan's part is no smaller than the plan), announces its size in its header word "plan
    #     bytes" to rank 1 (0 to itself), and sends it to rank 1 one round before batch 0's samples move.

    # (4) the round that exchanges batch 0 (it also carries the ids of batch 3 and the plan of batch 1): one
    #     all-to-all. Its header words came as the round before's trailers (rank 0 to rank 1: DATA 2 2 1 ~410 0,
    #     to itself DATA 2 2 1 0 0; rank 1: DATA 2 2 1 0 0: batch 3's slices, the plan bytes, the level words), and
    #     each rank computes the sample bytes it receives from the plan (bags of one length: 8 bytes a sample to
    #     rank 0, 12 with the id to rank 1).
    #     Each rank's block to each rank, in order:
    # rank 0 -> rank 0: trailer (48) | its ids of batch 3 (8) | g1: dense + label (8)                     =  64 bytes
    # rank 0 -> rank 1: trailer (48) | generation + part of batch 1's plan (~410) | g0: dense + label, f (12) = ~470
    # rank 1 -> rank 0: trailer (48) | its ids of batch 3 (8) | g2: dense + label (8)                     =  64 bytes
    # rank 1 -> rank 1: trailer (48) | g3: dense + label, f (12)                                         =  60 bytes
    # (a sample sent to rank 1, which does not plan, brings its ids of f; rank 0 has them from (2))

    # After: each rank holds its assigned samples of batch 0 as a Batch, and the plan (ScheduledBatch):
    # rank 0: Batch(dense=[d1, d2], f=[[2], [1]], labels=[1., 0.]), plan of batch 0 (made here)
    # rank 1: Batch(dense=[d0, d3], f=[[5], [6]], labels=[0., 1.]), its part of batch 0's plan (received in the
    #         round before); rank 0 executes its own part of the plan it made

The stage decides nothing: the policy (control plane) decides, this moves bytes. It counts its own bytes (in
`comm.counter`, by the rules of traffic.py: the plan as "plan") and calls the collectives through references taken
at import, so a run-wide counting patch of torch.distributed does not see them twice — the stage may run in a
background thread (`HeraldTrainPipeline(prefetch=...)`), where a patch scoped to the training step would miss or
mis-assign them.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import all_gather as _all_gather
from torch.distributed import all_to_all_single as _all_to_all_single
from torchrec.datasets.utils import Batch

from herald_torchrec.distributed.comm import PlanComm, hold_for_gloo, phase
from herald_torchrec.distributed.step.host_relay import HostMap
from herald_torchrec.distributed.step.plan_part import parts_pay, plan_parts, splittable
from herald_torchrec.distributed.train_pipeline.input_layout import (
    GatheredIds,
    ManagedTables,
    SampleRoute,
    SliceLayout,
    assigned_batch,
    assigned_kjt_parts,
    planner_parts,
    received_samples,
    sample_blocks,
    slice_layout,
)
from herald_torchrec.distributed.train_pipeline.input_round import (
    GENERATION_BYTES,
    NO_SLICE,
    PAY_WORDS,
    PLAN_WORD,
    TRAILER_BYTES,
    Announcement,
    CutInFlight,
    FailedPlan,
    OutgoingPlan,
    ParsedSlice,
    Pending,
    PlannedBatch,
    RoundHeads,
    SliceHeader,
    SliceStatus,
    decode_ids,
    host_key,
    ids_block,
    ids_sizes,
    parse_slice,
    plan_words,
    planners,
    raise_bad,
)
from herald_torchrec.distributed.train_pipeline.planner_transport import GroupTransport, planner_group
from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.plan import HostPlan, Plan
from herald_torchrec.schedule.plan_wire import decode_plan, encode_plan
from herald_torchrec.schedule.policy import SchedulePolicy

SCHED_MS_KEPT = 100_000  # recent planning times kept, however long the run


class ScheduledBatch(NamedTuple):
    """What the stage yields, in training order: this rank's assigned samples, their plan, and the scheduler
    generation that planned it (plans of an older generation than the stage's current one must not run)."""

    batch: Batch
    plan: Plan
    generation: int


class SchedulerState(NamedTuple):
    """The scheduler and its generation (how many times `reset_policy` replaced it), swapped as one object: the
    stage's thread reads both at once. `policy` is None before the first batch and on the ranks that do not plan."""

    generation: int
    policy: SchedulePolicy | None


@dataclass(frozen=True)
class Exchange:
    """A gathered global batch and its plan: this round moves its samples to the ranks the plan assigns them."""

    pending: Pending
    plan: Plan


@dataclass(frozen=True, kw_only=True)
class Round:
    """What one collective round does on this rank (`ScheduledInput._round`); each part may be absent."""

    exchange: Exchange | None = None  # the oldest gathered batch with a plan: its samples move
    gather: ParsedSlice | None = None  # this rank's next slice: its header and ids go out (None: no gather)
    carries_plan: bool = False  # a plan travels this round (made here as `made`, or received from the planner)
    made: OutgoingPlan | FailedPlan | None = None  # the plan this rank made for this round, where it plans
    announced: np.ndarray | None = None  # [R, PAY_WORDS]: this round's header words, from the last round's trailers
    next_words: Announcement | None = None  # this rank's header words of the next round: this round's trailer
    level: int = 0  # this rank's level word in this round's header (`ScheduledInput._level_word`)


@dataclass(frozen=True)
class SampleMoves:
    """Who sends which samples of the exchanged batch (`pending`): this rank's blocks per destination (bytes) and how
    many samples each holds, and the global indices the plan assigns here (increasing) with how many come from each
    rank."""

    pending: Pending
    blocks: list[np.ndarray]
    n_to: np.ndarray
    mine: np.ndarray
    n_from: np.ndarray


@dataclass
class RoundResult:
    """What one round leaves on this rank."""

    assigned: Batch | None = None  # this rank's samples of the exchanged batch (None: no exchange)
    gathered: Pending | None = None  # the global batch gathered (None: no gather, or the end of the data)
    end_of_data: bool = False  # the gather found some rank without a full slice: every rank stops gathering
    planned: PlannedBatch | None = None  # the plan this round carried (made here or received), with its generation
    next_announced: np.ndarray | None = None  # [R, PAY_WORDS]: the next round's header words, from the trailers
    levels: np.ndarray | None = None  # [R]: every rank's level word in this round's header


class ScheduledInput:
    """Iterator adapter: this rank's `Batch` slices in, `ScheduledBatch`es (assigned `Batch`, `Plan`, generation)
    out, L batches ahead.

    `policy_factory(batch_per_rank)` builds the scheduler once the first slice tells the batch size (the pipeline
    builds it from the sharded modules' own settings; every rank builds it, so a bad setting raises everywhere, and
    only the ranks that plan keep it: `policy` is None on the others, see `plan_on` in the module docstring);
    `reset_policy()` starts it again from the home placement (after a checkpoint load reset the data plane's
    ownership)."""

    def __init__(
        self,
        tables: ManagedTables,
        comm: PlanComm,
        policy_factory: Callable[[int], SchedulePolicy],
        plan_on: str = "host",
        cut_thread: bool = True,
    ) -> None:
        self.tables = tables
        self.comm = comm
        self.R, self.rank = comm.world_size, comm.rank
        self.plan_on = plan_on
        # a planner that sends parts cuts each plan's on a thread of its own while it makes the next plan (`__call__`)
        self.cut_thread = cut_thread
        self._cutter: ThreadPoolExecutor | None = None
        # who plans for whom: set at the first batch (the hosts are gathered with the layout)
        self.planner = self.rank  # the rank whose plans this rank executes
        self.plans_for = np.zeros(self.R, dtype=bool)  # the ranks this rank sends its plans to (never itself)
        self.planner_of = np.arange(self.R)  # the rank that plans for each rank
        self.is_planner = np.ones(self.R, dtype=bool)  # the ranks that plan
        self.ids_to = np.ones(self.R, dtype=bool)  # the ranks this rank sends its slices' ids to
        self.ids_from = np.ones(self.R, dtype=bool)  # the ranks whose ids this rank gathers (where it plans)
        self.host_transport: GroupTransport | None = None  # herald_hier planned per machine (module docstring)
        self.host_index = -1  # this rank's host among the planners' (where it plans per machine)
        self.ids_sent_bytes = 0  # bytes of this rank's ids sent to other ranks' planners (the tests read it)
        self.hosts: np.ndarray | None = None  # int64 [R], a key per rank's machine (set at the first batch)
        # a planner sends each rank only its part of the plan (step/plan_part.py) where parts pay (`parts_pay`: None
        # decides it at the first batch, from the ranks and their machines); the parts keep the readers the modules'
        # host relays need, so they are cut with the modules' host map (`relay_hosts`, set with them)
        self.send_parts: bool | None = None
        self.relay_hosts: HostMap | None = None
        self._factory = policy_factory
        self._current = SchedulerState(0, None)  # replaced as one object by reset_policy
        self.lookahead = 0
        self.layout: SliceLayout | None = None
        self.sched_ms: deque[float] = deque(maxlen=SCHED_MS_KEPT)  # the planning time of recent plans (bounded)
        # the planner's own CPU time per plan (this thread's), on the ranks that plan: sched_ms is wall time, which
        # also counts the waits of a low-priority thread for a core the training threads hold
        self.sched_cpu_ms: deque[float] = deque(maxlen=SCHED_MS_KEPT)
        self.dropped_samples = 0  # this rank's samples dropped at the end of data (uneven or short slices)
        self._ahead_samples = 0  # samples of the slice drawn a round ahead (dropped too if the data ends first)
        self._stop = False  # request_stop(): set by the training thread, read by the stage's (a bool, no lock needed)

    def request_stop(self) -> None:
        """End the stream early, at a round every rank agrees on: from its next slice on, this rank draws nothing
        more from its iterator and announces CLOSED instead; every rank then ends its stream as at the end of data
        (the batches already gathered are still exchanged, so every rank runs the same collectives), without the
        uneven-end warning. For `HeraldTrainPipeline.close()`, where the user's iterator is endless: a background stage
        left inside a collective when the interpreter exits aborts the process. It stays stopped."""
        self._stop = True

    @property
    def policy(self) -> SchedulePolicy | None:
        """The scheduler, on the rank(s) that plan (None before the first batch, and on the others)."""
        return self._current.policy

    @property
    def generation(self) -> int:
        return self._current.generation

    @property
    def plans_here(self) -> bool:
        return self.planner == self.rank

    @property
    def _layout(self) -> SliceLayout:
        """The slices' layout, set by the first batch (every round runs after it)."""
        if self.layout is None:
            raise RuntimeError("herald input stage: no layout before the first batch")
        return self.layout

    # ------------------------------------------------------------------ collectives (bytes only)
    def _all_gather_words(self, words: np.ndarray, kind: str) -> np.ndarray:
        """[R, n] int64 from every rank's n words."""
        if self.R == 1:
            return words[None, :].copy()
        t = torch.from_numpy(np.ascontiguousarray(words, dtype=np.int64))
        parts = [torch.empty_like(t) for _ in range(self.R)]
        self.comm.counter.add(kind, t.numel() * 8 * (self.R - 1))
        with phase("input.setup_all_gather"):
            _all_gather(parts, t, group=self.comm.group)
        hold_for_gloo(t, *parts)
        return torch.stack(parts).numpy()

    def _exchange_heads(self, head: np.ndarray, plan_to: np.ndarray) -> np.ndarray:
        """[R, PAY_WORDS + 1] int64: every rank's first PAY_WORDS header words (its plan word: the bytes of the plan
        it sends this rank), then the bytes of its samples sent to this rank, from this rank's header `head`
        (PAY_WORDS + R words) and `plan_to` (its plan bytes to each rank). One all-to-all of PAY_WORDS + 1 words per
        pair of ranks: each rank receives the size words of every rank that concern it, so a rank's share grows as
        R, not as R x R (an all-gather of every header)."""
        R = self.R
        if R == 1:
            return head[None, :].copy()
        send = np.empty((R, PAY_WORDS + 1), dtype=np.int64)
        send[:, :PAY_WORDS] = head[:PAY_WORDS]
        send[:, PLAN_WORD] = plan_to
        send[:, PAY_WORDS] = head[PAY_WORDS:]
        out = torch.empty(R * (PAY_WORDS + 1), dtype=torch.int64)
        self.comm.counter.add("control", (PAY_WORDS + 1) * 8 * (R - 1))
        sent = torch.from_numpy(send.reshape(-1))
        with phase("input.header_all_to_all"):
            _all_to_all_single(out, sent, group=self.comm.group)
        hold_for_gloo(out, sent)
        return out.numpy().reshape(R, PAY_WORDS + 1)

    def _all_to_all_bytes(self, blocks: list[np.ndarray], recv: list[int]) -> list[np.ndarray]:
        """Send blocks[d] (uint8) to rank d; receive recv[q] bytes from rank q (sizes known on both sides)."""
        if self.R == 1:
            return [blocks[0]]
        send = torch.from_numpy(np.concatenate(blocks)) if blocks else torch.zeros(0, dtype=torch.uint8)
        out = torch.empty(int(sum(recv)), dtype=torch.uint8)
        with phase("input.all_to_all"):
            _all_to_all_single(out, send, recv, [b.shape[0] for b in blocks], group=self.comm.group)
        hold_for_gloo(out, send)
        return list(np.split(out.numpy(), np.cumsum(recv)[:-1]))

    # ------------------------------------------------------------------ set-up
    def _setup(self, first: Batch | None) -> bool:
        """The first slice fixes the layout; every rank checks that all agree (keys, batch size, dense / labels).
        False if some rank has no data at all (every rank stops; the others warn)."""
        err: Exception | None = None
        layout = None
        if first is None:
            words = SliceHeader(SliceStatus.END).words()
        else:
            try:
                layout = slice_layout(first, self.tables)
                words = np.concatenate([[SliceStatus.DATA], layout.signature()])  # status, then the layout's words
            except ValueError as e:
                err, words = e, SliceHeader(SliceStatus.BAD).words()
        got = self._all_gather_words(np.append(words, host_key()), "control")  # + the host, for `planners`
        got, hosts = got[:, :-1], got[:, -1]
        raise_bad(got[:, 0], err)
        if (got[:, 0] == SliceStatus.END).any():
            if first is not None:
                warnings.warn(
                    f"herald input (rank {self.rank}): ranks "
                    f"{np.flatnonzero(got[:, 0] == SliceStatus.END).tolist()} have no data at all; every "
                    "rank stops before the first step",
                    stacklevel=3,
                )
            return False
        if (got[:, 1:] != got[0, 1:]).any():
            raise ValueError(
                "ranks disagree on the input's layout (KJT keys, batch size per rank, dense / label shapes, a "
                "Pipelineable's fields and batch-independent values): "
                f"batch sizes {got[:, 1].tolist()}, key counts {got[:, 2].tolist()}; every rank must feed slices "
                "of the same global batch"
            )
        assert layout is not None  # every rank, this one included, reported DATA: its first slice parsed
        self.layout = layout
        self.hosts = hosts  # the host key of every rank: the policy factory passes it on (host-aware LAIA)
        if self.send_parts is None:  # the same on every rank: from the gathered keys
            self.send_parts = parts_pay(self.R, int(np.unique(hosts).shape[0]))
        planner_of = planners(self.plan_on, hosts)
        self.planner = int(planner_of[self.rank])
        self.plans_for = (planner_of == self.rank) & (np.arange(self.R) != self.rank)
        self.is_planner = np.zeros(self.R, dtype=bool)
        self.is_planner[planner_of] = True
        self.ids_to, self.ids_from = self.is_planner.copy(), np.ones(self.R, dtype=bool)
        self.planner_of = planner_of
        policy = self._factory(layout.batch_size)
        if policy.num_ranks != self.R:
            raise ValueError(f"policy planned for {policy.num_ranks} ranks, but the process group has {self.R}")
        self._plan_per_host(policy, planner_of)
        self.lookahead = policy.lookahead
        self._current = SchedulerState(self.generation, policy if self.plans_here else None)
        return True

    def _plan_per_host(self, policy: SchedulePolicy, planner_of: np.ndarray) -> None:
        """herald_hier with one planner per machine (`plan_on="host"`, several machines, the policy's hosts being the
        machines, the plan travelling as parts): each rank's ids go to its own machine's planner only, and the
        planners plan their machines' parts through a gloo group of the planners (planner_transport.py). Elsewhere
        nothing changes. Collective (the group): every rank decides the same from the same words."""
        H = int(getattr(policy, "num_hosts", 1))
        if self.plan_on != "host" or not hasattr(policy, "plan_host") or H < 2 or not dist.is_initialized():
            return
        if not self.send_parts:  # a machine's planner keeps its own ranks' plan only, which travels as parts
            return
        ranks = np.flatnonzero(self.is_planner)
        P = self.R // H
        if ranks.shape[0] != H or not np.array_equal(planner_of, np.arange(self.R) // P * P):
            return  # the policy's hosts are not the machines: every planner plans everything, as before
        if dist.get_world_size(self.comm.group) != dist.get_world_size():
            return  # a subgroup: a group of its planners would need every process of the default group
        world = [
            dist.get_global_rank(self.comm.group, int(q)) if self.comm.group is not None else int(q) for q in ranks
        ]
        group = planner_group(world)
        self.ids_to = np.arange(self.R) == self.planner
        self.ids_from = planner_of == self.rank
        if self.plans_here:
            self.host_index = self.rank // P
            compact = getattr(policy, "planner_wire", None) == "compact"
            self.host_transport = GroupTransport(group, self.host_index, H, self.comm.counter, compact)

    def reset_policy(self) -> None:
        """A fresh scheduler (home placement), e.g. after `load_state_dict` reset the data plane's ownership.
        Every rank calls it at the same step, so generations agree across ranks."""
        fresh = self._factory(self.layout.batch_size) if self.layout is not None and self.plans_here else None
        self._current = SchedulerState(self.generation + 1, fresh)

    # ------------------------------------------------------------------ gather
    def _check_heads(self, heads: RoundHeads, parsed: ParsedSlice) -> bool:
        """True if every rank has a full slice; else warn (what this rank drops) and return False (end of data)."""
        raise_bad(heads.status, parsed.error)
        status = heads.status
        if (status == SliceStatus.DATA).all():
            return True
        if (status == SliceStatus.CLOSED).any():  # a pipeline closing (request_stop): asked for, nothing to warn
            return False
        mine = parsed.samples + self._ahead_samples  # with the slice drawn a round ahead
        self.dropped_samples += mine
        short = status == SliceStatus.SHORT
        if short.any():
            why = (
                "short last batch"
                + "es" * int(short.sum() > 1)
                + " ("
                + ", ".join(f"rank {q}: {int(heads.samples[q])} samples" for q in np.flatnonzero(short))
                + ")"
            )
        else:
            why = f"ranks {np.flatnonzero(status == SliceStatus.END).tolist()} ran out of data"
        if not (status == SliceStatus.END).all():  # an uneven end: say what is lost (a clean end is silent)
            warnings.warn(
                f"herald input (rank {self.rank}): {why}; the incomplete global batch is dropped, as with "
                f"drop_last: this rank drops {mine} samples (and whatever its iterator still holds)",
                stacklevel=3,
            )
        return False

    # ------------------------------------------------------------------ exchange
    def _sample_moves(self, ex: Exchange) -> SampleMoves:
        """This rank's samples of `ex` per destination (input_layout.sample_blocks: the ranks that do not plan also
        get their lengths and managed ids, which only the planners gathered), and the samples the plan assigns here."""
        lay, r = self._layout, self.rank
        B = lay.batch_size
        dest = ex.plan.slice_destinations(r)
        if not np.array_equal(self.ids_to, self.is_planner) and (self.planner_of[dest] != self.planner).any():
            raise RuntimeError(
                f"herald input stage (rank {r}): the plan sends samples to another machine, whose planner never "
                "gathered their ids (herald_hier planned per machine keeps samples on their machine)"
            )
        route = SampleRoute.by_destination(dest, ~self.is_planner)
        uniform = bool(ex.pending.uniform[r] >= 0)
        blocks, id_bytes = sample_blocks(ex.pending.local, lay, route, uniform)
        others = np.arange(self.R) != r
        ids_sent = int(id_bytes[others].sum())
        self.comm.counter.add("sample_ids", ids_sent, call=False)
        self.comm.counter.add(
            "samples", int(sum(b.shape[0] for d, b in enumerate(blocks) if d != r)) - ids_sent, call=False
        )
        mine = ex.plan.local_samples(r)
        return SampleMoves(ex.pending, blocks, route.counts, mine, np.bincount(mine // B, minlength=self.R))

    def _assemble(self, moves: SampleMoves, got: list[np.ndarray]) -> Batch:
        """This rank's assigned samples (`moves.mine`: global indices, in order; `moves.n_from`: how many from each
        rank) from what every rank sent it."""
        lay, n_from, cur = self._layout, moves.n_from, moves.pending
        if cur.ids is None:  # the samples brought their lengths and ids
            r = received_samples(got, n_from, cur.uniform, lay)
            return assigned_batch(r.lengths, r.values, r.fixed, lay, r.weights)
        mine = moves.mine - cur.first_sample  # into the gathered ids (this machine's, where planned per machine)
        parts = planner_parts(got, n_from, cur.ids, lay, mine)
        lengths, values = assigned_kjt_parts(cur.ids, lay, mine, parts.carried)
        return assigned_batch(lengths, values, parts.fixed, lay, parts.weights)

    def _level_word(self) -> int:
        """The level word this rank puts in a round's header: what its planner's budget asks for (`level_word`,
        schedule/herald/budget.py), where several ranks plan; 0 (FULL) elsewhere and for a policy without one."""
        policy = self._current.policy
        word = getattr(policy, "level_word", None) if self.plans_here and self.is_planner.sum() > 1 else None
        return 0 if word is None else int(word())

    def _plan_next(
        self, window: Sequence[Pending], first: int, levels: np.ndarray | None
    ) -> OutgoingPlan | FailedPlan | None:
        """Plan window[first] from it and the (up to) L gathered after it, where plans are made; the planner also
        encodes the plan for the others. Where several ranks plan, the plan's level is the one the planners agree
        on from `levels` (every rank's level word in the last round completed: the same on every planner). A failing
        scheduler is returned, so that every rank raises together."""
        generation, policy = self._current
        if not self.plans_here:
            return None
        batches = [window[i].scheduler_view() for i in range(first, min(first + self.lookahead + 1, len(window)))]
        try:
            if policy is None:
                raise RuntimeError("herald input stage: no scheduler on a rank that plans")
            agree = getattr(policy, "agree_level", None)
            if agree is not None and levels is not None and self.is_planner.sum() > 1:
                agree(levels[self.is_planner].tolist())
            with phase("input.plan"):
                cpu = time.thread_time()
                if self.host_transport is not None:  # this machine's part, with the other machines' planners
                    plan = policy.plan_host(self.host_index, batches, self.host_transport)
                else:
                    plan = policy.plan(batches)
                self.sched_cpu_ms.append((time.thread_time() - cpu) * 1e3)
            if self.cut_thread and self._cuts_parts(plan):  # cut while this thread makes the next plan
                if self._cutter is None:  # (its thread inherits this one's CPU priority)
                    self._cutter = ThreadPoolExecutor(1, thread_name_prefix="herald-plan-cut")
                return CutInFlight(generation, self._cutter.submit(self._wires, plan))
            cpu = time.thread_time()
            plan, wires = self._wires(plan)
            self._record_cut(policy, (time.thread_time() - cpu) * 1e3)
        except Exception as e:  # noqa: BLE001 - raised after the next header, on this rank as it is
            return FailedPlan(generation, e)
        return OutgoingPlan(plan, generation, wires)

    def _settled(self, made: OutgoingPlan | FailedPlan | CutInFlight | None) -> OutgoingPlan | FailedPlan | None:
        """A plan whose parts are being cut (`CutInFlight`), once they are: what the planner's thread waited for it
        counts in the planning budget as the cut's cost (0 where the cut kept up); a failed cut is a failed plan."""
        if not isinstance(made, CutInFlight):
            return made
        wait = time.perf_counter()
        try:
            plan, wires = made.cut.result()
        except Exception as e:  # noqa: BLE001 - raised after the next header, on this rank as it is
            return FailedPlan(made.generation, e)
        self._record_cut(self._current.policy, (time.perf_counter() - wait) * 1e3)
        return OutgoingPlan(plan, made.generation, wires)

    @staticmethod
    def _record_cut(policy: SchedulePolicy | None, ms: float) -> None:
        """The planner's time on a plan's parts, for a policy whose planning budget counts it (`record_cut`)."""
        record_cut = getattr(policy, "record_cut", None)
        if record_cut is not None:
            record_cut(ms)

    def _cuts_parts(self, plan: Plan) -> bool:
        """Whether `_wires` cuts the plan into parts (else it encodes it whole, or sends nothing)."""
        return bool(self.send_parts) and self.plan_on != "every_rank" and splittable(plan)

    def _wires(self, plan: Plan) -> tuple[Plan, dict[int, np.ndarray]]:
        """What this planner executes and what it sends each rank it plans for: each rank's own part
        (step/plan_part.py) where parts pay and the plan can travel so (`send_parts`), else the whole plan to every
        rank. Every planner cuts its own part even where it plans for itself alone, so that every rank of a step runs
        a part (or none does, `plan_on="every_rank"`): a part's rank learns only its own moves, and the directory
        syncs that follow (`sync_directory`) are collective."""
        to = np.flatnonzero(self.plans_for).tolist()
        if self._cuts_parts(plan):
            with phase("input.plan_parts"):
                parts = plan_parts(plan, [self.rank, *to], self.relay_hosts)
                return parts[self.rank], {d: encode_plan(parts[d]) for d in to}
        if isinstance(plan, HostPlan):  # pragma: no cover - plan_host runs only where parts are sent
            raise RuntimeError(f"herald input stage (rank {self.rank}): a machine's plan must travel as parts")
        if not to:
            return plan, {}
        wire = encode_plan(plan)
        return plan, dict.fromkeys(to, wire)

    def _raise_failed_plan(self, made: OutgoingPlan | FailedPlan | None, heads: RoundHeads) -> None:
        """After the header: a scheduler that failed on some rank stops every rank (before any data moves)."""
        if isinstance(made, FailedPlan):
            raise made.error
        failed = np.flatnonzero(heads.plan_bytes < 0)
        if failed.size:
            raise RuntimeError(
                f"herald input (rank {self.rank}): the scheduler failed on rank(s) {failed.tolist()} "
                "(see their error); every rank stops"
            )

    def _recv_sizes(self, cur: Pending, n_from: np.ndarray) -> list[int] | None:
        """Bytes of `cur`'s samples each rank sends this rank (`n_from`: how many of them its plan assigns here),
        computed here: every slice whose bags all have one length (its header word) sends a fixed number of bytes
        per sample. None if some slice's lengths travel: its sizes then come with the header."""
        if (cur.uniform < 0).any():
            return None
        planner = bool(self.is_planner[self.rank])
        return [int(n) * self._sample_bytes(int(u), planner) for n, u in zip(n_from, cur.uniform)]

    def _sample_bytes(self, u: int, planner: bool) -> int:
        """Bytes of one sample of a slice with bags of one length `u`, sent to a rank that plans or not
        (input_layout.sample_blocks)."""
        lay = self._layout
        ids = 0 if planner else lay.managed.shape[0] * u * lay.ids_dtype.itemsize
        return lay.fixed_bytes() + ids + lay.carried.shape[0] * u * 8 + lay.num_keys * u * lay.weight_bytes

    def _heads(self, work: Round, head: np.ndarray, plan_to: np.ndarray, moves: SampleMoves | None) -> RoundHeads:
        """Every rank's header words of this round that this rank needs (`head`: this rank's PAY_WORDS + R): from an
        all-to-all of them (`_exchange_heads`), unless the previous round's trailers announced them
        (`work.announced`) and this rank can size what it receives from the plan alone (`_recv_sizes`). Then the
        round is a single all-to-all; the announced words are checked against `head`, and the sample bytes this
        rank sends against what its receivers compute."""
        R, r, known = self.R, self.rank, work.announced
        sizes: list[int] | None = None
        if known is not None:
            sizes = [0] * R if moves is None else self._recv_sizes(moves.pending, moves.n_from)
        if known is None or sizes is None:
            return RoundHeads(self._exchange_heads(head, plan_to))
        # no gather: its words (END) are not used
        checked = slice(0, PAY_WORDS) if work.gather is not None else slice(PLAN_WORD, PAY_WORDS)
        if not np.array_equal(known[r, checked], head[checked]):
            raise RuntimeError(
                f"herald input stage (rank {r}): this round's header {head[:PAY_WORDS].tolist()} "
                f"differs from what the previous round announced {known[r].tolist()}"
            )
        if moves is not None:
            u = int(moves.pending.uniform[r])
            if [b.shape[0] for b in moves.blocks] != [
                int(n) * self._sample_bytes(u, bool(self.is_planner[d])) for d, n in enumerate(moves.n_to)
            ]:
                raise RuntimeError(
                    f"herald input stage (rank {r}): sample blocks differ from the sizes receivers compute"
                )
        words = np.empty((R, PAY_WORDS + 1), dtype=np.int64)
        words[:, :PAY_WORDS] = known
        words[:, PAY_WORDS] = sizes
        return RoundHeads(words)

    def _round(self, work: Round) -> RoundResult:
        """One collective round (`Round` says what it carries): the exchange of a gathered batch by its plan, the
        gather of this rank's next slice (its ids to the planners) and a plan (sent by the planner), after the header
        words (`_heads`). `work.next_words` rides on this round's all-to-all as a trailer, and every rank's comes
        back as `next_announced`."""
        R, r, q, lay = self.R, self.rank, self.planner, self._layout
        ex, made, parsed = work.exchange, work.made, work.gather
        result = RoundResult()
        receives_plan = work.carries_plan and q != r
        ids_in, plan_in = [0] * R, [0] * R  # bytes of each rank's ids block and plan coming here
        my_ids = empty = np.zeros(0, dtype=np.uint8)
        plan_to = plan_words(made, R)  # bytes of the plan (or part) this rank sends each rank
        wires: dict[int, np.ndarray] = {}
        if isinstance(made, OutgoingPlan) and made.wires:  # the planner: generation, then the plan or part
            generation = np.array([made.generation], dtype=np.int64).view(np.uint8)
            wires = {d: np.concatenate([generation, w]) for d, w in made.wires.items()}
            self.comm.counter.add("plan", int(plan_to[plan_to > 0].sum()), call=False)
        # cut the samples first: their bytes per destination travel in the header (unless receivers compute them: one
        # bag length), since a rank that does not plan cannot size the lengths and ids that come with them
        moves = None
        if ex is not None:
            moves = self._sample_moves(ex)
            self.comm.counter.add("samples", 0)
            pay = moves.blocks
        else:
            pay = [np.zeros(0, np.uint8)] * R
        my_slice = (parsed if parsed is not None else NO_SLICE).header
        head = np.concatenate(  # this rank's words
            [my_slice.words(), [plan_to[r], work.level], [b.shape[0] for b in pay]]
        )
        heads = self._heads(work, head, plan_to, moves)
        result.levels = heads.levels.copy()
        if work.carries_plan:
            self._raise_failed_plan(made, heads)
        if receives_plan:
            plan_in[q] = int(heads.plan_bytes[q])
        if parsed is not None:
            if self._check_heads(heads, parsed):
                my_ids = ids_block(parsed.full(), parsed.header, lay)
                if self.plans_here:
                    ids_in = [n if self.ids_from[q] else 0 for q, n in enumerate(ids_sizes(heads, lay))]
                to_planners = int(self.ids_to.sum()) - int(self.ids_to[r])
                self.comm.counter.add("sample_ids", my_ids.shape[0] * to_planners, call=ex is None)
                self.ids_sent_bytes += my_ids.shape[0] * to_planners
            else:
                result.end_of_data = True
        t = 0
        trailers = [empty] * R
        if work.next_words is not None:  # to each rank its own (its plan word differs)
            trailers = list(work.next_words.words_to().view(np.uint8))
            t = TRAILER_BYTES
            self.comm.counter.add("control", TRAILER_BYTES * (R - 1), call=False)
        # to each rank: [trailer | ids block (to a planner) | plan or part (to a rank this one plans for) | samples]
        sends = [
            np.concatenate([trailers[d], my_ids[: None if self.ids_to[d] else 0], wires.get(d, empty), p])
            for d, p in enumerate(pay)
        ]
        recv = [t + a + b + int(c) for a, b, c in zip(ids_in, plan_in, heads.sample_bytes_here)]
        if any(b.shape[0] for b in sends) or any(recv):
            got = self._all_to_all_bytes(sends, recv)
        else:
            got = [np.zeros(0, np.uint8)] * R
        if work.next_words is not None:
            result.next_announced = np.stack([g[:t].view(np.int64) for g in got])
        got = [g[t:] for g in got]
        if parsed is not None and not result.end_of_data:
            ids: GatheredIds | None = None
            view: GlobalBatch | None = None
            first = 0
            if self.plans_here:  # every rank's ids, or (planned per machine) this machine's ranks' ids
                src = np.flatnonzero(self.ids_from)
                ids, view = decode_ids(heads.uniform[src], [got[q][: ids_in[q]] for q in src], lay, self.tables)
                first = int(src[0]) * lay.batch_size
            result.gathered = Pending(parsed.full(), ids, view, heads.uniform.copy(), first)
        if isinstance(made, OutgoingPlan):  # planned here
            result.planned = PlannedBatch(made.plan, made.generation)
        elif receives_plan:  # from this rank's planner: [generation int64, encoded plan]
            block = got[q][ids_in[q] : ids_in[q] + plan_in[q]]
            result.planned = PlannedBatch(
                decode_plan(block[GENERATION_BYTES:]), int(block[:GENERATION_BYTES].view(np.int64)[0])
            )
        if moves is not None:
            result.assigned = self._assemble(moves, [b[n + m :] for b, n, m in zip(got, ids_in, plan_in)])
        return result

    # ------------------------------------------------------------------ the stream
    def __call__(self, stream: Iterator[Batch]) -> Iterator[ScheduledBatch]:
        """The assigned batches with their plans, in training order.

        Steady state, one all-to-all per round: each plan is made a round before it travels (so its size, and the
        next slice's header words, parsed a round ahead, ride on the round before as a trailer), which keeps one
        gathered batch more than the lookahead needs; two rounds before, its parts cut on the cut thread meanwhile,
        where parts are sent and `cut_thread` is on (module docstring)."""
        first = next(stream, None)
        if self.layout is None and not self._setup(first):
            return
        lay = self._layout
        pending_first: list[Batch | None] = [first]

        def draw() -> ParsedSlice:
            if self._stop:  # closing: no more slices from the user's (possibly endless) iterator
                return ParsedSlice(None, SliceHeader(SliceStatus.CLOSED))
            with phase("input.draw"):  # the user's iterator (loading, decoding), not Herald's work
                batch = pending_first.pop() if pending_first else next(stream, None)
            return parse_slice(batch, lay)

        window: deque[Pending] = deque()  # gathered batches, not yet exchanged
        planned: deque[PlannedBatch] = deque()  # the plans of window[0], window[1], ... on every rank
        # plans made (where made here; None elsewhere) for the batches after those planned, not yet sent: the first
        # travels in the next round; a second, made a round earlier, is being cut on the cut thread
        unsent: deque[OutgoingPlan | FailedPlan | CutInFlight | None] = deque()
        # plans made but not yet sent, after each round's plan is sent: two where parts are cut on the cut thread
        # (the same on every rank: `send_parts` follows from the ranks' machines)
        ahead_plans = 2 if self.cut_thread and self.send_parts and self.plan_on != "every_rank" else 1
        exhausted = False
        levels = None  # every rank's level word in the last round completed (the planners agree on a plan's level)

        def plan_more(sent: int) -> None:
            """Make the next plans (`sent`: plans of this round and before): up to `ahead_plans` unsent, the first
            whenever its batch is gathered, the others only with their whole lookahead gathered (or the data ended),
            so that every plan sees the batches it would see made a round later."""
            while len(unsent) < ahead_plans:
                j = len(planned) + sent + len(unsent)  # its batch in the window
                if j >= len(window) or (unsent and j + self.lookahead >= len(window) and not exhausted):
                    return
                unsent.append(self._plan_next(window, j, levels))

        try:
            for _ in range(self.lookahead + 1 + ahead_plans):
                with phase("input.gather"):
                    got = self._round(Round(gather=draw(), level=self._level_word()))
                levels = got.levels
                if got.gathered is None:  # the end of the data
                    exhausted = True
                    break
                window.append(got.gathered)

            plan_more(0)
            next_planning = bool(unsent)  # whether the next round carries a plan
            next_made = self._settled(unsent[0]) if unsent else None
            if unsent:
                unsent[0] = next_made
            level = self._level_word()  # published with the plan just made, in the round that carries it
            ahead = None if exhausted else draw()  # the slice the next round gathers, parsed
            announced = None  # the next round's header words, where the previous round's trailers brought them
            trailers = self.R > 1
            while window:
                carries_plan, made, parsed = next_planning, next_made, ahead
                if carries_plan:
                    unsent.popleft()
                plan_more(int(carries_plan))
                next_planning = bool(unsent)
                next_made = self._settled(unsent[0]) if unsent else None
                if unsent:
                    unsent[0] = next_made
                next_level = self._level_word()
                # `parsed` (drawn last round) is None exactly when the data had ended by then: nothing is gathered
                ahead = draw() if not exhausted else None
                next_words = None
                if trailers:  # the next round's words: its slice (END if none), its plan's bytes (-1: failed)
                    next_words = Announcement(
                        (ahead if ahead is not None else NO_SLICE).header, plan_words(next_made, self.R), next_level
                    )
                exchange = Exchange(window[0], planned[0].plan) if planned else None
                self._ahead_samples = ahead.samples if ahead is not None else 0
                with phase("input.exchange_and_gather"):
                    result = self._round(
                        Round(
                            exchange=exchange,
                            gather=parsed,
                            carries_plan=carries_plan,
                            made=made,
                            announced=announced,
                            next_words=next_words,
                            level=level,
                        )
                    )
                announced, levels, level = result.next_announced, result.levels, next_level
                if result.planned is not None:
                    planned.append(result.planned)
                    self.sched_ms.append(result.planned.plan.sched_seconds * 1e3)  # timed by the policy itself
                if result.end_of_data:
                    exhausted = True
                    ahead = None
                elif result.gathered is not None:
                    window.append(result.gathered)
                if exchange is not None:
                    window.popleft()
                    plan, generation = planned.popleft()
                    assert result.assigned is not None  # a round with an exchange assembles this rank's samples
                    yield ScheduledBatch(result.assigned, plan, generation)
        finally:
            if self._cutter is not None:  # no cut outlives the stream (one in flight finishes first)
                self._cutter.shutdown(wait=True, cancel_futures=True)
                self._cutter = None
