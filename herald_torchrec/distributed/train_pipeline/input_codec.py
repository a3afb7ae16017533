"""Any `Pipelineable` batch <-> the input stage's one internal form (a TorchRec `Batch`), sample by sample.

TorchRec's `TrainPipelineSparseDist` takes any `Pipelineable` (e.g. its test models' `ModelInput`: float features,
an id-list KJT, a weighted id-score KJT, labels) and finds by fx tracing which KJT feeds which sharded module. The
input stage moves samples between ranks, so it must carry every per-sample part of such an object and hand back the
user's own type, which TorchRec's pipeline then routes as it does for stock. Rather than teach every layout function
about arbitrary objects, this module translates (`PipelineableCodec`):

- every KeyedJaggedTensor field -> one merged internal KJT (the fields' keys one after the other; weighted if any
  field is, with weight 1.0 for the ids of unweighted fields, dropped again on the way back);
- every tensor field whose leading dim is the batch size -> its per-sample bytes, side by side, as the internal
  Batch's `dense_features` (uint8 [B, bytes]; its `labels` are empty), so every dtype and shape travels bit-exact;
- every other field is *batch-independent* (non-tensors, 0-dim tensors, tensors whose leading dim is not B): passed
  through unchanged, which is safe only if it is the same in every slice on every rank (an assigned batch mixes
  samples of every rank). So it must be: the first slice's values are part of the layout every rank checks, and each
  later slice's are compared with them; a value that changes is refused naming its field. Allowed are tensors and
  plain values (None, bool, int, float, str, bytes, enums, torch dtypes / devices, tuples of those).

Fields are the object's dataclass fields, or its `vars()`; a field may also be a list, tuple or dict of the above
(one level). The rebuilt object is a shallow copy of the first slice's with its sample fields replaced (so frozen
dataclasses and classes whose `__init__` takes other arguments work). `torchrec.datasets.utils.Batch` never comes
here: it is the stage's own form (the fast path, unchanged); a subclass of it does, so that it comes back as itself.

Managed keys (read by Herald-managed tables) keep their names in the internal KJT and must appear in exactly one
KJT field; other keys are renamed `field/key` where two fields share them.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from herald_torchrec.distributed.variable_batch import expand_variable_batch

WHERE = "HeraldTrainPipeline input: "
PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device)


@dataclass(frozen=True)
class FieldPath:
    """Where a leaf sits in the user's object: an attribute, and within it a list / tuple position or dict key."""

    attr: str
    index: int | str | None = None

    def __str__(self) -> str:
        return self.attr if self.index is None else f"{self.attr}[{self.index!r}]"


@dataclass(frozen=True)
class SampleTensor:
    """A per-sample tensor field: its per-sample shape and dtype, and its bytes' place in a sample's row."""

    path: FieldPath
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass(frozen=True)
class JaggedField:
    """A KJT field: its keys (and their names in the internal KJT), weights, and the dtypes it is rebuilt with."""

    path: FieldPath
    keys: tuple[str, ...]
    internal_keys: tuple[str, ...]
    weighted: bool
    values_dtype: torch.dtype
    lengths_dtype: torch.dtype


@dataclass(frozen=True)
class ConstantField:
    """A batch-independent field: the first slice's value, passed through (checked equal in every later slice)."""

    path: FieldPath
    value: Any


@dataclass(frozen=True)
class Container:
    """A field that is a list, tuple or dict of leaves: rebuilt with its own type (`keys`: positions or dict keys)."""

    attr: str
    kind: type
    keys: tuple[int | str, ...]


def _fields(obj: object) -> list[tuple[str, Any]]:
    if isinstance(obj, (torch.Tensor, KeyedJaggedTensor)):
        raise ValueError(
            f"{WHERE}a bare {type(obj).__name__} is not a batch: wrap it in a Pipelineable (a dataclass with "
            "tensor and KeyedJaggedTensor fields) or a torchrec.datasets.utils.Batch"
        )
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    try:
        return list(vars(obj).items())
    except TypeError:
        raise ValueError(
            f"HeraldTrainPipeline consumes a torchrec.datasets.utils.Batch or a Pipelineable whose fields are tensors "
            f"and KeyedJaggedTensors; got {type(obj).__name__}, which has neither dataclass fields nor attributes"
        ) from None


