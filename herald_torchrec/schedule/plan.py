"""The contract between the control plane (scheduler) and the data plane (sharded module): one `Plan` per step.

Semantics (docs/ARCHITECTURE.md §2), in the order the data plane executes them for step b:
1. `moves`: rows change owner *before* the step's compute, carrying value + optimizer state. All moves of a step
   apply at once (every row leaves, then every row arrives); after them each rank holds at most its guest capacity
   per table. Kinds: MIGRATE (to the single reader of this step), EVICT_HOME (a guest written back to its home
   rank), FORWARD (an evicted guest sent straight to the rank that reads it next).
2. Ownership after the moves is final for the step. Keys whose reader set is exactly {owner} are *exclusive*:
   trained by the owner through its fused TBE. Every other key read in the step is in `shared`: the owner sends the
   value to each non-owner reader, every reader (owner included) computes through the shared path, non-owner
   readers return their gradient, the owner applies one update with the sum.
3. `sample_order`: rank r trains global samples `sample_order[r*B:(r+1)*B]` (each in increasing global order).

numpy only: the control plane never imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

MIGRATE, EVICT_HOME, FORWARD = 0, 1, 2
MOVE_KIND_NAMES = {MIGRATE: "migrate", EVICT_HOME: "evict_home", FORWARD: "forward"}


def _i64(n: int = 0) -> np.ndarray:
    return np.zeros(n, dtype=np.int64)


@dataclass
class RowMoves:
    """Rows that change owner before the step: (table, row) goes src -> dst."""

    table: np.ndarray = field(default_factory=_i64)
    row: np.ndarray = field(default_factory=_i64)
    src: np.ndarray = field(default_factory=_i64)
    dst: np.ndarray = field(default_factory=_i64)
    kind: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int8))

    def __len__(self) -> int:
        return int(self.row.shape[0])


@dataclass
class SharedRows:
    """Keys whose reader set is not exactly {owner}; readers in CSR form (sorted, owner included if it reads)."""

    table: np.ndarray = field(default_factory=_i64)
    row: np.ndarray = field(default_factory=_i64)
    owner: np.ndarray = field(default_factory=_i64)
    reader_offsets: np.ndarray = field(default_factory=lambda: _i64(1))
    readers: np.ndarray = field(default_factory=_i64)

    def __len__(self) -> int:
        return int(self.row.shape[0])

    def remote_reads(self) -> int:
        """(key, reader) pairs with reader != owner: one value sent out and one gradient sent back each."""
        counts = np.diff(self.reader_offsets)
        owner_rep = np.repeat(self.owner, counts)
        return int((self.readers != owner_rep).sum())


@dataclass
class ReadVersions:
    """Counting-only policies (executable=False) and the replica policies report, for every distinct (key, reader) pair
    of the step, the version of the value the reader computes with (number of BSP steps whose update it contains), so
    that the checker can compare it with the true latest version. Ownership plans leave `Plan.reads` as None: the
    checker derives what every reader sees from the moves and the shared rows."""

    table: np.ndarray = field(default_factory=_i64)
    row: np.ndarray = field(default_factory=_i64)
    rank: np.ndarray = field(default_factory=_i64)
    version: np.ndarray = field(default_factory=_i64)
    # replica-based policies (fae, p2res): True where the reader used its local replica of the row, False where
    # the value came from the row's home rank; None for cache policies (het_bsp, het), whose versions the checker
    # takes as reported
    replica: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.row.shape[0])


@dataclass
class ReplicaSync:
    """What a replica-based policy does to its replicas in one step, so that the checker can replay their versions.

    * `to_home` (before the step): the replicas' value is written to the home copy (replicas are identical);
    * `to_replicas` (before the step): the home copy's value is copied to every replica;
    * `allreduce` (after the step): the gradients of these replicated rows are summed over all ranks and applied to
      every replica. A row read through replicas whose gradient is not all-reduced is lost (stale from then on).
    Rows are (table, row) pairs, each list without repeats.
    """

    to_home_table: np.ndarray = field(default_factory=_i64)
    to_home_row: np.ndarray = field(default_factory=_i64)
    to_replicas_table: np.ndarray = field(default_factory=_i64)
    to_replicas_row: np.ndarray = field(default_factory=_i64)
    allreduce_table: np.ndarray = field(default_factory=_i64)
    allreduce_row: np.ndarray = field(default_factory=_i64)
    # the whole replicated set, sent once (the first plan after the policy chose it): the data plane builds its
    # replica region from it, initialised from the home copies; empty in every other step
    replicated_table: np.ndarray = field(default_factory=_i64)
    replicated_row: np.ndarray = field(default_factory=_i64)

    def for_tables(self, lo: int, hi: int) -> "ReplicaSync":
        """The rows of tables [lo, hi), table indices shifted to start at 0 (see `Plan.for_tables`)."""
        out = ReplicaSync()
        for name in ("to_home", "to_replicas", "allreduce", "replicated"):
            t, r = getattr(self, f"{name}_table"), getattr(self, f"{name}_row")
            m = (t >= lo) & (t < hi)
            setattr(out, f"{name}_table", t[m] - lo)
            setattr(out, f"{name}_row", r[m])
        return out


HIT, MISS_PULL, MISS_UNCACHED, UPDATE_PULL = 0, 1, 2, 3  # CacheStep.action


@dataclass
class CacheStep:
    """What HET's per-worker caches do in one step (het, schedule/baselines/het.py), for the data plane to execute
    (distributed/comparison/het_cache.py). Per distinct (key, reader) pair of the step: `action` HIT (the cached copy),
    MISS_PULL (the home/PS value + optimizer state, then cached), MISS_UNCACHED (the PS value, read without caching:
    no room), UPDATE_PULL (the cached copy refreshed from the PS, its pending updates re-applied); `push`: after the
    step the reader pushes its accumulated gradient to the PS (more than S pending, or uncached). `evict_*`: copies
    dropped before the step (LRU, to make room), `evict_push` where they held pending updates (pushed first)."""

    table: np.ndarray = field(default_factory=_i64)
    row: np.ndarray = field(default_factory=_i64)
    rank: np.ndarray = field(default_factory=_i64)
    action: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int8))
    push: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    evict_table: np.ndarray = field(default_factory=_i64)
    evict_row: np.ndarray = field(default_factory=_i64)
    evict_rank: np.ndarray = field(default_factory=_i64)
    evict_push: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))


@dataclass
class Plan:
    step: int
    num_ranks: int
    batch_per_rank: int
    sample_order: np.ndarray  # int64 [R*B]: a permutation of the global batch
    moves: RowMoves = field(default_factory=RowMoves)
    shared: SharedRows = field(default_factory=SharedRows)
    # rows moved/read by kind (e.g. hit, migrate, evict_home, forward, shared_value, shared_grad); policies that
    # only model traffic (het_bsp) report their own kinds (miss_pull, update_pull, update_push, evict_push)
    counters: dict[str, int] = field(default_factory=dict)
    # kinds whose transfers carry the optimizer state with the row (row moves); the others carry `dim` floats
    stateful_kinds: tuple[str, ...] = ("migrate", "evict_home", "forward", "miss_pull", "evict_push", "replica_sync")
    executable: bool = True  # False for counting-only policies the data plane cannot run
    reads: ReadVersions | None = None  # counting-only policies: version read by every (key, reader) pair
    replicas: ReplicaSync | None = None  # replica-based policies (fae, p2res): syncs and all-reduces of the step
    sched_seconds: float = 0.0  # wall time the policy spent planning this step (filled by the policy)
    cache: CacheStep | None = None  # HET's caches (het): reads, pulls, pushes and evictions of the step
    stale_reads: int = 0  # (key, reader) pairs the policy serves with an older value than the latest (het, S > 0)

    def assignment(self) -> np.ndarray:
        """rank of every global sample (inverse view of sample_order)."""
        ranks = np.empty(self.num_ranks * self.batch_per_rank, dtype=np.int64)
        ranks[self.sample_order] = np.repeat(np.arange(self.num_ranks, dtype=np.int64), self.batch_per_rank)
        return ranks

    def local_samples(self, rank: int) -> np.ndarray:
        b = self.batch_per_rank
        return self.sample_order[rank * b : (rank + 1) * b]

    def slice_destinations(self, rank: int) -> np.ndarray:
        """The rank each sample of `rank`'s slice (global samples rank*B .. rank*B + B - 1) trains on."""
        b = self.batch_per_rank
        return self.assignment()[rank * b : (rank + 1) * b]

    def read_pairs(self) -> int:
        """Distinct (key, reader) pairs of the step, from the counters (hit + transfers that serve a read)."""
        c = self.counters
        return int(
            c.get("hit", 0)
            + c.get("migrate", 0)
            + c.get("shared_value", 0)
            + c.get("miss_pull", 0)
            + c.get("update_pull", 0)
        )

    def transmitted_rows(self) -> int:
        return sum(v for k, v in self.counters.items() if k != "hit")

    def transmitted_bytes(self, dim: int, state_width: int, bytes_per_float: int = 4) -> int:
        """Payload bytes: moved rows carry dim + optimizer-state floats, values and gradients carry dim."""
        total = 0
        for k, v in self.counters.items():
            if k == "hit":
                continue
            width = dim + state_width if k in self.stateful_kinds else dim
            total += v * width * bytes_per_float
        return total

    def for_tables(self, lo: int, hi: int) -> "Plan":
        """The part of the plan on tables [lo, hi), their indices shifted to start at 0: what one sharded module of a
        model with several Herald-managed EBCs executes (the scheduler plans all of them in one table space). The
        sample order and the counters are the whole step's."""
        if self.cache is not None:
            raise ValueError("het plans run with one Herald-managed EmbeddingBagCollection (its caches are not split)")
        mv, sh = self.moves, self.shared
        m = (mv.table >= lo) & (mv.table < hi)
        moves = RowMoves(mv.table[m] - lo, mv.row[m], mv.src[m], mv.dst[m], mv.kind[m])
        k = (sh.table >= lo) & (sh.table < hi)
        counts = np.diff(sh.reader_offsets)
        keep = np.repeat(k, counts)
        shared = SharedRows(
            sh.table[k] - lo,
            sh.row[k],
            sh.owner[k],
            np.concatenate([[0], np.cumsum(counts[k])]).astype(np.int64),
            sh.readers[keep],
        )
        replicas = None if self.replicas is None else self.replicas.for_tables(lo, hi)
        return Plan(
            self.step,
            self.num_ranks,
            self.batch_per_rank,
            self.sample_order,
            moves,
            shared,
            dict(self.counters),
            self.stateful_kinds,
            self.executable,
            None,
            replicas,
            self.sched_seconds,
        )


