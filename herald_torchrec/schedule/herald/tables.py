"""Adaptive LAIA: which tables are worth scheduling, and how much LAIA work fits the scheduling-time budget.

Scheduling a table costs time (its elements enter every LAIA pass) and saves traffic only where placement can
change who reads a key. Per table, from profile batches, with c_k the samples reading key k in a global batch of
N = R x B samples:
* a key read once (c = 1) costs a migration unless its sample lands on the owner: placing it saves (R-1)/R rows;
* a key read c >= 2 times is read by E[lambda] = R (1 - (1 - 1/R)^c) ranks when placement ignores it; co-locating
  its samples saves up to 2 (E[lambda] - 1) rows, achievable only while its samples fit on few ranks: weighted by
  max(0, 1 - c / B). Keys read by ~B samples or more (tiny tables: "hot everywhere") thus score ~0, and so do
  tables with few reads ("cold everywhere").
benefit[t] = modelled rows saved per sample. Tables are taken by decreasing benefit while their benefit is at least
`min_share` of the best table's. Then the number of best-response rounds (`refine`, up to `max_refine`) is the
largest whose modelled time fits `budget_ms` (0 if none does); when the caller forces more rounds than fit, the
least useful tables are dropped until they do.

The time model is a fixed function of the batch shape, calibrated on the reference 2-core machine (one thread,
docs/scheduler.md) — deliberately not a measurement, so that every rank makes the same choice (plans must agree
across ranks without communication):
    base  = 2.5 + 3.63e-5 N T + 4.8e-6 N R            (keys, reader sets, sync, first LAIA pass)
    round = 0.8 + 1.0e-6 N R (|S| + 9)                  (one best-response round over |S| scheduled tables)
measured in the simulator's setting (fresh batches, data generated between steps: cold caches, as in training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from herald_torchrec.schedule.global_batch import TableLayout
from herald_torchrec.schedule.reads import BatchKeys


def default_budget_ms(num_samples: int) -> float:
    """5 ms per global batch of up to 2048 samples (8 ranks x 256), growing linearly beyond (40 ms at 64 x 256)."""
    return 5.0 * max(1.0, num_samples / 2048)


@dataclass
class TableSelection:
    tables: np.ndarray  # int64, chosen table indices (sorted)
    refine: int  # best-response rounds
    benefit: np.ndarray  # float64 [T]: modelled rows saved per sample if the table is scheduled
    est_ms: float  # modelled scheduling time per step
    budget_ms: float | None

    def describe(self) -> dict:
        return {
            "tables": [int(t) for t in self.tables],
            "refine": self.refine,
            "benefit": [round(float(x), 4) for x in self.benefit],
            "est_ms": round(self.est_ms, 3),
            "budget_ms": None if self.budget_ms is None else round(self.budget_ms, 3),
        }


def table_benefit(profile: Sequence[BatchKeys], layout: TableLayout, num_ranks: int, batch_per_rank: int) -> np.ndarray:
    R, B = num_ranks, batch_per_rank
    T = layout.num_tables
    total = np.zeros(T, dtype=np.float64)
    samples = 0
    for bk in profile:
        c = bk.count.astype(np.float64)
        t = np.searchsorted(layout.offsets, bk.keys, side="right") - 1
        lam = R * (1.0 - (1.0 - 1.0 / R) ** c)
        gain = np.where(c <= 1, (R - 1) / R, 2.0 * (lam - 1.0) * np.clip(1.0 - c / B, 0.0, None))
        total += np.bincount(t, weights=gain, minlength=T)
        samples += bk.num_samples
    return total / max(samples, 1)


def estimate_ms(num_samples: int, num_ranks: int, num_tables: int, scored_tables: int, refine: int) -> float:
    """Modelled scheduling time per step in ms (single-hot elements, one thread, reference machine)."""
    N, R = num_samples, num_ranks
    base = 2.5 + 3.63e-5 * N * num_tables + 4.8e-6 * N * R
    rnd = 0.8 + 1.0e-6 * N * R * (scored_tables + 9)
    return base + refine * rnd


def select_tables(
    profile: Sequence[BatchKeys],
    layout: TableLayout,
    num_ranks: int,
    batch_per_rank: int,
    budget_ms: float | None = None,
    refine: int | None = None,
    max_refine: int = 2,
    tables: Sequence[int] | None = None,
    min_share: float = 0.25,
) -> TableSelection:
    """Choose the scheduled tables (unless given) and the refine rounds (unless given) for the budget."""
    benefit = table_benefit(profile, layout, num_ranks, batch_per_rank)
    N, T = num_ranks * batch_per_rank, layout.num_tables
    if tables is None:
        order = np.lexsort((np.arange(T), -benefit))
        best = float(benefit.max()) if T else 0.0
        chosen = [int(t) for t in order if best > 0 and benefit[t] >= min_share * best]
    else:
        chosen = sorted(int(t) for t in tables)

    def fits(n_tables: int, rounds: int) -> bool:
        return budget_ms is None or estimate_ms(N, num_ranks, T, n_tables, rounds) <= budget_ms

    if refine is None:
        refine = max([r for r in range(max_refine + 1) if fits(len(chosen), r)], default=0)
    if tables is None:
        # only the rounds depend on the scheduled tables: with rounds forced beyond the budget, drop the least
        # useful tables until they fit
        while refine > 0 and len(chosen) > 1 and not fits(len(chosen), refine):
            chosen.pop()
    sel = np.array(sorted(chosen), dtype=np.int64)
    return TableSelection(sel, int(refine), benefit, estimate_ms(N, num_ranks, T, len(chosen), refine), budget_ms)


def reduced_selection(sel: TableSelection, num_samples: int, num_ranks: int, num_tables: int) -> TableSelection:
    """The cheaper selection a planner that is behind uses (`schedule.herald.budget`): no best-response rounds (by the
    time model above, most of what can be saved) and the better half of the scheduled tables by benefit (at least
    one), which shrinks the first LAIA pass with the elements it scores. Ties keep the lower table index."""
    t = sel.tables
    order = t[np.lexsort((t, -sel.benefit[t]))] if t.shape[0] else t
    keep = np.sort(order[: max(1, (t.shape[0] + 1) // 2)]) if t.shape[0] else t
    est = estimate_ms(num_samples, num_ranks, num_tables, int(keep.shape[0]), 0)
    return TableSelection(keep.astype(np.int64), 0, sel.benefit, est, sel.budget_ms)
