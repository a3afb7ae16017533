"""The words of one round of the Herald input stage (`input_stage.py` drives the rounds): what each rank announces
about its next slice, who plans for whom, what a round carries, and the ids blocks the planners gather.

A round's header, per rank: SLICE_WORDS words about the slice it gathers (status, samples, managed ids, the one bag
length or -1), the bytes of the plan it sends (PLAN_WORD; -1: its scheduler failed), then R words: the bytes of its
samples sent to each rank. In steady state the first PAY_WORDS of them ride on the previous round's all-to-all as a
trailer (TRAILER_BYTES per rank). Pure numpy: the collectives stay in the stage.
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass

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

# header word 0 of each rank's slice: what the rest holds (CLOSED: the rank's pipeline is closing, `request_stop`)
DATA, END, SHORT, BAD, CLOSED = 1, 0, 2, -1, 3
SLICE_WORDS = 4  # header words of the slice: status, samples, managed ids, uniform bag length (-1: lengths travel)
IDS_WORD, UNIFORM_WORD = 2, 3  # of those: the slice's managed ids, its one bag length
PLAN_WORD = SLICE_WORDS  # then: bytes of the plan the planner sends this round (-1: a scheduler failed)
PAY_WORDS = PLAN_WORD + 1  # then R words: bytes of this round's samples sent to each rank
TRAILER_BYTES = PAY_WORDS * 8  # the next round's status, slice and plan words, riding on this round's all-to-all
GENERATION_BYTES = 8  # the scheduler generation (int64) in front of a sent plan
PLAN_ON = ("host", "rank0", "every_rank")


def planners(plan_on: str, hosts: np.ndarray) -> np.ndarray:
    """The rank that plans for each rank: the lowest rank of its host ("host"; `hosts` = a key per rank), rank 0
    ("rank0"), or itself ("every_rank")."""
    R = hosts.shape[0]
    if plan_on == "every_rank":
        return np.arange(R, dtype=np.int64)
    if plan_on == "rank0":
        return np.zeros(R, dtype=np.int64)
    first = {}
    return np.array([first.setdefault(int(h), q) for q, h in enumerate(hosts)], dtype=np.int64)


def host_key() -> int:
    """This machine, as an int64 every rank on it shares (a hash of the host name)."""
    return int.from_bytes(hashlib.sha1(socket.gethostname().encode()).digest()[:8], "little", signed=True)


@dataclass
class Pending:
    """A gathered global batch waiting for its plan: this rank's slice, the global ids (on the ranks that plan), the
    scheduler's view, and each rank's uniform bag length (header word; -1: its lengths travel)."""

    local: HostSlice
    ids: GatheredIds | None  # None on ranks that receive their plans: they get the ids with the samples
    batch: GlobalBatch | None  # the scheduler's view (None on ranks that receive their plans)
    uniform: np.ndarray


@dataclass
class Outgoing:
    """A plan made on a rank that plans, a round before it travels; `wire` is what it sends the ranks it plans for
    (None: it plans for itself only); `err` a failed scheduler."""

    plan: Plan | None
    generation: int
    wire: np.ndarray | None = None
    err: Exception | None = None


def plan_word(out: Outgoing | None) -> int:
    """The header word of the plan a round carries from this rank: the bytes it sends (generation, then the encoded
    plan), 0 if none, -1 if its scheduler failed."""
    if out is None:
        return 0
    if out.err is not None:
        return -1
    return 0 if out.wire is None else GENERATION_BYTES + out.wire.shape[0]


def raise_bad(status: np.ndarray, err: Exception | None) -> None:
    """This rank's own input error as it is; another rank's (status BAD) as a ValueError that names it."""
    if err is not None:
        raise err
    if (status == BAD).any():
        q = int(np.flatnonzero(status == BAD)[0])
        raise ValueError(f"rank {q} rejected its input batch (see its error); every rank stops")


def slice_words(status: int, samples: int = 0, ids: int = 0, uniform: int = 0) -> np.ndarray:
    """A slice's SLICE_WORDS header words: its status, samples, managed ids and one bag length (-1: lengths travel)."""
    return np.array([status, samples, ids, uniform], dtype=np.int64)


def slice_header(batch: Batch | None, lay: SliceLayout) -> tuple[HostSlice | None, np.ndarray, Exception | None]:
    """Parse this rank's next slice; its header words say what the others can expect from it."""
    if batch is None:
        return None, slice_words(END), None
    try:
        hs = host_slice(batch, lay)
    except ValueError as e:
        return None, slice_words(BAD), e
    if hs.n < lay.batch_size:
        return hs, slice_words(SHORT, hs.n), None
    n_ids = int(hs.lengths[lay.managed].sum())
    return hs, slice_words(DATA, hs.n, n_ids, hs.uniform), None


def ids_block(hs: HostSlice, head: np.ndarray, lay: SliceLayout) -> np.ndarray:
    """What this rank sends each planner about its slice: the bag lengths (unless one length fits all), then the
    managed ids."""
    parts = [] if head[UNIFORM_WORD] >= 0 else [hs.lengths.astype(np.int32).reshape(-1).view(np.uint8)]
    parts.append(managed_ids(hs, lay).view(np.uint8))
    return np.concatenate(parts)


def ids_sizes(heads: np.ndarray, lay: SliceLayout) -> list[int]:
    """Bytes of every rank's ids block, from its header words."""
    K, B = lay.num_keys, lay.batch_size
    return [(0 if h[UNIFORM_WORD] >= 0 else K * B * 4) + int(h[IDS_WORD]) * lay.ids_dtype.itemsize for h in heads]


def decode_ids(heads: np.ndarray, blocks: list[np.ndarray], lay: SliceLayout, tables: ManagedTables,
               index: int | None) -> tuple[GatheredIds, GlobalBatch]:
    """On a rank that plans: the global batch's ids from every rank's ids block, and the scheduler's view."""
    K, B = lay.num_keys, lay.batch_size
    lengths = np.empty((heads.shape[0], K, B), dtype=np.int64)
    ids = []
    for q, (h, b) in enumerate(zip(heads, blocks)):
        if h[UNIFORM_WORD] >= 0:
            lengths[q] = h[UNIFORM_WORD]
            ids.append(b.view(lay.ids_dtype))
        else:
            lengths[q] = b[: K * B * 4].view(np.int32).reshape(K, B)
            ids.append(b[K * B * 4 :].view(lay.ids_dtype))
    g = gather_ids(lengths, ids, lay)
    # the scheduler's view (the ids were range-checked on their rank, in host_slice)
    return g, global_batch(g, lay, tables, index)
