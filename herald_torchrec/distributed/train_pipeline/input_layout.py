"""Host-side layout of the Herald input stage: TorchRec `Batch`es <-> the scheduler's global batches (numpy only).

No process group here: everything is a pure function of arrays, so the input stage's bookkeeping is testable in
one process. `input_stage.py` moves the bytes these functions describe.

Vocabulary:
- a *slice* is one rank's `Batch` of a step (B samples: dense features, a KeyedJaggedTensor, labels);
- *managed keys* are the KJT keys read by Herald-managed tables (possibly several tables per key, across several
  EBCs); the scheduler sees their ids. *Carried keys* are all other keys (tables left to TorchRec's sharding, other
  sparse modules): their ids travel with the samples, like dense features and labels;
- global sample g = q * B + i is sample i of rank q's slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from herald_torchrec.distributed import host_kernels
from herald_torchrec.distributed.storage.row_layout import exclusive_cumsum, ragged_arange
from herald_torchrec.distributed.train_pipeline.input_codec import PipelineableCodec
from herald_torchrec.distributed.variable_batch import expand_variable_batch
from herald_torchrec.schedule.global_batch import GlobalBatch, TableLayout

INT32_MAX = int(np.iinfo(np.int32).max)


@dataclass(frozen=True)
class ManagedTables:
    """The Herald-managed tables of a model, in one global table space for the scheduler.

    `features[t]`: the KJT keys whose ids table t reads (a table may serve several features; a key may feed tables of
    several EBCs). `module_offsets[m]`: index of module m's first table (modules in model order)."""

    names: tuple[str, ...]
    rows: tuple[int, ...]
    features: tuple[tuple[str, ...], ...]
    module_offsets: tuple[int, ...]

    @property
    def layout(self) -> TableLayout:
        return TableLayout(self.rows)

    def keys(self) -> list[str]:
        """Every managed key, in first-use order."""
        out: list[str] = []
        for fs in self.features:
            out += [f for f in fs if f not in out]
        return out


@dataclass
class SliceLayout:
    """What every rank's slices look like (the first slice fixes it; every rank checks it agrees)."""

    keys: tuple[str, ...]
    batch_size: int
    dense_shape: tuple[int, ...]  # per sample
    dense_dtype: torch.dtype
    label_shape: tuple[int, ...]
    label_dtype: torch.dtype
    managed: np.ndarray  # positions in `keys` of the managed keys (ManagedTables.keys() order)
    carried: np.ndarray  # positions in `keys` of the other keys
    key_rows: np.ndarray  # per managed key: the smallest table it feeds (its ids must be below this)
    table_keys: list[np.ndarray] = field(default_factory=list)  # per managed table: indices into `managed`
    ids_dtype: np.dtype = np.dtype(np.int32)  # wire type of managed ids (int64 only for tables >= 2^31 rows)
    weighted: bool = False  # the KJTs carry weights (id-score lists): each id's float32 weight travels with it
    # a batch type other than torchrec's Batch: its translation to and from the stage's Batch (None: Batch itself)
    codec: PipelineableCodec | None = None

    @property
    def num_keys(self) -> int:
        return len(self.keys)

    def __post_init__(self) -> None:
        # per-sample byte counts, asked for several times a step (a torch dtype's size needs a tensor): once here
        self._dense_bytes = int(np.prod(self.dense_shape, dtype=np.int64)) * _itemsize(self.dense_dtype)
        label_bytes = int(np.prod(self.label_shape, dtype=np.int64)) * _itemsize(self.label_dtype)
        self.weight_bytes = 4 if self.weighted else 0  # bytes of one id's weight on the wire (float32)
        self._fixed_bytes = self._dense_bytes + label_bytes

    def dense_bytes(self) -> int:
        """Bytes of one sample's dense features on the wire."""
        return self._dense_bytes

    def fixed_bytes(self) -> int:
        """Bytes of one sample's dense features + label on the wire."""
        return self._fixed_bytes

    def signature(self) -> np.ndarray:
        """int64 words every rank must agree on (keys, batch size, dense / label shapes and dtypes)."""
        import zlib

        text = "\x00".join(self.keys) + f"|{self.dense_shape}|{self.dense_dtype}|{self.label_shape}|{self.label_dtype}"
        text += "|weighted" if self.weighted else ""
        text += f"|{self.codec.signature_text()}" if self.codec is not None else ""
        return np.array([self.batch_size, self.num_keys, zlib.crc32(text.encode())], dtype=np.int64)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def check_batch(batch: object) -> Batch:
    if not isinstance(batch, Batch):
        raise ValueError(
            f"HeraldTrainPipeline consumes torchrec.datasets.utils.Batch (dense_features, sparse_features, labels), "
            f"got {type(batch).__name__}"
        )
    kjt = batch.sparse_features
    if not isinstance(kjt, KeyedJaggedTensor):
        raise ValueError(f"Batch.sparse_features must be a KeyedJaggedTensor, got {type(kjt).__name__}")
    if kjt.variable_stride_per_key():  # one bag per sample: the same outputs and gradients (variable_batch.py)
        return Batch(batch.dense_features, expand_variable_batch(kjt, "HeraldTrainPipeline input"), batch.labels)
    return batch