@dataclass
class PlanPart(Plan):
    """The part of a step's `Plan` that one rank executes (`rank`), where a planner sends each rank only its part.

    Why: the whole plan grows with R (every move, every shared row's readers, every sample's rank), while a rank needs
    the rows it sends, receives or relays. A part holds the moves this rank sends or receives and those of the shared
    rows it holds (their owner before the moves sends the values), the shared rows it owns before or after the moves
    with all their readers, and the rows it reads with the readers its host's relay needs
    (distributed/step/plan_part.py says which); `sample_order` holds only this rank's B samples and `slice_ranks` where
    each sample of its own slice goes. The whole step's facts that decide which collectives run on every rank travel
    too: the tables with moves (`moved_tables`), with shared rows (`shared_tables`) and with a pair delivered through
    a host relay (`relayed_tables`), each sorted. Counters are the whole step's."""

    rank: int = -1
    slice_ranks: np.ndarray = field(default_factory=_i64)
    moved_tables: np.ndarray = field(default_factory=_i64)
    shared_tables: np.ndarray = field(default_factory=_i64)
    relayed_tables: np.ndarray = field(default_factory=_i64)

    def assignment(self) -> np.ndarray:
        raise ValueError(f"plan {self.step}: rank {self.rank}'s part of the plan does not hold every sample's rank")

    def local_samples(self, rank: int) -> np.ndarray:
        self._check_rank(rank)
        return self.sample_order

    def slice_destinations(self, rank: int) -> np.ndarray:
        self._check_rank(rank)
        return self.slice_ranks

    def _check_rank(self, rank: int) -> None:
        if rank != self.rank:
            raise ValueError(f"plan {self.step}: the part of rank {self.rank} was given to rank {rank}")

    def for_tables(self, lo: int, hi: int) -> "PlanPart":
        whole = Plan.for_tables(self, lo, hi)

        def within(t: np.ndarray) -> np.ndarray:
            return t[(t >= lo) & (t < hi)] - lo

        return PlanPart(
            **{f.name: getattr(whole, f.name) for f in dataclasses.fields(Plan)},
            rank=self.rank,
            slice_ranks=self.slice_ranks,
            moved_tables=within(self.moved_tables),
            shared_tables=within(self.shared_tables),
            relayed_tables=within(self.relayed_tables),
        )


