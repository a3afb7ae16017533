"""`HeraldTrainPipeline`: TorchRec's `TrainPipelineSparseDist` with Herald's input-permutation stage in front.

    pipeline = HeraldTrainPipeline(model, optimizer, device)   # TrainPipelineSparseDist's signature
    for _ in range(steps):
        pipeline.progress(batches)   # an iterator of torchrec Batch (or any Pipelineable): this rank's slices

Everything Herald needs comes from the sharded model: the Herald-managed modules (every EBC sharded by
`HeraldEmbeddingBagCollectionSharder`, the Herald part of mixed EBCs included) give the tables, the features that
read them and the scheduler's settings (policy, cache ratio, lookahead: the sharder is the one place they are set).
The pipeline's own settings (the input stage's `plan_on`, `prefetch`, `input_priority`, `host_relay`, and the policy's
options) are
a `HeraldOptions` too (herald_torchrec/options.py): `options=` (e.g. the sharder's `sharder.options`) and keywords.
The first batch gives the batch size per rank. The input stage (`ScheduledInput`) then gathers ids from the KJTs,
plans L global batches ahead, exchanges samples so that this rank holds exactly the B the plan assigns it, and
queues each plan on the modules (split by module when there are several). Plans are consumed one per training
forward, in order, so the pipeline's look-ahead of a batch or two keeps them aligned.

Evaluation (model.eval(): plain forwards or `EvalPipelineSparseDist`) never touches training plans: the modules
serve eval batches with read-only static plans of their own, which move no rows.

The input stage's collectives run on host tensors, over a gloo process group of their own (so a model trained
with NCCL works, and the CPU tests run the same path).

The background thread runs at a lower CPU priority (`input_priority`, default "low"; input_thread.py says why), and
the pipeline records how long training waits for it (`input_wait_ms`). It hands each step's time (without that wait)
and the wait to a policy that takes them (`observe_step`: Herald's planning budget, schedule/herald/budget.py, which
makes cheaper plans when planning falls behind a step), and tells it how many ranks make plans (`set_planners`;
several agree on each plan's level through the input stage's header words): the pipeline measures, the policy decides.

`close()` stops that thread at a round every rank agrees on (collective: every rank, after the same number of
`progress()` calls, before `destroy_process_group()`). A loop over an endless iterator otherwise ends with the
thread inside a gloo collective, and the process aborts at exit ("terminate called without an active exception",
SIGABRT: torchrun reports the job failed): the pipeline closes itself at interpreter exit for a script that did not,
with a shorter wait. A stream that ended (a finite iterator, an epoch) needs nothing.
"""

from __future__ import annotations

import atexit
import time
import warnings
import weakref
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from herald_torchrec.distributed.comm import PlanComm, default_group_timeout, release_gloo_tensors
from herald_torchrec.distributed.embeddingbag import ShardedHeraldEmbeddingBagCollection
from herald_torchrec.distributed.train_pipeline.input_layout import ManagedTables
from herald_torchrec.distributed.train_pipeline.input_stage import ScheduledInput
from herald_torchrec.distributed.train_pipeline.input_thread import CLOSE_TIMEOUT_S, WAITS_KEPT, PrefetchedInput
from herald_torchrec.options import SCHEDULER_SETTINGS, HeraldOptions
from herald_torchrec.schedule import POLICIES, make_policy
from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.plan import Plan
from herald_torchrec.schedule.policy import SchedulePolicy

WHERE = "HeraldTrainPipeline: "  # how the pipeline's errors about a setting begin
EXIT_CLOSE_TIMEOUT_S = 10.0  # close() at interpreter exit waits this long for the other ranks' stages
_RUNNING: "weakref.WeakSet[HeraldTrainPipeline]" = weakref.WeakSet()  # pipelines with a background stage, unclosed
_exit_hook = False


def _close_at_exit() -> None:
    """Close the pipelines a script left with a background input stage (registered when the first one starts, so
    it runs before exit hooks registered earlier, e.g. by torch.distributed's set-up)."""
    for pipeline in list(_RUNNING):
        pipeline.close(timeout=EXIT_CLOSE_TIMEOUT_S)
    release_gloo_tensors()  # the stages' last collectives, whichever exit hook was registered first