def slice_layout(batch: object, tables: ManagedTables) -> SliceLayout:
    """The layout the first slice defines (raises ValueError for what the stage cannot carry). A batch of another
    type than torchrec's Batch (any Pipelineable, subclasses of Batch included: they come back as themselves) travels
    as the Batch its codec makes (input_codec.py)."""
    codec = None
    if type(batch) is not Batch:
        codec = PipelineableCodec.of(batch, tables.keys())
        batch = codec.encode(batch)
    batch = check_batch(batch)
    kjt = batch.sparse_features
    keys = tuple(kjt.keys())
    B = int(kjt.stride())
    index = {k: i for i, k in enumerate(keys)}
    mkeys = tables.keys()
    missing = [k for k in mkeys if k not in index]
    if missing:
        raise ValueError(
            f"the batch's KeyedJaggedTensor lacks the Herald-managed features {missing} (has {list(keys)})"
        )
    managed = np.array([index[k] for k in mkeys], dtype=np.int64)
    carried = np.array([i for i, k in enumerate(keys) if k not in set(mkeys)], dtype=np.int64)
    key_rows = np.array(
        [min(r for r, fs in zip(tables.rows, tables.features) if k in fs) for k in mkeys], dtype=np.int64
    )
    table_keys = [np.array([mkeys.index(f) for f in fs], dtype=np.int64) for fs in tables.features]
    ids_dtype = np.dtype(np.int32) if max(tables.rows) <= INT32_MAX + 1 else np.dtype(np.int64)
    dense, labels = batch.dense_features, batch.labels
    if dense.shape[0] != B or labels.shape[0] != B:
        raise ValueError(
            f"Batch: dense_features has {dense.shape[0]} rows and labels {labels.shape[0]}, the KJT {B} samples"
        )
    return SliceLayout(
        keys=keys,
        batch_size=B,
        dense_shape=tuple(dense.shape[1:]),
        dense_dtype=dense.dtype,
        label_shape=tuple(labels.shape[1:]),
        label_dtype=labels.dtype,
        managed=managed,
        carried=carried,
        key_rows=key_rows,
        table_keys=table_keys,
        ids_dtype=ids_dtype,
        weighted=kjt.weights_or_none() is not None,
        codec=codec,
    )


@dataclass
class HostSlice:
    """One rank's slice on the host: KJT lengths [K, n] and values (int64, key-major), dense and label bytes."""

    n: int
    lengths: np.ndarray
    values: np.ndarray
    fixed: np.ndarray  # uint8 [n, fixed_bytes]: dense features then label, per sample
    uniform: int = -1  # the one length of every bag (`uniform_length`), else -1: computed once per slice
    weights: np.ndarray | None = None  # float32, laid out as `values` (weighted KJTs), else None

    def key_offsets(self) -> np.ndarray:
        return exclusive_cumsum(self.lengths.sum(axis=1))


