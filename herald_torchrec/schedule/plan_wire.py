"""A `Plan` as bytes: how a rank that plans hands each step's plan to the ranks it plans for.

Why it exists: the scheduler is deterministic, so every rank *could* compute the same plan, but then a machine
running R ranks computes it R times (~5 ms of CPU per step and rank on the default workload). The input stage
instead lets one rank per machine plan and ships the plan in the all-to-all it runs anyway
(distributed/train_pipeline/input_stage.py, `plan_on`), so its size counts: every integer array travels in the narrowest
signed type that holds its values (a table index in one byte, a row in four, a rank in one) and is restored to its
original dtype on arrival — the decoded plan equals the original field for field, dtypes included. The structure
(dataclass fields in declaration order) is fixed, so only the values travel: a small JSON skeleton with the scalars
and counters, then the arrays' bytes. Two fields travel in a shorter form that says the same: the sample order as
each sample's rank (its slices are increasing, so the ranks determine it), and the shared rows' reader CSR as one
bitmask per row (readers sorted and distinct, ranks below 63): at R=8 that is ~30 % of the plan. Plans that break those
invariants travel as they are.

Most plans (every ownership policy's: no read versions, replicas or cache step, both short forms apply) travel in
a flat form: one small JSON list of the scalars, counters and dtypes, then the ten arrays in a fixed order. It holds
the same as the general form (a skeleton of the dataclass tree) in a fraction of its Python work, which matters
because the planner encodes and every other rank of its machine decodes one plan per step. The first byte says
which form follows.

    buf = encode_plan(plan)        # np.uint8 [n]
    same = decode_plan(buf)        # == plan, field for field

numpy only (the control plane never imports torch).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from herald_torchrec.schedule import native
from herald_torchrec.schedule.plan import (
    CacheStep,
    HostPlan,
    Plan,
    PlanPart,
    ReadVersions,
    ReplicaSync,
    RowMoves,
    SharedRows,
)

_TYPES = {
    cls.__name__: cls for cls in (Plan, PlanPart, HostPlan, RowMoves, SharedRows, ReadVersions, ReplicaSync, CacheStep)
}
_NARROW = tuple(
    (np.dtype(t), int(np.iinfo(t).min), int(np.iinfo(t).max)) for t in (np.int8, np.int16, np.int32, np.int64)
)
_HEAD = np.dtype("<u4")  # length of the JSON skeleton (or of the flat form's JSON list), in front of it
_TREE, _FLAT, _PART = 0, 1, 2  # the buffer's first byte: which form follows
# the flat form writes these fields by name: a plan type with other fields travels in the general form
FLAT_FIELDS_MATCH = (
    tuple(f.name for f in dataclasses.fields(Plan))
    == (
        "step",
        "num_ranks",
        "batch_per_rank",
        "sample_order",
        "moves",
        "shared",
        "counters",
        "stateful_kinds",
        "executable",
        "reads",
        "replicas",
        "sched_seconds",
        "cache",
        "stale_reads",
    )
    and tuple(f.name for f in dataclasses.fields(RowMoves)) == ("table", "row", "src", "dst", "kind")
    and tuple(f.name for f in dataclasses.fields(SharedRows)) == ("table", "row", "owner", "reader_offsets", "readers")
)


_SIGNED = {np.dtype(t).itemsize: np.dtype(t).str for t in (np.int8, np.int16, np.int32, np.int64)}


def _compiled_ints(*arrays: np.ndarray) -> bool:
    """The compiled wire passes apply: the kernels are on and every array holds integers int64 can hold."""
    return native.enabled() and all(
        a.dtype.kind == "i" or (a.dtype.kind == "u" and a.dtype.itemsize < 8) for a in arrays
    )


def _narrow(a: np.ndarray) -> np.ndarray:
    """The array in the narrowest signed integer type holding its values (other dtypes as they are)."""
    if a.dtype.kind not in "iu" or a.size == 0:
        return a
    lo, hi = int(a.min()), int(a.max())
    for t, t_min, t_max in _NARROW:
        if t_min <= lo and hi <= t_max:
            return a.astype(t, copy=False)
    return a  # uint64 beyond int64: as is


def _assignment(plan: Plan) -> np.ndarray | None:
    """Each global sample's rank, if it determines the sample order (every rank's slice increasing, a permutation)."""
    so, R, B = plan.sample_order, plan.num_ranks, plan.batch_per_rank
    if so.ndim != 1 or so.shape[0] != R * B or so.shape[0] == 0:
        return None
    if _compiled_ints(so):
        return native.wire_assignment(so, R, B)
    if so.min() < 0 or so.max() >= so.shape[0]:
        return None
    if B > 1 and not (np.diff(so.reshape(R, B), axis=1) > 0).all():
        return None
    rank = np.full(so.shape[0], -1, dtype=np.int64)
    rank[so] = np.repeat(np.arange(R, dtype=np.int64), B)
    return rank if (rank >= 0).all() else None  # (a repeated sample leaves another unassigned)


def _reader_mask(sh: SharedRows) -> np.ndarray | None:
    """Each shared row's readers as a bitmask (bit q: rank q reads it), if that says the same as the CSR."""
    ro, rd, n = sh.reader_offsets, sh.readers, sh.row.shape[0]
    if ro.ndim != 1 or rd.ndim != 1 or ro.shape[0] != n + 1 or n == 0 or ro[0] != 0 or ro[-1] != rd.shape[0]:
        return None
    if _compiled_ints(ro, rd):
        return native.wire_reader_mask(ro, rd)
    counts = np.diff(ro)
    if (counts < 1).any() or rd.min() < 0 or rd.max() > 62:
        return None
    same_row = np.repeat(np.arange(n), counts)
    if not (np.diff(rd)[same_row[1:] == same_row[:-1]] > 0).all():  # sorted and distinct within each row
        return None
    return np.add.reduceat(np.left_shift(1, rd.astype(np.int64)), ro[:-1])


