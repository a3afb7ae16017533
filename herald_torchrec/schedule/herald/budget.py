"""The planning budget: a planner that falls behind training makes cheaper plans instead of making training wait.

The input stage plans each global batch a few batches ahead (`HeraldTrainPipeline(prefetch=...)`); when planning a
batch takes longer than a training step, the queue empties and training waits for input (`input_wait_ms`). So the
budget per plan is the step time, and a planner whose recent plans cost more than that degrades, one level at a time:

    FULL     the plan the policy makes today (scheduled tables and refine rounds chosen by `schedule.herald.tables`);
    REDUCED  no refine rounds and the better half of the scheduled tables (`tables.reduced_selection`);
    STATIC   owners as they are and every sample on its own rank: no LAIA, no migration, no eviction (a read of a row
             another rank owns is a shared read), only what every plan carries (the replica set where it is due).

Every level is an exact plan on the same ownership protocol (the checker accepts each; 0 stale reads), so the choice
may depend on time: it changes traffic, never the trained model.

The rule (`plan_budget_ms`):
* "auto" (default): budget = BUDGET_STEP_SHARE x the step time, an EWMA of the training step's wall time without
  its wait for input, as the pipeline measures it (`observe_step`); none before WARMUP_STEPS steps were measured
  (the simulator and a policy used outside the pipeline never measure one: they always plan FULL). While training
  waits for input for more than LATE_SHARE of its step (the input stage reports it is late), the budget halves:
  the stage's other work (ids gather, sample exchange) needs the rest.
* a number: that fixed budget in ms, whatever the step time (for tests and to force the fallback).
* None: off (always FULL).
A level's cost is the EWMA of the planner's own CPU time per plan at that level (thread CPU, not wall: a low-priority
input thread's wall time also counts the training threads that hold the cores, which is not the planner being slow),
with what the planner's thread does next with that plan before it can make the next one: cutting and encoding its
ranks' parts (`record_cut`, from the input stage; at 64 ranks on full Criteo tables the cut is ~40 % of the plan's
own time, and a level chosen on the plan alone would keep pace on paper and fall behind in training).
The policy plans at the first level whose cost is within the budget (a level not yet measured is tried once); every
PROBE_EVERY degraded plans it makes one plan a level up, to measure it again (the step time and the data change).
On the 2-core reference runs a plan costs ~3 ms of CPU against a ~40 ms step: the rule never triggers there.

Several planners (`plan_on="every_rank"`, or `plan_on="host"` on several machines) each plan every global batch
from their own copy of the ownership directory and send the plans to their own ranks only: they agree because the
policy is deterministic, so the level of every plan must be the same on all of them, although each one's clock (and
machine) differs. The rule (`agree`): each planner *publishes* the level its own measurements ask for (`wanted`:
the rule above, without the probe) as a word of a round's header, which the input stage gives every rank; before
each plan, every planner takes the words of the last round completed on every rank, and plans at

    level = the probe rule applied to max(the words of every planner)

(the probe counts the agreed degraded plans, so it is the same everywhere too). A planner computes its word right
after making a plan and publishes it in the header of the round that carries that plan; plans are made a round
before they travel, so the level of plan p follows the words published with plan p-2 (plans 0 and 1 follow the last
gathering round's words: FULL unless a budget applied already); where the input stage cuts each plan's parts on its
cut thread, plans are made a round earlier still, and plan p follows the words published with plan p-3. The counts
(`plans_reduced`, `plans_static`) are the same on every planner; only the CPU costs per level (which drive each
planner's word) are its own. One slow planner degrades every planner's plans: the slowest sets the pace, as it would
stall the step for all of them. With one planner (`set_planners(1)`) the level is its own word at once, lag 0
(`choose`).

Example: two planners A (fast) and B (slow), `plan_budget_ms=2`, the probe aside. Their words after each plan
(CPU per plan, FULL / REDUCED: A 1.5 / 0.8 ms, B 3 / 1.5 ms; B's REDUCED cost, unmeasured, is tried once):

    plan p            0     1     2        3        4        5
    level (agreed)    FULL  FULL  REDUCED  REDUCED  REDUCED  REDUCED     (max(A, B) published after plan p-2)
    A's word after p  FULL  FULL  FULL     FULL     FULL     FULL
    B's word after p  RED.  RED.  RED.     RED.     RED.     RED.        (FULL 3 ms > 2; REDUCED 1.5 ms <= 2)

Had B's reduced plans cost 2.5 ms, its word after plan 2 would be STATIC and plans 4, 5, ... static on A and B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

FULL, REDUCED, STATIC = 0, 1, 2
LEVEL_NAMES = ("full", "reduced", "static")
BUDGET_STEP_SHARE = 1.0  # the auto budget per plan, as a share of the training step: one plan per step keeps pace
WARMUP_STEPS = 10  # step times measured before the auto budget applies (the first steps include start-up work)
STEP_EWMA = 0.1  # weight of the newest step time (and wait) in their running averages
COST_EWMA = 0.3  # weight of the newest plan's CPU time in its level's running average
LATE_SHARE = 0.25  # training waits this share of its step for input: the stage is late, the auto budget halves
PROBE_EVERY = 50  # degraded plans between two plans made a level up (to measure that level again)


def check_plan_budget(value: object) -> float | str | None:
    """`plan_budget_ms` as the policy keeps it ("auto", None or a float > 0), or a ValueError naming the setting."""
    if value is None or value == "auto":
        return value  # type: ignore[return-value]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"herald: plan_budget_ms must be 'auto', null or a number of ms > 0, got {value!r}")
    return float(value)


@dataclass
class LevelCounts:
    """Plans made at each level over the policy's life."""

    full: int = 0
    reduced: int = 0
    static: int = 0

    def add(self, level: int) -> None:
        name = LEVEL_NAMES[level]
        setattr(self, name, getattr(self, name) + 1)