def host_slice(batch: object, layout: SliceLayout) -> HostSlice:
    """Parse a slice for the wire, with every check a rank can make alone (ValueError names what is wrong)."""
    if layout.codec is not None:
        batch = layout.codec.encode(batch)
    elif type(batch) is not Batch and isinstance(batch, Pipelineable):
        raise ValueError(f"a {type(batch).__name__} batch after a first batch of torchrec.datasets.utils.Batch")
    batch = check_batch(batch)
    kjt = batch.sparse_features
    keys = tuple(kjt.keys())
    if keys != layout.keys:
        raise ValueError(f"the batch's KJT keys {list(keys)} differ from the first batch's {list(layout.keys)}")
    if (kjt.weights_or_none() is not None) != layout.weighted:
        raise ValueError(
            f"the batch's KJT is {'un' if layout.weighted else ''}weighted, the first batch's was "
            f"{'' if layout.weighted else 'un'}weighted: every batch has weights or none has"
        )
    n = int(kjt.stride())
    if n > layout.batch_size:
        raise ValueError(
            f"a batch of {n} samples, more than the first batch's {layout.batch_size} (batch size per rank)"
        )
    dense, labels = batch.dense_features, batch.labels
    if tuple(dense.shape) != (n, *layout.dense_shape) or dense.dtype != layout.dense_dtype:
        raise ValueError(
            f"dense_features {tuple(dense.shape)} {dense.dtype} differ from the first batch's "
            f"(n, {layout.dense_shape}) {layout.dense_dtype}"
        )
    if tuple(labels.shape) != (n, *layout.label_shape) or labels.dtype != layout.label_dtype:
        raise ValueError(
            f"labels {tuple(labels.shape)} {labels.dtype} differ from the first batch's "
            f"(n, {layout.label_shape}) {layout.label_dtype}"
        )
    lengths = kjt.lengths().detach().cpu().numpy().astype(np.int64, copy=False).reshape(layout.num_keys, n)
    values = kjt.values().detach().cpu().numpy().astype(np.int64, copy=False)
    if values.shape[0] != int(lengths.sum()):
        raise ValueError(f"KJT: {values.shape[0]} values but lengths sum to {int(lengths.sum())}")
    _check_managed_ids(values, lengths.sum(axis=1), layout)
    fixed = (
        np.concatenate([_bytes_per_sample(dense, n), _bytes_per_sample(labels, n)], axis=1)
        if layout.fixed_bytes()
        else np.zeros((n, 0), dtype=np.uint8)
    )
    weights = None
    if layout.weighted:
        weights = kjt.weights().detach().cpu().numpy().astype(np.float32, copy=False)
        if weights.shape[0] != values.shape[0]:
            raise ValueError(f"KJT: {weights.shape[0]} weights for {values.shape[0]} values")
    return HostSlice(n=n, lengths=lengths, values=values, fixed=fixed, uniform=uniform_length(lengths), weights=weights)


def _check_managed_ids(values: np.ndarray, per_key: np.ndarray, layout: SliceLayout) -> None:
    """Managed ids must address their tables (checked before any narrowing to the wire's dtype): one pass over all
    values against the bound of each value's key (carried keys' ids are not Herald's to check)."""
    K = layout.num_keys
    if per_key.size and (per_key == per_key[0]).all():  # as many ids per key: a [K, n] block, one bound per row
        block = values.reshape(K, -1)[layout.managed]
        if not ((block < 0) | (block >= layout.key_rows[:, None])).any():
            return
    key = np.repeat(np.arange(K), per_key)  # the key of every value
    bound = np.full(layout.num_keys, -1, dtype=np.int64)  # -1: a carried key
    bound[layout.managed] = layout.key_rows
    lim = bound[key]
    bad = (lim >= 0) & ((values < 0) | (values >= lim))
    if bad.any():
        k = int(key[np.flatnonzero(bad)[0]])
        shown = values[bad & (key == k)][:5].tolist()
        raise ValueError(f"feature {layout.keys[k]!r}: ids out of range {shown} (its table has {bound[k]} rows)")


def _bytes_per_sample(t: torch.Tensor, n: int) -> np.ndarray:
    a = t.detach().cpu().contiguous()
    return a.view(torch.uint8).numpy().reshape(n, -1) if a.numel() else np.zeros((n, 0), dtype=np.uint8)


def managed_ids(s: HostSlice, layout: SliceLayout) -> np.ndarray:
    """The ids of the managed keys, key after key (ManagedTables.keys() order), as the wire's dtype."""
    if s.uniform >= 0:  # key-major [K, n * u] values: the managed keys' rows
        return s.values.reshape(layout.num_keys, -1)[layout.managed].astype(layout.ids_dtype).reshape(-1)
    per_key = s.lengths.sum(axis=1)
    koff = exclusive_cumsum(per_key)
    idx = ragged_arange(koff[layout.managed], per_key[layout.managed])
    return s.values[idx].astype(layout.ids_dtype)


def uniform_length(lengths: np.ndarray) -> int:
    """The one length of every bag in `lengths`, or -1 if they differ (or there are none). Single-hot data (every
    bag of length 1) is the common case; the layout functions below take one reshape for it instead of ragged
    index arithmetic, with the same results."""
    if lengths.size == 0:
        return -1
    u = int(lengths.flat[0])
    return u if (lengths == u).all() else -1