def _readers_from_mask(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(reader_offsets, readers) from `_reader_mask`."""
    bits = (mask[:, None] >> np.arange(max(int(mask.max()).bit_length(), 1), dtype=np.int64)) & 1
    row, rank = np.nonzero(bits)  # row-major: each row's readers in increasing order
    return np.concatenate([[0], np.cumsum(np.bincount(row, minlength=mask.shape[0]))]), rank


def _scalar(v: Any) -> Any:
    """A plan scalar as JSON holds it (numpy scalars as Python ones), in both forms; TypeError for anything else."""
    if isinstance(v, np.generic):
        return v.item()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError


def _scalars(plan: Plan) -> list | None:
    """The flat forms' JSON head: the plan's scalars, counters and stateful kinds (None: one is not a JSON scalar)."""
    try:
        return [
            _scalar(plan.step),
            _scalar(plan.num_ranks),
            _scalar(plan.batch_per_rank),
            _scalar(plan.executable),
            _scalar(plan.stale_reads),
            _scalar(plan.sched_seconds),
            {str(k): _scalar(v) for k, v in plan.counters.items()},
            [_scalar(k) for k in plan.stateful_kinds],
        ]
    except (TypeError, AttributeError):
        return None


def _encode_flat(plan: Plan) -> np.ndarray | None:
    """The flat form (module docstring), or None where the plan needs the general one."""
    if (
        not FLAT_FIELDS_MATCH
        or type(plan) is not Plan
        or plan.reads is not None
        or plan.replicas is not None
        or plan.cache is not None
        or type(plan.moves) is not RowMoves
        or type(plan.shared) is not SharedRows
        or type(plan.stateful_kinds) is not tuple
    ):
        return None
    mv, sh = plan.moves, plan.shared
    fields = (mv.table, mv.row, mv.src, mv.dst, mv.kind, sh.table, sh.row, sh.owner)
    if any(
        type(a) is not np.ndarray or a.ndim != 1 for a in (plan.sample_order, *fields, sh.reader_offsets, sh.readers)
    ):
        return None
    n_mv, n_sh = mv.table.shape[0], sh.table.shape[0]
    if any(a.shape[0] != n_mv for a in fields[:5]) or any(a.shape[0] != n_sh for a in fields[5:]):
        return None
    rank = _assignment(plan)
    if rank is None:
        return None
    if n_sh:
        mask = _reader_mask(sh)
        if mask is None:
            return None
    elif sh.reader_offsets.shape[0] == 1 and sh.reader_offsets[0] == 0 and sh.readers.shape[0] == 0:
        mask = np.zeros(0, dtype=np.int64)
    else:
        return None
    head = _scalars(plan)
    if head is None:
        return None
    sent, data = _pack([rank, *fields, mask], fields)
    originals = (plan.sample_order, *fields, sh.reader_offsets, sh.readers)
    meta = json.dumps(head + [n_mv, n_sh, [a.dtype.str for a in originals], sent], separators=(",", ":")).encode()
    return _framed(_FLAT, meta, data)


_RANK_CENTER = 128  # a part's rank arrays travel as rank - 128: up to 256 ranks fit one signed byte
_PART_RANKS = (3, 4, 8, 10, 11)  # in `_encode_part`'s array order: move src, dst, owner, readers, slice ranks


def _encode_part(plan: PlanPart) -> np.ndarray | None:
    """The flat form of a rank's part (`PlanPart`), or None where it needs the general one: the flat plan's scalars
    and arrays, but the rank's own sample order as it is and the readers as counts + ranks (a part's rows have a few
    readers each: shorter than bitmasks, and for any R), then the part's rank, slice ranks and table lists. Ranks
    travel centred (`_RANK_CENTER`), so that at R = 129..256 they take one byte, not two."""
    if not FLAT_FIELDS_MATCH or type(plan) is not PlanPart:
        return None
    if plan.reads is not None or plan.replicas is not None or plan.cache is not None:
        return None
    if (
        type(plan.moves) is not RowMoves
        or type(plan.shared) is not SharedRows
        or type(plan.stateful_kinds) is not tuple
    ):
        return None
    mv, sh = plan.moves, plan.shared
    fields = (mv.table, mv.row, mv.src, mv.dst, mv.kind, sh.table, sh.row, sh.owner)
    extra = (plan.slice_ranks, plan.moved_tables, plan.shared_tables, plan.relayed_tables)
    arrays = (plan.sample_order, *fields, sh.reader_offsets, sh.readers, *extra)
    if any(type(a) is not np.ndarray or a.ndim != 1 or a.dtype.kind not in "iu" for a in arrays):
        return None
    n_mv, n_sh, ro = mv.table.shape[0], sh.table.shape[0], sh.reader_offsets
    if any(a.shape[0] != n_mv for a in fields[:5]) or any(a.shape[0] != n_sh for a in fields[5:]):
        return None
    if ro.shape[0] != n_sh + 1 or ro[0] != 0 or ro[-1] != sh.readers.shape[0]:
        return None
    head = _scalars(plan)
    if head is None or not isinstance(plan.rank, (int, np.integer)):
        return None
    head.append(int(plan.rank))
    c = _RANK_CENTER
    wide = [
        *(plan.sample_order, mv.table, mv.row, mv.src - c, mv.dst - c, mv.kind, sh.table, sh.row, sh.owner - c),
        *(np.diff(ro), sh.readers - c, plan.slice_ranks - c, *extra[1:]),
    ]
    sent, data = _pack(wide, arrays)
    lens = [a.shape[0] for a in wide]
    meta = json.dumps(head + [lens, [a.dtype.str for a in arrays], sent], separators=(",", ":")).encode()
    return _framed(_PART, meta, data)


def _decode_part(buf: np.ndarray) -> PlanPart:
    n = int(buf[1 : 1 + _HEAD.itemsize].view(_HEAD)[0])
    pos = 1 + _HEAD.itemsize + n
    step, R, B, executable, stale, seconds, counters, kinds, rank, lens, orig, sent = json.loads(
        bytes(buf[1 + _HEAD.itemsize : pos])
    )
    out, _ = _unpack(buf, pos, lens, sent)
    out = [a.astype(np.int64) + _RANK_CENTER if i in _PART_RANKS else a for i, a in enumerate(out)]
    order, mv, sh, counts, readers, extra = out[0], out[1:6], out[6:9], out[9], out[10], out[11:]
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    a = [x.astype(o) for x, o in zip([order, *mv, *sh, offsets, readers, *extra], orig)]  # copies, original dtypes
    return PlanPart(
        step=step,
        num_ranks=R,
        batch_per_rank=B,
        sample_order=a[0],
        moves=RowMoves(*a[1:6]),
        shared=SharedRows(*a[6:11]),
        counters=counters,
        stateful_kinds=tuple(kinds),
        executable=executable,
        sched_seconds=seconds,
        stale_reads=stale,
        rank=rank,
        slice_ranks=a[11],
        moved_tables=a[12],
        shared_tables=a[13],
        relayed_tables=a[14],
    )


def _pack(wide: list[np.ndarray], ints: tuple[np.ndarray, ...]) -> tuple[list[str], list[np.ndarray]]:
    """Every array narrowed (`_narrow`), back to back: (the dtypes sent, the bytes). One compiled pass where the
    kernels are on and `ints` hold integers; an empty array keeps its dtype."""
    if _compiled_ints(*ints):
        data, sizes = native.wire_pack(wide)
        return [_SIGNED[z] if a.shape[0] else a.dtype.str for a, z in zip(wide, sizes)], [data]
    arrays = [np.ascontiguousarray(_narrow(a)) for a in wide]
    return [a.dtype.str for a in arrays], [a.view(np.uint8) for a in arrays]


def _framed(form: int, meta: bytes, data: list[np.ndarray]) -> np.ndarray:
    """[form byte | length of meta | meta | data]."""
    return np.concatenate(
        [
            np.array([form], dtype=np.uint8),
            np.array([len(meta)], dtype=_HEAD).view(np.uint8),
            np.frombuffer(meta, dtype=np.uint8),
            *data,
        ]
    )


def _unpack(buf: np.ndarray, start: int, lens: list[int], sent: list[str]) -> tuple[list[np.ndarray], bool]:
    """The arrays `_pack` wrote at `start` (lengths `lens`), and whether they came back as int64 copies (compiled);
    else views of `buf` in the dtypes sent. ValueError if the buffer's length does not match."""
    types = [np.dtype(t) for t in sent]
    end = start + sum(t.itemsize * n for t, n in zip(types, lens))
    if end != buf.shape[0]:
        raise ValueError(f"decode_plan: a malformed plan ({buf.shape[0]} bytes, {end} read)")
    if native.enabled() and all(t.kind == "i" for t in types):  # widened to int64 in one pass (copies)
        return native.wire_unpack(buf[start:], lens, [t.itemsize for t in types]), True
    out, at = [], start
    for t, n in zip(types, lens):
        out.append(buf[at : at + t.itemsize * n].view(t))
        at += t.itemsize * n
    return out, False


