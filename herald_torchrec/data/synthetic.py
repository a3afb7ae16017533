"""Deterministic synthetic click log with real skew: the embedded default data and the simulator's trace.

Why synthetic: the real logs are tens of GB; this generator reproduces what matters for embedding scheduling
(per-table sizes from Criteo Kaggle, a Zipf head with a uniform tail, and *temporal locality* — ids that appear,
burst and fade as in a chronological log) and labels from a hidden model so that AUC means something.

Every sample is a pure function of (seed, position in the log): its random draws are hashes of the position
(counter-based, like Philox), not a generator's state. So any rank, and the simulator, can produce any batch — or
just its own slice of one, at 1/R of the cost — without state, and runs are bit-for-bit repeatable whatever the batch
size. numpy only (the control plane uses it too).

Split: the log is cut into blocks of `val_block` samples and every `val_every`-th block is held out for validation
(blocks val_every-1, 2*val_every-1, ...). The split is fixed in samples, not in global batches, so the training
stream — the training samples in log order, `train_samples(first, count)` — is the same whatever the global batch,
and a run may continue from any training sample at another global batch (trainer.resume). The default block (512
samples) is the default global batch (2 ranks x 256): there, the held-out blocks are exactly the every-tenth global
batches that earlier versions held out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from herald_torchrec.data.samples import Samples

# Criteo Kaggle per-table cardinalities (C1..C26), REFERENCE.md.
CRITEO_KAGGLE_ROWS: tuple[int, ...] = (
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
)

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Stateless 64-bit mixer: a hash we can evaluate for any index, so batches need no generator state."""
    with np.errstate(over="ignore"):
        z = np.asarray(x).astype(np.uint64, copy=False) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _unit(h: np.ndarray) -> np.ndarray:
    """uint64 hash -> float64 uniform in [0, 1)."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class SyntheticSpec:
    """Knobs of the generator. Defaults: Criteo-like, scaled to fit a laptop, temporal locality on."""

    scale: float = 0.01  # multiplies the Criteo Kaggle cardinalities
    num_tables: int = 26  # first N Criteo tables (cycled if more are asked for)
    table_rows: tuple[int, ...] | None = None  # explicit sizes; overrides scale/num_tables
    zipf: float = 1.15  # exponent of the popularity head
    tail: float = 0.1  # share of ids drawn uniformly over the whole table
    locality: float = 0.5  # share of ids drawn from the drifting "trending" set; 0 = i.i.d.
    trend_life: int = 20_000  # samples over which a trending id rises and fades
    num_dense: int = 13
    seed: int = 0
    val_every: int = 10  # every val_every-th block of val_block samples is held out for validation
    val_block: int = 512  # samples per split block (= the default global batch, 2 ranks x 256)

    def __post_init__(self) -> None:
        checks = [
            (self.scale > 0, f"scale must be > 0, got {self.scale}"),
            (self.num_tables >= 1, f"num_tables must be >= 1, got {self.num_tables}"),
            (self.zipf > 1.0, f"zipf exponent must be > 1, got {self.zipf}"),
            (0.0 <= self.tail <= 1.0, f"tail must be in [0, 1], got {self.tail}"),
            (0.0 <= self.locality <= 1.0, f"locality must be in [0, 1], got {self.locality}"),
            (self.tail + self.locality <= 1.0, "tail + locality must be <= 1"),
            (self.trend_life >= 1, f"trend_life must be >= 1, got {self.trend_life}"),
            (self.num_dense >= 0, f"num_dense must be >= 0, got {self.num_dense}"),
            (self.val_every >= 2, f"val_every must be >= 2, got {self.val_every}"),
            (
                isinstance(self.val_block, int) and not isinstance(self.val_block, bool) and self.val_block >= 1,
                f"val_block must be an integer >= 1, got {self.val_block!r}",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"SyntheticSpec: {msg}")
        if self.table_rows is not None and (len(self.table_rows) == 0 or min(self.table_rows) < 1):
            raise ValueError(f"SyntheticSpec: table_rows must be a non-empty list of sizes >= 1, got {self.table_rows}")

    def rows(self) -> list[int]:
        if self.table_rows is not None:
            return [int(r) for r in self.table_rows]
        base = [CRITEO_KAGGLE_ROWS[i % len(CRITEO_KAGGLE_ROWS)] for i in range(self.num_tables)]
        # small tables keep (at least a few of) their rows: scaling a 3-row table to 0 makes no sense
        return [max(min(c, 8), math.ceil(c * self.scale)) for c in base]


@dataclass
class SyntheticCTR:
    """Criteo-like click log. `global_batch(i, n)` is the i-th chronological batch of n samples."""

    spec: SyntheticSpec = field(default_factory=SyntheticSpec)

    def __post_init__(self) -> None:
        s = self.spec
        self.table_rows = s.rows()
        self.num_tables = len(self.table_rows)
        self.feature_names = [f"c{t}" for t in range(self.num_tables)]
        self.num_dense = s.num_dense
        hidden = np.random.default_rng([s.seed, 0xC0FFEE])
        self._dense_w = hidden.normal(0.0, 0.6, size=s.num_dense)
        self._table_w = hidden.uniform(0.4, 1.0, size=self.num_tables)  # how much each field matters
        # a bijection rank -> id per table (popular ids spread over the table, not 0..k)
        self._mult = np.array([self._coprime(n, t) for t, n in enumerate(self.table_rows)], dtype=np.int64)
        self._rows = np.array(self.table_rows, dtype=np.int64)
        # trending ids: one born per `trend_life / births` samples, ages ~ exponential with mean births / 4
        births = np.clip(self._rows // 4, 16, 256)
        self._trend_step = np.maximum(1, s.trend_life // births)
        self._trend_scale = births / 4.0
        self._trend_salt = np.arange(self.num_tables, dtype=np.uint64) * np.uint64(7) + np.uint64(s.seed * 1_000_003)
        # counter-based draws: 4 per (sample, table), 2 per dense feature, 1 for the label
        self._draws = 4 * self.num_tables + 2 * s.num_dense + 1
        self._salt = splitmix64(np.array([s.seed], dtype=np.uint64) ^ np.uint64(0x5EED))[0]

    def _coprime(self, n: int, t: int) -> int:
        m = int(splitmix64(np.array([self.spec.seed * 1000 + t]))[0] % np.uint64(max(n, 2))) | 1
        while math.gcd(m, n) != 1:
            m += 2
        return m % n if n > 1 else 0

    # ---- hidden ground truth -------------------------------------------------------------------------
    def _id_effect(self, t: int | np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Per-id hidden weight in [-1.5, 1.5]: what the embedding of that id should learn (`t` may be a row of
        table indices broadcast against ids [N, T])."""
        key = (
            ids.astype(np.uint64) * np.uint64(64)
            + np.asarray(t, dtype=np.uint64)
            + np.uint64(self.spec.seed) * np.uint64(7919)
        )
        return (_unit(splitmix64(key)) - 0.5) * 3.0

    # ---- id sampling ---------------------------------------------------------------------------------
    def _zipf_ranks(self, u: np.ndarray, n: np.ndarray | int) -> np.ndarray:
        """Truncated Zipf(a) over ranks 0..n-1 by the continuous inverse CDF (vectorised, exact enough)."""
        a = self.spec.zipf
        hi = (np.asarray(n, dtype=np.float64) + 1.0) ** (1.0 - a)
        x = (1.0 + u * (hi - 1.0)) ** (1.0 / (1.0 - a))
        return np.minimum(np.floor(x).astype(np.int64) - 1, np.asarray(n) - 1).clip(0)

    def _uniforms(self, pos: np.ndarray, first: int, count: int) -> np.ndarray:
        """[N, count] uniforms in (0, 1): draws first..first+count-1 of the samples at log positions pos. Counter
        based (a hash of position and draw), so any sample range costs only its own draws."""
        key = pos.astype(np.uint64)[:, None] * np.uint64(self._draws) + np.arange(first, first + count, dtype=np.uint64)
        return ((splitmix64(key ^ self._salt) >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))

    def _ids(self, pos: np.ndarray) -> np.ndarray:
        """Ids [N, T] of the samples at log positions pos (draws 0..4T-1 of each sample)."""
        s, T, n = self.spec, self.num_tables, self._rows
        # one [N, T] block per kind of draw (smaller temporaries than one [N, 4T] block: measured faster)
        mode, rank_u, tail_u, age_u = (self._uniforms(pos, k * T, T) for k in range(4))
        ids = self._zipf_ranks(rank_u, n) * self._mult % n  # a Zipf head spread over the table
        tail = mode < s.tail  # uniform over the whole table
        ids = np.where(tail, np.minimum(np.floor(tail_u * n).astype(np.int64), n - 1), ids)
        # trending ids are born at a steady pace (one per `life / births` samples); an id's chance to be drawn
        # decays with its age, so it bursts right after birth and fades over ~trend_life samples
        trend = (mode >= s.tail) & (mode < s.tail + s.locality)
        if trend.any():
            now = pos[:, None] // self._trend_step
            age = np.floor(-np.log(age_u) * self._trend_scale).astype(np.int64)  # exponential, mean births / 4
            born = np.maximum(now - age, 0)
            h = splitmix64(born.astype(np.uint64) * np.uint64(131) + self._trend_salt)
            ids = np.where(trend, (h % n.astype(np.uint64)).astype(np.int64), ids)
        return ids

    # ---- batches -------------------------------------------------------------------------------------
    def samples(self, start: int, count: int) -> Samples:
        """Samples [start, start + count) of the log: a pure function of (seed, position), so a rank can make just
        its slice of a global batch, and a sample is the same whatever the batch size."""
        if start < 0 or count < 0:
            raise ValueError(f"samples: need start >= 0 and count >= 0, got start={start}, count={count}")
        return self.samples_at(np.arange(start, start + count, dtype=np.int64))

    def samples_at(self, pos: np.ndarray) -> Samples:
        """The samples at log positions `pos` (int64, any order): each one depends on its own position only."""
        T, D = self.num_tables, self.num_dense
        ids = self._ids(pos)
        u = self._uniforms(pos, 4 * T, 2 * D + 1)
        dense = np.sqrt(-2.0 * np.log(u[:, :D])) * np.cos(2.0 * math.pi * u[:, D : 2 * D])  # Box-Muller normals
        effects = self._id_effect(np.arange(T), ids)
        logit = -1.0 + dense @ self._dense_w + effects @ self._table_w / math.sqrt(T) * 2.0
        if D and T >= 2:  # one interaction: a dense feature gates a field
            logit += 0.5 * dense[:, 0] * self._id_effect(T - 1, ids[:, 1])
        p = 1.0 / (1.0 + np.exp(-logit))
        labels = (u[:, 2 * D] < p).astype(np.float32)
        # dense features are shown to the model as log(1 + max(x, 0))-like non-negative values, as in Criteo
        return Samples(dense=np.log1p(np.exp(dense)).astype(np.float32), ids=ids, labels=labels)

    def global_batch(self, index: int, size: int) -> Samples:
        """Samples [index*size, (index+1)*size) of the log."""
        if index < 0 or size < 1:
            raise ValueError(f"global_batch: need index >= 0 and size >= 1, got index={index}, size={size}")
        return self.samples(index * size, size)

    def batch_slice(self, index: int, size: int, lo: int, hi: int) -> Samples:
        """Samples [lo, hi) of global batch `index` of `size` samples: `global_batch(index, size).take(slice(lo,
        hi))` at the cost of hi - lo samples (a rank makes its own slice only)."""
        if not 0 <= lo <= hi <= size:
            raise ValueError(f"batch_slice: need 0 <= lo <= hi <= size, got lo={lo}, hi={hi}, size={size}")
        if index < 0:
            raise ValueError(f"batch_slice: need index >= 0, got {index}")
        return self.samples(index * size + lo, hi - lo)

    # ---- the split: blocks of val_block samples, every val_every-th held out ---------------------------
    def train_positions(self, first: int, count: int) -> np.ndarray:
        """Log positions of training samples first..first+count-1 (the log without its held-out blocks)."""
        if first < 0 or count < 0:
            raise ValueError(f"train_positions: need first >= 0 and count >= 0, got first={first}, count={count}")
        v, k = self.spec.val_every, self.spec.val_block
        j = np.arange(first, first + count, dtype=np.int64)
        per_cycle = (v - 1) * k  # training samples between two held-out blocks
        return j // per_cycle * (v * k) + j % per_cycle

    def val_positions(self, first: int, count: int) -> np.ndarray:
        """Log positions of held-out samples first..first+count-1 (the held-out blocks, in log order)."""
        if first < 0 or count < 0:
            raise ValueError(f"val_positions: need first >= 0 and count >= 0, got first={first}, count={count}")
        v, k = self.spec.val_every, self.spec.val_block
        j = np.arange(first, first + count, dtype=np.int64)
        return j // k * (v * k) + (v - 1) * k + j % k

    def train_samples(self, first: int, count: int) -> Samples:
        """Training samples first..first+count-1: a pure function of the sample's place in the training stream,
        whatever global batch they are cut into."""
        return self.samples_at(self.train_positions(first, count))

    def val_samples(self, first: int, count: int) -> Samples:
        """Held-out samples first..first+count-1."""
        return self.samples_at(self.val_positions(first, count))
