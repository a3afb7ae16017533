"""The herald_hier planners' messages: their kinds and the protocol's byte count of each, the table bits of a host's
step summary, and the `Transport` that carries one phase's messages between host planners.

Why a module of its own: the host planner (`host_planner.py`) writes and reads these messages, the policy
(`hierarchy.py`) drives the phases through a transport, the simulator counts their bytes and the training pipeline
sends them over a gloo group (distributed/train_pipeline/planner_transport.py); the protocol itself (phases, fields,
bytes per field, a worked example) is in hierarchy.py's docstring. A message is a list of numpy arrays
(schedule/message_wire.py carries it as bytes); the in-process transport encodes, counts and decodes every message
between two hosts, so every simulated plan goes through the wire form. A host builds a phase's messages as an
`Outbox` (its fields grouped by destination, slices per host) and reads them as an `Inbox` (each field concatenated
over the senders): at R=256 a phase carries 31 messages of 1-11 arrays each way, and both forms keep the work per
field rather than per array. numpy only (the control plane never imports torch.distributed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence, Union

import numpy as np

from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.message_wire import (
    WIRE_FORMS,
    Encoded,
    Fields,
    Message,
    decode_fields,
    decode_messages,
    encode_joined,
    encode_slices,
)
from herald_torchrec.schedule.plan import Plan
from herald_torchrec.schedule.reads import stable_order

KEY_BYTES, RANK_BYTES, COUNT_BYTES, INDEX_BYTES, SAMPLE_BYTES, ID_BYTES = 8, 2, 2, 4, 4, 8
DENSE_LABEL_BYTES = 56  # a sample's dense features and label: 13 float32 + 1 (Criteo's layout)
MOVE_ENTRY_BYTES = KEY_BYTES + RANK_BYTES + 1  # key, peer rank, kind
MESSAGE_KINDS = (
    "demand", "owners", "offers", "swaps", "samples", "reads", "arrivals", "cancels", "evictions", "decisions",
    "departures", "shares", "pins",
)  # fmt: skip
MOVED, SHARED, RELAYED = 1, 2, 4  # a table's bits in a host's step summary (`HostPlanner.routed`)


def plan_part_bytes(plan: Plan) -> np.ndarray:
    """Bytes of the part of `plan` each rank needs (hierarchy.py's docstring), int64 [R]."""
    R, B = plan.num_ranks, plan.batch_per_rank
    out = np.full(R, SAMPLE_BYTES * B, dtype=np.int64)
    mv = plan.moves
    out += MOVE_ENTRY_BYTES * (np.bincount(mv.src, minlength=R) + np.bincount(mv.dst, minlength=R))
    sh = plan.shared
    counts = np.diff(sh.reader_offsets)
    owner_rep = np.repeat(sh.owner, counts)
    remote = sh.readers != owner_rep
    others = np.bincount(np.repeat(np.arange(len(sh)), counts)[remote], minlength=len(sh))
    own_bytes = KEY_BYTES + COUNT_BYTES + RANK_BYTES * others
    out += np.bincount(sh.owner, weights=own_bytes, minlength=R).astype(np.int64)
    out += (KEY_BYTES + RANK_BYTES) * np.bincount(sh.readers[remote], minlength=R)
    return out


def ids_bytes(batch: GlobalBatch, num_ranks: int, batch_per_rank: int) -> np.ndarray:
    """Bytes of the ids each rank loads (ID_BYTES per id), int64 [R]: what it sends to a planner. A single-hot batch
    (one id per sample and table) without a pass per table (a planner runs this every step)."""
    if batch._cache.get("dense") is not None:
        return np.full(num_ranks, batch_per_rank * batch.layout.num_tables * ID_BYTES, dtype=np.int64)
    ends = np.arange(num_ranks + 1, dtype=np.int64) * batch_per_rank
    per = np.zeros(num_ranks, dtype=np.int64)
    for off in batch.offsets:
        per += np.diff(off[ends])
    return per * ID_BYTES


class MessageBytes:
    """Bytes between hosts, by kind and by host (a host's messages to itself are free), by the protocol's count.
    `on=False` (a planner alone in training, `plan_host`, where nothing reads them): nothing is counted, and the phases
    skip computing what they would count."""

    def __init__(self, H: int, on: bool = True) -> None:
        self.kind = dict.fromkeys(MESSAGE_KINDS, 0)
        self.host = np.zeros(H, dtype=np.int64)
        self.on = on

    def add(self, kind: str, src: int, dst: int, nbytes: int) -> None:
        if self.on and src != dst and nbytes:
            self.kind[kind] += int(nbytes)
            self.host[src] += int(nbytes)
            self.host[dst] += int(nbytes)

    def add_many(
        self, kind: str, src: np.ndarray | int, dst: np.ndarray | int, nbytes: np.ndarray | int, H: int
    ) -> None:
        """Many messages at once: `nbytes[i]` from host src[i] to dst[i]; src or dst may be one host for all (an int)
        and nbytes one size for all (an int), which saves the arrays that would repeat them."""
        if not self.on:
            return
        cross = np.asarray(src != dst)
        if not cross.any():
            return
        one_size = np.ndim(nbytes) == 0
        b = int(nbytes) if one_size else np.asarray(nbytes, dtype=np.int64)[cross]
        total = int(cross.sum()) * b if one_size else int(b.sum())
        self.kind[kind] += total
        for end in (src, dst):
            if np.ndim(end) == 0:
                self.host[int(end)] += total
            elif one_size:
                self.host += np.bincount(end[cross], minlength=H) * b
            else:
                self.host += np.bincount(end[cross], weights=b, minlength=H).astype(np.int64)


# the planners' messages as raw arrays by default: the compact form costs a planner 0.55-1.2 ms of CPU per step
# (R=64-256) to save ~0.3-0.6 MB per host, which pays on host links below ~4 Gbit/s only (RESULTS.md)
DEFAULT_PLANNER_WIRE = "raw"


def check_planner_wire(planner_wire: object) -> None:
    """A clear error for a wire form of the planners' messages that does not exist (scheduler.planner_wire)."""
    if planner_wire not in WIRE_FORMS:
        raise ValueError(f"herald_hier: planner_wire must be one of {WIRE_FORMS}, got {planner_wire!r}")


@dataclass
class Outbox:
    """One host's messages of a phase to several hosts, as slices of a few arrays: the message to host dests[j] is
    [fields[i][starts[j, i]:stops[j, i]] for every field i]. Why: at R=256 a phase sends up to 31 messages of 1-11
    arrays; kept as slices of its fields, a planner builds and encodes them with work per field, not Python per array
    sent (message_wire.encode_slices). A transport takes an Outbox or a dict {host: message} alike."""

    dests: list[int]  # increasing
    fields: list[np.ndarray]
    starts: np.ndarray  # int64 [len(dests), len(fields)]
    stops: np.ndarray

    @classmethod
    def by_host(cls, dest: np.ndarray, H: int, arrays: Sequence[np.ndarray]) -> "Outbox":
        """`arrays` (aligned with `dest`, the host of each entry) as a message to every host with some entry, each
        in the entries' order."""
        o = stable_order(dest)
        n = np.bincount(dest, minlength=H)
        bounds = np.concatenate([[0], np.cumsum(n)])
        t = np.flatnonzero(n)
        return cls.from_bounds(t, [x[o] for x in arrays], bounds[t], bounds[t + 1])

    @classmethod
    def from_bounds(cls, dests: np.ndarray, fields: list[np.ndarray], lo: np.ndarray, hi: np.ndarray) -> "Outbox":
        """Every field sliced alike: host dests[j] gets fields[:][lo[j]:hi[j]]."""
        W = len(fields)
        return cls(np.asarray(dests).tolist(), fields, np.repeat(lo[:, None], W, 1), np.repeat(hi[:, None], W, 1))

    @classmethod
    def joined(cls, parts: Sequence["Outbox"]) -> "Outbox":
        """The fields of `parts` side by side: every host that one of them sends to gets all their fields (empty
        slices from the parts that send it nothing)."""
        dests = sorted(set().union(*(p.dests for p in parts)))
        row = {t: j for j, t in enumerate(dests)}
        starts, stops = [], []
        for p in parts:
            s0 = np.zeros((len(dests), len(p.fields)), dtype=np.int64)
            s1 = s0.copy()
            at = [row[t] for t in p.dests]
            s0[at], s1[at] = p.starts, p.stops
            starts.append(s0)
            stops.append(s1)
        fields = [f for p in parts for f in p.fields]
        return cls(dests, fields, np.concatenate(starts, axis=1), np.concatenate(stops, axis=1))

    def _row(self, j: int) -> Message:
        """The message to host dests[j] (views of the fields)."""
        return [f[a:b] for f, a, b in zip(self.fields, self.starts[j].tolist(), self.stops[j].tolist())]

    def messages(self) -> dict[int, Message]:
        """The same messages as lists of arrays (views of the fields)."""
        return {t: self._row(j) for j, t in enumerate(self.dests)}

    def message(self, t: int) -> Message | None:
        """The message to host t (None: nothing sent to it)."""
        return self._row(self.dests.index(t)) if t in self.dests else None

    def encode(self, skip: int | None, compact: bool) -> tuple[list[int], Encoded]:
        """The hosts it sends to but `skip`, and their messages as bytes, in that (increasing) order."""
        if skip in self.dests:
            keep = [j for j, t in enumerate(self.dests) if t != skip]
            dests, starts, stops = [self.dests[j] for j in keep], self.starts[keep], self.stops[keep]
        else:
            dests, starts, stops = self.dests, self.starts, self.stops
        if not dests:  # (a phase that sends nothing: no pass to set up)
            return dests, Encoded.join([])
        return dests, encode_slices(self.fields, starts, stops, compact)


class Inbox(Mapping):
    """What one host received in a phase, {source host: message} as a mapping, held field by field: each field the
    concatenation of the sources' arrays in source order (message_wire.Fields). Why: most phases read their messages
    concatenated over the sources (`fields`); decoded so, the per-source messages are views made on demand."""

    def __init__(self, got: Fields) -> None:
        self.sources, self.fields, self.bounds = got.sources, got.fields, got.bounds
        self._row = {s: j for j, s in enumerate(self.sources)}

    def __getitem__(self, s: int) -> Message:
        j = self._row[s]
        lo, hi = self.bounds[j].tolist(), self.bounds[j + 1].tolist()
        return [f[a:b] for f, a, b in zip(self.fields, lo, hi)]

    def __iter__(self) -> Iterator[int]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def decode_inbox(buf: np.ndarray, sizes: Sequence[int]) -> Mapping[int, Message]:
    """The messages of one phase a host received (sizes[s]: bytes from host s, 0 for none) as {source: message}: an
    Inbox where they share one layout, else a dict."""
    got = decode_fields(buf, sizes)
    if got is not None:
        return Inbox(got)
    return {s: m for s, m in enumerate(decode_messages(buf, sizes)) if m is not None}


def concatenated(inbox: Mapping[int, Message], dtypes: Sequence[type]) -> list[np.ndarray]:
    """The messages of `inbox` (every source host's, in host order) as len(dtypes) concatenated arrays, each cast to
    its dtype: an Inbox's fields as they are, where they have that width."""
    if isinstance(inbox, Inbox) and len(inbox.fields) == len(dtypes):
        return [f.astype(dt, copy=False) for f, dt in zip(inbox.fields, dtypes)]
    ms = [inbox[s] for s in sorted(inbox)]
    return [
        np.concatenate([m[i] for m in ms]).astype(dt, copy=False) if ms else np.zeros(0, dtype=dt)
        for i, dt in enumerate(dtypes)
    ]


def source_counts(inbox: Mapping[int, Message], field: int = 0) -> np.ndarray:
    """The length of field `field` of every source's message, in source order (int64)."""
    if isinstance(inbox, Inbox):
        return np.diff(inbox.bounds[:, field]) if inbox.fields else np.zeros(len(inbox), dtype=np.int64)
    return np.array([len(inbox[s][field]) for s in sorted(inbox)], dtype=np.int64)


Outgoing = Union[dict[int, Message], Outbox]  # what one host sends in a phase: {host: message}, or an Outbox


def outgoing_messages(to: Outgoing) -> dict[int, Message]:
    """What a host sends, as {host: message} whichever form it was built in."""
    return to.messages() if isinstance(to, Outbox) else to


def encode_outgoing(to: Outgoing, skip: int | None, compact: bool) -> tuple[list[int], Encoded]:
    """The hosts `to` sends to but `skip`, increasing, and their messages as bytes back to back in that order
    (schedule/message_wire.py): a transport's send buffer as it is."""
    if isinstance(to, Outbox):
        return to.encode(skip, compact)
    dests = sorted(t for t in to if t != skip)
    return dests, encode_joined([to[t] for t in dests], compact)


class Transport:
    """The messages between host planners, one phase at a time (hierarchy.py's docstring). `exchange(kind, out)`:
    out[src][dst] is the message host src (a host this process plans) sends host dst (`out[src]` a dict or an
    `Outbox`); returns inbox[dst][src] (inbox[dst] a mapping: a dict or an `Inbox`) for this process's hosts (a
    host's message to itself included; a missing entry: nothing sent). Every host's process calls it with the same
    kinds in the same order. `last_bytes`: the bytes this process sent to other hosts'
    processes, by kind, since the planner last read them (the implementation's own wire, next to the protocol's count
    in `HierStep`)."""

    def __init__(self) -> None:
        self.last_bytes: dict[str, int] = {}

    def count(self, kind: str, nbytes: int) -> None:
        self.last_bytes[kind] = self.last_bytes.get(kind, 0) + int(nbytes)

    def exchange(self, kind: str, out: dict[int, Outgoing]) -> dict[int, Mapping[int, Message]]:
        raise NotImplementedError


class InProcessTransport(Transport):
    """Every host in this process (the simulator, the tests): every message is encoded as the planners' wire carries
    it (schedule/message_wire.py), a host's message to itself included (as a planner's own goes through its group's
    all-to-all in training), those to other hosts counted, and each host's decoded as it would receive them."""

    def __init__(self, num_hosts: int, compact: bool = False) -> None:
        super().__init__()
        self.num_hosts, self.compact = num_hosts, compact

    def exchange(self, kind: str, out: dict[int, Outgoing]) -> dict[int, Mapping[int, Message]]:
        H = self.num_hosts
        sent: list[list[np.ndarray]] = [[np.zeros(0, np.uint8)] * H for _ in range(H)]  # [dst][src]
        for src, to in out.items():
            dests, enc = encode_outgoing(to, None, self.compact)
            bufs = enc.messages()
            self.count(kind, sum(b.shape[0] for t, b in zip(dests, bufs) if t != src))
            for t, b in zip(dests, bufs):
                sent[t][src] = b
        return {h: decode_inbox(np.concatenate(sent[h]), [b.shape[0] for b in sent[h]]) for h in range(H)}