@dataclass
class HostPlan(Plan):
    """The part of a step's `Plan` that one host's ranks execute, as a per-host planner (herald_hier in training,
    schedule/herald/hierarchy.py) assembles it from the other hosts' messages, without the whole plan.

    Why: the whole plan of a step grows with R; a host's ranks execute the rows they send, receive, own or read, and
    cutting their parts (distributed/step/plan_part.py) needs no more. A host plan holds the moves whose source or
    destination is on the host and those of the shared rows it holds; the shared rows one of its ranks owns, before or
    after the moves, with all their readers, and the rows its ranks only read with their readers on the host (a host
    relay's group: distributed/step/host_relay.py). Rows are in key order and readers in rank order, as in the whole
    plan, so the parts cut from it are the whole plan's, byte for byte. `sample_order` holds the host's ranks'
    samples (rank `ranks[0]`'s B first) and `slice_ranks` where each sample of their slices goes. The whole step's
    facts travel with it: the counters, and the tables with moves, with shared rows and with a (row, host) group a
    host relay serves under the host map `hosts` (the host of every rank; `relayed_pairs`' rule)."""

    host: int = 0
    ranks: np.ndarray = field(default_factory=_i64)
    hosts: np.ndarray = field(default_factory=_i64)
    slice_ranks: np.ndarray = field(default_factory=_i64)
    moved_tables: np.ndarray = field(default_factory=_i64)
    shared_tables: np.ndarray = field(default_factory=_i64)
    relayed_tables: np.ndarray = field(default_factory=_i64)

    def _at(self, rank: int) -> slice:
        i = int(rank) - int(self.ranks[0]) if self.ranks.shape[0] else -1
        if not 0 <= i < self.ranks.shape[0]:
            raise ValueError(f"plan {self.step}: host {self.host}'s plan holds ranks {self.ranks.tolist()}, not {rank}")
        b = self.batch_per_rank
        return slice(i * b, (i + 1) * b)

    def assignment(self) -> np.ndarray:
        raise ValueError(f"plan {self.step}: host {self.host}'s plan does not hold every sample's rank")

    def local_samples(self, rank: int) -> np.ndarray:
        return self.sample_order[self._at(rank)]

    def slice_destinations(self, rank: int) -> np.ndarray:
        return self.slice_ranks[self._at(rank)]

    def for_tables(self, lo: int, hi: int) -> "Plan":
        raise ValueError(f"plan {self.step}: a host plan is cut into its ranks' parts, which split by tables")


