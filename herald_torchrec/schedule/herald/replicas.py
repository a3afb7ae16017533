"""Rows replicated on every rank inside Herald: which rows, chosen by a cost model over a window of steps.

Why: a row that (nearly) every rank reads every step — the rows of the tiny tables, the Zipf heads of the big ones —
costs Herald 2 rows per remote reader (value out, gradient back), all through its owner, which makes the owner the
busiest rank of the step and sends the row over the host links once per reading rank. Replicated, every reader reads
its own copy and the gradients are summed by one all-reduce (hierarchical across hosts), whose result every copy and
the owner's own copy apply with the fused optimizer's math, so the model stays exactly stock TorchRec's.

Cost model, per row and per step, in rows (host-aware when the policy has a host map: a row crossing hosts counts 1,
one inside a host `intra_host_cost` = a):
* kept owned (Herald's shared path, as the data plane delivers it): 2 x the sum over the remote readers of 1 (reader on
  another host than the owner) or a (same host);
* replicated: the all-reduce, only in the steps that read the row: 2 (R-1) rows; with H hosts, hierarchical:
  2 (H-1) crossing + a (2 (R-1) - 2 (H-1)) inside hosts;
* joining the set: the owner's value + state to every other rank once ((R - R/H) + a (R/H - 1) with hosts, R-1
  without), spread over the `interval` steps the choice holds.
The window is the steps since the last choice (their true reader sets under Herald's assignment, with each row's
owner) plus the lookahead batches, whose readers are estimated as under a uniform split (a key read by c samples
reaches R (1 - (1 - 1/R)^c) ranks: about every rank for the hot rows this targets). Every `interval` steps the rows
with the largest positive expected saving (kept-owned cost - replicated cost - amortised join cost for rows not yet
in the set) form the new set, at most `budget` rows, among the rows whose all-reduce moves at most `row_margin` x its
rows more than the shared path would (rank-level: every row counts 1). That second test keeps the total rows down:
with a = 0.2 the host-weighted saving alone picks rows read by a third of the ranks, each all-reduce then moving up
to 3x its shared rows (R=64: 13.7 rows per sample against Herald's 12.0); a margin of 0.1 picks the rows read by
about every rank (the tiny tables, the heads), which cuts the crossing rows and the busiest rank at no cost in
rows. Without a host map the saving is never positive (a row has at most R-1 remote readers per step, the all-reduce
costs 2 (R-1)): rank-level rows alone never pay for replication.

A row leaves the set without a sync (its owner's copy applied every all-reduce); a row joining is copied from its
current owner. numpy only.
"""

from __future__ import annotations

import numpy as np

from herald_torchrec.schedule.global_batch import TableLayout

REPLICA_BUDGET = 4096  # rows per rank by default (docs/scheduler.md: what the sweep replicates fits in it)
REPLICA_INTERVAL = 10  # steps between choices of the set
# a replicated row may cost at most this share of its all-reduce in extra rows (rank-level) over the shared path:
# 0.1 keeps every R of the sweep at or below plain Herald's rows per sample (docs/scheduler.md)
REPLICA_ROW_MARGIN = 0.1