def _decode_flat(buf: np.ndarray) -> Plan:
    n = int(buf[1 : 1 + _HEAD.itemsize].view(_HEAD)[0])
    pos = 1 + _HEAD.itemsize + n
    step, R, B, executable, stale, seconds, counters, kinds, n_mv, n_sh, orig, sent = json.loads(
        bytes(buf[1 + _HEAD.itemsize : pos])
    )
    out, compiled = _unpack(buf, pos, [R * B] + [n_mv] * 5 + [n_sh] * 4, sent)  # assignment, moves, shared, mask
    rank, mask = out[0], out[9]
    csr = native.wire_readers(mask, R) if compiled and n_sh else None
    if csr is not None:
        offsets, readers = csr
    elif n_sh:
        offsets, readers = _readers_from_mask(mask.astype(np.int64))
    else:
        offsets, readers = np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    # copies, in the original dtypes (the compiled arrays are copies already)
    a = [x if compiled and np.dtype(o) == x.dtype else x.astype(o) for x, o in zip(out[1:9], orig[1:9])]
    order = native.wire_sample_order(rank, R) if compiled else None
    if order is None:
        order = np.argsort(rank, kind="stable")
    return Plan(
        step=step,
        num_ranks=R,
        batch_per_rank=B,
        sample_order=order.astype(orig[0], copy=False),
        moves=RowMoves(*a[:5]),
        shared=SharedRows(*a[5:], offsets.astype(orig[9]), readers.astype(orig[10])),
        counters=counters,
        stateful_kinds=tuple(kinds),
        executable=executable,
        sched_seconds=seconds,
        stale_reads=stale,
    )