@dataclass(frozen=True)
class LastPlan:
    """The level of the last plan recorded, and whether it was that level's first measured cost."""

    level: int
    first: bool


@dataclass
class PlanBudget:
    """The rule of the module docstring, fed by the pipeline (`observe_step`) and by the policy (`record`)."""

    setting: float | str | None = "auto"
    planners: int = 1  # ranks that make plans; with several, each plan's level is agreed on (`agree`)
    step_ms: float | None = None  # EWMA of the training step without its input wait
    wait_ms: float = 0.0  # EWMA of the training step's wait for input
    steps_seen: int = 0
    cost_ms: list[float | None] = field(default_factory=lambda: [None, None])  # FULL, REDUCED (STATIC costs ~0)
    counts: LevelCounts = field(default_factory=LevelCounts)
    agreed: int | None = None  # the level of the next plan, agreed on by several planners (`agree`)
    _degraded_run: int = 0  # degraded plans since the last probe
    _last: LastPlan | None = None  # the last plan recorded, until its cut is (`record_cut`)

    def __post_init__(self) -> None:
        self.setting = check_plan_budget(self.setting)

    def observe_step(self, step_ms: float, wait_ms: float = 0.0) -> None:
        """One training step's wall time without its input wait, and that wait (ms)."""
        step_ms, wait_ms = max(float(step_ms), 0.0), max(float(wait_ms), 0.0)
        if self.step_ms is None:
            self.step_ms, self.wait_ms = step_ms, wait_ms
        else:
            self.step_ms += STEP_EWMA * (step_ms - self.step_ms)
            self.wait_ms += STEP_EWMA * (wait_ms - self.wait_ms)
        self.steps_seen += 1

    @property
    def late(self) -> bool:
        """Training waits for input for more than LATE_SHARE of its step."""
        return self.step_ms is not None and self.wait_ms > LATE_SHARE * self.step_ms

    @property
    def budget_ms(self) -> float | None:
        """The budget per plan now (None: no budget, every plan FULL)."""
        if self.setting is None:
            return None
        if self.setting != "auto":
            return float(self.setting)
        if self.step_ms is None or self.steps_seen < WARMUP_STEPS:
            return None
        return BUDGET_STEP_SHARE * self.step_ms * (0.5 if self.late else 1.0)

    def wanted(self) -> int:
        """The level this planner's own measurements ask for (the first whose cost is within the budget, a level not
        yet measured tried once), without the probe: the word it publishes where several planners agree."""
        budget = self.budget_ms
        if budget is None:
            return FULL
        return next((lv for lv in (FULL, REDUCED) if self.cost_ms[lv] is None or self.cost_ms[lv] <= budget), STATIC)

    def _settle(self, level: int) -> int:
        """The probe rule: every PROBE_EVERY degraded plans in a row, one plan a level up (to measure it again)."""
        if level == FULL:
            self._degraded_run = 0
            return FULL
        self._degraded_run += 1
        if self._degraded_run > PROBE_EVERY:
            self._degraded_run = 0
            return level - 1
        return level

    def agree(self, words: Sequence[int]) -> int:
        """The level of the next plan from the words every planner published (`wanted`; the module docstring's
        rule): the same on every planner given the same words. Kept for `choose`, and returned."""
        levels = [int(w) for w in words]
        if not levels or any(w not in (FULL, REDUCED, STATIC) for w in levels):
            raise ValueError(f"herald planning budget: planners' level words must be 0, 1 or 2, got {levels}")
        self.agreed = self._settle(max(levels))
        return self.agreed

    def choose(self) -> int:
        """The level of the next plan: with one planner, its own at once; with several, the level `agree` set
        (FULL where no words were agreed on: a policy used outside the input stage). Consumed by the plan."""
        if self.planners == 1:
            return self._settle(self.wanted())
        level, self.agreed = self.agreed, None
        return FULL if level is None else level

    def record(self, level: int, cpu_ms: float) -> None:
        """A plan was made at `level` in `cpu_ms` of the planner's CPU."""
        self.counts.add(level)
        self._last = None
        if level != STATIC:
            old = self.cost_ms[level]
            self.cost_ms[level] = cpu_ms if old is None else old + COST_EWMA * (cpu_ms - old)
            self._last = LastPlan(level, first=old is None)

    def record_cut(self, cpu_ms: float) -> None:
        """The planner spent `cpu_ms` more on the last plan recorded (cutting and encoding its parts): its level's cost
        becomes what it would be had `record` been given the sum (STATIC's is not kept)."""
        last, self._last = self._last, None
        if last is not None:
            self.cost_ms[last.level] += max(float(cpu_ms), 0.0) * (1.0 if last.first else COST_EWMA)

    def describe(self) -> dict:
        budget = self.budget_ms
        return {
            "plan_budget": self.setting,
            "plan_budget_planners": self.planners,  # several: every plan's level agreed on by all of them
            "plan_budget_ms_now": None if budget is None else round(budget, 3),
            "step_ms_ewma": None if self.step_ms is None else round(self.step_ms, 3),
            "plans_full": self.counts.full,
            "plans_reduced": self.counts.reduced,
            "plans_static": self.counts.static,
        }