def relayed_pairs(
    pair_row: np.ndarray, readers: np.ndarray, before: np.ndarray, after: np.ndarray, host: np.ndarray
) -> np.ndarray:
    """Which (row, reader) pairs of a step's shared rows a host relay serves (distributed/step/host_relay.py): those
    of a (row, host) group with two readers that do not receive the row in the moves, on a host that is not both
    owners'. `pair_row`: each pair's row; `before` / `after`: every row's owner before and after the moves; `host`:
    the host of every rank. bool, per pair."""
    p_before, p_after = before[pair_row], after[pair_row]
    fill = (readers == p_after) & (p_before != p_after)
    r_host = host[readers]
    H = int(host.max()) + 1 if host.shape[0] else 1
    group = pair_row * H + r_host
    if group.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    if (group[1:] >= group[:-1]).all():  # each group's pairs together (hosts of consecutive ranks): runs
        run = np.cumsum(np.r_[True, group[1:] != group[:-1]]) - 1
        live = np.bincount(run[~fill], minlength=int(run[-1]) + 1)[run]
    elif int(group.max()) < 2**24:  # a count per (row, host)
        live = np.bincount(group[~fill], minlength=int(group.max()) + 1)[group]
    else:
        g, cnt = np.unique(group[~fill], return_counts=True)
        at = np.minimum(np.searchsorted(g, group), max(g.shape[0] - 1, 0))
        live = np.where(g[at] == group, cnt[at], 0) if g.shape[0] else np.zeros(group.shape[0], dtype=np.int64)
    return (live >= 2) & ((r_host != host[p_before]) | (r_host != host[p_after]))
