"""`HeraldOptions`: every Herald setting in one frozen record, validated once when it is built.

    options = HeraldOptions(cache_ratio=0.1, policy="herald", lookahead=4, prefetch=2)
    sharder = HeraldEmbeddingBagCollectionSharder(options=options, fused_params=...)
    pipeline = HeraldTrainPipeline(model, optimizer, device, options=options)

The sharder carries the scheduler's settings (cache ratio, policy, look-ahead) into the sharded modules and keeps the
unscheduled tables with TorchRec; the pipeline reads the scheduler's settings back from those modules and takes its
input stage's settings (plan_on, prefetch, input_priority) and the policy's own options from the options it is given;
the app (train.py) builds one from `scheduler.*` and hands it to both. Keyword settings of the sharder and the
pipeline go through `dataclasses.replace`, so they are checked by the same code.

A bad value is an `OptionError` (a ValueError) of one line naming the setting, what it takes and the value given;
`HeraldOptions.named("scheduler.", ...)` names it as the app's config key. No torch here: the app and the control
plane use it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

PLAN_ON = ("host", "rank0", "every_rank")  # who makes the plans (HeraldOptions.plan_on)
INPUT_PRIORITIES = ("normal", "low", "idle")  # CPU priorities of the input stage's thread (input_thread.py says why)
PREFETCH = 2  # batches the background input stage runs ahead of training by default (input_thread.py says why)
NATIVE_MODES = ("auto", "on", "off")  # when Herald's compiled kernels are used


class OptionError(ValueError):
    """A Herald setting given a value it cannot take: one line naming the setting, what it takes and the value."""

    def __init__(self, setting: str, requirement: str, prefix: str = "") -> None:
        self.setting, self.requirement = setting, requirement
        super().__init__(f"{prefix}{setting} {requirement}")

    def named(self, prefix: str) -> OptionError:
        """The same error with the setting named as `prefix` + its name (e.g. the app's `scheduler.` config key)."""
        return OptionError(self.setting, self.requirement, prefix)


@contextmanager
def settings_named(prefix: str) -> Iterator[None]:
    """Within the block, a bad setting's error names it as `prefix` + its name."""
    try:
        yield
    except OptionError as e:
        raise e.named(prefix) from None


def check_cache_ratio(cache_ratio: object) -> float:
    """`cache_ratio` as a float in (0, 1] (the guest capacity's share of a table's rows), or an OptionError."""
    if not isinstance(cache_ratio, (int, float)) or isinstance(cache_ratio, bool) or not (0.0 < cache_ratio <= 1.0):
        raise OptionError("cache_ratio", f"must be in (0, 1], got {cache_ratio!r}")
    return float(cache_ratio)


def check_prefetch(prefetch: object) -> int:
    """`prefetch` as a queue depth: an integer >= 0 (2.5 must not become 2, nor True become 1)."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise OptionError(
            "prefetch",
            "must be an integer >= 0 (batches the input stage schedules ahead of training; "
            f"0 = in the training thread), got {prefetch!r}",
        )
    return prefetch


def check_native(native: object) -> str:
    """`native` as one of `NATIVE_MODES`, or an OptionError."""
    if native not in NATIVE_MODES:
        raise OptionError("native", f"must be one of {list(NATIVE_MODES)} (Herald's compiled kernels), got {native!r}")
    return str(native)


SCHEDULER_SETTINGS = ("policy", "cache_ratio", "lookahead")  # what the sharded modules carry for the pipeline


@dataclasses.dataclass(frozen=True)
class HeraldOptions:
    """Every Herald setting with its default (module docstring: who reads which). Checked once, when built (and
    again by `dataclasses.replace`, which builds a new one): a bad value is a one-line `OptionError`."""

    cache_ratio: float = 0.1
    """Guest rows per rank and table, as a share of the table's rows, in (0, 1]."""
    policy: str = "herald"
    """The scheduling policy's name (`herald_torchrec.schedule.POLICIES`)."""
    lookahead: int = 1
    """Future global batches the scheduler sees (>= 0)."""
    policy_options: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}), hash=False)
    """The policy's own settings (e.g. fae's `hot_budget`, het's `staleness`, herald's `replicate`), checked by the
    policy; `replicate` (herald: rows every host reads replicated on every rank) is also checked here, since the
    sharder reads it to give the modules their replica region (`replicates`)."""
    unscheduled_tables: Collection[str] = frozenset()
    """Tables left to TorchRec's own sharding (a frozenset of table names)."""
    plan_on: str = "host"
    """Who plans: "host" (the lowest rank of each machine), "rank0", or "every_rank"."""
    prefetch: int = PREFETCH
    """Batches the input stage's background thread schedules ahead of training (0: in the training thread)."""
    input_priority: str = "low"
    """CPU priority of the input stage's thread: "low" (nice 19), "idle" (SCHED_IDLE) or "normal"."""
    cut_thread: bool = True
    """A planner that sends its ranks their parts of each plan cuts them on a thread of its own (a second core) while
    it makes the next plan, plans made a round earlier for it; False cuts them on the input stage's thread."""
    native: str = "auto"
    """Herald's compiled kernels: "auto", "on" (an error if they cannot build) or "off" (numpy only)."""
    host_relay: bool = True
    """Where ranks share hosts, a shared row crosses to each reading host once and one gradient sum crosses back
    (one reader per host relays: distributed/step/host_relay.py); False sends to and from every reader directly."""

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)  # frozen: normalised values are set once, here

        put("cache_ratio", check_cache_ratio(self.cache_ratio))
        if not isinstance(self.policy, str) or not self.policy:
            raise OptionError("policy", f"must be a non-empty string, got {self.policy!r}")
        try:
            lookahead = int(self.lookahead)  # as the sharder always took it
        except (TypeError, ValueError):
            lookahead = -1
        if lookahead < 0:
            raise OptionError(
                "lookahead",
                f"must be an integer >= 0 (future global batches the scheduler sees), got {self.lookahead!r}",
            )
        put("lookahead", lookahead)
        if not isinstance(self.policy_options, Mapping) or not all(isinstance(k, str) for k in self.policy_options):
            raise OptionError(
                "policy_options",
                "must be a mapping of the policy's settings by name (e.g. "
                f"{{'staleness': 0}}), got {self.policy_options!r}",
            )
        put("policy_options", MappingProxyType(dict(self.policy_options)))
        if not isinstance(self.policy_options.get("replicate", False), bool):
            raise OptionError(
                "policy_options",
                f"replicate must be true or false (rows replicated on every rank), got "
                f"{self.policy_options['replicate']!r}",
            )
        if isinstance(self.unscheduled_tables, str):
            raise OptionError(
                "unscheduled_tables", f"must be a collection of table names, got the string {self.unscheduled_tables!r}"
            )
        try:
            put("unscheduled_tables", frozenset(self.unscheduled_tables))
        except TypeError:
            raise OptionError(
                "unscheduled_tables", f"must be a collection of table names, got {self.unscheduled_tables!r}"
            ) from None
        if self.plan_on not in PLAN_ON:
            raise OptionError("plan_on", f"must be one of {list(PLAN_ON)} (where plans are made), got {self.plan_on!r}")
        put("prefetch", check_prefetch(self.prefetch))
        if self.input_priority not in INPUT_PRIORITIES:
            raise OptionError(
                "input_priority",
                f"must be one of {list(INPUT_PRIORITIES)} (the CPU priority of the "
                f"input stage's thread), got {self.input_priority!r}",
            )
        put("native", check_native(self.native))
        if not isinstance(self.host_relay, bool):
            raise OptionError("host_relay", f"must be true or false, got {self.host_relay!r}")
        if not isinstance(self.cut_thread, bool):
            raise OptionError("cut_thread", f"must be true or false, got {self.cut_thread!r}")

    @classmethod
    def named(cls, prefix: str, base: HeraldOptions | None = None, **settings: Any) -> HeraldOptions:
        """`base` (default: the defaults) with `settings` replaced; a bad one's error names it as `prefix` + its
        name (`HeraldOptions.named("scheduler.", plan_on="x")` -> "scheduler.plan_on must be one of ...")."""
        with settings_named(prefix):
            return dataclasses.replace(base if base is not None else cls(), **settings)

    def runnable_policy(self) -> str:
        """The policy's name if the data plane can execute its plans with `policy_options`, else a ValueError (an
        unknown policy, a counting-only one). Not checked when built: the sharder takes any name, for modules driven
        by a plan source of one's own; the pipeline checks it before building the policy, the app up front."""
        from herald_torchrec.schedule import runnable_policy

        return runnable_policy(self.policy, **self.policy_options)

    @property
    def replicates(self) -> bool:
        """Whether the policy replicates rows on every rank (`policy_options["replicate"]`): the sharded modules
        then run the replica region (distributed/step/replicas.py)."""
        return bool(self.policy_options.get("replicate", False))

    def scheduler_settings(self) -> dict[str, Any]:
        """The settings the sharded modules carry for the pipeline's scheduler (`SCHEDULER_SETTINGS`)."""
        return {name: getattr(self, name) for name in SCHEDULER_SETTINGS}


__all__ = [
    "INPUT_PRIORITIES",
    "NATIVE_MODES",
    "PLAN_ON",
    "PREFETCH",
    "SCHEDULER_SETTINGS",
    "HeraldOptions",
    "OptionError",
    "check_cache_ratio",
    "check_native",
    "check_prefetch",
    "settings_named",
]
