"""`herald`: vectorised LAIA + on-demand synchronisation on the exact ownership protocol (executable plans).

Cost model (docs/ARCHITECTURE.md §2): in a step, key k read by the rank set R_k with owner o costs
2 x |R_k \\ {o}| rows (value out, gradient back per remote reader), a migration 1 row (+ state), an eviction 1.
So traffic is driven by how many ranks read a key (co-location) and whether the owner is one of them.

Per step (batches[0] = current global batch, batches[1:] = up to L lookahead batches):
1. LAIA, on the *scheduled tables* only (adaptive selection, `schedule.tables`), each key k weighing w(c_k), with
   c_k the samples reading k in this batch and w(c) = ((R-1)/R)^(c-1) (a hot key is read everywhere anyway):
   a. the first pass (`first_pass`; `auto`: the stream from 8 ranks, bids below):
      stream: the samples in batch order, each to the open rank where the weight of its keys already there (owned,
      or read by a sample placed there before it) is largest (`laia.stream_assign`): samples that share a key
      gather;
      bids: score[s, r] = sum over the sample's keys owned by r of w(c_k); without refinement, `balanced_assign`
      turns it into exactly B samples per rank (regret-ordered rounds, deterministic); with refinement, each
      sample's preferred rank (unbalanced) is the starting point of
   b. `refine` rounds of balanced best response on the exact marginal cost: for sample s and rank r,
      score[s, r] = sum over its keys of 2 x [another sample reads k at r] + 2 x [r owns k and nobody else reads
      it there] (+ a bonus for staying put, against oscillation). Single-hot batches gather one per-key [R] row
      per table column (O(elements x R) in a few large numpy ops); jagged ones with many ranks expand reader lists.
      `refine` is chosen with the tables (`schedule.tables`) to fit the scheduling-time budget.
2. Reader sets under the final assignment (`schedule.reads`: one bitmap over (key, rank)).
3. Ownership: a key read by one rank moves there (MIGRATE); a shared key stays with its owner when the owner
   reads it, else moves to the reader with the most samples reading it (ties: lowest rank). With `owner_balance`
   (on with replicas), an owner whose rows sent + received in the step exceed that factor x the mean rank's hands its
   widest shared rows to their least loaded readers (`schedule.herald.balance`: a migration each). Arrivals beyond a
   rank's guest capacity evict guests not read in this step: first those not used in the lookahead window, then
   those used furthest ahead (Belady-like), least recently used first among equals. An evicted guest that the
   next batch reads is FORWARDed to the rank its sample is predicted to go to (the rank owning most of that
   sample's scheduled keys after this step) when that rank has room, else sent home (EVICT_HOME). Where a rank cannot
   make room, the least valuable arrivals are cancelled (the key is then read through the shared path). All moves of a
   step apply at once and capacity holds after them.
4. Every read key whose reader set is not exactly {owner} goes to `shared`.

Host-aware LAIA (`hosts`: the host of every rank; off when every rank is one host or its own host, so that the plans
are then exactly those without a host map). Ranks of one host share a fast link, hosts a slow one; with a = the cost
of a row moved inside a host over one crossing hosts (`intra_host_cost`), a shared key read by the rank set R_k and
host set H_k, owner o on host h(o), costs, when a host-aware data plane sends each value once per reading host and
sums the gradients inside a host, 2 a |R_k \\ {o}| + 2 (1 - a) |H_k \\ {h(o)}|: a times the rank-level cost above plus
(1 - a) times the same cost with hosts for ranks. Both LAIA passes score accordingly: score[s, r] = a x (the score
above at rank r) + (1 - a) x (the same score computed over hosts, at r's host), e.g. the first pass counts the keys
rank r owns with weight 1 and those other ranks of its host own with weight 1 - a. The numpy path runs it (the
compiled assign kernel scores ranks only; the rest of the plan is the same code either way).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from herald_torchrec.schedule import native, reads
from herald_torchrec.schedule.directory import OwnershipDirectory
from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.herald.balance import balance_owners, check_factor
from herald_torchrec.schedule.herald.budget import FULL, REDUCED, STATIC, LevelCounts, PlanBudget, check_plan_budget
from herald_torchrec.schedule.herald.eviction import EvictionPool, cancel_arrivals
from herald_torchrec.schedule.herald.laia import STREAM_READERS, balanced_assign, stream_assign
from herald_torchrec.schedule.herald.replicas import REPLICA_BUDGET, REPLICA_INTERVAL, REPLICA_ROW_MARGIN, ReplicaChoice
from herald_torchrec.schedule.herald.tables import (
    TableSelection,
    default_budget_ms,
    reduced_selection,
    select_tables,
)
from herald_torchrec.schedule.plan import (
    EVICT_HOME,
    FORWARD,
    MIGRATE,
    Plan,
    ReadVersions,
    ReplicaSync,
    RowMoves,
    SharedRows,
)
from herald_torchrec.schedule.policy import SchedulePolicy, order_from_assignment, shared_rows, split_gid
from herald_torchrec.schedule.reads import BatchKeys, StepReads, step_reads
from herald_torchrec.schedule.traffic import FAN_OUT, KindTransfers

# LAIA's first pass: "stream" (laia.stream_assign: samples gather where their keys are owned or already read),
# "bids" (laia.balanced_assign over owner scores alone), or "auto": the stream from STREAM_FROM_RANKS ranks, bids
# below, where the refine rounds the time model affords co-locate as well (the stream moved 0.4-0.9 % fewer rows at
# 2-4 ranks, 5-13 % at 8-64; docs/scheduler.md). Host-aware, the stream scores hosts too (laia.stream_assign).
FIRST_PASSES = ("auto", "stream", "bids")
STREAM_FROM_RANKS = 8


def check_first_pass(first_pass: object) -> None:
    if first_pass not in FIRST_PASSES:
        raise ValueError(f"herald: first_pass must be one of {', '.join(FIRST_PASSES)}, got {first_pass!r}")


def check_rounds(name: str, v: object) -> None:
    """`refine` / `max_refine`: None (the time model's choice) or an integer >= 0."""
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
        raise ValueError(f"herald: {name} must be an integer >= 0, got {v!r}")


INTRA_HOST_COST = 0.2  # default: a row moved inside a host costs a fifth of one crossing hosts (docs/scheduler.md)


def host_ids(hosts: int | Sequence[int] | None, num_ranks: int) -> np.ndarray:
    """The host of every rank as dense ids 0..H-1 in order of first appearance (int64 [R]): `hosts` is None (every
    rank one host: no host map), the ranks per host (ranks r .. r+H-1 share one; the last may hold fewer), or a host
    key per rank (any integers: equal keys, one host)."""
    R = num_ranks
    if hosts is None:
        return np.zeros(R, dtype=np.int64)
    if isinstance(hosts, (int, np.integer)) and not isinstance(hosts, bool):
        if hosts < 1:
            raise ValueError(f"herald: hosts (ranks per host) must be >= 1, got {hosts!r}")
        return np.arange(R, dtype=np.int64) // int(hosts)
    try:
        keys = np.asarray(list(hosts))
    except TypeError:
        keys = None
    if keys is None or keys.ndim != 1 or keys.shape[0] != R or (R and keys.dtype.kind not in "iu"):
        raise ValueError(
            f"herald: hosts must be None, the ranks per host (int >= 1) or one integer host key per rank "
            f"({R} ranks), got {hosts!r}"
        )
    _, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    rank_of_first = np.argsort(np.argsort(first))  # ids by first appearance, not by key value
    return rank_of_first[inv.reshape(-1)].astype(np.int64)


@dataclass
class _Scheduled:
    es: np.ndarray  # sample of every scheduled element
    ec: np.ndarray  # its key, as an index into the batch's sorted keys
    K: int  # number of keys of the batch
    cols: np.ndarray | None  # ec as [width, N] for single-hot batches (fixed width, sample-major; a view of ec)
    w0: np.ndarray  # first-pass LAIA weight of every element
    R: int  # ranks

    # only the numpy path reads these: made on first use
    @functools.cached_property
    def esR(self) -> np.ndarray:
        return self.es * self.R

    @functools.cached_property
    def ecR(self) -> np.ndarray:
        return self.ec * self.R


def scheduled_elements(
    bk: BatchKeys, scheduled: np.ndarray, geo: np.ndarray, R: int, sample_of_element=None
) -> _Scheduled:
    """A batch's elements in the `scheduled` tables (bool per table), each with its sample, its key (index into the
    batch's sorted keys: the unscheduled small tables add few keys, compacting would cost more) and its first-pass
    weight: geo[its key's batch count], capped at the batch's samples (multi-hot bags can read a key more often than
    there are samples: such keys weigh as much as one read by every sample). `sample_of_element(n, width)`: the
    samples of a single-hot batch's elements, if the caller keeps them. One compiled pass for single-hot batches."""
    N = bk.num_samples
    if bk.width is None:
        m = scheduled[bk.tab]
        es, ec = bk.smp[m], bk.cid[m]
        return _Scheduled(es, ec, bk.keys.shape[0], None, geo[np.minimum(bk.count, N)][ec], R)
    idx = np.flatnonzero(scheduled)  # single-hot: the scheduled columns of the [N, T] key ids, sample-major
    S = idx.shape[0]
    if native.enabled():
        es, ec, w0 = native.scheduled_elements(bk.cid, N, bk.width, idx, bk.count, geo, N)
    else:
        ec = bk.cid.reshape(-1, bk.width)[:, idx].ravel()
        es = sample_of_element(N, S) if sample_of_element else np.repeat(np.arange(N, dtype=np.int64), S)
        w0 = geo[np.minimum(bk.count, N)][ec]
    cols = ec.reshape(N, S).T if es.shape[0] else None  # [S, N]
    return _Scheduled(es, ec, bk.keys.shape[0], cols, w0, R)


def _round_scores(
    v: _Scheduled,
    N: int,
    group: np.ndarray,
    G: int,
    key_group: np.ndarray,
    owner_weight: float,
    wtype: type,
    out_dtype: type,
) -> tuple[np.ndarray, np.ndarray]:
    """A best-response round's marginal scores over G groups (ranks, or hosts), dense: for sample s and group g, the
    sum over its keys of 2 x [some sample reads k in g] + owner_weight x [g owns k and nobody reads it there]
    ([N, G]), and each sample's correction at its own group for the keys only it reads there ([N]). `group`: the
    current group of every element's sample; `key_group`: the group owning every key. Counts are group-major
    [G, K], so each group's row of per-key scores is one contiguous array to gather from."""
    es, ec, K = v.es, v.ec, v.K
    code = group * K + ec
    c = np.bincount(code, minlength=G * K)
    self_only = c[code] == 1  # the sample's own group: its keys that nobody else reads there
    corr = np.bincount(es, weights=self_only * ((key_group[ec] == group) * owner_weight - 2.0), minlength=N)
    W = (c > 0) * wtype(2)  # [G * K]: the score of key k in group g
    kio = key_group * K + np.arange(K)  # each key's owner cell
    W[kio] += (c[kio] == 0) * wtype(owner_weight)
    if v.cols is not None:  # per group, the sum over a sample's keys ([S, N] gathers, summed in order)
        sc = np.empty((N, G), dtype=out_dtype)
        for g in range(G):
            sc[:, g] = np.add.reduce(W[g * K : (g + 1) * K][v.cols], axis=0)
    else:
        sc = np.bincount(
            np.repeat(es * G, G) + np.tile(np.arange(G), es.shape[0]),
            weights=W.reshape(G, K).T[ec].ravel(),
            minlength=N * G,
        ).reshape(N, G)
    return sc, corr


class HeraldPolicy(SchedulePolicy):
    """Ours (see the module docstring).

    tables: "auto" (profile the first window and schedule the worthy tables), "all", or a list of table indices.
    refine: best-response rounds after the first LAIA pass; None = as many (up to `max_refine`) as the time model
        fits in the budget.
    budget_ms: scheduling-time budget per global batch for the automatic choices: "auto" = 5 ms up to 2048
        samples, linear beyond (5 ms at 8 x 256, 40 ms at 64 x 256); None = unlimited.
    forward: forward evicted guests to their predicted next reader.
    hosts: the host of every rank: ranks per host (int: ranks r .. r+H-1 share one) or a host id per rank; None (the
        default), one host for all ranks, or a host per rank leave LAIA rank-level (the plans without a host map).
    intra_host_cost: a row moved inside a host over one crossing hosts, in [0, 1] (module docstring); 0.2 by
        default, docs/scheduler.md says why.
    replicate: replicate the rows every rank reads (`schedule.herald.replicas`): off by default, so that the
        plans without it stay those of plain Herald; the data plane runs them (`HeraldOptions.replicates`).
    replica_budget: replicated rows per rank (every rank holds every replica); None = `REPLICA_BUDGET`.
    replica_interval: steps between two choices of the replicated set (the cost model's window of recent steps).
    replica_row_margin: the extra rows, as a share of its all-reduce, a replicated row may cost over the shared path.
    host_laia: with a host map, whether LAIA scores hosts (True) or ranks only, the host map then serving replication's
        cost model alone (host-aware LAIA moves more rows in all at R <= 32: docs/scheduler.md).
    owner_balance: hand shared rows from owners above this factor x the mean rank's rows in the step to their least
        loaded readers (`schedule.herald.balance`); "auto" (the default): `OWNER_BALANCE` (1.15); None: off. Measured
        on the synthetic default, 8 ranks per host: the busiest rank 1.93x -> 1.15x the mean at R=64, 1.23x -> 1.13x
        at R=16, for +0.02-0.05 % rows and 0.5 ms of planner CPU at R=64 (compiled); nothing changes at R=2
        (benchmarks/RESULTS.md).
    plan_budget_ms: the planning budget per plan (`schedule.herald.budget`): "auto" (the default) = the training
        step time the pipeline measures (`observe_step`; never triggers without it, nor on the 2-core reference
        runs), a number = that fixed budget in ms, None = off. A planner over it makes cheaper plans (fewer
        scheduled tables and no refine rounds, then static ones), counted in `describe()`; where several ranks plan
        (`set_planners`), every plan's level is the one they agree on (`agree_level`).
    The replica defaults are measured (schedule/herald/replicas.py, docs/scheduler.md): a row pays for replication
    only where hosts are given (without a host map nothing is replicated); the rows that pay are few (~250 of 337,694
    at R=64 on the synthetic default), so the budget of 4,096 rows per rank (2 MiB at dim 128) is never the limit.
    The choice is made on the first plan() (or by calling `profile(batches)`) and exposed by `tables`, `refine`
    and `selection`.
    """

    name = "herald"
    takes_hosts = True  # the training pipeline passes the host of every rank (`hosts`)

    def __init__(
        self,
        table_rows,
        num_ranks: int,
        batch_per_rank: int,
        cache_ratio: float = 0.1,
        lookahead: int = 4,
        *,
        tables: str | Sequence[int] = "auto",
        refine: int | None = None,
        max_refine: int = 2,
        budget_ms: float | str | None = "auto",
        forward: bool = True,
        stay_bonus: float = 2.0,
        owner_weight: float = 2.0,
        hosts: int | Sequence[int] | None = None,
        intra_host_cost: float = INTRA_HOST_COST,
        replicate: bool = False,
        replica_budget: int | None = None,
        replica_interval: int = REPLICA_INTERVAL,
        replica_row_margin: float = REPLICA_ROW_MARGIN,
        host_laia: bool = True,
        owner_balance: float | str | None = "auto",
        plan_budget_ms: float | str | None = "auto",
        first_pass: str = "auto",
    ) -> None:
        super().__init__(table_rows, num_ranks, batch_per_rank, cache_ratio, lookahead)
        check_first_pass(first_pass)
        if first_pass == "auto":
            first_pass = "stream" if self.num_ranks >= STREAM_FROM_RANKS else "bids"
        self.first_pass = first_pass  # the pass it runs: stream or bids
        check_rounds("refine", refine)
        check_rounds("max_refine", max_refine)
        if budget_ms == "auto":
            budget_ms = default_budget_ms(self.global_batch)
        elif budget_ms is not None and (isinstance(budget_ms, str) or not budget_ms > 0):
            raise ValueError(f"herald: budget_ms must be > 0, 'auto' or None, got {budget_ms!r}")
        self.directory = OwnershipDirectory(self.layout, self.num_ranks, self.cache_ratio)
        self.eviction = EvictionPool(
            self.directory.slots, self.directory.last_use
        )  # victims without a pass over full caches
        T = self.layout.num_tables
        self._refine_arg = refine
        self.refine = 0 if refine is None else int(refine)  # set by profile() when None
        self.max_refine = int(max_refine)
        self.forward = bool(forward)
        self.stay_bonus = float(stay_bonus)
        self.owner_weight = float(owner_weight)
        if isinstance(intra_host_cost, bool) or not isinstance(intra_host_cost, (int, float, np.floating)):
            raise ValueError(f"herald: intra_host_cost must be a number in [0, 1], got {intra_host_cost!r}")
        if not 0.0 <= float(intra_host_cost) <= 1.0:
            raise ValueError(f"herald: intra_host_cost must be in [0, 1], got {intra_host_cost!r}")
        self.intra_host_cost = float(intra_host_cost)
        self.host_of_rank = host_ids(hosts, self.num_ranks)
        self.num_hosts = int(self.host_of_rank.max()) + 1 if self.num_ranks else 0
        # host-aware only where it can change a score: more than one host, and some host with several ranks
        if not isinstance(host_laia, (bool, np.bool_)):
            raise ValueError(f"herald: host_laia must be True or False, got {host_laia!r}")
        hosts_matter = 1 < self.num_hosts < self.num_ranks
        self.host_aware = hosts_matter and bool(host_laia)
        # per-key score rows: small integers when the weights are (fewer bytes to gather), else float32
        whole = self.owner_weight.is_integer() and (2 + self.owner_weight) * self.layout.num_tables < 2**15
        self._wtype = np.int16 if whole else np.float32
        self.budget_ms = budget_ms
        self.selection: TableSelection | None = None
        self._fixed_tables: np.ndarray | None = None
        if isinstance(tables, str):
            if tables not in ("auto", "all"):
                raise ValueError(f"herald: tables must be 'auto', 'all' or a list of table indices, got {tables!r}")
            if tables == "all":
                self._fixed_tables = np.arange(T)
        else:
            idx = np.asarray(list(tables), dtype=np.int64)
            if idx.ndim != 1 or ((idx < 0) | (idx >= T)).any():
                raise ValueError(f"herald: table indices must be in [0, {T}), got {list(tables)}")
            self._fixed_tables = np.unique(idx)
        self._set_tables(self._fixed_tables if self._fixed_tables is not None else np.zeros(0, dtype=np.int64))
        n = self.layout.total_rows
        self.next_use = np.zeros(n, dtype=np.int16 if lookahead < 2**15 else np.int32)  # 1..L, 0 = not in window
        self._picked = np.zeros(n, dtype=bool)
        self._es_cache: dict[tuple[int, int], np.ndarray] = {}
        # the compiled kernels (schedule/native.py), fixed for the policy's life: the eviction pool's state must be
        # kept by one implementation
        self._native = (
            native.DirectoryArrays(self.directory, self.eviction, self.next_use, self._picked)
            if native.enabled()
            and native.DirectoryArrays.supported(self.directory, self.eviction, self.next_use, self._picked)
            else None
        )
        # w(c) for c = 0..N: weight of an owned key read by c samples of the batch
        c = np.arange(self.global_batch + 1, dtype=np.float64)
        self._geo = ((self.num_ranks - 1) / self.num_ranks) ** np.maximum(c - 1, 0)
        if not isinstance(replicate, (bool, np.bool_)):
            raise ValueError(f"herald: replicate must be True or False, got {replicate!r}")
        # rows replicated on every rank (None: plain Herald, the plans without replicas)
        self.replicas: ReplicaChoice | None = (
            ReplicaChoice(
                self.layout,
                self.num_ranks,
                REPLICA_BUDGET if replica_budget is None else replica_budget,
                replica_interval,
                self.host_of_rank if hosts_matter else None,
                self.intra_host_cost,
                replica_row_margin,
            )
            if replicate
            else None
        )
        self.owner_balance = check_factor(owner_balance)
        self.balanced = 0  # rows handed on by owner balancing, over the policy's life
        # the planning budget (schedule/herald/budget.py): cheaper plans while the planner is behind training
        self.budget = PlanBudget(plan_budget_ms)
        self._reduced: TableSelection | None = None  # the cheaper selection (made from `selection` when first needed)
        self._level = FULL  # the level of the plan being made

    # ---- table selection --------------------------------------------------------------------------------------
    def _set_tables(self, idx: np.ndarray) -> None:
        self.scheduled = np.zeros(self.layout.num_tables, dtype=bool)
        self.scheduled[idx] = True
        # batches cache per-selection views under this key (several policies may share a batch object)
        self._sel_key = ("herald_sched", self.scheduled.tobytes())

    @property
    def tables(self) -> list[int]:
        """Indices of the tables LAIA schedules (after profiling when tables='auto')."""
        return [int(t) for t in np.flatnonzero(self.scheduled)]

    def profile(self, batches: Sequence[GlobalBatch]) -> TableSelection:
        """Choose the scheduled tables and refine rounds from sample batches (done on the first plan())."""
        self.selection = select_tables(
            [self.keys_of(b) for b in batches],
            self.layout,
            self.num_ranks,
            self.batch_per_rank,
            budget_ms=self.budget_ms,
            refine=self._refine_arg,
            max_refine=self.max_refine,
            tables=self._fixed_tables,
        )
        self.adopt(self.selection)
        return self.selection

    def adopt(self, sel: TableSelection) -> None:
        """Plan with `sel`'s tables and refine rounds (`profile`'s choice, or one made elsewhere: herald_hier's host 0
        chooses for every host)."""
        self.selection = sel
        self._set_tables(sel.tables)
        self.refine = int(sel.refine)

    # ---- per batch --------------------------------------------------------------------------------------------
    def _sample_of_element(self, n: int, width: int) -> np.ndarray:
        """[0]*width + [1]*width + ... (n samples): the same for every single-hot batch, so made once (read-only)."""
        es = self._es_cache.get((n, width))
        if es is None:
            es = np.repeat(np.arange(n, dtype=np.int64), width)
            es.setflags(write=False)
            self._es_cache = {(n, width): es}  # one shape at a time: the selection or batch size rarely changes
        return es

    def _sched(self, b: GlobalBatch) -> "_Scheduled":
        """The batch's elements in the scheduled tables (`scheduled_elements`, cached per batch and selection)."""
        key = self._sel_key
        hit = b._cache.get(key)
        if hit is None:
            hit = scheduled_elements(
                self.keys_of(b), self.scheduled, self._geo, self.num_ranks, self._sample_of_element
            )
            b._cache[key] = hit
        return hit

    # ---- LAIA -------------------------------------------------------------------------------------------------
    def assign(self, b: GlobalBatch, bk: BatchKeys, own_k: np.ndarray) -> np.ndarray:
        """Rank of every sample. Works in rotated rank coordinates (column j = rank (first + j) % R, first =
        step % R) so that ties go to the first rank of the rotation without permuting score matrices."""
        R, B, N = self.num_ranks, self.batch_per_rank, b.num_samples
        first = self.step % R
        v = self._sched(b)
        es, ec, K = v.es, v.ec, v.K
        if es.shape[0] == 0:
            return np.repeat(np.arange(R, dtype=np.int64), B)
        own = (own_k - first) % R
        # dense per-key [R] rows summed per sample; jagged batches with many ranks expand reader lists instead
        dense = K * R <= reads.DENSE_LIMIT and (v.cols is not None or R <= 16)
        # the same arithmetic, compiled (schedule/native.py): its refine rounds use [K, R] tables, its first pass
        # does not (the numpy paths agree without refine rounds)
        stream = self.first_pass == "stream"
        if (dense or self.refine == 0) and native.enabled() and not self.host_aware:
            per_sample = 0 if v.cols is None else v.cols.shape[0]
            a = native.assign(
                N,
                R,
                B,
                K,
                es,
                ec,
                v.w0,
                per_sample,
                own,
                self.refine,
                self.owner_weight,
                self.stay_bonus,
                self._wtype is np.int16,
                STREAM_READERS if stream else 0,
            )
            return (a + first) % R
        eo = own[ec]
        if self.host_aware:
            H = self.num_hosts
            hcol = self.host_of_rank[(np.arange(R) + first) % R]  # the host of every (rotated) column
            host_own = self.host_of_rank[own_k]  # the host owning every key
        if stream:  # the refine rounds below start from its balanced assignment
            hosts = hcol if self.host_aware else None
            intra = self.intra_host_cost
            if native.enabled():  # the same pass, compiled
                a = native.assign(N, R, B, K, es, ec, v.w0, 0, own, 0, 0.0, 0.0, False, STREAM_READERS, hosts, intra)
            else:
                a = stream_assign(N, R, B, es, ec, v.w0, own, hosts=hosts, intra=intra)
        else:
            score = np.bincount(v.esR + eo, weights=v.w0, minlength=N * R).reshape(N, R)
            if self.host_aware:  # + the keys other ranks of the column's host own, weighted 1 - intra_host_cost
                by_host = np.bincount(es * H + host_own[ec], weights=v.w0, minlength=N * H).reshape(N, H)
                score = self._host_mix(score, by_host, hcol)
            if self.refine == 0:
                a = balanced_assign(score, B)
            else:  # each sample's preferred rank, unbalanced: the refine rounds start from these intents
                a = np.argmax(score, axis=1)
        for _ in range(self.refine):
            ea = a[es]
            if dense:
                sc, corr = _round_scores(v, N, ea, R, own, self.owner_weight, self._wtype, np.float32)
            else:
                # (key, rank) read counts, key-major [K, R]: the reader lists below expand from them
                code = v.ecR + ea
                c = np.bincount(code, minlength=K * R)
                # the sample's own rank: its keys that nobody else reads there
                self_only = c[code] == 1
                corr = np.bincount(es, weights=self_only * ((eo == ea) * self.owner_weight - 2.0), minlength=N)
                nz = np.flatnonzero(c)
                kk, rr = nz // R, nz % R
                lam = np.bincount(kk, minlength=K)
                start = np.cumsum(lam) - lam
                # for every element, every rank reading its key (keys read by every rank add a constant: skipped)
                el = np.flatnonzero(lam[ec] < R)
                rep = lam[ec[el]]
                tot = int(rep.sum())
                within = np.arange(tot, dtype=np.int64) - np.repeat(np.cumsum(rep) - rep, rep)
                idx = np.repeat(start[ec[el]], rep) + within
                sc = np.bincount(np.repeat(es[el] * R, rep) + rr[idx], minlength=N * R).astype(np.float64) * 2.0
                sc += np.bincount(es * R + eo, weights=(c[ec * R + eo] == 0) * self.owner_weight, minlength=N * R)
                sc = sc.reshape(N, R)
            if self.host_aware:
                sc[np.arange(N), a] += corr
                sc = self._host_mix(sc, self._host_round(v, a, hcol, host_own), hcol)
                sc[np.arange(N), a] += self.stay_bonus
            else:
                sc[np.arange(N), a] += corr + self.stay_bonus
            a = balanced_assign(sc, B)
        return (a + first) % R

    def _host_mix(self, by_rank: np.ndarray, by_host: np.ndarray, hcol: np.ndarray) -> np.ndarray:
        """a x the rank-level scores [N, R] + (1 - a) x the host-level ones [N, H] at each column's host."""
        a = self.intra_host_cost
        return a * by_rank.astype(np.float64) + (1.0 - a) * by_host[:, hcol]

    def _host_round(self, v: "_Scheduled", a: np.ndarray, hcol: np.ndarray, host_own: np.ndarray) -> np.ndarray:
        """A best-response round's marginal scores [N, H] with hosts for ranks (`_round_scores` over hosts), the
        sample's current host corrected for its own reads, as the rank-level round does."""
        H = self.num_hosts
        sc, corr = _round_scores(v, a.shape[0], hcol[a[v.es]], H, host_own, self.owner_weight, np.float64, np.float64)
        sc[np.arange(a.shape[0]), hcol[a]] += corr
        return sc

    @property
    def _forwards(self) -> bool:
        """Whether `_forward` can forward anything: a forwarded guest goes to a third rank, neither the one it leaves
        nor its home, so with two ranks no victim can be; the prediction (~0.1 ms per plan on the rank that plans)
        is then skipped. The plans are the same."""
        return self.forward and self.num_ranks > 2

    # ---- planning budget --------------------------------------------------------------------------------------
    @staticmethod
    def runs_with(
        plan_budget_ms: float | str | None = "auto", first_pass: str = "auto", refine: object = None, **_: object
    ) -> None:
        """The app's and the pipeline's check of the options, before any set-up (schedule.runnable_policy)."""
        check_plan_budget(plan_budget_ms)
        check_first_pass(first_pass)
        check_rounds("refine", refine)

    def observe_step(self, step_ms: float, wait_ms: float = 0.0) -> None:
        """A training step's wall time without its wait for input, and that wait, in ms (the pipeline calls it after
        every step; from the training thread, while plans are made in the input thread: plain float updates)."""
        self.budget.observe_step(step_ms, wait_ms)

    def set_planners(self, count: int) -> None:
        """How many ranks make plans (the input stage's `plan_on`): with several, each plan's level is the one they
        agree on (`agree_level`), since a decision read from each planner's own clock could make their plans differ
        (`schedule.herald.budget` says how)."""
        if int(count) < 1:
            raise ValueError(f"herald: set_planners needs at least one planner, got {count!r}")
        self.budget.planners = int(count)

    def record_cut(self, cpu_ms: float) -> None:
        """The input stage's CPU ms cutting and encoding the last plan's parts, counted into its level's cost."""
        self.budget.record_cut(cpu_ms)

    def level_word(self) -> int:
        """The level this planner's own measurements ask for: the word it publishes for `agree_level` (0 FULL,
        1 REDUCED, 2 STATIC)."""
        return self.budget.wanted()

    def agree_level(self, words: Sequence[int]) -> int:
        """Before each plan where several ranks plan: the level words every planner published (`level_word`) in the
        last round completed on every rank; the next plan is made at the level they agree on (returned)."""
        return self.budget.agree(words)

    def plan_levels(self) -> LevelCounts:
        """Plans made so far at each level of the budget (full, reduced, static)."""
        return self.budget.counts

    def _reduced_selection(self) -> TableSelection:
        if self._reduced is None:
            assert self.selection is not None  # the first plan profiles at FULL
            self._reduced = reduced_selection(self.selection, self.global_batch, self.num_ranks, self.layout.num_tables)
        return self._reduced

    # ---- step -------------------------------------------------------------------------------------------------
    def _plan(self, batches: list[GlobalBatch]) -> Plan:
        if self.selection is None:
            self.profile(batches)
            self._level = FULL
        if self._level != REDUCED:
            return self._plan_step(batches, static=self._level == STATIC)
        scheduled, sel_key, refine = self.scheduled, self._sel_key, self.refine
        self._set_tables(self._reduced_selection().tables)
        self.refine = 0
        try:
            return self._plan_step(batches, static=False)
        finally:
            self.scheduled, self._sel_key, self.refine = scheduled, sel_key, refine

    def _plan_step(self, batches: list[GlobalBatch], static: bool) -> Plan:
        """One plan (module docstring); `static`: owners as they are and every sample on its own rank (no LAIA, no
        migration, no owner balancing: `schedule.herald.budget`'s STATIC level)."""
        b = batches[0]
        R, B = self.num_ranks, self.batch_per_rank
        d = self.directory
        bk = self.keys_of(b)
        own_k = d.owner[bk.keys].astype(np.int64)
        sample_rank = np.repeat(np.arange(R, dtype=np.int64), B) if static else self.assign(b, bk, own_k)
        rd = step_reads(bk, sample_rank, R)
        keys = rd.keys
        own = own_k
        home = d.home[keys].astype(np.int64)
        pk, pr = rd.pair_key, rd.pair_rank
        if static:  # every row stays with its owner: a read by another rank is a shared read
            want, single, sole = own.copy(), rd.count == 1, pr[rd.start]
        elif self._native is not None:  # the same decision, compiled (want: int64, which make_room updates in place)
            want, single, sole = native.decide(
                own,
                rd.count,
                rd.start,
                pr,
                bk.cid,
                bk.width,
                None if bk.width is not None else bk.smp,
                sample_rank,
                R,
                reads.DENSE_LIMIT,
            )
        else:
            want, single, sole = self._decide(bk, rd, own, sample_rank)
        # lookahead window: next use (1..L) of every key read in it
        nu = self.next_use
        window = [self.keys_of(x) for x in batches[1:]]
        for j in range(len(window), 0, -1):
            nu[window[j - 1].keys] = j
        d.last_use[keys] = self.step  # also pins this step's keys: they are never eviction victims
        joining = self._replica_step(keys, rd, own, want, window) if self.replicas is not None else None
        if self.owner_balance is not None and not static:
            skip = None if self.replicas is None else self.replicas.member[keys]
            self.balanced += balance_owners(want, own, rd.count, rd.start, pk, pr, skip, R, self.owner_balance)
        if self._native is not None:
            victims, room = self._native.make_room(keys, own, home, want, single, self.step, self.lookahead + 1)
        else:
            victims, room = self._make_room(keys, own, home, want, single, nu)
        v_src = d.owner[victims].astype(np.int64)
        v_dst = d.home[victims].astype(np.int64)
        v_kind = np.full(victims.shape[0], EVICT_HOME, dtype=np.int8)
        if self._forwards and victims.shape[0]:
            self._forward(victims, v_src, v_dst, v_kind, nu, window, keys, own, want, room)
        for w in window:
            nu[w.keys] = 0
        if self._native is not None:
            plan = self._assemble_native(sample_rank, rd, own, want, single, sole, victims, v_src, v_dst, v_kind)
            return plan if joining is None else self._with_replicas(plan, rd, want, joining)
        # ---- moves -------------------------------------------------------------------------------------------
        mig = np.flatnonzero(want != own)
        mv_gid = np.concatenate([keys[mig], victims])
        mv_src = np.concatenate([own[mig], v_src])
        mv_dst = np.concatenate([want[mig], v_dst])
        mv_kind = np.concatenate([np.full(mig.shape[0], MIGRATE, dtype=np.int8), v_kind])
        # ---- shared ------------------------------------------------------------------------------------------
        exclusive = single & (sole == want)
        moved = want != own
        pair_owner = want[pk]
        hit = int(((pair_owner == pr) & ~moved[pk]).sum())
        remote = int((pair_owner != pr).sum())
        ids, offs, readers = rd.readers_csr(~exclusive)
        shared = shared_rows(self.layout, d.table, keys[ids], want[ids], offs, readers)
        # ---- apply -------------------------------------------------------------------------------------------
        self.eviction.arrived(d.apply_moves(mv_gid, mv_dst))
        o = np.argsort(mv_gid, kind="stable")
        t, row = split_gid(self.layout, d.table, mv_gid[o])
        moves = RowMoves(table=t, row=row, src=mv_src[o], dst=mv_dst[o], kind=mv_kind[o])
        counters = {
            "hit": hit,
            "migrate": int(mig.shape[0]),
            "evict_home": int((v_kind == EVICT_HOME).sum()),
            "forward": int((v_kind == FORWARD).sum()),
            "shared_value": remote,
            "shared_grad": remote,
        }
        plan = Plan(
            step=self.step,
            num_ranks=R,
            batch_per_rank=B,
            sample_order=order_from_assignment(sample_rank, R),
            moves=moves,
            shared=shared,
            counters=counters,
        )
        return plan if joining is None else self._with_replicas(plan, rd, want, joining)

    # ---- replicas ----------------------------------------------------------------------------------------------
    def _replica_step(self, keys, rd: StepReads, own, want, window: list[BatchKeys]) -> np.ndarray:
        """The replicas' part of the step before the moves: the window learns the step's reads, the set is chosen
        again when due, replicated rows stay with their owner (`want`) and are pinned against eviction. Returns the
        rows joining the set in this step."""
        rep = self.replicas
        rep.observe(keys, rd.pair_key, rd.pair_rank, own)
        joining = np.zeros(0, dtype=np.int64)
        if rep.due(self.step):
            joining = rep.choose([(w.keys, w.count) for w in window])
        rk = rep.member[keys]
        want[rk] = own[rk]
        self.directory.last_use[rep.rows] = self.step
        return joining

    def _with_replicas(self, plan: Plan, rd: StepReads, want: np.ndarray, joining: np.ndarray) -> Plan:
        """The plan with the replicated rows read from every reader's replica: out of `shared`, their remote
        reads become hits, their gradients all-reduced; the set declared when rows join it (their values from their
        owner), the version of every read reported for the checker."""
        rep, R, d = self.replicas, self.num_ranks, self.directory
        keys, pk, pr = rd.keys, rd.pair_key, rd.pair_rank
        rk = rep.member[keys]
        prk = rk[pk]
        moved_remote = int((prk & (want[pk] != pr)).sum())
        c = plan.counters
        c["hit"] += moved_remote
        c["shared_value"] -= moved_remote
        c["shared_grad"] -= moved_remote
        ar = keys[rk]
        c["allreduce"] = 2 * (R - 1) * int(ar.shape[0])
        c["replica_sync"] = (R - 1) * int(joining.shape[0])
        sh = plan.shared
        keep = ~rep.member[self.layout.offsets[sh.table] + sh.row]
        if not keep.all():
            counts = np.diff(sh.reader_offsets)
            plan.shared = SharedRows(
                table=sh.table[keep],
                row=sh.row[keep],
                owner=sh.owner[keep],
                reader_offsets=np.concatenate([[0], np.cumsum(counts[keep])]).astype(np.int64),
                readers=sh.readers[np.repeat(keep, counts)],
            )
        sync = ReplicaSync()
        sync.allreduce_table, sync.allreduce_row = split_gid(self.layout, d.table, ar)
        if joining.shape[0]:  # the whole new set: the data plane rebuilds its replicas from the owners' copies
            sync.replicated_table, sync.replicated_row = split_gid(self.layout, d.table, rep.rows)
        plan.replicas = sync  # the data plane's replica region runs it (distributed/step/replicas.py)
        pg = keys[pk]
        t, row = split_gid(self.layout, d.table, pg)
        plan.reads = ReadVersions(table=t, row=row, rank=pr.copy(), version=rep.version[pg], replica=prk)
        rep.version[keys] += 1
        self.last_transfers = {}
        if joining.shape[0]:  # each joining row from its owner to every other rank, with its optimizer state
            src = np.repeat(d.owner[joining].astype(np.int64), R)
            dst = np.tile(np.arange(R, dtype=np.int64), joining.shape[0])
            other = src != dst
            jt = d.table[joining].astype(np.int64)
            self.last_transfers["replica_sync"] = KindTransfers(
                np.repeat(joining, R)[other], src[other], dst[other], FAN_OUT, np.repeat(jt, R)[other]
            )
        return plan

    def _decide(self, bk: BatchKeys, rd, own: np.ndarray, sample_rank: np.ndarray):
        """(want, single, sole) per read key: the owner it should have after the step (module docstring, 3.),
        whether one rank reads it, and its first reader."""
        R, K = self.num_ranks, rd.keys.shape[0]
        pk, pr = rd.pair_key, rd.pair_rank
        owner_reads = np.zeros(K, dtype=bool)
        owner_reads[pk[own[pk] == pr]] = True
        single = rd.count == 1
        sole = pr[rd.start]  # the reader of single-reader keys (first reader otherwise)
        want = own.copy()
        m_single = single & ~owner_reads
        want[m_single] = sole[m_single]
        far = ~single & ~owner_reads
        if far.any():  # shared key whose owner does not read it: move to the reader with most samples
            el = far[bk.cid]
            F = int(far.sum())
            if F * R <= reads.DENSE_LIMIT:
                fidx = np.cumsum(far) - 1
                er = bk.element_ranks(sample_rank)[el]
                cnt = np.bincount(fidx[bk.cid[el]] * R + er, minlength=F * R).reshape(F, R)
                want[far] = np.argmax(cnt, axis=1)  # ties: lowest rank
            else:  # no [F, R] table: count per (key, reader) pair (pair codes are sorted), first maximum per key
                pair_code = pk * R + pr
                at = np.searchsorted(pair_code, bk.cid[el] * R + bk.element_ranks(sample_rank)[el])
                cp = np.bincount(at, minlength=pk.shape[0])
                fk = np.flatnonzero(far)
                best = np.maximum.reduceat(cp, rd.start[fk])  # far keys have >= 2 readers: no empty segment
                kmax = np.zeros(K, dtype=np.int64)
                kmax[fk] = best
                top = np.flatnonzero(far[pk] & (cp == kmax[pk]))
                first = top[np.concatenate([[True], pk[top][1:] != pk[top][:-1]])]  # lowest rank per key
                want[pk[first]] = pr[first]
        return want, single, sole

    def _assemble_native(self, sample_rank, rd, own, want, single, sole, victims, v_src, v_dst, v_kind) -> Plan:
        """The moves, the shared rows and the counters of the plan (the numpy tail of `_plan`, compiled), and the
        moves applied to the directory."""
        R, B, d = self.num_ranks, self.batch_per_rank, self.directory
        a = native.assemble(
            rd.keys,
            own,
            want,
            single,
            sole,
            rd.count,
            rd.start,
            rd.pair_rank,
            victims,
            v_src,
            v_dst,
            v_kind,
            MIGRATE,
            d.table,
            self.layout.offsets,
        )
        self._native.apply_moves(a["apply_gid"], a["apply_dst"])
        moves = RowMoves(table=a["table"], row=a["row"], src=a["src"], dst=a["dst"], kind=a["kind"])
        shared = SharedRows(
            table=a["sh_table"],
            row=a["sh_row"],
            owner=a["sh_owner"],
            reader_offsets=a["sh_offsets"],
            readers=a["sh_readers"],
        )
        counters = {
            "hit": a["hit"],
            "migrate": int(a["apply_gid"].shape[0] - victims.shape[0]),
            "evict_home": int((v_kind == EVICT_HOME).sum()),
            "forward": int((v_kind == FORWARD).sum()),
            "shared_value": a["remote"],
            "shared_grad": a["remote"],
        }
        return Plan(
            step=self.step,
            num_ranks=R,
            batch_per_rank=B,
            sample_order=order_from_assignment(sample_rank, R),
            moves=moves,
            shared=shared,
            counters=counters,
        )

    # ---- capacity -----------------------------------------------------------------------------------------------
    def _make_room(self, keys, own, home, want, single, nu) -> tuple[np.ndarray, np.ndarray]:
        """Pick eviction victims so that every guest group fits after the step's moves; cancels (in `want`) the
        least valuable arrivals of groups that cannot make room. Returns the victims (global rows) and the room
        left in every group after all moves (a lower bound)."""
        d = self.directory
        R, T = self.num_ranks, self.layout.num_tables
        G = R * T
        tk = d.table[keys].astype(np.int64)
        last, step, L1 = d.last_use, self.step, self.lookahead + 1
        chosen = np.zeros(0, dtype=np.int64)
        freed = np.zeros(G, dtype=np.int64)
        picked = self._picked
        victim_rounds = 2

        def prio(pos: np.ndarray) -> np.ndarray:
            g = d.slots.slot[pos]
            lu = last[g].astype(np.int64)
            n = nu[g].astype(np.int64)
            p = np.where(n > 0, L1 - n, 0) * (step + 2) + lu + 1
            return np.where((lu == step) | picked[g], -1, p)  # read this step or already picked: stays

        # Cancelling an arrival whose row is a guest elsewhere also cancels that departure, which its group may
        # have counted on: each round settles one link of such chains (cancelling rows that come from home first,
        # which breaks them). Every round cancels at least one arrival, so this ends.
        for it in range(keys.shape[0] + 2):
            mv = np.flatnonzero(want != own)
            arr = mv[want[mv] != home[mv]]
            dep = mv[own[mv] != home[mv]]
            arr_g = want[arr] * T + tk[arr]
            deficit = (
                d.slots.fill
                - np.bincount(own[dep] * T + tk[dep], minlength=G)
                + np.bincount(arr_g, minlength=G)
                - freed
                - d.slots.cap
            )
            gneed = np.flatnonzero(deficit > 0)
            if gneed.shape[0] == 0:
                break
            left = deficit
            if it < victim_rounds:
                vpos = self.eviction.pick(gneed, deficit[gneed], prio)  # prio > last use: the pool's floor
                v = d.slots.slot[vpos]
                if v.shape[0]:
                    picked[v] = True
                    chosen = np.concatenate([chosen, v])
                    vg = d.owner[v].astype(np.int64) * T + d.table[v].astype(np.int64)
                    vcount = np.bincount(vg, minlength=G)
                    freed += vcount
                    left = deficit - vcount
                    if (left <= 0).all():  # the victims made room everywhere: nothing to cancel
                        deficit = left
                        break
            cancel_arrivals(arr, arr_g, left, keys, single, lambda k: nu[k] > 0, own, home, want)
        else:  # pragma: no cover - every round cancels an arrival
            raise RuntimeError("herald: capacity resolution did not converge")
        picked[chosen] = False
        return np.sort(chosen), -deficit  # victims, room left per group after all moves

    def _forward(self, victims, v_src, v_dst, v_kind, nu, window, keys, own, want, room) -> None:
        """Send evicted guests that the next batch reads to the rank their sample is predicted to go to
        (the rank owning most of that sample's scheduled keys after this step's moves), where it has room."""
        d = self.directory
        R, T = self.num_ranks, self.layout.num_tables
        vn = nu[victims]
        cand = np.flatnonzero(vn == 1)  # read by the next batch: the best-known next reader
        if cand.shape[0] == 0:
            return
        # only worth predicting where some other rank has room in the victim's table
        tab_room = (room.reshape(R, T) > 0).any(axis=0)
        cand = cand[tab_room[d.table[victims[cand]]]]
        if cand.shape[0] == 0:
            return
        pred = np.full(cand.shape[0], -1, dtype=np.int64)
        d.owner[keys] = want  # owners after this step's migrations (restored below)
        try:
            for j in sorted({int(x) for x in vn[cand]}):
                at = np.flatnonzero(vn[cand] == j)
                wk, wb = window[j - 1], self._window_batches[j - 1]
                samples = wk.first_sample[np.searchsorted(wk.keys, victims[cand[at]])]
                v = self._sched(wb)
                if v.cols is not None:
                    rows = np.repeat(np.arange(at.shape[0]), v.cols.shape[0])
                    eg = wk.keys[v.cols[:, samples].T.ravel()]
                else:
                    m = np.isin(v.es, samples)
                    us = np.unique(samples)
                    rows = np.searchsorted(us, v.es[m])
                    eg = wk.keys[v.ec[m]]
                    samples = np.searchsorted(us, samples)
                n = int(rows.max()) + 1 if rows.shape[0] else 1
                votes = np.bincount(rows * R + d.owner[eg], minlength=n * R).reshape(n, R)
                if v.cols is None:
                    votes = votes[samples]
                best = np.argmax(votes, axis=1)
                best[votes.max(axis=1) == 0] = -1
                pred[at] = best
        finally:
            d.owner[keys] = own
        # the next reader is this rank (unknown) or home (a plain eviction): nothing to forward
        ok = (pred >= 0) & (pred != v_src[cand]) & (pred != v_dst[cand])
        cand, pred = cand[ok], pred[ok]
        if cand.shape[0] == 0:
            return
        g = pred * T + d.table[victims[cand]].astype(np.int64)
        o = np.lexsort((victims[cand], g))
        cand, pred, g = cand[o], pred[o], g[o]
        first = np.searchsorted(g, g, side="left")
        take = (np.arange(g.shape[0]) - first) < room[g]
        v_dst[cand[take]] = pred[take]
        v_kind[cand[take]] = FORWARD

    def plan(self, batches):  # keep the window's batch objects for _forward
        bl = [batches] if isinstance(batches, GlobalBatch) else list(batches)
        self._window_batches = bl[1 : self.lookahead + 1]
        self._level = self.budget.choose()
        cpu = time.thread_time()
        plan = super().plan(bl)
        self.budget.record(self._level, (time.thread_time() - cpu) * 1e3)
        return plan

    def describe(self) -> dict:
        out = super().describe()
        out.update(
            {
                "tables": self.tables,
                "refine": self.refine,
                "forward": self.forward,
                "budget_ms": self.budget_ms,
                "hosts": self.num_hosts,
                "host_aware": self.host_aware,
                "intra_host_cost": self.intra_host_cost,
                "owner_balance": self.owner_balance,
                "owner_balanced": self.balanced,
                **self.budget.describe(),
                "guests": self.directory.occupancy(),
            }
        )
        if self.replicas is not None:
            out.update(self.replicas.describe())
        if self.selection is not None:
            out["selection"] = self.selection.describe()
        return out