class ReplicaChoice:
    """The replicated set of one HeraldPolicy and the cost model's window (module docstring)."""

    def __init__(
        self,
        layout: TableLayout,
        num_ranks: int,
        budget: int,
        interval: int,
        host_of_rank: np.ndarray | None,
        intra_host_cost: float,
        row_margin: float = REPLICA_ROW_MARGIN,
    ) -> None:
        if isinstance(row_margin, bool) or not isinstance(row_margin, (int, float)) or not 0.0 <= row_margin <= 1.0:
            raise ValueError(f"herald: replica_row_margin must be a number in [0, 1], got {row_margin!r}")
        self.row_margin = float(row_margin)
        for name, v, lo in (("replica_budget", budget, 0), ("replica_interval", interval, 1)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"herald: {name} must be an integer >= {lo}, got {v!r}")
        self.budget, self.interval = int(budget), int(interval)
        R = self.num_ranks = int(num_ranks)
        n = layout.total_rows
        self.member = np.zeros(n, dtype=bool)  # the replicated set
        self.version = np.zeros(n, dtype=np.int64)  # steps that updated every row (the versions plans report)
        self._cost = np.zeros(n, dtype=np.float64)  # window sums: kept-owned cost
        self._touched = np.zeros(n, dtype=np.float64)  # window sums: steps reading the row
        self._rows = np.zeros(n, dtype=np.float64)  # window sums: kept-owned rows (rank-level, every row counts 1)
        self._seen: list[np.ndarray] = []
        self._steps = 0
        self.host_of_rank = host_of_rank
        a = self.intra_host_cost = float(intra_host_cost)
        if host_of_rank is None:
            self.allreduce_cost = 2.0 * (R - 1)
            self.join_cost = float(R - 1)
            self._remote_share = 1.0  # a remote reader's cost (uniform over the other ranks), for estimates
        else:
            H = int(host_of_rank.max()) + 1
            per_host = R / H
            self.allreduce_cost = 2.0 * (H - 1) + a * (2.0 * (R - 1) - 2.0 * (H - 1))
            self.join_cost = (R - per_host) + a * (per_host - 1)
            self._remote_share = self.join_cost / max(R - 1, 1)
        self.choices = 0  # sets chosen
        self.joined = 0  # rows that joined a set, over the policy's life

    @property
    def rows(self) -> np.ndarray:
        """The replicated global rows, sorted."""
        return np.flatnonzero(self.member)

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def observe(self, keys: np.ndarray, pair_key: np.ndarray, pair_rank: np.ndarray, owner: np.ndarray) -> None:
        """Add one step's reads to the window: `keys` (sorted global rows) read by the (key index, rank) pairs, each
        key owned by `owner` (its owner in the step: the kept-owned cost of replicated rows too)."""
        po = owner[pair_key]
        remote = pair_rank != po
        rows = 2.0 * np.bincount(pair_key, weights=remote, minlength=keys.shape[0])
        self._rows[keys] += rows
        if self.host_of_rank is None:
            w = remote.astype(np.float64)
        else:
            h = self.host_of_rank
            w = remote * np.where(h[pair_rank] != h[po], 1.0, self.intra_host_cost)
        self._cost[keys] += 2.0 * np.bincount(pair_key, weights=w, minlength=keys.shape[0])
        self._touched[keys] += 1.0
        self._seen.append(keys)
        self._steps += 1

    def choose(self, lookahead: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """The new set from the window and the lookahead batches ((sorted keys, elements reading each) per batch);
        resets the window. Returns the rows that join (sorted)."""
        R = self.num_ranks
        cand = [*self._seen, *(k for k, _ in lookahead), self.rows]
        cand = np.unique(np.concatenate(cand)) if cand else np.zeros(0, dtype=np.int64)
        cost, touched, rows = self._cost[cand], self._touched[cand], self._rows[cand]
        for keys, count in lookahead:  # expected readers under a uniform split of the batch over the ranks
            readers = R * (1.0 - (1.0 - 1.0 / R) ** count.astype(np.float64))
            pos = np.searchsorted(cand, keys)
            cost[pos] += 2.0 * readers * (1.0 - 1.0 / R) * self._remote_share
            rows[pos] += 2.0 * readers * (1.0 - 1.0 / R)
            touched[pos] += 1.0
        steps = max(self._steps + len(lookahead), 1)
        saving = (cost - self.allreduce_cost * touched) / steps
        saving -= np.where(self.member[cand], 0.0, self.join_cost / self.interval)
        allreduce_rows = 2.0 * (R - 1) * touched
        keep = np.flatnonzero((saving > 0) & (allreduce_rows - rows <= self.row_margin * allreduce_rows))
        keep = keep[np.lexsort((cand[keep], -saving[keep]))][: self.budget]
        new = np.zeros_like(self.member)
        new[cand[keep]] = True
        joining = np.flatnonzero(new & ~self.member)
        self.member = new
        self._cost[cand] = 0.0
        self._touched[cand] = 0.0
        self._rows[cand] = 0.0
        self._seen, self._steps = [], 0
        self.choices += 1
        self.joined += int(joining.shape[0])
        return joining

    def describe(self) -> dict:
        return {
            "replica_budget": self.budget,
            "replica_interval": self.interval,
            "replica_row_margin": self.row_margin,
            "replicated_rows": int(self.member.sum()),
            "replica_joins": self.joined,
        }
