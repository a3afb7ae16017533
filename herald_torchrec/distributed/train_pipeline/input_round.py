"""The words and records of one round of the Herald input stage (`input_stage.py` drives the rounds): what each
rank announces about its next slice, who plans for whom, what a round carries, and the ids blocks the planners
gather.

A round's header, per rank: SLICE_WORDS words about the slice it gathers (`SliceHeader`: status, samples, managed
ids, the one bag length or -1), the bytes of the plan it sends (PLAN_WORD; -1: its scheduler failed), the planning
level its planner asks for (LEVEL_WORD: schedule/herald/budget.py, where several ranks plan; 0 elsewhere), then R
words: the bytes of its samples sent to each rank. Every rank's header of a round, side by side, is `RoundHeads`.
In steady state the first PAY_WORDS of them ride on the previous round's all-to-all as a trailer (`Announcement`,
TRAILER_BYTES per rank). Pure numpy: the collectives stay in the stage.
"""

from __future__ import annotations

import enum
import hashlib
import os
import socket
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from torchrec.datasets.utils import Batch

from herald_torchrec.distributed.train_pipeline.input_layout import (
    GatheredIds,
    HostSlice,
    ManagedTables,
    SliceLayout,
    gather_ids,
    global_batch,
    host_slice,
    managed_ids,
)
from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.plan import Plan


class SliceStatus(enum.IntEnum):
    """Header word 0 of a rank's slice: what the rest of its words hold (the values are the wire's)."""

    BAD = -1  # the rank rejected its slice (its own error says why): every rank stops
    END = 0  # no slice: its iterator ended (also the words of a round that gathers nothing)
    DATA = 1  # a full slice of B samples
    SHORT = 2  # fewer than B samples: a short last batch, dropped as with drop_last
    CLOSED = 3  # the rank's pipeline is closing (`request_stop`)


STATUS_WORD, SAMPLES_WORD, IDS_WORD, UNIFORM_WORD = 0, 1, 2, 3  # a slice's header words (`SliceHeader`)
SLICE_WORDS = 4
PLAN_WORD = SLICE_WORDS  # then: bytes of the plan the planner sends this round (-1: a scheduler failed)
LEVEL_WORD = PLAN_WORD + 1  # then: the planning level this rank's planner asks for (its budget's word; 0: FULL)
PAY_WORDS = LEVEL_WORD + 1  # then R words: bytes of this round's samples sent to each rank
TRAILER_BYTES = PAY_WORDS * 8  # the next round's status, slice, plan and level words, riding on this round's all-to-all
GENERATION_BYTES = 8  # the scheduler generation (int64) in front of a sent plan


def planners(plan_on: str, hosts: np.ndarray) -> np.ndarray:
    """The rank that plans for each rank: the lowest rank of its host ("host"; `hosts` = a key per rank), rank 0
    ("rank0"), or itself ("every_rank")."""
    R = hosts.shape[0]
    if plan_on == "every_rank":
        return np.arange(R, dtype=np.int64)
    if plan_on == "rank0":
        return np.zeros(R, dtype=np.int64)
    first: dict[int, int] = {}
    return np.array([first.setdefault(int(h), q) for q, h in enumerate(hosts)], dtype=np.int64)


def host_key() -> int:
    """This machine, as an int64 every rank on it shares: a hash of the host name and, under torchrun, its GROUP_RANK.

    Why GROUP_RANK: clusters run one torchrun agent per machine, whose group rank then names the machine even where
    host names repeat (containers, or network namespaces emulating hosts on one machine, which all report the same
    name); several agents on one machine count as separate hosts. `torchrun --standalone` gives every rank
    GROUP_RANK=0, so a single-machine run stays one host; without torchrun the host name alone decides.
    """
    name = socket.gethostname()
    group = os.environ.get("GROUP_RANK")
    if group is not None:
        name = f"{name}/group{group}"
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "little", signed=True)


@dataclass(frozen=True)
class SliceHeader:
    """A slice's SLICE_WORDS header words, by name: what every rank learns of it before its ids move."""

    status: SliceStatus
    samples: int = 0
    ids: int = 0  # managed ids in the slice (what it sends each planner, with its lengths unless `uniform` >= 0)
    uniform: int = 0  # the one length of every bag in the slice; -1: they differ, so its lengths travel

    def words(self) -> np.ndarray:
        """The words on the wire (int64)."""
        return np.array([int(self.status), self.samples, self.ids, self.uniform], dtype=np.int64)