@dataclass
class GatheredIds:
    """The managed ids of a whole global batch (every rank holds it after the gather) and its lengths of all keys."""

    lengths: np.ndarray  # int64 [K, R*B]: lengths of every key for every global sample
    values: np.ndarray  # int64: managed ids, managed key after key, global samples in order
    key_start: np.ndarray  # int64 [J]: where each managed key's ids start in `values`
    bag_start: np.ndarray | None  # int64 [J, R*B]: start of each (managed key, sample) bag; None: from `uniform`
    uniform: int = -1  # the one bag length of every key and sample (values is then [J, R*B, uniform]), else -1

    @property
    def sample_start(self) -> np.ndarray:
        """int64 [J, R*B]: start of each (managed key, sample) bag in `values` (of one-length bags: arithmetic, made
        only where a layout needs it; single-hot batches never do)."""
        if self.bag_start is None:
            self.bag_start = self.key_start[:, None] + np.arange(self.lengths.shape[1], dtype=np.int64) * self.uniform
        return self.bag_start


def gather_ids(lengths: np.ndarray, per_rank_ids: Sequence[np.ndarray], layout: SliceLayout) -> GatheredIds:
    """Assemble the global batch from every rank's lengths [R, K, B] and managed ids (key-major per rank)."""
    R, K, B = lengths.shape
    J = layout.managed.shape[0]
    u = uniform_length(lengths)
    if u >= 0:  # every bag of one length (single-hot data): each rank's ids are a [J, B * u] block
        values = np.empty((J, R, B * u), dtype=np.int64)
        for q, v in enumerate(per_rank_ids):  # widened to int64 as it is copied in
            values[:, q] = np.asarray(v).reshape(J, B * u)
        key_start = np.arange(J, dtype=np.int64) * (R * B * u)
        return GatheredIds(
            lengths=np.full((K, R * B), u, dtype=np.int64),
            values=values.reshape(-1),
            key_start=key_start,
            bag_start=None,
            uniform=u,
        )
    glen = lengths.transpose(1, 0, 2).reshape(K, R * B)
    mlen = lengths[:, layout.managed, :]  # [R, J, B]
    seg = mlen.sum(axis=2)  # [R, J] ids of key j sent by rank q
    flat = np.concatenate([np.asarray(v, dtype=np.int64) for v in per_rank_ids])
    start_qj = exclusive_cumsum(seg.reshape(-1)).reshape(R, J)
    order = ragged_arange(start_qj.T.reshape(-1), seg.T.reshape(-1))  # (key, rank) order
    values = flat[order]
    mg = glen[layout.managed]  # [J, R*B]
    key_start = exclusive_cumsum(mg.sum(axis=1))
    within = np.concatenate([np.zeros((J, 1), np.int64), np.cumsum(mg, axis=1)[:, :-1]], axis=1)
    sample_start = key_start[:, None] + within
    return GatheredIds(lengths=glen, values=values, key_start=key_start, bag_start=sample_start)


def global_batch(ids: GatheredIds, layout: SliceLayout, tables: ManagedTables, index: int | None = None) -> GlobalBatch:
    """The scheduler's view: per managed table, the CSR of the ids every global sample reads in it (a table fed by
    several keys reads them all, key after key). Single-hot data takes the dense fast path. The ids must have been
    range-checked (`host_slice` does it on the rank that drew them): the fast path does not check them again."""
    lay = tables.layout
    N = ids.lengths.shape[1]
    one_key = all(k.shape[0] == 1 for k in layout.table_keys)
    if one_key and (ids.uniform == 1 or (ids.uniform < 0 and (ids.lengths[layout.managed] == 1).all())):
        first = np.array([int(k[0]) for k in layout.table_keys], dtype=np.int64)
        per_key = ids.values.reshape(-1, N)  # [J, N]: every key's ids are N consecutive values
        cols = [per_key[j] for j in first.tolist()]
        # the ids were range-checked on their ranks (host_slice); each table's ids are already one contiguous row
        return GlobalBatch.from_dense(
            np.ascontiguousarray(per_key[first].T), lay, index, columns=cols, range_checked=True
        )
    mg = ids.lengths[layout.managed]  # [J, N]
    offs, vals = [], []
    for keys in layout.table_keys:
        cnt = mg[keys].sum(axis=0)
        offs.append(np.concatenate([[0], np.cumsum(cnt)]).astype(np.int64))
        if keys.shape[0] == 1:
            k = int(keys[0])
            vals.append(ids.values[ids.key_start[k] : ids.key_start[k] + int(mg[k].sum())])
        else:  # per sample: the ids of each key in turn
            starts = ids.sample_start[keys].T.reshape(-1)
            widths = mg[keys].T.reshape(-1)
            vals.append(ids.values[ragged_arange(starts, widths)])
    return GlobalBatch(offs, vals, lay, index)