def encode_plan(plan: Plan) -> np.ndarray:
    """The plan as a uint8 array (see the module docstring): the flat form where it applies, else the general one."""
    flat = _encode_flat(plan) if type(plan) is Plan else _encode_part(plan)
    if flat is not None:
        return flat
    return np.concatenate([np.array([_TREE], dtype=np.uint8), encode_plan_tree(plan)])


def encode_plan_tree(plan: Plan) -> np.ndarray:
    """The general form alone (no leading form byte): the JSON skeleton of the dataclass tree, then the arrays. Also
    what `benchmarks/simulate.py` hashes into `plan_digest`, so digests compare across versions of the wire."""
    arrays: list[np.ndarray] = []

    def walk(v: Any) -> Any:
        if type(v) is Plan:
            rank = _assignment(v)
            if rank is not None:  # the sample order as each sample's rank
                f = [walk(getattr(v, x.name)) if x.name != "sample_order" else None for x in dataclasses.fields(v)]
                return {"d": "Plan", "f": f, "as": [walk(rank), v.sample_order.dtype.str]}
        if type(v) is SharedRows:
            mask = _reader_mask(v)
            if mask is not None:  # the reader CSR as one bitmask per row
                return {
                    "d": "SharedRows",
                    "f": [walk(v.table), walk(v.row), walk(v.owner)],
                    "rm": [walk(mask), v.reader_offsets.dtype.str, v.readers.dtype.str],
                }
        if isinstance(v, np.ndarray):
            if v.ndim != 1:
                raise ValueError(f"encode_plan: plan arrays are 1-D, got shape {v.shape}")
            w = np.ascontiguousarray(_narrow(v))
            arrays.append(w)
            return {"a": [v.dtype.str, w.dtype.str, int(v.shape[0])]}
        if dataclasses.is_dataclass(v):
            name = type(v).__name__
            if _TYPES.get(name) is not type(v):
                raise ValueError(f"encode_plan: unknown plan part {type(v).__qualname__}")
            return {"d": name, "f": [walk(getattr(v, f.name)) for f in dataclasses.fields(v)]}
        if isinstance(v, tuple):
            return {"t": [walk(x) for x in v]}
        if isinstance(v, dict):
            return {"m": {str(k): walk(x) for k, x in v.items()}}
        try:
            return _scalar(v)
        except TypeError:
            raise ValueError(f"encode_plan: cannot encode a {type(v).__name__} in a plan") from None

    skeleton = json.dumps(walk(plan), separators=(",", ":")).encode()
    head = np.array([len(skeleton)], dtype=_HEAD).view(np.uint8)
    return np.concatenate([head, np.frombuffer(skeleton, dtype=np.uint8), *(a.view(np.uint8) for a in arrays)])