def herald_modules(model: torch.nn.Module) -> list[ShardedHeraldEmbeddingBagCollection]:
    """Every Herald-managed sharded module in a (DMP-wrapped) model, including the Herald part of a mixed EBC."""
    return [m for m in model.modules() if isinstance(m, ShardedHeraldEmbeddingBagCollection)]


def managed_tables(modules: list[ShardedHeraldEmbeddingBagCollection]) -> ManagedTables:
    """The modules' tables in one table space (module after module), with the features that read each table."""
    names, rows, features, offsets = [], [], [], []
    for m in modules:
        offsets.append(len(names))
        for t, name in enumerate(m.table_names):
            names.append(name)
            rows.append(int(m.store.rows[t]))
            features.append(tuple(f for f, ft in zip(m.feature_names, m.feature_table) if ft == t))
    return ManagedTables(tuple(names), tuple(rows), tuple(features), tuple(offsets))


def host_process_group() -> Optional[dist.ProcessGroup]:
    """A gloo group over every rank for the host-side input stage (None without torch.distributed). Collective:
    every rank builds it, in the same order. It waits as long as the default group does (`new_group` alone would
    give it torch's 30 minutes whatever the user chose), so a dead peer is an error in the user's time."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=default_group_timeout())


def scheduler_settings(modules: list[ShardedHeraldEmbeddingBagCollection]) -> dict[str, Any]:
    """The scheduler settings the modules were sharded with (they must agree: one scheduler plans them all)."""
    settings = [{name: getattr(m, name) for name in SCHEDULER_SETTINGS} for m in modules]
    if any(s != settings[0] for s in settings[1:]):
        raise ValueError(
            f"the Herald-managed modules were sharded with different scheduler settings {settings}; "
            "shard every EBC with the same HeraldEmbeddingBagCollectionSharder settings"
        )
    return settings[0]


def warn_if_batch_coupled(model: torch.nn.Module) -> None:
    """Layers that mix the samples of a rank's batch (batch norm) see other batches under Herald, whose scheduler
    decides which samples train together on a rank: the trained model then differs from stock training."""
    bn = [n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if bn:
        warnings.warn(
            f"HeraldTrainPipeline: the model has batch-norm layers {bn[:3]}{'...' if len(bn) > 3 else ''}; Herald "
            "assigns samples to ranks by where their embeddings live, so each rank's batch statistics differ from "
            "stock training and the trained model is no longer the same (see README, Known limitations)",
            stacklevel=3,
        )


class WaitRecord(deque):
    """The training thread's recent waits for its batch (ms, the last `maxlen`), and their running total: the
    pipeline takes a step's wait from the total, however many batches the step drew."""

    def __init__(self, iterable: Iterable[float] = (), maxlen: Optional[int] = None) -> None:
        super().__init__(iterable, maxlen=maxlen)
        self.total_ms = float(sum(self))

    def append(self, ms: float) -> None:
        super().append(ms)
        self.total_ms += ms


