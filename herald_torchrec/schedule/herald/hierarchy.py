"""`herald_hier`: Herald planned by one planner per host, for its own samples and ranks, with explicit messages.

Why: the flat planner (`planner.py`) plans the whole global batch; its time and the bytes around it (every rank's
ids to every host's planner, the whole plan to every rank) grow with R. Here every host plans an R = P problem
(P = ranks per host) on its own samples, and hosts exchange only what concerns the rows they read.

Hosts are consecutive groups of P ranks (the host map of `traffic.host_of`; in training, the machines the pipeline
reports, else `ranks_per_host`). Host h's samples are those its ranks loaded: global samples [h P B, (h+1) P B); by
default they never leave the host (2b below swaps some). Every row has one owner rank; the row's *directory host*
(the host of its ROW_WISE home rank, shifted by its table's index: `directory_host_of`, known to everyone from the
key; with one table, the home rank's host) keeps its directory entry (owner rank) and decides where it goes next.
The shift spreads the small tables, whose rows are all homed on the first ranks, over the hosts: at R=256 the first
host homed 4.3x the median host's shared pairs. Each host keeps the guest slots of its own ranks. Per step:

1. demand   (h -> directory host A): the distinct keys h's samples read in the current batch, A's keys.
2. owners   (A -> h): the current owner rank of every demanded key (aligned with the demand).
2b. (move_samples="swap" only; off by default) samples swap hosts towards their rows (`sample_swap.py`).
3. LAIA on host h: `planner`'s assignment (first pass + refine rounds, the compiled kernel where it runs) over h's P
   ranks and P B samples; keys owned outside the host score at no rank (owner -1). Then h's readers per key. With
   several hosts the hosts plan in parallel, so each gets the wall budget of the whole global batch
   (`default_budget_ms(R B)`) and one best-response round (HOST_MAX_REFINE): herald's own time model at the host's
   size fits none in 5 ms, and without it herald_hier moved 6-8 % more rows than herald at R=16-32 (1.7 % / 0.3 %
   more with it, 0.5 ms more per host; max_refine=2 moves 2-4 % fewer than herald for another ~0.5 ms).
4. reads    (h -> A): every (key, reader rank) pair of h with its element count (the index of the key in the demand).
5. decide   (at A, for its keys, on the union of the reads): herald's rule (`HeraldPolicy._decide`): the owner
   keeps a key it reads; a key with one reader migrates there; else to the reader with the most elements (ties:
   lowest rank). Then owner balancing (`owner_balance`) of the load A's own keys make, against their mean rank's:
   rows that no rank could take under the threshold go to A's own share of the ranks (= A mod H), disjoint between
   directory hosts (schedule/herald/balance.py). No replicas. Each directory host decides its keys in one vectorised
   pass over the reads it received, sorted by key then rank.
6. arrivals (A -> t): every decided move into a rank of host t (key, destination, source); pins (A -> t): the keys
   held as guests on t's ranks and read in the step only by other hosts (t must not evict them; t knows its own).
7. capacity (at t, for its ranks' guest groups only): room for the arrivals: victims (its guests not read in the
   step; those its own samples' lookahead window reads evicted last, least recently used first), else cancelled
   arrivals (herald's order). Departures to other hosts are not counted as room, so a cancellation never takes room
   another host counted on: each host decides alone. Victims go home (EVICT_HOME; no FORWARD).
   cancels (t -> A): the cancelled arrivals; evictions (t -> the victim's directory host): the rows sent home.
8. decisions (A -> h): the final owner rank of every demanded key; departures (A -> the source host of a move):
   the rows leaving it; shares (A -> the final owner's host): every shared key's reader ranks.
   On the wire (`HostPlanner.routed`) each host gets the entries its own ranks execute (`HostPlan`, schedule/plan.py):
   a migration goes to its two ends' hosts and to every host that gets its row as shared; a shared row with all its
   readers to its owners' hosts (before and after the moves), and to every other host with its readers there; a
   victim to its owner's host, its home host and its directory host; every host gets every host's step summary (its
   counts, and its tables with moves, shared rows and relayed (row, host) groups: a few bytes per table). Each host
   assembles its `HostPlan` from them and applies to its replica the moves of its directory's rows and of its ranks'
   guests, the only state it reads (its directory role's owners, its capacity phase's guests).
In one process (`plan`: the simulator, the tests) the policy also returns the whole `Plan`, the union of the hosts'
parts, so the checker, the traffic accounting and the data plane run it unchanged.

Bytes (`MessageBytes`; only messages between two different hosts are counted, a host's own are free): a key is
KEY_BYTES = 8, a rank RANK_BYTES = 2, a count COUNT_BYTES = 2, an index into an earlier message INDEX_BYTES = 4.
demand KEY; owners RANK; reads INDEX + RANK + COUNT per pair; arrivals KEY + 2 RANK; cancels INDEX; evictions KEY;
decisions RANK per demanded key; departures KEY + RANK; shares KEY + COUNT + RANK per reader; pins KEY; offers,
swaps and
samples as in 2b. A rank's plan part
(what it would need of the plan): SAMPLE_BYTES = 4 per sample it trains (its order), KEY + RANK + 1 per move it sends
or receives, KEY + COUNT + RANK per other reader for a shared key it owns, KEY + RANK for one it reads remotely. Its
ids: ID_BYTES = 8 per id, sent to its own host's planner only.

Worked example (tests/schedule/test_hierarchy.py): R = 4 as 2 hosts of 2 ranks, B = 1, one table of 8 rows (home
rank = row // 2: host 0 is home to rows 0-3, host 1 to rows 4-7), the samples read rows [0, 4, 4, 6]. Host 0
(samples 0, 1) demands row 4 from host 1 (8 B; row 0 is its own); host 1 answers owner rank 2 (2 B). LAIA: sample
0 to rank 0 (owns row 0), sample 1 to rank 1; host 1: sample 2 to rank 2 (owns row 4), sample 3 to rank 3. Host 0
reports the pair (row 4, rank 1) (8 B). Host 1 decides: row 4 stays with rank 2, which reads it (shared with rank
1); row 6 and row 0 are hits. Decisions: row 4's owner to host 0 (2 B). Total 20 B between hosts. Plan parts: rank 0
4 B, rank 1 4 + 10 B, rank 2 4 + 12 B, rank 3 4 B.

Code: `HostPlanner(policy, h, window)` (host_planner.py) is what host h runs (its phases, from its own samples'
window and what it receives); `Transport` (host_messages.py, with the byte counts above) carries each phase's
messages between hosts (`exchange`: host -> host arrays).
`HeraldHierPolicy.plan` drives every host in one process through `InProcessTransport` (the simulator, the tests);
`plan_host(h, window, transport)` runs host h alone, in its own process with its own replica of the shared state, as
the training pipeline does (distributed/train_pipeline/planner_transport.py), and returns h's `HostPlan`. Both run
the same per-host code (each host assembles its own plan and updates its replica in both), and every rank's part
cut from a host's plan equals the one cut from the whole plan (tests/schedule/test_hierarchy.py).
`HierStep.wire_bytes` counts what the transport really sends: every message in schedule/message_wire.py's form
(`planner_wire`: raw arrays, the default, or compact: each array in the form of fewest bytes for its values, sorted
keys as varint gaps, ranks and counts in the bits their range needs; the in-process transport encodes, counts and
decodes every message between hosts, so every simulated plan goes through that form). `message_bytes` is the
protocol's count above, every field at a fixed width: at R=256 the compact wire carries about 0.4x of it, and ids +
messages + part per rank grow 1.20x from R=8 with it, 1.72x raw (RESULTS.md).

Planning time is measured per host (`HierStep.host_seconds`: its phases 1-4, 7, its part of 8 and its own plan with
its replica's update, `host_plan_seconds`) and per directory host (`directory_seconds`: 2, 5, 6, 8 for its keys,
the routing of its part included); the union of the parts into one Plan (`union_seconds`) is work no host does in
training.

Memory: each process holds arrays over every row (owner, home, table, last use and slot position: 0.6 GB on full
Criteo Kaggle tables), of which host h reads and updates only its home rows' owners and its own ranks' guests
(`benchmarks/hier_memory.py` computes what that needs). A per-host store would keep those alone: the home rows
remapped per table, the guests behind a key -> slot map.

The planning budget (`plan_budget_ms`, schedule/herald/budget.py) holds per host too: every host's planner plans
each global batch at the level they agree on from each other's words (FULL; REDUCED: the per-host selection's better
half of the tables, no refine round; STATIC: every sample on its own rank, no move), so that a planner that falls
behind training makes cheaper plans instead of making training wait.

With one host (R <= P) there is no message to send and the per-host problem is the whole problem: the policy is
plain `herald` (same plans, same digest), owner balancing and forwarding included. With several hosts it differs
from herald by design: samples stay on their host (unless swapped), decisions are taken per row on the union of
reads (as herald's), owners are balanced per directory host (each sees only its own keys' load), there is no
forwarding (under 1 eviction per step at R >= 16 in the simulator's default: FORWARD would save at most that), and
each host's eviction order knows only its own lookahead. Without owner balancing the busiest rank moved 1.9x the
mean rank's rows at R=64 and 4.1x at R=256 (the heads of every table homed on rank 0); with it 1.09x and 1.24x.
In training (`scheduler=herald_hier`, `plan_on="host"`, one planner per machine) each machine's planning rank gathers
its own machine's ids only and runs `plan_host` for its machine, the messages going through a gloo group of the
planners (distributed/train_pipeline/planner_transport.py); each planner gets its machine's `HostPlan` and cuts each
of its ranks its own part of it (distributed/step/plan_part.py). No process holds the whole plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from herald_torchrec.schedule import native
from herald_torchrec.schedule.directory import OwnershipDirectory
from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.herald import host_plans
from herald_torchrec.schedule.herald.balance import balance_owners, check_factor
from herald_torchrec.schedule.herald.budget import FULL, REDUCED, STATIC, LevelCounts, PlanBudget
from herald_torchrec.schedule.herald.eviction import EvictionPool, cancel_arrivals
from herald_torchrec.schedule.herald.host_messages import (
    DEFAULT_PLANNER_WIRE,
    MESSAGE_KINDS,
    InProcessTransport,
    MessageBytes,
    Transport,
    check_planner_wire,
    ids_bytes,
    plan_part_bytes,
)
from herald_torchrec.schedule.herald.host_planner import HostPlanner
from herald_torchrec.schedule.herald.laia import STREAM_READERS, balanced_assign, stream_assign
from herald_torchrec.schedule.herald.planner import (
    HeraldPolicy,
    _round_scores,
    _Scheduled,
    host_ids,
    scheduled_elements,
)
from herald_torchrec.schedule.herald.sample_swap import swap_samples
from herald_torchrec.schedule.herald.tables import TableSelection, default_budget_ms
from herald_torchrec.schedule.message_wire import encode_message
from herald_torchrec.schedule.plan import HostPlan, Plan
from herald_torchrec.schedule.policy import SchedulePolicy
from herald_torchrec.schedule.reads import BatchKeys, in_sorted

RANKS_PER_HOST = 8
SAMPLE_GAIN = 1.0  # a sample offers to move when another host owns this much more of its first-pass LAIA weight
MOVE_SAMPLES = ("off", "swap")
HOST_MAX_REFINE = 1  # best-response rounds per host with several hosts (module docstring says why)
# what HierStep's seconds are measured with: wall time, or CPU time (time.process_time, the simulator's
# --hier-clock cpu), which other jobs on a shared machine disturb less
CLOCK = time.perf_counter


@dataclass
class HierStep:
    """What one step of the hierarchical planner cost: seconds per host and per directory host, bytes of every
    message kind between hosts (totals over all host pairs), bytes each host sent + received, and per rank its ids
    and its plan part (module docstring)."""

    host_seconds: np.ndarray  # float64 [H]
    directory_seconds: np.ndarray  # float64 [H]
    union_seconds: float  # the whole Plan from every host's part, in one process (work no host does in training)
    # of host_seconds: each host's own plan from the entries routed to it, and its replica's update [H]
    host_plan_seconds: np.ndarray = field(default_factory=lambda: np.zeros(0))
    message_bytes: dict[str, int] = field(default_factory=dict)
    host_message_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [H] sent + received
    ids_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [R]
    # [R]; the protocol's counts of the messages and plan parts (message_bytes, host_message_bytes, plan_part_bytes)
    # are left at 0 by a planner alone (`plan_host`, as in training: nothing reads them there)
    plan_part_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    swapped_samples: int = 0  # samples that trained on another host than the one that loaded them (phase 2b)
    wire_bytes: dict[str, int] = field(default_factory=dict)  # what the transport sent to other hosts, by phase
    # every host's whole part (`HostPlanner.part`) in the wire form, what an all-gather would carry once (0 from a
    # planner alone, as the protocol's counts above)
    parts_bytes: int = 0

    @property
    def per_host_seconds(self) -> np.ndarray:
        """A host's whole planning time: its own planner and its directory role."""
        return self.host_seconds + self.directory_seconds