def sample_major_ids(s: HostSlice, keys: np.ndarray, samples: np.ndarray, of: np.ndarray | None = None) -> np.ndarray:
    """int64 ids of `keys` (positions in the slice's keys) of the given local samples, sample after sample, key after
    key within one: the order in which ids travel with their samples. `of`: another array laid out as the slice's
    values (its weights), taken in the same order."""
    values = s.values if of is None else of
    if keys.shape[0] == 0 or samples.shape[0] == 0:
        return np.zeros(0, dtype=values.dtype)
    u = s.uniform
    if u >= 0:  # the slice's values are a [K, n, u] block
        return values.reshape(s.lengths.shape[0], s.n, u)[keys][:, samples].transpose(1, 0, 2).reshape(-1)
    koff = s.key_offsets()
    within = np.zeros_like(s.lengths)
    within[:, 1:] = np.cumsum(s.lengths[:, :-1], axis=1)
    starts = (koff[keys][None, :] + within[keys][:, samples].T).reshape(-1)  # (sample, key)
    widths = s.lengths[keys][:, samples].T.reshape(-1)
    return values[ragged_arange(starts, widths)]


def key_major(sample_major: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Values that travelled sample after sample (key after key within one) in a KJT's order (key after key,
    samples in order within one); `lengths` [K, n] are the bags' lengths."""
    K, n = lengths.shape
    if sample_major.shape[0] == 0:
        return sample_major
    flat = lengths.T.reshape(-1)  # (sample, key) order
    start = exclusive_cumsum(flat).reshape(n, K).T  # [K, n]: where each bag starts in the sample-major values
    return sample_major[ragged_arange(start.reshape(-1), lengths.reshape(-1))]


@dataclass(frozen=True)
class SampleRoute:
    """Where a rank's samples of one global batch go: `order` (local indices, grouped by destination, in order
    within), `order[cut[d] : cut[d + 1]]` the samples for rank d, and `with_ids[d]`: rank d does not plan, so its
    block also brings the samples' lengths and managed ids."""

    order: np.ndarray
    cut: np.ndarray
    with_ids: np.ndarray

    @classmethod
    def by_destination(cls, dest: np.ndarray, with_ids: np.ndarray) -> SampleRoute:
        """The route of samples whose destinations are `dest` (a rank per local sample) among len(with_ids) ranks."""
        order = np.argsort(dest, kind="stable")  # by destination, local (so global) order within
        cut = np.concatenate([[0], np.cumsum(np.bincount(dest, minlength=with_ids.shape[0]))])
        return cls(order, cut, with_ids)

    @property
    def counts(self) -> np.ndarray:
        """How many samples go to each rank."""
        return np.diff(self.cut)


