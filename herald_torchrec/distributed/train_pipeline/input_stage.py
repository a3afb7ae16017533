"""The Herald input stage: from this rank's `Batch` slice of each global batch to its *assigned* samples plus the Plan.

Per step, every rank:
(1) learns every rank's header of 5 + R words (status, samples, managed ids, uniform bag length, plan bytes, then
    the bytes of this round's samples it sends to each rank) — end of data, short batches, rank-local input errors
    and a failed scheduler become known to every rank here, so all ranks stop or raise together. In steady state the
    first 5 words came with the previous round's all-to-all (a 40-byte trailer per rank: each slice is parsed a
    round before it is gathered, each plan made a round before it travels) and the sample bytes are computed by the
    receiver from the plan (every bag of one length: a fixed size per sample), so the round is one collective;
    otherwise (the first rounds, slices whose lengths travel) the words are all-gathered first;
(2) sends the lengths (unless every bag has the same length) and the ids of the Herald-managed features of its slice
    to the ranks that plan (below), so each of them holds the ids of the whole global batch (dense features, labels
    and the other features stay put);
(3) plans: the scheduler is deterministic, so any rank can plan for any other. With `plan_on="host"` (the
    default) the lowest rank on each machine (by host name: the ranks that share its cores) runs it on the global
    batch and the next L and sends the plan to the other ranks of its machine (schedule/plan_wire.py: ~11 KB on the
    W&D workload at R=2), so a machine running R ranks plans once, not R times (~5 ms of CPU per step each), and
    no plan crosses to another machine; `plan_on="rank0"`: rank 0 plans for every rank, wherever it runs;
    `plan_on="every_rank"`: every rank plans for itself and nothing is sent;
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
the lookahead needs, for the plans made a round early) and one parsed slice of its own. Multi-hot and
variable-length bags, empty bags, a key read by several tables and tables of several EBCs are all handled: the
scheduler gets one CSR per managed table (input_layout.py).

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
from typing import Callable, Iterator

import numpy as np
import torch
from torch.distributed import all_gather as _all_gather, all_to_all_single as _all_to_all_single
from torchrec.datasets.utils import Batch

from herald_torchrec.distributed.comm import PlanComm, phase
from herald_torchrec.distributed.train_pipeline.input_layout import (
    HostSlice,
    ManagedTables,
    SliceLayout,
    assigned_batch,
    assigned_kjt_parts,
    received_samples,
    sample_blocks,
    slice_layout,
)
from herald_torchrec.distributed.train_pipeline.input_round import (
    BAD,
    CLOSED,
    DATA,
    END,
    GENERATION_BYTES,
    PAY_WORDS,
    PLAN_ON,
    PLAN_WORD,
    SHORT,
    SLICE_WORDS,
    TRAILER_BYTES,
    UNIFORM_WORD,
    Outgoing,
    Pending,
    decode_ids,
    host_key,
    ids_block,
    ids_sizes,
    plan_word,
    planners,
    raise_bad,
    slice_header,
    slice_words,
)
from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.plan import Plan
from herald_torchrec.schedule.plan_wire import decode_plan, encode_plan
from herald_torchrec.schedule.policy import SchedulePolicy

SCHED_MS_KEPT = 100_000  # recent planning times kept, however long the run


class ScheduledInput:
    """Iterator adapter: this rank's `Batch` slices in, (assigned `Batch`, `Plan`) out, L batches ahead.

    `policy_factory(batch_per_rank)` builds the scheduler once the first slice tells the batch size (the pipeline
    builds it from the sharded modules' own settings; every rank builds it, so a bad setting raises everywhere, and
    only the ranks that plan keep it: `policy` is None on the others, see `plan_on` in the module docstring);
    `reset_policy()` starts it again from the home placement (after a checkpoint load reset the data plane's
    ownership)."""

    def __init__(self, tables: ManagedTables, comm: PlanComm, policy_factory: Callable[[int], SchedulePolicy],
                 plan_on: str = "host") -> None:
        if plan_on not in PLAN_ON:
            raise ValueError(f"plan_on must be one of {PLAN_ON}, got {plan_on!r}")
        self.tables = tables
        self.comm = comm
        self.R, self.rank = comm.world_size, comm.rank
        self.plan_on = plan_on
        # who plans for whom: set at the first batch (the hosts are gathered with the layout)
        self.planner = self.rank  # the rank whose plans this rank executes
        self.plans_for = np.zeros(self.R, dtype=bool)  # the ranks this rank sends its plans to (never itself)
        self.is_planner = np.ones(self.R, dtype=bool)  # the ranks that plan: only they receive every slice's ids
        self._factory = policy_factory
        # (generation, policy), replaced as one object by reset_policy (the stage's thread reads both at once);
        # the generation counts resets: plans of an older one must not be executed
        self._current: tuple[int, SchedulePolicy | None] = (0, None)
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
        return self._current[1]

    @property
    def generation(self) -> int:
        return self._current[0]

    @property
    def plans_here(self) -> bool:
        return self.planner == self.rank

    # ------------------------------------------------------------------ collectives (bytes only)
    def _all_gather_words(self, words: np.ndarray, kind: str) -> np.ndarray:
        """[R, n] int64 from every rank's n words."""
        if self.R == 1:
            return words[None, :].copy()
        t = torch.from_numpy(np.ascontiguousarray(words, dtype=np.int64))
        parts = [torch.empty_like(t) for _ in range(self.R)]
        self.comm.counter.add(kind, t.numel() * 8 * (self.R - 1))
        with phase("input.header_all_gather"):
            _all_gather(parts, t, group=self.comm.group)
        return torch.stack(parts).numpy()

    def _all_to_all_bytes(self, blocks: list[np.ndarray], recv: list[int]) -> list[np.ndarray]:
        """Send blocks[d] (uint8) to rank d; receive recv[q] bytes from rank q (sizes known on both sides)."""
        if self.R == 1:
            return [blocks[0]]
        send = torch.from_numpy(np.concatenate(blocks)) if blocks else torch.zeros(0, dtype=torch.uint8)
        out = torch.empty(int(sum(recv)), dtype=torch.uint8)
        with phase("input.all_to_all"):
            _all_to_all_single(out, send, recv, [b.shape[0] for b in blocks], group=self.comm.group)
        return list(np.split(out.numpy(), np.cumsum(recv)[:-1]))

    # ------------------------------------------------------------------ set-up
    def _setup(self, first: Batch | None) -> bool:
        """The first slice fixes the layout; every rank checks that all agree (keys, batch size, dense / labels).
        False if some rank has no data at all (every rank stops; the others warn)."""
        err: Exception | None = None
        layout = None
        if first is None:
            words = slice_words(END)
        else:
            try:
                layout = slice_layout(first, self.tables)
                words = np.concatenate([[DATA], layout.signature()])
            except ValueError as e:
                err, words = e, slice_words(BAD)
        got = self._all_gather_words(np.append(words, host_key()), "control")  # + the host, for `planners`
        got, hosts = got[:, :-1], got[:, -1]
        raise_bad(got[:, 0], err)
        if (got[:, 0] == END).any():
            if first is not None:
                warnings.warn(f"herald input (rank {self.rank}): ranks {np.flatnonzero(got[:, 0] == END).tolist()} "
                              "have no data at all; every rank stops before the first step", stacklevel=3)
            return False
        if (got[:, 1:] != got[0, 1:]).any():
            raise ValueError(
                "ranks disagree on the input's layout (KJT keys, batch size per rank, dense / label shapes): "
                f"batch sizes {got[:, 1].tolist()}, key counts {got[:, 2].tolist()}; every rank must feed slices "
                "of the same global batch"
            )
        self.layout = layout
        planner_of = planners(self.plan_on, hosts)
        self.planner = int(planner_of[self.rank])
        self.plans_for = (planner_of == self.rank) & (np.arange(self.R) != self.rank)
        self.is_planner = np.zeros(self.R, dtype=bool)
        self.is_planner[planner_of] = True
        policy = self._factory(layout.batch_size)  # type: ignore[union-attr]
        if policy.num_ranks != self.R:
            raise ValueError(f"policy planned for {policy.num_ranks} ranks, but the process group has {self.R}")
        self.lookahead = policy.lookahead
        self._current = (self.generation, policy if self.plans_here else None)
        return True

    def reset_policy(self) -> None:
        """A fresh scheduler (home placement), e.g. after `load_state_dict` reset the data plane's ownership.
        Every rank calls it at the same step, so generations agree across ranks."""
        fresh = self._factory(self.layout.batch_size) if self.layout is not None and self.plans_here else None
        self._current = (self.generation + 1, fresh)

    # ------------------------------------------------------------------ gather
    def _check_heads(self, heads: np.ndarray, hs: HostSlice | None, err: Exception | None) -> bool:
        """True if every rank has a full slice; else warn (what this rank drops) and return False (end of data)."""
        raise_bad(heads[:, 0], err)
        status = heads[:, 0]
        if (status == DATA).all():
            return True
        if (status == CLOSED).any():  # a pipeline closing (request_stop): asked for, so nothing to warn about
            return False
        mine = (hs.n if hs is not None else 0) + self._ahead_samples  # with the slice drawn a round ahead
        self.dropped_samples += mine
        if (status == SHORT).any():
            why = "short last batch" + "es" * int((status == SHORT).sum() > 1) + " (" + ", ".join(
                f"rank {q}: {int(heads[q, 1])} samples" for q in np.flatnonzero(status == SHORT)) + ")"
        else:
            why = f"ranks {np.flatnonzero(status == END).tolist()} ran out of data"
        if not (status == END).all():  # an uneven end: say what is lost (a clean end of every rank is silent)
            warnings.warn(
                f"herald input (rank {self.rank}): {why}; the incomplete global batch is dropped, as with "
                f"drop_last: this rank drops {mine} samples (and whatever its iterator still holds)",
                stacklevel=3,
            )
        return False

    # ------------------------------------------------------------------ exchange
    def _payload(self, cur: Pending, plan: Plan) -> tuple[list[np.ndarray], np.ndarray]:
        """Per destination: this rank's samples the plan assigns there (input_layout.sample_blocks: the ranks that do
        not plan also get their lengths and managed ids, which only the planners gathered), and how many."""
        lay, B, r = self.layout, self.layout.batch_size, self.rank  # type: ignore[union-attr]
        dest = plan.assignment()[r * B : (r + 1) * B]
        order = np.argsort(dest, kind="stable")  # by destination, global order within
        cut = np.concatenate([[0], np.cumsum(np.bincount(dest, minlength=self.R))])
        uniform = bool(cur.uniform[r] >= 0)
        blocks, id_bytes = sample_blocks(cur.local, lay, order, cut, ~self.is_planner, uniform)  # type: ignore[arg-type]
        others = np.arange(self.R) != r
        ids_sent = int(id_bytes[others].sum())
        self.comm.counter.add("sample_ids", ids_sent, call=False)
        self.comm.counter.add("samples", int(sum(b.shape[0] for d, b in enumerate(blocks) if d != r)) - ids_sent, call=False)
        return blocks, np.diff(cut)

    def _assemble(self, cur: Pending, mine: np.ndarray, n_from: np.ndarray, got: list[np.ndarray]) -> Batch:
        """This rank's assigned samples (`mine`: global indices, in order; `n_from`: how many from each rank) from
        what every rank sent it."""
        lay = self.layout
        if cur.ids is None:  # the samples brought their lengths and ids
            fixed, lengths, values = received_samples(got, n_from, cur.uniform, lay)  # type: ignore[arg-type]
            return assigned_batch(lengths, values, fixed, lay)  # type: ignore[arg-type]
        fb = lay.fixed_bytes()  # type: ignore[union-attr]
        fixed = np.concatenate([g[: n * fb] for g, n in zip(got, n_from)]).reshape(mine.shape[0], fb)
        carried = np.concatenate([g[n * fb :] for g, n in zip(got, n_from)]).view(np.int64)
        lengths, values = assigned_kjt_parts(cur.ids, lay, mine, carried)  # type: ignore[arg-type]
        return assigned_batch(lengths, values, fixed, lay)  # type: ignore[arg-type]

    def _plan_next(self, batches: list[GlobalBatch]) -> Outgoing | None:
        """Plan the next batch (batches: it and up to L after it) where plans are made; the planner also encodes
        the plan for the others. A failing scheduler is returned (err), so that every rank raises together."""
        generation, policy = self._current
        if not self.plans_here:
            return None
        try:
            with phase("input.plan"):
                cpu = time.thread_time()
                plan = policy.plan(batches)  # type: ignore[union-attr]
                self.sched_cpu_ms.append((time.thread_time() - cpu) * 1e3)
            wire = encode_plan(plan) if self.plans_for.any() else None
        except Exception as e:  # noqa: BLE001 - raised after the next header, on this rank as it is
            return Outgoing(None, generation, err=e)
        return Outgoing(plan, generation, wire)

    def _raise_failed_plan(self, out: Outgoing | None, heads: np.ndarray) -> None:
        """After the header: a scheduler that failed on some rank stops every rank (before any data moves)."""
        if out is not None and out.err is not None:
            raise out.err
        failed = np.flatnonzero(heads[:, PLAN_WORD] < 0)
        if failed.size:
            raise RuntimeError(f"herald input (rank {self.rank}): the scheduler failed on rank(s) {failed.tolist()} "
                               "(see their error); every rank stops")

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
        lay = self.layout
        ids = 0 if planner else lay.managed.shape[0] * u * lay.ids_dtype.itemsize  # type: ignore[union-attr]
        return lay.fixed_bytes() + ids + lay.carried.shape[0] * u * 8  # type: ignore[union-attr]

    def _step(self, cur: Pending | None, plan: Plan | None, gather: bool,
              parsed: tuple[HostSlice | None, np.ndarray, Exception | None] | None,
              out: Outgoing | None = None, planning: bool = False, known: np.ndarray | None = None,
              trailer: np.ndarray | None = None) -> tuple[Batch | None, Pending | None | bool, tuple[Plan, int] | None, np.ndarray | None]:
        """One collective round: the exchange of `cur` by `plan` (if any), the gather of the slice `parsed` (this
        rank's next slice, parsed by `_header`, if `gather`) and, if `planning`, the plan of a later batch (made here
        as `out`, or received from this rank's planner).

        The round's header words (each rank's slice status, plan bytes and sample bytes) come from an all-gather,
        unless the previous round brought them (`known`: [R, PAY_WORDS], its trailers) and this rank can size what
        it receives from the plan alone (`_recv_sizes`): then the round is a single all-to-all. `trailer` (this
        rank's header words of the next round, every rank or none) rides on this round's all-to-all.
        Returns (assigned batch or None, gathered pending batch or False at the end of data, (plan, generation) of
        the planned batch or None, the next round's header words from the trailers or None)."""
        R, r, q = self.R, self.rank, self.planner
        receives = planning and q != r
        ids_blocks_in, plan_in = [0] * R, [0] * R
        gathered: Pending | None | bool = None
        my_ids = wire = np.zeros(0, dtype=np.uint8)
        if plan_word(out) > 0:  # the planner: generation, then the plan
            wire = np.concatenate([np.array([out.generation], dtype=np.int64).view(np.uint8), out.wire])  # type: ignore[union-attr]
            self.comm.counter.add("plan", wire.shape[0] * int(self.plans_for.sum()), call=False)
        # cut the samples first: their bytes per destination travel in the header (unless receivers compute them: one
        # bag length), since a rank that does not plan cannot size the lengths and ids that come with them
        if cur is not None:
            pay, n_to = self._payload(cur, plan)  # type: ignore[arg-type]
            self.comm.counter.add("samples", 0)
        else:
            pay, n_to = [np.zeros(0, np.uint8)] * R, np.zeros(R, dtype=np.int64)
        hs, head, err = parsed if gather and parsed is not None else slice_header(None, self.layout)  # type: ignore[arg-type]
        head = np.concatenate([head, [plan_word(out)], [b.shape[0] for b in pay]])
        mine = n_from = None  # the global indices the plan assigns here (increasing), and how many from each rank
        if cur is not None:
            mine = plan.local_samples(r)  # type: ignore[union-attr]
            n_from = np.bincount(mine // self.layout.batch_size, minlength=R)  # type: ignore[union-attr]
        sizes = None if known is None else ([0] * R if cur is None else self._recv_sizes(cur, n_from))  # type: ignore[arg-type]
        if sizes is not None:  # the header came with the previous round: no all-gather
            checked = slice(0, PAY_WORDS) if gather else slice(PLAN_WORD, PAY_WORDS)  # no gather: its words unused
            if not np.array_equal(known[r, checked], head[checked]):  # type: ignore[index]
                raise RuntimeError(f"herald input stage (rank {r}): this round's header {head[:PAY_WORDS].tolist()} "
                                   f"differs from what the previous round announced {known[r].tolist()}")  # type: ignore[index]
            if cur is not None and [b.shape[0] for b in pay] != [
                    int(n) * self._sample_bytes(int(cur.uniform[r]), bool(self.is_planner[d])) for d, n in enumerate(n_to)]:
                raise RuntimeError(f"herald input stage (rank {r}): sample blocks differ from the sizes receivers compute")
            heads = np.zeros((R, PAY_WORDS + R), dtype=np.int64)
            heads[:, :PAY_WORDS] = known
            heads[:, PAY_WORDS + r] = sizes
        else:
            heads = self._all_gather_words(head, "control") if R > 1 else head[None, :]
        if planning:
            self._raise_failed_plan(out, heads)
        if receives:
            plan_in[q] = int(heads[q, PLAN_WORD])
        if gather:
            if self._check_heads(heads[:, :SLICE_WORDS], hs, err):
                my_ids = ids_block(hs, head, self.layout)  # type: ignore[arg-type]
                if self.plans_here:
                    ids_blocks_in = ids_sizes(heads, self.layout)  # type: ignore[arg-type]
                to_planners = int(self.is_planner.sum()) - int(self.is_planner[r])
                self.comm.counter.add("sample_ids", my_ids.shape[0] * to_planners, call=cur is None)
            else:
                gathered = False
        tb = trailer.astype(np.int64).view(np.uint8) if trailer is not None else np.zeros(0, np.uint8)
        if trailer is not None:
            self.comm.counter.add("control", TRAILER_BYTES * (R - 1), call=False)
        sends = [np.concatenate([tb, my_ids[: None if self.is_planner[d] else 0], wire[: None if self.plans_for[d] else 0], p])
                 for d, p in enumerate(pay)]
        t = tb.shape[0]
        recv = [t + a + b + int(c) for a, b, c in zip(ids_blocks_in, plan_in, heads[:, PAY_WORDS + r])]
        if any(b.shape[0] for b in sends) or any(recv):
            got = self._all_to_all_bytes(sends, recv)
        else:
            got = [np.zeros(0, np.uint8)] * R
        following = np.stack([g[:t].view(np.int64) for g in got]) if trailer is not None else None
        got = [g[t:] for g in got]
        if gathered is None and gather:
            g, gb = (decode_ids(heads[:, :SLICE_WORDS], [b[:n] for b, n in zip(got, ids_blocks_in)], self.layout,  # type: ignore[arg-type]
                                 self.tables, None)
                     if self.plans_here else (None, None))
            gathered = Pending(hs, g, gb, heads[:, UNIFORM_WORD].copy())  # type: ignore[arg-type]
        planned = None
        if out is not None:  # planned here
            planned = (out.plan, out.generation)
        elif receives:  # from this rank's planner: [generation int64, encoded plan]
            block = got[q][ids_blocks_in[q] : ids_blocks_in[q] + plan_in[q]]
            planned = (decode_plan(block[GENERATION_BYTES:]), int(block[:GENERATION_BYTES].view(np.int64)[0]))
        rest = [b[n + m :] for b, n, m in zip(got, ids_blocks_in, plan_in)]
        assigned = self._assemble(cur, mine, n_from, rest) if cur is not None else None  # type: ignore[arg-type]
        return assigned, gathered, planned, following  # type: ignore[return-value]

    # ------------------------------------------------------------------ the stream
    def __call__(self, stream: Iterator[Batch]) -> Iterator[tuple[Batch, Plan, int]]:
        """(assigned batch, its plan, the scheduler generation that planned it), in training order.

        Steady state, one all-to-all per round: each plan is made a round before it travels (so its size, and the
        next slice's header words, parsed a round ahead, ride on the round before as a trailer), which keeps one
        gathered batch more than the lookahead needs."""
        first = next(stream, None)
        if self.layout is None and not self._setup(first):
            return
        pending_first: list[Batch | None] = [first]

        def draw() -> tuple[HostSlice | None, np.ndarray, Exception | None]:
            if self._stop:  # closing: no more slices from the user's (possibly endless) iterator
                return None, slice_words(CLOSED), None
            with phase("input.draw"):  # the user's iterator (loading, decoding), not Herald's work
                batch = pending_first.pop() if pending_first else next(stream, None)
            return slice_header(batch, self.layout)  # type: ignore[arg-type]

        window: deque[Pending] = deque()  # gathered batches, not yet exchanged
        planned: deque[tuple[Plan, int]] = deque()  # (plan, generation) of window[0], window[1], ... on every rank
        exhausted = False
        for _ in range(self.lookahead + 2):
            with phase("input.gather"):
                _, got, _, _ = self._step(None, None, True, draw())
            if got is False:
                exhausted = True
                break
            window.append(got)  # type: ignore[arg-type]
        L1 = self.lookahead + 1

        def plan_of(j: int) -> Outgoing | None:  # window[j]'s plan, from it and the (up to) L gathered after it
            return self._plan_next([window[i].batch for i in range(j, min(j + L1, len(window)))])

        next_planning = bool(window)  # whether the next round carries a plan, and (where made here) which
        next_out = plan_of(0) if next_planning else None
        ahead = None if exhausted else draw()  # the slice the next round gathers, parsed
        known = None  # the next round's header words, where the previous round's trailers brought them
        trailers = self.R > 1
        while window:
            planning, out, parsed = next_planning, next_out, ahead
            j = len(planned) + int(planning)  # the first batch without a plan once this round's has travelled
            next_planning = j < len(window)
            next_out = plan_of(j) if next_planning else None
            gather = not exhausted
            ahead = draw() if gather else None
            trailer = None
            if trailers:  # the next round's words: its slice (END if none), its plan's bytes (-1: a failed scheduler)
                trailer = np.concatenate([(ahead or slice_header(None, self.layout))[1], [plan_word(next_out)]])  # type: ignore[arg-type]
            cur = window[0] if planned else None
            self._ahead_samples = ahead[0].n if ahead is not None and ahead[0] is not None else 0
            with phase("input.exchange_and_gather"):
                assigned, got, new_plan, known = self._step(cur, planned[0][0] if planned else None, gather, parsed,
                                                            out, planning, known, trailer)
            if new_plan is not None:
                planned.append(new_plan)
                self.sched_ms.append(new_plan[0].sched_seconds * 1e3)  # timed by the policy itself
            if not exhausted:
                if got is False:
                    exhausted = True
                    ahead = None
                else:
                    window.append(got)  # type: ignore[arg-type]
            if cur is not None:
                window.popleft()
                plan, generation = planned.popleft()
                yield assigned, plan, generation  # type: ignore[misc]