def _leaves(obj: object) -> Iterator[tuple[FieldPath, Any, Container | None]]:
    """Every leaf of the object with its path (and the container it sits in, if any); a VBE KJT as one bag per
    sample (variable_batch.py: the EBCs' outputs and gradients are the same)."""
    for attr, value in _fields(obj):
        if isinstance(value, (list, tuple)) and not _is_plain(value):
            box = Container(attr, type(value), tuple(range(len(value))))
            for i, v in enumerate(value):
                yield FieldPath(attr, i), _per_sample(FieldPath(attr, i), v), box
        elif isinstance(value, dict):
            box = Container(attr, type(value), tuple(value))
            for k, v in value.items():
                yield FieldPath(attr, k), _per_sample(FieldPath(attr, k), v), box
        else:
            yield FieldPath(attr), _per_sample(FieldPath(attr), value), None


def _per_sample(path: FieldPath, value: Any) -> Any:
    if isinstance(value, KeyedJaggedTensor):
        return expand_variable_batch(value, f"{WHERE}field {path}")
    return value


def _is_plain(value: object) -> bool:
    if isinstance(value, tuple):
        return all(_is_plain(v) for v in value)
    return isinstance(value, PLAIN_TYPES)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
        )
    return type(a) is type(b) and (a is b or bool(a == b))


def _constant_text(value: object) -> str:
    """What every rank must agree on about a batch-independent value (its bytes for a tensor)."""
    if isinstance(value, torch.Tensor):
        raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return f"tensor{tuple(value.shape)}{value.dtype}:{zlib.crc32(raw)}"
    return f"{type(value).__qualname__}:{value!r}"


def _sample_bytes(t: torch.Tensor, n: int) -> np.ndarray:
    a = t.detach().cpu().contiguous()
    return a.reshape(n, -1).view(torch.uint8).numpy() if a.numel() else np.zeros((n, 0), dtype=np.uint8)