def check_ranks_per_host(ranks_per_host: object) -> None:
    """A clear error for a bad `ranks_per_host` (the app's scheduler.ranks_per_host)."""
    if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, (int, np.integer)) or ranks_per_host < 1:
        raise ValueError(f"herald_hier: ranks_per_host must be an integer >= 1, got {ranks_per_host!r}")


def _decide_pairs(g: np.ndarray, r: np.ndarray, c: np.ndarray, owner: np.ndarray) -> tuple[np.ndarray, ...]:
    """`HeraldHierPolicy.decide_keys` before owner balancing (numpy; the kernels decide in `native.host_decide`):
    from (key, reader, elements) pairs sorted by key then rank, every key's owner and where it should live (with its
    owner where the owner reads it, else with the reader of the most elements, the lowest rank among ties): (keys,
    own, want, single, sole, count, start, kid)."""
    new = np.empty(g.shape[0], dtype=bool)
    new[0] = True
    np.not_equal(g[1:], g[:-1], out=new[1:])
    start = np.flatnonzero(new)
    keys = g[start]
    count = np.diff(np.append(start, g.shape[0]))
    kid = np.cumsum(new) - 1
    own = owner[keys].astype(np.int64)
    owner_reads = np.zeros(keys.shape[0], dtype=bool)
    owner_reads[kid[own[kid] == r]] = True
    best = np.maximum.reduceat(c, start)
    top = np.flatnonzero(c == best[kid])
    first = top[np.concatenate([[True], kid[top][1:] != kid[top][:-1]])]  # lowest rank with the most elements
    want = np.where(owner_reads, own, r[first])
    return keys, own, want, count == 1, r[start], count, start, kid