def sample_blocks(
    s: HostSlice, layout: SliceLayout, route: SampleRoute, uniform: bool
) -> tuple[list[np.ndarray], np.ndarray]:
    """What this rank sends of its samples: one uint8 block per destination d, holding its samples
    `route.order[route.cut[d] : route.cut[d + 1]]` (local indices). Every block has their dense + label bytes; where
    `route.with_ids[d]` (a rank that does not plan, so it never received this slice's managed ids) then their bag
    lengths of every key (int32 [n, K], sample-major; left out where `uniform`: the slice's bags all have one length,
    which the header told) and their managed ids (the wire's dtype, sample-major); then their carried ids (int64,
    sample-major); last, for weighted KJTs, the weights of every key's ids (float32, sample-major: the weights
    travel with their samples to every rank, planners included, which gathered only ids). Returns (blocks, bytes of
    lengths and managed ids in each block)."""
    order, cut, with_ids = route.order, route.cut, route.with_ids
    R = cut.shape[0] - 1
    if s.uniform >= 0 and uniform and not layout.weighted:  # the same blocks, compiled (None: kernels off)
        fast = host_kernels.sample_blocks_uniform(
            s.fixed, s.values, s.n, s.uniform, layout.managed, layout.carried, layout.ids_dtype, order, cut, with_ids
        )
        if fast is not None:
            return fast
    fixed = s.fixed[order].reshape(-1)
    fb = layout.fixed_bytes()

    u = s.uniform

    def ids_and_cut(keys: np.ndarray, dtype: np.dtype, of: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The samples' ids of `keys` (or their weights, `of`) as bytes, and the byte offset at which each sample's
        start."""
        if u >= 0:
            cut_bytes = dtype.itemsize * keys.shape[0] * u * np.arange(order.shape[0] + 1, dtype=np.int64)
        else:
            per_sample = s.lengths[keys][:, order].sum(axis=0)
            cut_bytes = dtype.itemsize * np.concatenate([[0], np.cumsum(per_sample)]).astype(np.int64)
        return sample_major_ids(s, keys, order, of).astype(dtype, copy=False).view(np.uint8), cut_bytes

    car, car_cut = ids_and_cut(layout.carried, np.dtype(np.int64))
    if layout.weighted:  # every key's weights, float32, after the carried ids
        wts, w_cut = ids_and_cut(np.arange(layout.num_keys, dtype=np.int64), np.dtype(np.float32), s.weights)
    if with_ids.any():
        man, man_cut = ids_and_cut(layout.managed, layout.ids_dtype)
        lw = 0 if uniform else 4 * layout.num_keys  # bytes of one sample's lengths
        lens = s.lengths[:, order].T.astype(np.int32).reshape(-1).view(np.uint8) if lw else np.zeros(0, np.uint8)
    blocks, id_bytes = [], np.zeros(R, dtype=np.int64)
    for d in range(R):
        a, b = int(cut[d]), int(cut[d + 1])
        parts = [fixed[a * fb : b * fb]]
        if with_ids[d]:
            parts += [lens[a * lw : b * lw], man[man_cut[a] : man_cut[b]]]
            id_bytes[d] = (b - a) * lw + int(man_cut[b] - man_cut[a])
        parts.append(car[car_cut[a] : car_cut[b]])
        if layout.weighted:
            parts.append(wts[w_cut[a] : w_cut[b]])
        blocks.append(np.concatenate(parts))
    return blocks, id_bytes


class ReceivedSamples(NamedTuple):
    """The samples a rank received (`received_samples`), in source-rank order: dense + label bytes [n, fixed_bytes],
    KJT lengths [K * n] and values (keys in the slices' order), and their weights laid out as the values (weighted
    KJTs; else None)."""

    fixed: np.ndarray
    lengths: np.ndarray
    values: np.ndarray
    weights: np.ndarray | None = None


def received_samples(
    blocks: Sequence[np.ndarray], n_from: np.ndarray, uniform_from: np.ndarray, layout: SliceLayout
) -> ReceivedSamples:
    """Inverse of `sample_blocks` on a rank that does not plan (every block holds lengths and ids): the received
    samples, in source-rank order. `uniform_from[q]`: the one bag length of rank q's slice (its header), or -1
    (lengths sent)."""
    K, fb, it = layout.num_keys, layout.fixed_bytes(), layout.ids_dtype.itemsize
    wb = layout.weight_bytes
    u = int(uniform_from[0]) if len(uniform_from) else -1
    if u >= 0 and (np.asarray(uniform_from) == u).all():
        return _received_uniform(blocks, n_from, u, layout)
    fixed, lens, man, car, wts = [], [], [], [], []
    for blk, n, u in zip(blocks, n_from.tolist(), uniform_from.tolist()):
        fixed.append(blk[: n * fb])
        at = n * fb
        if u >= 0:
            ln = np.full((K, n), u, dtype=np.int64)
        else:
            ln = blk[at : at + 4 * K * n].view(np.int32).reshape(n, K).T.astype(np.int64)
            at += 4 * K * n
        m, c = int(ln[layout.managed].sum()), int(ln[layout.carried].sum())
        w = int(ln.sum()) * wb
        if blk.shape[0] != at + m * it + 8 * c + w:  # both sides are this module: a mismatch is a protocol bug
            raise RuntimeError(
                f"herald input stage: a block of {n} samples has {blk.shape[0]} bytes, its lengths say "
                f"{at + m * it + 8 * c + w}"
            )
        man.append(blk[at : at + m * it].view(layout.ids_dtype).astype(np.int64))
        car.append(blk[at + m * it : at + m * it + 8 * c].view(np.int64))
        wts.append(key_major(blk[at + m * it + 8 * c :].view(np.float32), ln) if wb else None)
        lens.append(ln)
    n_all = int(n_from.sum())
    lens_all = np.concatenate(lens, axis=1) if lens else np.zeros((K, 0), dtype=np.int64)
    managed = np.concatenate(man) if man else np.zeros(0, np.int64)
    carried = np.concatenate(car) if car else np.zeros(0, np.int64)
    start = np.zeros((K, n_all), dtype=np.int64)
    base = 0
    for keys, vals in ((layout.managed, managed), (layout.carried, carried)):
        kl = lens_all[keys]  # [k, n]: sample-major within `vals`, key after key within a sample
        start[keys] = base + exclusive_cumsum(kl.sum(axis=0))[None, :] + np.cumsum(kl, axis=0) - kl
        base += vals.shape[0]
    values = np.concatenate([managed, carried])[ragged_arange(start.reshape(-1), lens_all.reshape(-1))]
    fixed_all = np.concatenate(fixed).reshape(n_all, fb) if n_all else np.zeros((0, fb), dtype=np.uint8)
    return ReceivedSamples(fixed_all, lens_all.reshape(-1), values, _merge_keys(wts, lens) if wb else None)


def _merge_keys(per_source: list[np.ndarray], lens: list[np.ndarray]) -> np.ndarray:
    """One KJT-ordered array (key after key, the sources' samples in order within one) from each source's own
    KJT-ordered array (`lens[q]`: its [K, n_q] lengths)."""
    if not per_source:
        return np.zeros(0, dtype=np.float32)
    parts = []
    K = lens[0].shape[0]
    cuts = [np.concatenate([[0], np.cumsum(ln.sum(axis=1))]) for ln in lens]
    for k in range(K):
        parts += [a[c[k] : c[k + 1]] for a, c in zip(per_source, cuts)]
    return np.concatenate(parts).astype(np.float32, copy=False)


def assigned_kjt_parts(
    ids: GatheredIds, layout: SliceLayout, mine: np.ndarray, carried: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(lengths int64 [K * B'], values int64) of the KJT of the samples `mine` (global indices, in order), keys in the
    slices' order, on a rank that plans: managed ids from the gathered batch, carried ids from `carried` (laid out as
    `sample_major_ids` of the carried keys, samples in `mine` order)."""
    K = layout.num_keys
    u = ids.uniform
    if u >= 0:  # [K, B', u] blocks: the managed keys' from the gathered [J, N, u], the carried from [B', C, u]
        n, J, C = mine.shape[0], layout.managed.shape[0], layout.carried.shape[0]
        values = np.empty((K, n, u), dtype=np.int64)
        values[layout.managed] = ids.values.reshape(J, ids.lengths.shape[1], u)[:, mine]
        if C:
            values[layout.carried] = carried.reshape(n, C, u).transpose(1, 0, 2)
        return np.full(K * n, u, dtype=np.int64), values.reshape(-1)
    lens = ids.lengths[:, mine]  # [K, B']
    start = np.zeros((K, mine.shape[0]), dtype=np.int64)
    base_carried = ids.values.shape[0]
    start[layout.managed] = ids.sample_start[:, mine]
    if layout.carried.shape[0]:
        cl = lens[layout.carried].T  # [B', C] in the order `carried` holds them
        start[layout.carried] = (base_carried + exclusive_cumsum(cl.reshape(-1)).reshape(cl.shape)).T
    source = np.concatenate([ids.values, carried]) if carried.shape[0] else ids.values
    values = source[ragged_arange(start.reshape(-1), lens.reshape(-1))]
    return lens.reshape(-1), values


class PlannerParts(NamedTuple):
    """What the samples assigned to a rank that plans brought (its gathered ids hold the rest): dense + label bytes
    [n, fixed_bytes], carried ids (as `assigned_kjt_parts` takes them) and, for weighted KJTs, every id's weight in
    the KJT's order (else None)."""

    fixed: np.ndarray
    carried: np.ndarray
    weights: np.ndarray | None


def planner_parts(
    blocks: Sequence[np.ndarray], n_from: np.ndarray, ids: GatheredIds, layout: SliceLayout, mine: np.ndarray
) -> PlannerParts:
    """Inverse of `sample_blocks` on a rank that plans: the blocks of the samples `mine` (global indices, in order;
    `n_from[q]` of them from rank q)."""
    fb = layout.fixed_bytes()
    fixed = np.concatenate([g[: n * fb] for g, n in zip(blocks, n_from)]).reshape(mine.shape[0], fb)
    if not layout.weighted:
        carried = np.concatenate([g[n * fb :] for g, n in zip(blocks, n_from)]).view(np.int64)
        return PlannerParts(fixed, carried, None)
    lens = ids.lengths[:, mine]  # [K, n]
    cut = np.concatenate([[0], np.cumsum(n_from)]).astype(np.int64)
    car, wts = [], []
    for q, g in enumerate(blocks):
        ln = lens[:, cut[q] : cut[q + 1]]
        c = 8 * int(ln[layout.carried].sum())
        at = int(n_from[q]) * fb
        car.append(g[at : at + c])
        wts.append(g[at + c :])
    weights = key_major(np.concatenate(wts).view(np.float32), lens)
    return PlannerParts(fixed, np.concatenate(car).view(np.int64), weights)


def _received_uniform(
    blocks: Sequence[np.ndarray], n_from: np.ndarray, u: int, layout: SliceLayout
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`received_samples` where every source's bags have the one length u: each block is [n, fixed] bytes, then
    [n, J, u] managed ids (wire dtype), then [n, C, u] carried ids (int64), so the KJT's [K, n, u] values are two
    transposes (or one compiled pass)."""
    K, fb, it = layout.num_keys, layout.fixed_bytes(), layout.ids_dtype.itemsize
    J, C, wb = layout.managed.shape[0], layout.carried.shape[0], layout.weight_bytes
    for blk, n in zip(blocks, n_from.tolist()):
        if blk.shape[0] != n * (fb + J * u * it + 8 * C * u + wb * K * u):  # both sides are this module: a bug
            raise RuntimeError(
                f"herald input stage: a block of {n} samples has {blk.shape[0]} bytes, its lengths say "
                f"{n * (fb + J * u * it + 8 * C * u + wb * K * u)}"
            )
    n_all = int(n_from.sum())
    lengths = np.full(K * n_all, u, dtype=np.int64)
    fast = None
    if not wb:
        fast = host_kernels.received_uniform(
            list(blocks), n_from, fb, K, u, layout.managed, layout.carried, layout.ids_dtype
        )
    if fast is not None:  # the same arrays, compiled
        return ReceivedSamples(fast[0], lengths, fast[1])
    fixed, man, car, wts = [], [], [], []
    for blk, n in zip(blocks, n_from.tolist()):
        m = n * J * u * it
        fixed.append(blk[: n * fb])
        man.append(blk[n * fb : n * fb + m].view(layout.ids_dtype).reshape(n, J, u))
        car.append(blk[n * fb + m : n * fb + m + 8 * n * C * u].view(np.int64).reshape(n, C, u))
        if wb:
            wts.append(blk[n * fb + m + 8 * n * C * u :].view(np.float32).reshape(n, K, u))
    values = np.empty((K, n_all, u), dtype=np.int64)
    if n_all:
        values[layout.managed] = np.concatenate(man).transpose(1, 0, 2)
        if C:
            values[layout.carried] = np.concatenate(car).transpose(1, 0, 2)
    fixed_all = np.concatenate(fixed).reshape(n_all, fb) if n_all else np.zeros((0, fb), dtype=np.uint8)
    weights = None
    if wb:
        weights = np.concatenate(wts).transpose(1, 0, 2).reshape(-1) if n_all else np.zeros(0, np.float32)
    return ReceivedSamples(fixed_all, lengths, values.reshape(-1), weights)


def assigned_batch(
    lengths: np.ndarray,
    values: np.ndarray,
    fixed: np.ndarray,
    layout: SliceLayout,
    weights: np.ndarray | None = None,
) -> object:
    """A TorchRec Batch from the assembled KJT parts (`weights`: of weighted KJTs) and the received dense / label
    bytes; of the user's own batch type where the slices were another Pipelineable (`layout.codec`)."""
    n = fixed.shape[0]
    dense_b = layout.dense_bytes()
    fixed = np.ascontiguousarray(fixed)
    dense = torch.from_numpy(np.ascontiguousarray(fixed[:, :dense_b])).view(layout.dense_dtype)
    labels = torch.from_numpy(np.ascontiguousarray(fixed[:, dense_b:])).view(layout.label_dtype)
    dense, labels = dense.reshape(n, *layout.dense_shape), labels.reshape(n, *layout.label_shape)
    kjt = KeyedJaggedTensor(
        keys=list(layout.keys),
        values=torch.from_numpy(values),
        lengths=torch.from_numpy(lengths.astype(np.int32)),
        weights=None if weights is None else torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32)),
    )
    out = Batch(dense_features=dense, sparse_features=kjt, labels=labels)
    return out if layout.codec is None else layout.codec.decode(out)


def one_process_global_batch(batch: object, tables: ManagedTables, index: int | None = None) -> GlobalBatch:
    """The scheduler's view of a whole global batch held by one process (profiling, simulation): the same path as
    the input stage with a single rank."""
    layout = slice_layout(batch, tables)
    s = host_slice(batch, layout)
    ids = gather_ids(s.lengths[None], [managed_ids(s, layout)], layout)
    return global_batch(ids, layout, tables, index)