class PipelineableCodec:
    """The translation of one batch type (fixed by the first slice) to and from the stage's internal `Batch`.

    `of(first, managed_keys)` reads the first slice; `encode(slice)` checks a slice against it (ValueError naming
    the field) and returns the internal Batch; `decode(internal)` rebuilds the user's type from assigned samples."""

    def __init__(
        self,
        template: object,
        batch_size: int,
        tensors: list[SampleTensor],
        kjts: list[JaggedField],
        constants: list[ConstantField],
        containers: dict[str, Container],
    ) -> None:
        self.template = template  # a shallow copy of the first slice, its sample fields cleared
        self.type = type(template)
        self.batch_size = batch_size
        self.tensors = tensors
        self.kjts = kjts
        self.constants = constants
        self.containers = containers
        self.row_bytes = sum(t.nbytes for t in tensors)
        self.weighted = any(f.weighted for f in kjts)

    # ---------------------------------------------------------------- the first slice
    @classmethod
    def of(cls, first: object, managed_keys: Sequence[str]) -> PipelineableCodec:
        leaves = list(_leaves(first))
        containers = {box.attr: box for _, _, box in leaves if box is not None}
        jagged = [(p, v) for p, v, _ in leaves if isinstance(v, KeyedJaggedTensor)]
        if not jagged:
            raise ValueError(
                f"{WHERE}{type(first).__name__} has no KeyedJaggedTensor field: no ids for the Herald-managed "
                f"features {list(managed_keys)}"
            )
        for p, v in jagged:
            _check_kjt(p, v)
        B = int(jagged[0][1].stride())
        for p, v in jagged[1:]:
            if int(v.stride()) != B:
                raise ValueError(
                    f"{WHERE}field {p}: a KeyedJaggedTensor of {int(v.stride())} samples, field {jagged[0][0]} has {B}"
                )
        managed = set(managed_keys)
        home: dict[str, FieldPath] = {}
        count: dict[str, int] = {}
        for p, v in jagged:
            for k in v.keys():
                count[k] = count.get(k, 0) + 1
                if k in managed and k in home:
                    raise ValueError(
                        f"{WHERE}the Herald-managed feature {k!r} is in two KeyedJaggedTensors, fields {home[k]} and "
                        f"{p}: a managed key must be in one only"
                    )
                home.setdefault(k, p)
        missing = [k for k in managed_keys if k not in home]
        if missing:
            has = ", ".join(f"{p} {list(v.keys())}" for p, v in jagged)
            raise ValueError(
                f"{WHERE}the Herald-managed features {missing} are in none of the batch's KeyedJaggedTensors ({has})"
            )
        kjts = [
            JaggedField(
                path=p,
                keys=tuple(v.keys()),
                internal_keys=tuple(k if k in managed or count[k] == 1 else f"{p}/{k}" for k in v.keys()),
                weighted=v.weights_or_none() is not None,
                values_dtype=v.values().dtype,
                lengths_dtype=v.lengths().dtype,
            )
            for p, v in jagged
        ]
        tensors: list[SampleTensor] = []
        constants: list[ConstantField] = []
        offset = 0
        for p, v, _ in leaves:
            if isinstance(v, KeyedJaggedTensor):
                continue
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == B:
                nbytes = (v.numel() // B) * v.element_size()
                tensors.append(SampleTensor(p, tuple(v.shape[1:]), v.dtype, offset, nbytes))
                offset += nbytes
            elif isinstance(v, torch.Tensor) or _is_plain(v):
                constants.append(ConstantField(p, v))
            else:
                raise ValueError(
                    f"{WHERE}field {p} ({type(v).__name__}) cannot be carried: the input stage moves tensors whose "
                    f"leading dim is the batch size ({B}) and KeyedJaggedTensors sample by sample, and passes "
                    "tensors and plain values (None, numbers, strings) that are the same in every batch through"
                )
        template = copy.copy(first)
        for attr in {p.attr for p in [*(t.path for t in tensors), *(f.path for f in kjts)]}:
            object.__setattr__(template, attr, None)
        return cls(template, B, tensors, kjts, constants, containers)

    def signature_text(self) -> str:
        """What every rank's first slice must agree on (the stage checks it, with the rest of the layout)."""
        parts = [self.type.__qualname__]
        parts += [f"{t.path}:{t.shape}:{t.dtype}" for t in self.tensors]
        parts += [f"{f.path}:{f.keys}:{'w' if f.weighted else ''}" for f in self.kjts]
        parts += [f"{c.path}={_constant_text(c.value)}" for c in self.constants]
        return "|".join(parts)

    # ---------------------------------------------------------------- every slice
    def encode(self, batch: object) -> Batch:
        """The internal Batch of a slice, after checking it against the first (ValueError naming the field)."""
        if type(batch) is not self.type:
            raise ValueError(f"{WHERE}a {type(batch).__name__} batch after a first batch of {self.type.__name__}")
        got = {p: v for p, v, _ in _leaves(batch)}
        paths = [t.path for t in self.tensors] + [f.path for f in self.kjts] + [c.path for c in self.constants]
        if set(got) != set(paths):
            raise ValueError(
                f"{WHERE}the batch's fields {sorted(map(str, got))} differ from the first batch's "
                f"{sorted(map(str, paths))}"
            )
        kjts: list[KeyedJaggedTensor] = []
        for f in self.kjts:
            v = got[f.path]
            if not isinstance(v, KeyedJaggedTensor):
                raise ValueError(f"{WHERE}field {f.path}: a {type(v).__name__}, the first batch's was a KJT")
            _check_kjt(f.path, v)
            if tuple(v.keys()) != f.keys:
                raise ValueError(
                    f"{WHERE}field {f.path}: keys {list(v.keys())} differ from the first batch's {list(f.keys)}"
                )
            if (v.weights_or_none() is not None) != f.weighted:
                raise ValueError(
                    f"{WHERE}field {f.path}: {'no ' if f.weighted else ''}weights, the first batch's KJT had "
                    f"{'' if f.weighted else 'none'}{'them' if f.weighted else ''}"
                )
            kjts.append(v)
        n = int(kjts[0].stride())
        for f, v in zip(self.kjts, kjts):
            if int(v.stride()) != n:
                raise ValueError(f"{WHERE}field {f.path}: {int(v.stride())} samples, field {self.kjts[0].path} has {n}")
        if n > self.batch_size:
            raise ValueError(f"{WHERE}a batch of {n} samples, more than the first batch's {self.batch_size}")
        rows = []
        for t in self.tensors:
            v = got[t.path]
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != (n, *t.shape) or v.dtype != t.dtype:
                what = f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(
                    f"{WHERE}field {t.path}: {what}, the first batch's was (samples, {', '.join(map(str, t.shape))}) "
                    f"{t.dtype} with {n} samples in this batch"
                )
            rows.append(_sample_bytes(v, n))
        for c in self.constants:
            if not _same(got[c.path], c.value):
                raise ValueError(
                    f"{WHERE}field {c.path} changed from the first batch's: a batch-independent field (not per sample) "
                    "is passed through only if it is the same in every batch on every rank"
                )
        dense = np.concatenate(rows, axis=1) if rows else np.zeros((n, 0), dtype=np.uint8)
        return Batch(
            dense_features=torch.from_numpy(np.ascontiguousarray(dense)),
            sparse_features=self._merged(kjts),
            labels=torch.zeros((n, 0), dtype=torch.uint8),
        )

    def _merged(self, kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        values = torch.cat([v.values().to(torch.int64) for v in kjts])
        weights = None
        if self.weighted:
            parts = []
            for f, v in zip(self.kjts, kjts):
                w = v.weights_or_none()
                parts.append(w.to(torch.float32) if w is not None else torch.ones(v.values().shape[0]))
            weights = torch.cat(parts)
        return KeyedJaggedTensor(
            keys=[k for f in self.kjts for k in f.internal_keys],
            values=values,
            lengths=torch.cat([v.lengths().to(torch.int64) for v in kjts]),
            weights=weights,
        )

    def decode(self, internal: Batch) -> object:
        """The user's type holding the samples of an internal Batch (as `encode` made it, after the exchange)."""
        kjt = internal.sparse_features
        n = int(internal.dense_features.shape[0])
        out = copy.copy(self.template)
        leaves: dict[FieldPath, Any] = {}
        rows = internal.dense_features.numpy() if self.tensors else None
        for t in self.tensors:
            assert rows is not None
            if t.nbytes:
                raw = torch.from_numpy(np.ascontiguousarray(rows[:, t.offset : t.offset + t.nbytes]))
                leaves[t.path] = raw.view(t.dtype).reshape(n, *t.shape)
            else:
                leaves[t.path] = torch.empty((n, *t.shape), dtype=t.dtype)
        lengths = kjt.lengths()
        per_key = lengths.reshape(-1, n).sum(dim=1) if n else torch.zeros(len(kjt.keys()), dtype=torch.int64)
        key_at, value_at = 0, 0
        weights = kjt.weights_or_none()
        for f in self.kjts:
            k = len(f.keys)
            m = int(per_key[key_at : key_at + k].sum())
            leaves[f.path] = KeyedJaggedTensor(
                keys=list(f.keys),
                values=kjt.values()[value_at : value_at + m].to(f.values_dtype),
                lengths=lengths[key_at * n : (key_at + k) * n].to(f.lengths_dtype),
                weights=weights[value_at : value_at + m] if f.weighted and weights is not None else None,
            )
            key_at, value_at = key_at + k, value_at + m
        for c in self.constants:
            leaves[c.path] = c.value
        for attr in {p.attr for p in leaves}:
            box = self.containers.get(attr)
            if box is None:
                value = leaves[FieldPath(attr)]
            elif box.kind is dict or issubclass(box.kind, dict):
                value = box.kind((k, leaves[FieldPath(attr, k)]) for k in box.keys)
            else:
                items = [leaves[FieldPath(attr, i)] for i in box.keys]
                value = box.kind._make(items) if hasattr(box.kind, "_make") else box.kind(items)
            object.__setattr__(out, attr, value)
        return out


def _check_kjt(path: FieldPath, kjt: KeyedJaggedTensor) -> None:
    w = kjt.weights_or_none()
    if w is not None and w.dtype != torch.float32:
        raise ValueError(f"{WHERE}field {path}: weights of dtype {w.dtype}; the input stage carries float32 weights")
