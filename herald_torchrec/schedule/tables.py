"""Adaptive LAIA: which tables are worth scheduling, within a scheduling-time budget.

Scheduling a table costs time (its elements enter every LAIA pass) and saves traffic only where placement can
change who reads a key. Per table, from profile batches, with c_k the samples reading key k in a global batch of
N = R x B samples:
* a key read once (c = 1) costs a migration unless its sample lands on the owner: placing it saves (R-1)/R rows;
* a key read c >= 2 times is read by E[lambda] = R (1 - (1 - 1/R)^c) ranks when placement ignores it; co-locating
  its samples saves up to 2 (E[lambda] - 1) rows, achievable only while its samples fit on few ranks: weighted by
  max(0, 1 - c / B). Keys read by ~B samples or more (tiny tables: "hot everywhere") thus score ~0, and so do
  tables with few reads ("cold everywhere").
benefit[t] = expected rows saved per sample. Tables are taken by decreasing benefit while their benefit is at least
`min_share` of the best table's and the modelled scheduling time fits `budget_ms`. The time model is a fixed
linear function of the elements scored (calibrated on the reference 2-core machine, see docs/scheduler.md) — not a
measurement, so that every rank makes the same choice (plans must agree across ranks without communication).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from herald_torchrec.schedule.batch import TableLayout
from herald_torchrec.schedule.reads import BatchKeys

# scheduling-time model (ms) on the reference machine: fixed part per (sample, key) element of the step, plus
# per scored element and LAIA pass (1 + refine passes)
MS_PER_ELEMENT = 3.0e-5
MS_PER_SCORED_ELEMENT_PASS = 4.5e-5


@dataclass
class TableSelection:
    tables: np.ndarray  # int64, chosen table indices (sorted)
    benefit: np.ndarray  # float64 [T]: modelled rows saved per sample if the table is scheduled
    est_ms: float  # modelled scheduling time per step with the chosen tables
    budget_ms: float | None

    def describe(self) -> dict:
        return {"tables": [int(t) for t in self.tables], "benefit": [round(float(x), 4) for x in self.benefit],
                "est_ms": round(self.est_ms, 3), "budget_ms": self.budget_ms}


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
        samples += int(bk.smp.max()) + 1 if bk.smp.shape[0] else 0
    return total / max(samples, 1)


def estimate_ms(num_samples: int, num_tables: int, scored_tables: int, refine: int) -> float:
    """Modelled scheduling time per step (single-hot elements)."""
    return (MS_PER_ELEMENT * num_samples * num_tables
            + MS_PER_SCORED_ELEMENT_PASS * num_samples * scored_tables * (1 + refine))


def select_tables(profile: Sequence[BatchKeys], layout: TableLayout, num_ranks: int, batch_per_rank: int,
                  refine: int = 2, budget_ms: float | None = None, min_share: float = 0.25) -> TableSelection:
    benefit = table_benefit(profile, layout, num_ranks, batch_per_rank)
    order = np.lexsort((np.arange(benefit.shape[0]), -benefit))
    N, T = num_ranks * batch_per_rank, layout.num_tables
    best = float(benefit.max()) if benefit.shape[0] else 0.0
    chosen: list[int] = []
    for t in order:
        if best <= 0 or benefit[t] < min_share * best:
            break
        if budget_ms is not None and chosen and estimate_ms(N, T, len(chosen) + 1, refine) > budget_ms:
            break
        chosen.append(int(t))
    tables = np.array(sorted(chosen), dtype=np.int64)
    return TableSelection(tables, benefit, estimate_ms(N, T, len(chosen), refine), budget_ms)