@dataclass(frozen=True)
class ParsedSlice:
    """This rank's next slice, parsed (a round before its ids travel): the slice (None at the end of data, or where
    rejected), its header words, and the error that rejected it (raised once every rank knows)."""

    local: HostSlice | None
    header: SliceHeader
    error: Exception | None = None

    @property
    def samples(self) -> int:
        return self.local.n if self.local is not None else 0

    def full(self) -> HostSlice:
        """The slice, where every rank reported DATA (so this one parsed)."""
        if self.local is None:
            raise RuntimeError("herald input stage: a gathered slice without data (a protocol bug)")
        return self.local


NO_SLICE = ParsedSlice(None, SliceHeader(SliceStatus.END))  # what a round that gathers nothing announces


def parse_slice(batch: Batch | None, lay: SliceLayout) -> ParsedSlice:
    """Parse this rank's next slice; its header words say what the others can expect from it."""
    if batch is None:
        return NO_SLICE
    try:
        hs = host_slice(batch, lay)
    except ValueError as e:
        return ParsedSlice(None, SliceHeader(SliceStatus.BAD), e)
    if hs.n < lay.batch_size:
        return ParsedSlice(hs, SliceHeader(SliceStatus.SHORT, hs.n))
    n_ids = int(hs.lengths[lay.managed].sum())
    return ParsedSlice(hs, SliceHeader(SliceStatus.DATA, hs.n, n_ids, hs.uniform))


@dataclass(frozen=True)
class Announcement:
    """This rank's first PAY_WORDS header words of the next round (its slice, the bytes of the plan it sends each
    rank, its planner's level word), sent a round early as the trailer of this round's all-to-all, so that the next
    round needs no all-gather of them."""

    header: SliceHeader
    plan_bytes: np.ndarray  # int64 [R]: to each rank (`plan_words`)
    level: int = 0

    def words_to(self) -> np.ndarray:
        """[R, PAY_WORDS] int64: row d is the trailer sent to rank d (only the plan word differs)."""
        out = np.empty((self.plan_bytes.shape[0], PAY_WORDS), dtype=np.int64)
        out[:, :SLICE_WORDS] = self.header.words()
        out[:, PLAN_WORD] = self.plan_bytes
        out[:, LEVEL_WORD] = self.level
        return out


@dataclass(frozen=True)
class RoundHeads:
    """Every rank's header words of one round as one rank holds them, [R, PAY_WORDS + 1] int64 (row q: rank q's
    first PAY_WORDS words, then the bytes of its samples sent to this rank), by name."""

    words: np.ndarray

    @property
    def status(self) -> np.ndarray:
        return self.words[:, STATUS_WORD]

    @property
    def samples(self) -> np.ndarray:
        return self.words[:, SAMPLES_WORD]

    @property
    def ids(self) -> np.ndarray:
        return self.words[:, IDS_WORD]

    @property
    def uniform(self) -> np.ndarray:
        return self.words[:, UNIFORM_WORD]

    @property
    def plan_bytes(self) -> np.ndarray:
        """The bytes of the plan each rank sends this rank this round (-1 from every rank whose scheduler failed)."""
        return self.words[:, PLAN_WORD]

    @property
    def levels(self) -> np.ndarray:
        """The planning level each rank's planner asks for (schedule/herald/budget.py; 0 on ranks that do not plan)."""
        return self.words[:, LEVEL_WORD]

    @property
    def sample_bytes_here(self) -> np.ndarray:
        """The bytes of its samples each rank sends this rank this round."""
        return self.words[:, PAY_WORDS]


@dataclass
class Pending:
    """A gathered global batch waiting for its plan: this rank's slice, the global ids (on the ranks that plan), the
    scheduler's view, and each rank's uniform bag length (header word; -1: its lengths travel)."""

    local: HostSlice
    ids: GatheredIds | None  # None on ranks that receive their plans: they get the ids with the samples
    batch: GlobalBatch | None  # the scheduler's view (None on ranks that receive their plans)
    uniform: np.ndarray
    first_sample: int = 0  # the global index of `ids`' first sample (a machine's first, where planned per machine)

    def scheduler_view(self) -> GlobalBatch:
        if self.batch is None:
            raise RuntimeError("herald input stage: only the ranks that plan hold the scheduler's view")
        return self.batch


