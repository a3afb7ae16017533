"""A `Plan` as bytes: how a rank that plans hands each step's plan to the ranks it plans for.

Why it exists: the scheduler is deterministic, so every rank *could* compute the same plan, but then a machine
running R ranks computes it R times (~5 ms of CPU per step and rank on the default workload). The input stage
instead lets one rank per machine plan and ships the plan in the all-to-all it runs anyway
(distributed/scheduled_input.py, `plan_on`), so its size counts: every integer array travels in the narrowest
signed type that holds its values (a table index in one byte, a row in four, a rank in one) and is restored to its
original dtype on arrival — the decoded plan equals the original field for field, dtypes included. The structure
(dataclass fields in declaration order) is fixed, so only the values travel: a small JSON skeleton with the scalars
and counters, then the arrays' bytes. Two fields travel in a shorter form that says the same: the sample order as
each sample's rank (its slices are increasing, so the ranks determine it), and the shared rows' reader CSR as one
bitmask per row (readers sorted and distinct, ranks below 63): at R=8 that is ~30 % of the plan. Plans that break those invariants travel as they are.

    buf = encode_plan(plan)        # np.uint8 [n]
    same = decode_plan(buf)        # == plan, field for field

numpy only (the control plane never imports torch).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from herald_torchrec.schedule.plan import CacheStep, Plan, ReadVersions, ReplicaSync, RowMoves, SharedRows

_TYPES = {cls.__name__: cls for cls in (Plan, RowMoves, SharedRows, ReadVersions, ReplicaSync, CacheStep)}
_NARROW = tuple((np.dtype(t), int(np.iinfo(t).min), int(np.iinfo(t).max)) for t in (np.int8, np.int16, np.int32, np.int64))
_HEAD = np.dtype("<u4")  # length of the JSON skeleton, in front of it


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
    if so.ndim != 1 or so.shape[0] != R * B or so.shape[0] == 0 or so.min() < 0 or so.max() >= so.shape[0]:
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


def encode_plan(plan: Plan) -> np.ndarray:
    """The plan as a flat uint8 array (see the module docstring)."""
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
                return {"d": "SharedRows", "f": [walk(v.table), walk(v.row), walk(v.owner)],
                        "rm": [walk(mask), v.reader_offsets.dtype.str, v.readers.dtype.str]}
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
        if isinstance(v, np.generic):
            return v.item()
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise ValueError(f"encode_plan: cannot encode a {type(v).__name__} in a plan")

    skeleton = json.dumps(walk(plan), separators=(",", ":")).encode()
    head = np.array([len(skeleton)], dtype=_HEAD).view(np.uint8)
    return np.concatenate([head, np.frombuffer(skeleton, dtype=np.uint8), *(a.view(np.uint8) for a in arrays)])


def decode_plan(buf: np.ndarray) -> Plan:
    """Inverse of `encode_plan` (the arrays are copies: the buffer may be reused)."""
    buf = np.ascontiguousarray(buf, dtype=np.uint8)
    n = int(buf[: _HEAD.itemsize].view(_HEAD)[0])
    skeleton = json.loads(bytes(buf[_HEAD.itemsize : _HEAD.itemsize + n]))
    pos = _HEAD.itemsize + n

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
            fields[[f.name for f in dataclasses.fields(Plan)].index("sample_order")] = \
                np.argsort(rank, kind="stable").astype(v["as"][1])
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