class HeraldTrainPipeline(TrainPipelineSparseDist):
    """`TrainPipelineSparseDist` whose `progress(iterator of Batch or any Pipelineable)` schedules each global batch
    first (a Pipelineable other than Batch travels field by field: input_codec.py).

    Extra keyword arguments: `options` (a `HeraldOptions`, e.g. the sharder's: its policy, cache ratio and lookahead
    must be those the modules were sharded with) gives the settings below, which the keywords `prefetch`, `plan_on`,
    `input_priority`, `host_relay`, `cut_thread` and `policy_options` replace (both checked by `HeraldOptions`,
    before any set-up); `on_plan(plan)` is called with the plan of every batch once it has trained (statistics):
    this rank's part of it (`PlanPart`: its moves, shared rows and samples; the counters are the whole step's) where
    parts pay (ranks on several machines, or 9+), else the whole plan (and with `plan_on="every_rank"`, replicas or
    HET's caches); `host_group` overrides the gloo group of the input stage; `prefetch` (default 2) is how many
    batches a background thread schedules and exchanges ahead of training (0: in the training thread, as TorchRec
    draws batches; input_thread.py says why the default is short); `plan_on` (default "host") where plans are made:
    the lowest rank of each machine plans and sends each plan to the other ranks of its machine (~11 KB per step on
    W&D at R=2; the scheduler's CPU once per machine and step, not once per rank), "rank0" (rank 0 plans for every
    rank) or "every_rank" (each rank runs the same deterministic scheduler, nothing is sent); `input_priority`
    (default "low") the CPU priority of the background thread (with `prefetch` > 0): "low" (nice 19), "idle"
    (SCHED_IDLE) or "normal" (input_thread.py says why); `policy_options` go to the policy (e.g. fae's `hot_budget`,
    het's `staleness`); `host_relay` (default True): where ranks share machines, each shared row crosses to a
    reading machine once and one gradient sum crosses back (distributed/step/host_relay.py); `cut_thread` (default
    True): a planner that sends parts cuts each plan's on a thread of its own while it makes the next plan
    (input_stage.py); `profile` (global batches, the scheduler's view) is handed to `policy.profile()` when the
    policy is built (fae / p2res choose their replicated rows from it). The rest go to TrainPipelineSparseDist.

    `input_wait_ms` holds, per batch (the last `WAITS_KEPT`), how long the training thread waited for the
    background input stage (with `prefetch` > 0): ~0 while the stage keeps ahead of training."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        *args: Any,
        on_plan: Optional[Callable[[Plan], None]] = None,
        host_group: Optional[dist.ProcessGroup] = None,
        options: Optional[HeraldOptions] = None,
        prefetch: Optional[int] = None,
        plan_on: Optional[str] = None,
        input_priority: Optional[str] = None,
        policy_options: Optional[dict[str, Any]] = None,
        host_relay: Optional[bool] = None,
        cut_thread: Optional[bool] = None,
        profile: Optional[list[GlobalBatch]] = None,
        **kwargs: Any,
    ) -> None:
        given = {
            "prefetch": prefetch,
            "plan_on": plan_on,
            "input_priority": input_priority,
            "policy_options": policy_options,
            "host_relay": host_relay,
            "cut_thread": cut_thread,
        }
        given_options = options is not None
        # checked before any set-up: a typo must not cost a model build
        options = HeraldOptions.named(WHERE, options, **{k: v for k, v in given.items() if v is not None})
        super().__init__(model, optimizer, device, execute_all_batches, *args, **kwargs)
        modules = herald_modules(model)
        if not modules:
            left = {t: r.reason for m in model.modules() for t, r in getattr(m, "herald_refusals", {}).items()}
            why = (
                f": HeraldEmbeddingBagCollectionSharder left every table to TorchRec ({left}); train it with "
                "TrainPipelineSparseDist"
                if left
                else " (shard it with HeraldEmbeddingBagCollectionSharder)"
            )
            raise ValueError(f"HeraldTrainPipeline: the model has no Herald-managed sharded module{why}")
        self._herald_modules = modules
        sharded_with = scheduler_settings(modules)
        ours = options.scheduler_settings()
        if given_options and ours != sharded_with:
            raise ValueError(
                f"HeraldTrainPipeline: options has the scheduler settings {ours}, but the modules were "
                f"sharded with {sharded_with}; pass the sharder's options (sharder.options)"
            )
        # the scheduler's settings as the modules carry them, the rest as given
        self.options = HeraldOptions.named(WHERE, options, **sharded_with)
        if self.options.replicates and not all(m.runs_replicas for m in modules):
            raise ValueError(
                "HeraldTrainPipeline: policy_options has replicate=True, but the modules were sharded without a "
                "replica region; shard with the same options (sharder.options)"
            )
        self._profile = profile
        self.tables = managed_tables(modules)
        self._bounds = [(lo, lo + len(m.table_names)) for lo, m in zip(self.tables.module_offsets, modules)]
        warn_if_batch_coupled(model)
        group = host_group if host_group is not None else host_process_group()
        self.input_stage = ScheduledInput(
            self.tables,
            PlanComm(group),
            self._make_policy,
            plan_on=self.options.plan_on,
            cut_thread=self.options.cut_thread,
        )
        self._on_plan = on_plan
        # wall ms the training thread waited for each batch of the background input stage: near 0 while the stage
        # keeps ahead; steadily high means it cannot (a starved low-priority thread, or a scheduler slower than a step).
        # The most recent WAITS_KEPT batches only, so that a long run does not grow it without bound
        self.input_wait_ms = WaitRecord(maxlen=WAITS_KEPT)
        self._in_flight: deque[Optional[Plan]] = deque()  # plans of the batches drawn and not yet trained
        self._source: Optional[Iterable[Batch]] = None
        self._scheduled: Optional[Iterator[Batch]] = None
        self._prefetched: Optional[PrefetchedInput] = None  # the background stage of the current stream
        self._closed = False
        self._stream_ended = True  # the current iterator's stream ran to its end (or there is none yet)
        self._ownership = self._ownership_versions()
        self.trained_counters: dict[str, int] = {}  # this rank's rows by kind over training steps (not eval)

    @property
    def policy(self) -> Optional[SchedulePolicy]:
        """The scheduler (built at the first batch; None on the ranks that receive their plans, see `plan_on`)."""
        return self.input_stage.policy

    def _make_policy(self, batch_per_rank: int) -> SchedulePolicy:
        o = self.options
        world = self.input_stage.R
        name = o.runnable_policy()
        extra: dict[str, Any] = {}
        hosts = self.input_stage.hosts
        if hosts is not None:  # the data plane relays shared rows through one rank per host (where hosts are shared)
            for m in self._herald_modules:
                m.set_hosts(hosts, relay=o.host_relay)
            self.input_stage.relay_hosts = self._herald_modules[0].hosts  # the parts of the plans keep their relays
        if getattr(POLICIES[name], "takes_hosts", False) and hosts is not None and "hosts" not in o.policy_options:
            # the ranks grouped by machine, as every rank gathered them: host-aware LAIA across machines (all
            # ranks on one machine: one host, the plans are those without a host map)
            extra["hosts"] = [int(h) for h in hosts]
        policy = make_policy(
            name,
            list(self.tables.rows),
            world,
            batch_per_rank,
            cache_ratio=o.cache_ratio,
            lookahead=o.lookahead,
            **o.policy_options,
            **extra,
        )
        if self._profile is not None:
            policy.profile(self._profile)
        set_planners = getattr(policy, "set_planners", None)
        if set_planners is not None:  # the input stage knows who plans before it builds the policy
            set_planners(int(self.input_stage.is_planner.sum()))
        return policy

    def _ownership_versions(self) -> tuple[int, ...]:
        return tuple(int(getattr(m, "ownership_version", 0)) for m in self._herald_modules)

    def _queue(self, plan: Plan) -> None:
        if len(self._herald_modules) == 1:
            self._herald_modules[0].set_plan(plan)
        else:
            for m, (lo, hi) in zip(self._herald_modules, self._bounds):
                m.set_plan(plan.for_tables(lo, hi))

    def _schedule(self, source: Iterator[Batch]) -> Iterator[Batch]:
        """Batches in training order, each with its plan queued on the modules as it is drawn (in the main thread,
        so queue and forwards stay aligned). With `prefetch`, a background thread runs the input stage (ids gather,
        scheduling, sample exchange) up to `prefetch` batches ahead while the model trains."""
        global _exit_hook
        depth, priority = self.options.prefetch, self.options.input_priority
        if not depth:
            stream = self.input_stage(source)
        else:
            stream = self._prefetched = PrefetchedInput(
                self.input_stage, source, depth, priority, self.input_wait_ms, stop=self.input_stage.request_stop
            )
            _RUNNING.add(self)
            if not _exit_hook:
                atexit.register(_close_at_exit)
                _exit_hook = True
        self._stream_ended = False
        for batch, plan, generation in stream:
            current = generation == self.input_stage.generation
            if current:
                self._queue(plan)
            else:  # planned before a checkpoint load reset ownership: the step runs the static plan instead
                for m in self._herald_modules:
                    m.set_plan(None)
            self._in_flight.append(plan if current else None)
            yield batch
        self._stream_ended = True

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the background input stage (module docstring): collective, every rank after the same number of
        `progress()` calls. The batches it had scheduled ahead are dropped, so the pipeline trains no more after it
        (evaluation, `state_dict()` and checkpoints are unaffected). Idempotent; a no-op without a background stage."""
        if self._closed:
            return
        self._closed = True
        _RUNNING.discard(self)
        stage, self._prefetched = self._prefetched, None
        if stage is not None and not stage.close(timeout):
            warnings.warn(
                f"HeraldTrainPipeline.close(): the input stage did not stop within {timeout:.0f} s (close() "
                "is collective: every rank calls it after the same number of progress() calls); its thread "
                "is left running",
                RuntimeWarning,
                stacklevel=2,
            )

    def progress(self, dataloader_iter: Iterator[Batch]) -> Any:
        if self._closed:
            raise RuntimeError(
                "HeraldTrainPipeline.progress: the pipeline is closed (close() was called) and trains "
                "no more: the batches its input stage had scheduled ahead were dropped"
            )
        if not self._model.training:
            raise ValueError(
                "HeraldTrainPipeline.progress trains: call model.train() first; evaluate with a plain "
                "forward or torchrec's EvalPipelineSparseDist (they never touch training plans)"
            )
        versions = self._ownership_versions()
        if versions != self._ownership:  # a checkpoint load reset ownership to home and dropped the queued plans
            self.input_stage.reset_policy()  # plan from the home placement from now on
            for m in self._herald_modules:  # the batches already drawn run static plans, in their places
                for _ in self._in_flight:
                    m.set_plan(None)
            self._in_flight = deque([None] * len(self._in_flight))
            self._ownership = versions
        if dataloader_iter is not self._source:
            if not self._stream_ended:  # else the scheduler's view of who owns which row would no longer hold
                raise ValueError(
                    "HeraldTrainPipeline.progress: a different iterator while the previous one still has batches "
                    "scheduled: the input stage plans ahead, and the scheduler has already moved rows for batches of "
                    "the previous iterator that would never train. Pass the same iterator until progress() raises "
                    "StopIteration (an epoch), then the next one"
                )
            self._source = dataloader_iter
            self._scheduled = self._schedule(iter(dataloader_iter))
        started, waited_before = time.perf_counter(), self.input_wait_ms.total_ms
        out = super().progress(self._scheduled)  # type: ignore[arg-type]
        self._observe_step(started, waited_before)
        for m in self._herald_modules:
            # the step ends here: its shared rows' update (a no-op if the fused optimizer's step already did it).
            # With only dense optimizers given (in-backward embedding optimizers) it would otherwise wait for the
            # next forward, which resets the step's counters before its shared-gradient rows are counted
            m.finish_step()
        trained = self._in_flight.popleft() if self._in_flight else None  # the plan of the batch just trained
        if trained is not None and self._on_plan is not None:
            self._on_plan(trained)
        for m in self._herald_modules:
            for k, v in (*m.step_counters.items(), *m.step_host_rows.items()):
                self.trained_counters[k] = self.trained_counters.get(k, 0) + int(v)
        return out

    def _observe_step(self, started: float, waited_before: float) -> None:
        """Hand the step's wall time without its wait for input, and that wait, to a policy that takes them (on the
        rank that plans). With `prefetch=0` the step itself plans: there is no separate step time to budget by."""
        observe = getattr(self.policy, "observe_step", None)
        if observe is None or not self.options.prefetch:
            return
        waited = self.input_wait_ms.total_ms - waited_before
        observe((time.perf_counter() - started) * 1e3 - waited, waited)
