"""`StepExtension`: a system that runs its own part of a step beside Herald's, in the same sharded module.

Why: rows replicated on every rank (replicas.py: Herald with `replicate`, FAE, P²RES) and the comparison systems'
HET cache (distributed/comparison/) run through the same module, but their rows, collectives and updates are theirs.
The module is built with the extensions its policy needs (none for plain Herald), so Herald's step holds no branch
for them and a module without extensions does no work for them.

An extension's step, in the order the module calls it (collective hooks run on every rank, in the same order,
driven by the plan alone):

    part = extension.begin(plan, local, ownership_version)  # collective; the ids it serves are set aside
    out = part.pooled(out, training)                        # after Herald's lookup
    hits, reads = part.count(hits, reads, counters)
    part.finish()                                           # collective; after the backward, if `part.pending`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from herald_torchrec.distributed.comm import PlanComm
from herald_torchrec.distributed.step.prepare import LocalInput
from herald_torchrec.distributed.storage.row_store import RowStore
from herald_torchrec.schedule.plan import Plan

EXTENSION_PLAN_PARTS = ("replicas", "cache")  # the Plan fields that only an extension runs


@dataclass(frozen=True)
class ExtensionResources:
    """What an extension may use of the module that runs it: the home rows, the collectives, the device, and the
    embedding optimizer's settings (its own copies of rows are updated as the home rows are)."""

    store: RowStore
    comm: PlanComm
    device: torch.device
    optimizer: Any
    learning_rate: float
    eps: float
    tbe_settings: dict[str, Any]


class ExtensionStep(Protocol):
    """One step of an extension on this rank, from `StepExtension.begin` to `finish`."""

    remaining: LocalInput | None  # the step's ids left to Herald's path (None: the input failed its checks)

    def pooled(self, out: torch.Tensor, training: bool) -> torch.Tensor:
        """`out` plus the pooled values of the ids this extension serves."""
        ...

    def count(self, hits: np.ndarray, reads: np.ndarray, counters: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """(hits, distinct keys read) per table with this extension's reads added; its own counters go into
        `counters`."""
        ...

    @property
    def pending(self) -> bool:
        """Whether a trained step leaves updates for `finish`."""
        ...

    def finish(self) -> None:
        """The extension's updates of a trained step (collective)."""
        ...


class StepExtension(Protocol):
    """A system beside Herald's step, chosen when the module is built."""

    plan_part: str  # the Plan field (one of EXTENSION_PLAN_PARTS) whose actions this extension runs

    def begin(self, plan: Plan, local: LocalInput | None, ownership_version: int) -> ExtensionStep:
        """The extension's collectives before Herald's exchange; the ids it serves leave `local`
        (`ExtensionStep.remaining`). A ValueError (the plan does not match the batch) is raised after the
        collectives every rank runs. `ownership_version` changes when a load moved every row home."""
        ...

    def set_learning_rate(self, lr: float) -> None: ...


def check_plan_served(plan: Plan, extensions: Sequence[StepExtension], policy: str) -> None:
    """ValueError if the plan carries actions (replicas, HET's cache) that none of the module's extensions runs:
    Herald's path alone would read those ids from the wrong place."""
    served = {e.plan_part for e in extensions}
    for part in EXTENSION_PLAN_PARTS:
        if getattr(plan, part) is not None and part not in served:
            how = "the policy that planned it"
            if part == "replicas":
                how += " and, for Herald's replicated rows, policy_options={'replicate': True}"
            raise ValueError(
                f"set_plan: plan {plan.step} carries `{part}`, which the module built for policy "
                f"{policy!r} does not run (build it with {how})"
            )
