"""Control plane: the scheduler (numpy, and compiled kernels in schedule/native.py — never imports torch).
See docs/scheduler.md.

    from herald_torchrec.schedule import GlobalBatch, make_policy, PlanChecker
    policy = make_policy("herald", table_rows, num_ranks=8, batch_per_rank=256, cache_ratio=0.1, lookahead=4)
    plan = policy.plan([GlobalBatch.from_dense(ids, table_rows) for ids in window])  # current + L lookahead
"""

from __future__ import annotations

from typing import Sequence

from herald_torchrec.schedule.baselines.fae import FaePolicy
from herald_torchrec.schedule.baselines.greedy import HeraldGreedyPolicy
from herald_torchrec.schedule.baselines.het import HetPolicy
from herald_torchrec.schedule.baselines.het_bsp import HetBspPolicy
from herald_torchrec.schedule.baselines.p2res import P2resPolicy
from herald_torchrec.schedule.baselines.static import StaticPolicy
from herald_torchrec.schedule.checker import PlanChecker
from herald_torchrec.schedule.directory import OwnershipDirectory
from herald_torchrec.schedule.global_batch import GlobalBatch, TableLayout
from herald_torchrec.schedule.herald.hierarchy import HeraldHierPolicy
from herald_torchrec.schedule.herald.planner import HeraldPolicy
from herald_torchrec.schedule.plan import Plan, ReadVersions, ReplicaSync, RowMoves, SharedRows
from herald_torchrec.schedule.policy import SchedulePolicy

POLICIES: dict[str, type[SchedulePolicy]] = {
    "static": StaticPolicy,
    "het_bsp": HetBspPolicy,
    "het": HetPolicy,
    "fae": FaePolicy,
    "p2res": P2resPolicy,
    "herald_greedy": HeraldGreedyPolicy,
    "herald": HeraldPolicy,
    "herald_hier": HeraldHierPolicy,
}


def make_policy(
    name: str,
    table_rows: Sequence[int] | TableLayout,
    num_ranks: int,
    batch_per_rank: int,
    cache_ratio: float = 0.1,
    lookahead: int = 4,
    **kwargs,
) -> SchedulePolicy:
    """Build a policy by name (`POLICIES`); extra keyword arguments go to the policy (e.g. herald's `refine`)."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](table_rows, num_ranks, batch_per_rank, cache_ratio, lookahead, **kwargs)


def runnable_policy(name: str, **options) -> str:
    """`name` if the data plane can execute its plans with these policy options (HeraldTrainPipeline checks it
    before building the policy, the app up front); a ValueError for an unknown policy or a counting-only one
    (simulator baselines)."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}")
    runs = getattr(POLICIES[name], "runs_with", None)
    if runs is not None:
        runs(**options)  # raises ValueError naming the setting it cannot run
    elif not POLICIES[name].executable:
        runnable = sorted(n for n, p in POLICIES.items() if p.executable)
        raise ValueError(
            f"policy {name!r} only models traffic (benchmarks/simulate.py); the data plane runs {runnable}"
        )
    return name


__all__ = [
    "GlobalBatch",
    "TableLayout",
    "OwnershipDirectory",
    "Plan",
    "RowMoves",
    "SharedRows",
    "ReadVersions",
    "ReplicaSync",
    "SchedulePolicy",
    "StaticPolicy",
    "HetBspPolicy",
    "HetPolicy",
    "HeraldGreedyPolicy",
    "HeraldPolicy",
    "HeraldHierPolicy",
    "FaePolicy",
    "P2resPolicy",
    "PlanChecker",
    "POLICIES",
    "make_policy",
    "runnable_policy",
]