def decode_plan(buf: np.ndarray) -> Plan:
    """Inverse of `encode_plan` (the arrays are copies: the buffer may be reused)."""
    buf = np.ascontiguousarray(buf, dtype=np.uint8)
    if buf.shape[0] < 1 + _HEAD.itemsize or buf[0] not in (_TREE, _FLAT, _PART):
        raise ValueError(f"decode_plan: a malformed plan ({buf.shape[0]} bytes)")
    if buf[0] == _FLAT:
        return _decode_flat(buf)
    if buf[0] == _PART:
        return _decode_part(buf)
    n = int(buf[1 : 1 + _HEAD.itemsize].view(_HEAD)[0])
    skeleton = json.loads(bytes(buf[1 + _HEAD.itemsize : 1 + _HEAD.itemsize + n]))
    pos = 1 + _HEAD.itemsize + n

    def build(v: Any) -> Any:
        nonlocal pos
        if not isinstance(v, dict):
            return v
        if "a" in v:
            orig, sent, length = v["a"]
            size = np.dtype(sent).itemsize * length
            a = buf[pos : pos + size].view(sent).astype(orig)  # a copy, in the original dtype
            pos += size
            return a
        if "rm" in v:  # SharedRows with its readers as bitmasks
            table, row, owner = (build(x) for x in v["f"])
            offsets, readers = _readers_from_mask(build(v["rm"][0]))
            return SharedRows(table, row, owner, offsets.astype(v["rm"][1]), readers.astype(v["rm"][2]))
        if "as" in v:  # Plan with its sample order as each sample's rank
            fields = [build(x) for x in v["f"]]
            rank = build(v["as"][0])
            fields[[f.name for f in dataclasses.fields(Plan)].index("sample_order")] = np.argsort(
                rank, kind="stable"
            ).astype(v["as"][1])
            return Plan(*fields)
        if "d" in v:
            return _TYPES[v["d"]](*(build(x) for x in v["f"]))
        if "t" in v:
            return tuple(build(x) for x in v["t"])
        return {k: build(x) for k, x in v["m"].items()}

    plan = build(skeleton)
    if pos != buf.shape[0] or not isinstance(plan, Plan):
        raise ValueError(f"decode_plan: a malformed plan ({buf.shape[0]} bytes, {pos} read)")
    return plan