class HeraldHierPolicy(SchedulePolicy):
    """Hierarchical Herald (module docstring).

    hosts: the host map: ranks per host (int; ranks r .. r+P-1 share one) or a host key per rank (the training
        pipeline passes every rank's machine), which must form consecutive groups of equal size (the simulator's and
        the traffic accounting's host map). None (the default): `ranks_per_host`.
    ranks_per_host: the ranks of a host where no host map is given (default 8, a GPU host); unused with `hosts`.
    move_samples: the global swap of samples between hosts (module docstring, step 2b); False: samples never leave
        the host that loaded them. sample_gain: the least gain of a sample's offer (SAMPLE_GAIN).
    owner_balance: as `HeraldPolicy`'s ("auto": 1.15; None: off), each directory host balancing its own keys' load
        (module docstring, step 5).
    tables / refine / max_refine / budget_ms / stay_bonus / owner_weight: as `HeraldPolicy`'s, chosen once for the
        per-host problem (P ranks, P B samples) from host 0's first window; with one host every other keyword is
        passed to the plain `HeraldPolicy` this policy then is.
    `last_step` (a `HierStep`) says what the latest plan cost.
    """

    name = "herald_hier"
    takes_hosts = True

    def __init__(
        self,
        table_rows,
        num_ranks: int,
        batch_per_rank: int,
        cache_ratio: float = 0.1,
        lookahead: int = 4,
        *,
        hosts: int | Sequence[int] | None = None,
        ranks_per_host: int = RANKS_PER_HOST,
        move_samples: str = "off",
        sample_gain: float = SAMPLE_GAIN,
        tables: str | Sequence[int] = "auto",
        refine: int | None = None,
        max_refine: int | None = None,
        budget_ms: float | str | None = "auto",
        stay_bonus: float = 2.0,
        owner_weight: float = 2.0,
        plan_budget_ms: float | str | None = "auto",
        planner_wire: str = DEFAULT_PLANNER_WIRE,
        first_pass: str = "auto",
        owner_balance: float | str | None = "auto",
        **herald_kwargs,
    ) -> None:
        super().__init__(table_rows, num_ranks, batch_per_rank, cache_ratio, lookahead)
        R = self.num_ranks
        check_ranks_per_host(ranks_per_host)
        host = host_ids(ranks_per_host if hosts is None else hosts, R)
        H = int(host.max()) + 1
        P = -(-R // H)
        if not np.array_equal(host, np.arange(R) // P) or R % P:
            raise ValueError(
                f"herald_hier: hosts must be consecutive groups of equal size (ranks per host dividing num_ranks={R}),"
                f" got {hosts!r}"
            )
        if move_samples not in MOVE_SAMPLES:
            raise ValueError(f"herald_hier: move_samples must be one of {MOVE_SAMPLES}, got {move_samples!r}")
        if isinstance(sample_gain, bool) or not isinstance(sample_gain, (int, float)) or not sample_gain > 0:
            raise ValueError(f"herald_hier: sample_gain must be a number > 0, got {sample_gain!r}")
        check_planner_wire(planner_wire)
        self.move_samples, self.sample_gain = move_samples, float(sample_gain)
        self.planner_wire = planner_wire  # the form of the planners' messages (schedule/message_wire.py)
        self.ranks_per_host, self.num_hosts = P, H
        self.rank_dtype = np.int16 if R < 2**15 else np.int32  # ranks and reader counts on the planners' wire
        self.host_of_rank = host
        self.last_step: HierStep | None = None
        self.last_host_plans: dict[int, HostPlan] = {}  # the latest step's plan of every host planned here
        self.last_swapped = 0
        settings = dict(tables=tables, refine=refine, budget_ms=budget_ms)
        settings.update(stay_bonus=stay_bonus, owner_weight=owner_weight, first_pass=first_pass)
        settings.update(owner_balance=owner_balance)
        self.owner_balance = check_factor(owner_balance)
        self._balanced = 0  # rows handed on by owner balancing over the policy's life, every directory host here
        # one host: the per-host problem is the whole problem, and plain herald plans it
        self._flat: HeraldPolicy | None = None
        if H == 1:
            if max_refine is not None:
                settings["max_refine"] = max_refine
            self._flat = HeraldPolicy(
                self.layout, R, batch_per_rank, cache_ratio, lookahead, **settings, plan_budget_ms=plan_budget_ms,
                **herald_kwargs,
            )  # fmt: skip
            return
        # the planning budget (schedule/herald/budget.py): every host plans each batch at the level all agree on
        self.budget = PlanBudget(plan_budget_ms)
        self._level = FULL
        # several hosts plan in parallel: each has the wall budget of the whole global batch, and one round
        settings["max_refine"] = HOST_MAX_REFINE if max_refine is None else max_refine
        if budget_ms == "auto":
            settings["budget_ms"] = default_budget_ms(R * batch_per_rank)
        if herald_kwargs:
            raise ValueError(
                f"herald_hier: {sorted(herald_kwargs)} apply with one host only (the plain herald planner); "
                f"{H} hosts plan without them"
            )
        # the per-host problem's settings: a HeraldPolicy of P ranks validates them and chooses tables / refine
        self._local = HeraldPolicy(self.layout.table_rows, P, batch_per_rank, cache_ratio, lookahead, **settings)
        # only its settings and its table selection are used: its per-row state goes (the compiled kernels' view of
        # it included, which kept a whole second directory alive: 0.6 GB on full Criteo tables)
        for name in ("directory", "eviction", "next_use", "_picked", "_native"):
            setattr(self._local, name, None)
        self.directory = OwnershipDirectory(self.layout, R, self.cache_ratio)
        self.eviction = EvictionPool(self.directory.slots, self.directory.last_use)
        self._guests_fit = native.guests_supported(self.directory, self.eviction)  # the kernels' dtypes
        c = np.arange(P * batch_per_rank + 1, dtype=np.float64)
        self._geo = ((P - 1) / P) ** np.maximum(c - 1, 0) if P > 1 else (c <= 1).astype(np.float64)

    # ---- the pipeline's hooks --------------------------------------------------------------------------------------
    @staticmethod
    def runs_with(
        ranks_per_host: object = RANKS_PER_HOST, planner_wire: object = DEFAULT_PLANNER_WIRE, **herald_options: object
    ) -> None:
        """The app's and the pipeline's check of the options, before any set-up (schedule.runnable_policy)."""
        check_ranks_per_host(ranks_per_host)
        check_planner_wire(planner_wire)
        HeraldPolicy.runs_with(**herald_options)

    def observe_step(self, step_ms: float, wait_ms: float = 0.0) -> None:
        """The pipeline's step time and input wait, for the planning budget (schedule/herald/budget.py)."""
        self._budget.observe_step(step_ms, wait_ms)

    @property
    def _budget(self) -> PlanBudget:
        """The budget of the plans this policy makes: herald's with one host."""
        return self._flat.budget if self._flat is not None else self.budget

    def set_planners(self, count: int) -> None:
        """How many ranks make plans: with several (one per machine), each plan's level is the one they agree on."""
        if self._flat is not None:
            self._flat.set_planners(count)
        elif int(count) < 1:
            raise ValueError(f"herald_hier: set_planners needs at least one planner, got {count!r}")
        else:
            self.budget.planners = int(count)

    def record_cut(self, cpu_ms: float) -> None:
        """The input stage's CPU ms cutting and encoding the last plan's parts, counted into its level's cost."""
        self._budget.record_cut(cpu_ms)

    def level_word(self) -> int:
        """The level this planner's own measurements ask for (0 FULL, 1 REDUCED, 2 STATIC), which it publishes for
        the planners' agreement (`agree_level`)."""
        return self._flat.level_word() if self._flat is not None else self.budget.wanted()

    def agree_level(self, words: Sequence[int]) -> int:
        """The level of the next plan from every planner's word: the same on every host, so that all hosts plan a
        step at one level (each host's plan follows from the same messages only if every host takes the same steps)."""
        return self._flat.agree_level(words) if self._flat is not None else self.budget.agree(words)

    @property
    def level(self) -> int:
        """The planning budget's level of the plan being made (FULL, REDUCED or STATIC): what a host's phases run."""
        return self._level

    @property
    def has_settings(self) -> bool:
        """Whether this process's per-host tables and refine rounds are chosen (host 0's choice, `settings`)."""
        return self._local.selection is not None

    def choose_settings(self, window: Sequence[GlobalBatch]) -> TableSelection:
        """Host 0's choice of the per-host tables and refine rounds from its first window (its own from now on)."""
        return self._local.profile(window)

    def adopt_settings(self, sel: TableSelection) -> None:
        """Another host's adoption of host 0's choice (`choose_settings`), once."""
        self._local.adopt(sel)

    def plan_levels(self) -> LevelCounts:
        """Plans made at each level of the budget (full, reduced, static)."""
        return self._flat.plan_levels() if self._flat is not None else self.budget.counts

    # ---- settings -------------------------------------------------------------------------------------------------
    @property
    def balanced(self) -> int:
        """Rows handed on by owner balancing over the policy's life (with one host, plain herald's)."""
        return self._flat.balanced if self._flat is not None else self._balanced

    @property
    def tables(self) -> list[int]:
        return self._flat.tables if self._flat is not None else self._local.tables

    @property
    def refine(self) -> int:
        return self._flat.refine if self._flat is not None else self._local.refine

    @property
    def selection(self) -> TableSelection | None:
        return self._flat.selection if self._flat is not None else self._local.selection

    def describe(self) -> dict:
        out = self._flat.describe() if self._flat is not None else super().describe()
        out.update(name=self.name, hosts=self.num_hosts, ranks_per_host=self.ranks_per_host, tables=self.tables)
        if self._flat is None:
            P = self.ranks_per_host
            planned = sorted(self.last_host_plans) or range(self.num_hosts)  # the hosts whose guests it keeps
            ranks = np.concatenate([np.arange(h * P, (h + 1) * P) for h in planned])
            out.update(refine=self.refine, guests=self.directory.occupancy(ranks), **self.budget.describe())
        return out

    @property
    def guests_compiled(self) -> bool:
        """Whether the kernels keep this replica's guests and eviction pool (the replica update, the capacity
        phase): they are on and take its arrays' dtypes."""
        return self._guests_fit and native.enabled()

    # ---- a key's table and home, from the layout --------------------------------------------------------------
    def table_of(self, keys: np.ndarray) -> np.ndarray:
        """Table of every key (int64), by a binary search in the layout's T + 1 offsets: no random read of an array
        over every row (the directory's `table`), which a host planner need not hold."""
        return np.searchsorted(self.layout.offsets, keys, side="right") - 1

    def sorted_tables(self, keys: np.ndarray) -> np.ndarray:
        """`table_of` for sorted keys: where the layout's T + 1 offsets fall among them (T binary searches)."""
        T = self.layout.num_tables
        ends = np.searchsorted(keys, self.layout.offsets)
        return np.repeat(np.arange(T, dtype=np.int64), np.diff(ends))

    def directory_host_of(self, keys: np.ndarray) -> np.ndarray:
        """The host that keeps every key's directory entry and decides its moves (int64): its home host (the host of
        its ROW_WISE home rank) shifted by its table's index, so that the small tables, whose rows are all homed on
        the first ranks, spread over the hosts (at R=256 the first host homed 4.3x the median host's shared pairs,
        shifted 1.45x)."""
        t = self.table_of(keys)
        home = (keys - self.layout.offsets[t]) // self.directory.block[t]
        return (home // self.ranks_per_host + t) % self.num_hosts

    def home_of(self, keys: np.ndarray) -> np.ndarray:
        """ROW_WISE home rank of every key (int64), = the directory's `home`, computed from the key."""
        t = self.table_of(keys)
        return (keys - self.layout.offsets[t]) // self.directory.block[t]

    # ---- per-host batches ---------------------------------------------------------------------------------------
    def host_batch(self, b: GlobalBatch, h: int) -> GlobalBatch:
        """Host h's samples of `b` (cached on the batch: a lookahead batch is the current one later)."""
        key = ("herald_hier_host", self.num_hosts, h)
        sub = b._cache.get(key)
        if sub is None:
            n = self.ranks_per_host * self.batch_per_rank
            dense = b._cache.get("dense")
            if dense is not None:
                sub = GlobalBatch.from_dense(dense[h * n : (h + 1) * n], self.layout, b.index, range_checked=True)
            else:
                sub = b.take(np.arange(h * n, (h + 1) * n, dtype=np.int64))
            b._cache[key] = sub
        return sub

    def scheduled_of(self, sub: GlobalBatch, bk: BatchKeys) -> _Scheduled:
        """The host batch's elements in the scheduled tables and their first-pass weights (cached per selection)."""
        loc = self._local
        key = ("herald_hier_sched", loc.scheduled.tobytes())
        hit = sub._cache.get(key)
        if hit is None:
            hit = scheduled_elements(bk, loc.scheduled, self._geo, self.ranks_per_host)
            sub._cache[key] = hit
        return hit

    # ---- phase 3: LAIA inside a host -----------------------------------------------------------------------------
    def host_assign(self, sub: GlobalBatch, bk: BatchKeys, own_local: np.ndarray) -> np.ndarray:
        """Rank (0..P-1) of every sample of a host batch; `own_local` is every key's owner among the host's ranks
        (-1: owned outside the host). Rotated coordinates as `HeraldPolicy.assign` (ties to rank step % P first)."""
        P, B, loc = self.ranks_per_host, self.batch_per_rank, self._local
        N = sub.num_samples
        first = self.step % P
        v = self.scheduled_of(sub, bk)
        if v.es.shape[0] == 0:
            return np.repeat(np.arange(P, dtype=np.int64), B)
        own = np.where(own_local >= 0, (own_local - first) % P, -1)
        refine = loc.refine
        stream = loc.first_pass == "stream"
        if native.enabled():
            per_sample = 0 if v.cols is None else v.cols.shape[0]
            a = native.assign(
                N, P, B, v.K, v.es, v.ec, v.w0, per_sample, own, refine, loc.owner_weight, loc.stay_bonus,
                loc._wtype is np.int16, STREAM_READERS if stream else 0,
            )  # fmt: skip
            return (a + first) % P
        # numpy: group P stands for "outside the host" (its column is dropped)
        own_g = np.where(own >= 0, own, P)
        score = np.bincount(v.es * (P + 1) + own_g[v.ec], weights=v.w0, minlength=N * (P + 1))
        score = score.reshape(N, P + 1)[:, :P]
        if stream:
            a = stream_assign(N, P, B, v.es, v.ec, v.w0, own)
        else:
            a = balanced_assign(score, B) if refine == 0 else np.argmax(score, axis=1)
        for _ in range(refine):
            sc, corr = _round_scores(v, N, a[v.es], P + 1, own_g, loc.owner_weight, loc._wtype, np.float32)
            sc = np.ascontiguousarray(sc[:, :P])
            sc[np.arange(N), a] += corr + loc.stay_bonus
            a = balanced_assign(sc, B)
        return (a + first) % P

    # ---- step ---------------------------------------------------------------------------------------------------
    def plan(self, batches):
        if self._flat is None:
            return self._at_level(lambda: super(HeraldHierPolicy, self).plan(batches))
        t0 = CLOCK()
        plan = self._flat.plan(batches)
        self.step += 1
        R = self.num_ranks
        bl = [batches] if isinstance(batches, GlobalBatch) else list(batches)
        self.last_step = HierStep(
            host_seconds=np.array([CLOCK() - t0]),
            directory_seconds=np.zeros(1),
            union_seconds=0.0,
            message_bytes=dict.fromkeys(MESSAGE_KINDS, 0),
            host_message_bytes=np.zeros(1, dtype=np.int64),
            ids_bytes=ids_bytes(bl[0], R, self.batch_per_rank),
            plan_part_bytes=plan_part_bytes(plan),
        )
        return plan

    def _plan(self, batches: list[GlobalBatch]) -> Plan:
        """Every host's part in this process, through an in-process transport (the simulator, the tests): each host
        makes its own plan and updates what its replica keeps, as in training, and the whole plan is their union."""
        windows = {h: [self.host_batch(x, h) for x in batches] for h in range(self.num_hosts)}
        host_plan = self.move_samples != "swap"  # swapped samples train away from their slices' host
        return self.plan_hosts(
            windows,
            InProcessTransport(self.num_hosts, self.planner_wire == "compact"),
            whole=batches,
            host_plan=host_plan,
        )

    def plan_host(self, host: int, batches: Sequence[GlobalBatch], transport: Transport) -> HostPlan:
        """One host's planner in a run where every host plans in its own process (the training pipeline): `batches`
        are host `host`'s samples of the current batch and the next L (P B samples each), `transport` reaches the
        other hosts' planners, which call this at the same step. Returns the host's plan (`HostPlan`: what its ranks
        execute, and the step's counters and tables), never the whole one."""
        if self._flat is not None:
            raise ValueError("herald_hier: plan_host needs several hosts (with one host the policy is plain herald)")
        bl = list(batches)
        n = self.ranks_per_host * self.batch_per_rank
        bad = [i for i, b in enumerate(bl) if b.num_samples != n or b.layout != self.layout]
        if not bl or bad or not 0 <= host < self.num_hosts:
            raise ValueError(
                f"herald_hier: plan_host takes host 0..{self.num_hosts - 1}'s batches of ranks_per_host x "
                f"batch_per_rank = {n} samples on tables {self.layout.table_rows}; got host {host}, batches {bad}"
            )
        t0 = time.perf_counter()
        plan = self._at_level(
            lambda: self.plan_hosts({host: bl[: self.lookahead + 1]}, transport, host_plan=True, count=False)
        )
        plan.sched_seconds = time.perf_counter() - t0
        self.step += 1
        return plan

    def _at_level(self, make: Callable[[], Plan]) -> Plan:
        """`make()` (one step of this process's hosts) at the planning budget's level (schedule/herald/budget.py,
        agreed on by every host's planner): FULL; REDUCED, the per-host selection's better half of the tables and no
        refine round; STATIC, every sample on its own rank and every row with its owner (no LAIA, no move). The
        level's CPU time is recorded for the budget. The first plan, which chooses the per-host tables, is FULL."""
        loc = self._local
        self._level = self.budget.choose() if loc.selection is not None else FULL
        cpu = time.thread_time()
        if self._level != REDUCED:
            plan = make()
        else:
            kept = loc.scheduled, loc._sel_key, loc.refine
            loc._set_tables(loc._reduced_selection().tables)
            loc.refine = 0
            try:
                plan = make()
            finally:
                loc.scheduled, loc._sel_key, loc.refine = kept
        self.budget.record(self._level, (time.thread_time() - cpu) * 1e3)
        return plan

    def plan_hosts(
        self,
        windows: dict[int, list[GlobalBatch]],
        transport: Transport,
        whole: list[GlobalBatch] | None = None,
        host_plan: bool = False,
        count: bool = True,
    ) -> Plan:
        """One step of the hosts in `windows` (host -> its samples' window), phase by phase (module docstring), their
        messages through `transport`; `whole` (the global window) only for move_samples="swap", which needs every
        host in this process. With `host_plan` every host makes its own plan (`HostPlan`) and applies its own moves;
        returns that host's plan where `windows` holds one host (`plan_host`), else the whole Plan (the union of the
        parts, applied to this process's directory if the hosts did not apply theirs). `count`: the protocol's
        bytes of the messages and plan parts (HierStep); a planner alone in training (`plan_host`) leaves them."""
        H, P, R = self.num_hosts, self.ranks_per_host, self.num_ranks
        msg = MessageBytes(H, on=count)
        host_s, dir_s = np.zeros(H), np.zeros(H)
        hosts: dict[int, HostPlanner] = {}
        for h, w in windows.items():
            t0 = CLOCK()
            hosts[h] = HostPlanner(self, h, w, msg)
            host_s[h] += CLOCK() - t0

        def run(kind: str, seconds: np.ndarray, fn) -> dict[int, dict[int, list[np.ndarray]]]:
            out = {}
            for h, hp in hosts.items():
                t0 = CLOCK()
                out[h] = fn(hp)
                seconds[h] += CLOCK() - t0
            return transport.exchange(kind, out)

        if self._local.selection is None:  # once, from host 0's first window, sent to every host (a few bytes)
            got = run("settings", host_s, lambda hp: hp.settings())
            for h, hp in hosts.items():
                hp.adopt_settings(got.get(h, {}).get(0))
        got = run("demand", host_s, lambda hp: hp.demand())  # phase 1
        got = run("owners", dir_s, lambda hp: hp.owners(got[hp.h]))  # phase 2
        for h, hp in hosts.items():
            t0 = CLOCK()
            hp.receive_owners(got[h])
            host_s[h] += CLOCK() - t0
        self.last_swapped = 0
        if self.move_samples == "swap":  # phase 2b: the coordinator needs every host here
            if whole is None or len(hosts) != H:
                raise ValueError("herald_hier: move_samples='swap' plans every host in one process (the simulator)")
            if swap_samples(self, whole, hosts, msg, (host_s, dir_s), CLOCK):
                got = transport.exchange("demand", {h: hp.demand(count=False) for h, hp in hosts.items()})
                for h, hp in hosts.items():
                    hp.owners(got[h])  # the directories learn the new demand (its bytes: swap_samples)
        got = run("reads", host_s, lambda hp: hp.assign_and_read())  # phases 3-4
        got = run("arrivals", dir_s, lambda hp: hp.decide(got[hp.h]))  # phases 5-6 (and the pins)
        got = run("cancels", host_s, lambda hp: hp.make_room(got[hp.h]))  # phase 7
        parts = {}
        for h, hp in hosts.items():  # phase 8: every host's part of the plan
            t0 = CLOCK()
            parts[h] = hp.part(got[h])
            dir_s[h] += CLOCK() - t0
        union_s, plan_s = 0.0, np.zeros(H)
        if host_plan:  # each host its own ranks' plan, from the entries routed to it
            routed = {}
            for h, hp in hosts.items():
                t0 = CLOCK()
                routed.update(hp.routed(parts[h]))
                dir_s[h] += CLOCK() - t0
            got = transport.exchange("parts", routed)
            plans, moves = {}, {}
            for h, hp in hosts.items():
                t0 = CLOCK()
                plans[h], moves[h] = host_plans.host_plan(self, hp, parts[h], got[h])
                plan_s[h] += CLOCK() - t0
            # every host's rows leave before any arrives (where several share this directory); one host alone in one
            for stage in ("release", "land") if len(hosts) > 1 else ("both",):
                for h in hosts:
                    t0 = CLOCK()
                    host_plans.apply_host_moves(self, moves[h], stage)
                    plan_s[h] += CLOCK() - t0
            host_s += plan_s
            self.last_host_plans = plans
            if len(hosts) == 1:
                (plan,) = plans.values()
            else:  # the whole plan, for the simulator's checker and counts (no host builds it)
                t0 = CLOCK()
                plan = host_plans.whole_plan(self, list(parts.values()), apply=False)
                union_s = CLOCK() - t0
        else:  # move_samples="swap", every host in this process: the whole plan, applied to its directory
            t0 = CLOCK()
            plan = host_plans.whole_plan(self, list(parts.values()))
            union_s = CLOCK() - t0
        ids = np.zeros(R, dtype=np.int64)
        for h, w in windows.items():  # (a few passes over the batch's offsets: kept by a planner alone too)
            ids[h * P : (h + 1) * P] = ids_bytes(w[0], P, self.batch_per_rank)
        compact = self.planner_wire == "compact"
        self.last_step = HierStep(
            host_seconds=host_s,
            directory_seconds=dir_s,
            union_seconds=union_s,
            host_plan_seconds=plan_s,
            message_bytes=dict(msg.kind),
            host_message_bytes=msg.host,
            ids_bytes=ids,
            plan_part_bytes=plan_part_bytes(plan) if count else np.zeros(R, dtype=np.int64),
            swapped_samples=self.last_swapped,
            wire_bytes=dict(transport.last_bytes),
            # every host's whole part as the wire form would carry it: counted with the protocol's bytes (the
            # simulator), not by a planner in training, whose thread would pay for the encoding
            parts_bytes=sum(encode_message(m, compact).shape[0] for m in parts.values()) if count else 0,
        )
        transport.last_bytes.clear()
        return plan

    def decide_keys(self, g: np.ndarray, r: np.ndarray, c: np.ndarray, h: int):
        """Directory host h's decision (phase 5) from its keys' (key, reader, elements) triples sorted by key then
        rank, numpy (the kernels decide in `decide_host`): (keys, owner, want, single, sole, each pair's key index
        into keys, pair ranks). With `owner_balance`, h balances the load of its own keys, its heavy rows going to
        its ranks = h mod H (schedule/herald/balance)."""
        d = self.directory
        if g.shape[0] == 0:
            z = np.zeros(0, dtype=np.int64)
            return z, z, z, np.zeros(0, dtype=bool), z, z, z
        keys, own, want, single, sole, count, start, kid = _decide_pairs(g, r, c, d.owner)
        if self.owner_balance is not None and self._level != STATIC:
            R = self.num_ranks
            heavy_ranks = np.arange(R) % self.num_hosts == h
            self._balanced += balance_owners(want, own, count, start, kid, r, None, R, self.owner_balance, heavy_ranks)
        return keys, own, want, single, sole, kid, r

    def decide_host(self, h: int, first, n_of, idx, r, c, demanded, demand_owner) -> native.HostDecision:
        """`decide_keys` and phase 6's messages of directory host h in one compiled pass (`native.host_decide`;
        HostPlanner.decide), from the reads it received: n_of[s] (index in sender s's demand, which begins at first[s]
        in `demanded`; reader; elements) triples from each sender, in sender order; `demand_owner`, the demanded
        keys' owners as phase 2 read them."""
        balance = self.owner_balance if self._level != STATIC else None
        got = native.host_decide(
            first, n_of, idx, r, c, demanded, demand_owner, self.num_ranks, self.ranks_per_host,
            self.num_hosts, h, self._level == STATIC, balance, self.layout.offsets, self.directory.block,
            self.rank_dtype,
        )  # fmt: skip
        self._balanced += got.balanced
        return got

    def room_for_arrivals(self, t, keys, own, home, want, single, window_keys) -> np.ndarray:
        """Host t's capacity (phase 7): victims among its guests (returned, sorted) and cancelled arrivals (in
        `want`), so that its guest groups fit after the moves into them (`keys`, sorted, with their owner, home,
        wanted owner and single-reader flag). `window_keys`: the sorted keys of t's lookahead batches 1..L, whose
        first use of a key ranks it (a binary search in each, for the few keys the phase asks about: an array over
        every row, set and cleared each step, cost 0.3 ms per host and 68 MB on full Criteo tables). numpy; the
        kernels' `native.host_room` does the whole phase (`HostPlanner.make_room`)."""
        mine = np.arange(keys.shape[0])

        def next_use(k: np.ndarray) -> np.ndarray:
            return _first_use(k, window_keys)

        d, P, T = self.directory, self.ranks_per_host, self.layout.num_tables
        lo = t * P * T
        Gt = P * T
        tk = self.table_of(keys)
        last, step, L1 = d.last_use, self.step, self.lookahead + 1
        freed = np.zeros(Gt, dtype=np.int64)
        chosen = np.zeros(0, dtype=np.int64)

        def prio(pos: np.ndarray) -> np.ndarray:
            gg = d.slots.slot[pos]
            lu = last[gg].astype(np.int64)
            n = next_use(gg)
            p = np.where(n > 0, L1 - n, 0) * (step + 2) + lu + 1
            return np.where((lu == step) | np.isin(gg, chosen), -1, p)  # this step's victims stay picked

        for it in range(mine.shape[0] + 2):
            m = mine[want[mine] != own[mine]]
            arr = m[want[m] != home[m]]
            dep = m[(own[m] // P == t) & (own[m] != home[m])]  # guests moving between the host's own ranks
            arr_g = want[arr] * T + tk[arr] - lo
            deficit = (
                d.slots.fill[lo : lo + Gt]
                - np.bincount(own[dep] * T + tk[dep] - lo, minlength=Gt)
                + np.bincount(arr_g, minlength=Gt)
                - freed
                - d.slots.cap[lo : lo + Gt]
            )
            gneed = np.flatnonzero(deficit > 0)
            if gneed.shape[0] == 0:
                break
            left = deficit
            if it < 2:
                vpos = self.eviction.pick(gneed + lo, deficit[gneed], prio)
                v = d.slots.slot[vpos]
                if v.shape[0]:
                    chosen = np.concatenate([chosen, v])
                    vcount = np.bincount(d.owner[v].astype(np.int64) * T + d.table[v].astype(np.int64) - lo,
                                         minlength=Gt)  # fmt: skip
                    freed += vcount
                    left = deficit - vcount
                    if (left <= 0).all():
                        break
            cancel_arrivals(arr, arr_g, left, keys, single, lambda k: next_use(k) > 0, own, home, want)
        else:  # pragma: no cover - every round cancels an arrival
            raise RuntimeError("herald_hier: capacity resolution did not converge")
        return np.sort(chosen)


def _first_use(keys: np.ndarray, window_keys: Sequence[np.ndarray]) -> np.ndarray:
    """The first batch of a lookahead window (1..L) that reads each key, 0 for none (int64); `window_keys`: each
    batch's sorted keys."""
    out = np.zeros(keys.shape[0], dtype=np.int64)
    for j in range(len(window_keys), 0, -1):
        out[in_sorted(keys, window_keys[j - 1])] = j
    return out