@dataclass(frozen=True)
class OutgoingPlan:
    """A plan made on a rank that plans, a round before it travels: `plan` is what this rank executes (its own part
    where the plan travels as parts: distributed/step/plan_part.py), `wires` what it sends each rank it plans for
    (rank -> encoded plan or part; empty: it plans for itself only)."""

    plan: Plan
    generation: int
    wires: dict[int, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class CutInFlight:
    """A plan made on a rank that plans, its parts being cut on the cut thread (`ScheduledInput(cut_thread=True)`):
    `cut` gives (what this rank executes, the wires), as `OutgoingPlan` holds them, once done."""

    generation: int
    cut: Future


@dataclass(frozen=True)
class FailedPlan:
    """A scheduler that raised: kept until the next header tells every rank, then raised here as it is."""

    generation: int
    error: Exception


class PlannedBatch(NamedTuple):
    """A plan ready on this rank (made here or received) and the scheduler generation that made it."""

    plan: Plan
    generation: int


def plan_words(out: OutgoingPlan | FailedPlan | None, world_size: int) -> np.ndarray:
    """The header word of the plan a round carries from this rank, per receiving rank, int64 [R]: the bytes it sends
    that rank (generation, then the encoded plan or part), 0 if none, -1 to every rank if its scheduler failed."""
    words = np.zeros(world_size, dtype=np.int64)
    if isinstance(out, FailedPlan):
        words[:] = -1
    elif out is not None:
        for d, wire in out.wires.items():
            words[d] = GENERATION_BYTES + wire.shape[0]
    return words


def raise_bad(status: np.ndarray, err: Exception | None) -> None:
    """This rank's own input error as it is; another rank's (status BAD) as a ValueError that names it."""
    if err is not None:
        raise err
    if (status == SliceStatus.BAD).any():
        q = int(np.flatnonzero(status == SliceStatus.BAD)[0])
        raise ValueError(f"rank {q} rejected its input batch (see its error); every rank stops")


def ids_block(hs: HostSlice, header: SliceHeader, lay: SliceLayout) -> np.ndarray:
    """What this rank sends each planner about its slice: the bag lengths (unless one length fits all), then the
    managed ids."""
    parts = [] if header.uniform >= 0 else [hs.lengths.astype(np.int32).reshape(-1).view(np.uint8)]
    parts.append(managed_ids(hs, lay).view(np.uint8))
    return np.concatenate(parts)


def ids_sizes(heads: RoundHeads, lay: SliceLayout) -> list[int]:
    """Bytes of every rank's ids block, from its header words."""
    K, B = lay.num_keys, lay.batch_size
    return [(0 if u >= 0 else K * B * 4) + int(n) * lay.ids_dtype.itemsize for u, n in zip(heads.uniform, heads.ids)]


def decode_ids(
    uniform: np.ndarray, blocks: list[np.ndarray], lay: SliceLayout, tables: ManagedTables, index: int | None = None
) -> tuple[GatheredIds, GlobalBatch]:
    """On a rank that plans: the global batch's ids from every rank's ids block (`uniform[q]`: rank q's one bag
    length, or -1: its block starts with its lengths), and the scheduler's view."""
    K, B = lay.num_keys, lay.batch_size
    lengths = np.empty((uniform.shape[0], K, B), dtype=np.int64)
    ids = []
    for q, (u, b) in enumerate(zip(uniform, blocks)):
        if u >= 0:
            lengths[q] = u
            ids.append(b.view(lay.ids_dtype))
        else:
            lengths[q] = b[: K * B * 4].view(np.int32).reshape(K, B)
            ids.append(b[K * B * 4 :].view(lay.ids_dtype))
    g = gather_ids(lengths, ids, lay)
    # the scheduler's view (the ids were range-checked on their rank, in host_slice)
    return g, global_batch(g, lay, tables, index)
