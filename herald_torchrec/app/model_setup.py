"""Turn the app's model into a DistributedModelParallel + train pipeline for the chosen scheduler.

`scheduler=torchrec` is stock TorchRec: the planner (optionally restricted to some sharding types) with the stock
EmbeddingBagCollectionSharder and TrainPipelineSparseDist. The Herald schedulers plug in here with their own sharder
and pipeline, behind the same small `ShardedSetup` surface the trainer uses.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import CacheParams, ShardingEnv, ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from herald_torchrec.app.metrics import hbm_cache_stats
from herald_torchrec.app.model_state import load_torchrec_tables
from herald_torchrec.app.runtime import DistContext
from herald_torchrec.data.batch import to_batch
from herald_torchrec.data.samples import Samples
from herald_torchrec.data.source import DataSource
from herald_torchrec.distributed.embeddingbag import HOST_ROW_KINDS
from herald_torchrec.distributed.sharder import with_row_wise
from herald_torchrec.models import FeatureSpec, TrainModel, table_name
from herald_torchrec.options import HeraldOptions, check_native, settings_named
from herald_torchrec.schedule.plan import Plan

CONFIG_KEY = "scheduler."  # the app's Herald settings are scheduler.* (conf/scheduler/*.yaml)
SHARDING_TYPES = {
    "row_wise": ShardingType.ROW_WISE,
    "table_wise": ShardingType.TABLE_WISE,
    "column_wise": ShardingType.COLUMN_WISE,
    "table_row_wise": ShardingType.TABLE_ROW_WISE,
    "data_parallel": ShardingType.DATA_PARALLEL,
}


class StockSharder(EmbeddingBagCollectionSharder):
    """TorchRec's EBC sharder, offering ROW_WISE and TABLE_ROW_WISE on CPU too (stock offers them on CUDA only; both run
    on CPU / gloo)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return with_row_wise(super().sharding_types(compute_device_type))


@dataclass
class ShardedSetup:
    """What the trainer drives: the sharded model, its pipeline, and how local samples become pipeline inputs."""

    name: str
    model: torch.nn.Module
    pipeline: Any
    train_batches: Callable[[Iterator[Samples]], Iterator[Any]]  # called once per training stream
    eval_batches: Callable[[Iterator[Samples]], Iterator[Any]]
    dense_optimizer: Any  # KeyedOptimizer of the dense parameters (its state goes into checkpoints)
    step_stats: Callable[[], dict[str, float]] = field(default=lambda: {})
    final_stats: Callable[[int], dict[str, Any]] = field(default=lambda steps: {})
    # bytes sent by collectives the training-step counter cannot see (Herald's input stage counts its own: it may run
    # in a background thread)
    host_bytes: Callable[[], int] = field(default=lambda: 0)
    # a step of the global training stream before ranks take their slices (fae's hot/cold reordering), or None
    reorder: Callable[[Iterator[Samples]], Iterator[Samples]] | None = None


@dataclass
class _Tally:
    rows: dict[str, int] = field(default_factory=dict)
    hits: int = 0
    pairs: int = 0
    steps: int = 0
    stale_reads: int = 0

    def add(self, plan: Plan) -> None:
        for k, v in plan.counters.items():
            self.rows[k] = self.rows.get(k, 0) + int(v)
        self.hits += int(plan.counters.get("hit", 0))
        self.pairs += plan.read_pairs()
        self.stale_reads += int(plan.stale_reads)
        self.steps += 1

    def hit_rate(self) -> float:
        return self.hits / self.pairs if self.pairs else float("nan")


class PlanStats:
    """Scheduler counters over the run and over the current logging window (global: plans are global)."""

    def __init__(self) -> None:
        self.total, self.win = _Tally(), _Tally()
        self.last_window_steps = 0  # steps in the window `window()` last returned

    def add(self, plan: Plan) -> None:
        self.total.add(plan)
        self.win.add(plan)

    def window(self) -> dict[str, float]:
        """Rows per step by kind and the hit rate since the last call (for progress lines / TensorBoard)."""
        w, self.win = self.win, _Tally()
        self.last_window_steps = w.steps
        out = {f"rows_{k}": v / max(w.steps, 1) for k, v in w.rows.items() if k != "hit"}
        out["hit_rate"] = w.hit_rate()
        return out


def stock_sharding_types(cfg: DictConfig, model_parallel_only: bool = False) -> list[str] | None:
    """`sharding.types` as TorchRec values (None: the planner may pick any type)."""
    types = cfg.sharding.get("types")
    if not types:
        return None
    bad = [t for t in types if t not in SHARDING_TYPES]
    if bad:
        raise ValueError(f"sharding.types: unknown {bad}; choose from {sorted(SHARDING_TYPES)}")
    if model_parallel_only:
        if "data_parallel" in types:
            raise ValueError(
                "sharding.types: data_parallel is not available for tables left unscheduled by Herald "
                "(they train with the fused embedding optimizer); use row_wise, table_wise or column_wise"
            )
    return [SHARDING_TYPES[t].value for t in types]


# trainer.embedding_optimizer -> (the in-backward optimizer class, FBGEMM's fused optimizer, whether it takes eps)
EMBEDDING_OPTIMIZERS: dict[str, tuple[type, str, bool]] = {
    "rowwise_adagrad": (RowWiseAdagrad, "exact_rowwise_adagrad", True),
    "adagrad": (torch.optim.Adagrad, "exact_adagrad", True),  # per-element state, as torch.optim.Adagrad
    "sgd": (torch.optim.SGD, "exact_sgd", False),
}


def _embedding_optimizer_kwargs(cfg: DictConfig) -> dict[str, Any]:
    t = cfg.trainer
    takes_eps = EMBEDDING_OPTIMIZERS[t.embedding_optimizer][2]
    return {"lr": t.embedding_lr, **({"eps": t.get("embedding_eps", 1e-8)} if takes_eps else {})}


def fused_optimizer(cfg: DictConfig) -> tuple[type, dict[str, Any]]:
    """The embedding optimizer as `apply_optimizer_in_backward` takes it (stock TorchRec sharders)."""
    return EMBEDDING_OPTIMIZERS[cfg.trainer.embedding_optimizer][0], _embedding_optimizer_kwargs(cfg)


def dense_optimizer(model: torch.nn.Module, cfg: DictConfig) -> KeyedOptimizerWrapper:
    t = cfg.trainer
    make = {
        "adam": lambda p: torch.optim.Adam(p, lr=t.dense_lr),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=t.dense_lr),
        "sgd": lambda p: torch.optim.SGD(p, lr=t.dense_lr),
    }[t.dense_optimizer]
    return KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())), make)


def sample_converter(features: FeatureSpec, source: DataSource) -> Callable[[Samples], Any]:
    keys, names = list(features.names), list(source.feature_names)
    return lambda s: to_batch(s, keys, names)


def batch_converter(features: FeatureSpec, source: DataSource) -> Callable[[Iterator[Samples]], Iterator[Any]]:
    convert = sample_converter(features, source)
    return lambda it: (convert(s) for s in it)


def ranks_per_machine(world_size: int) -> int:
    """The ranks per machine as TorchRec reads them (`get_local_size`: torchrun's LOCAL_WORLD_SIZE or MPI's, else 8
    where that divides the world, else the world), which its TABLE_ROW_WISE groups shards by and DMP's default planner
    uses; one process is one machine."""
    from torchrec.distributed.comm import get_local_size

    return 1 if world_size <= 1 else get_local_size(world_size)


def planner_topology(ctx: DistContext) -> Topology:
    """The planner's topology, its ranks per machine as TorchRec's sharding and DMP's default planner read them
    (`ranks_per_machine`; a Topology without them takes the whole world for one machine: its cost model then prices
    every link as inside a machine, and its TABLE_ROW_WISE shards span machines while the sharding groups them by
    machine, which fails to build).
    Where ranks share GPUs (more local ranks than GPUs: `init_distributed` then puts rank r on GPU r % GPUs), shard
    placements must name that GPU, or TorchRec rejects its own shards ("Local shard tensor device does not match"):
    placements are cuda:(rank % local_world_size)."""
    local = ranks_per_machine(ctx.world_size)  # (it divides the world: TorchRec falls back to the world where not)
    kw: dict[str, Any] = {"local_world_size": local}
    if ctx.device.type == "cuda" and torch.cuda.device_count() < local:
        kw["local_world_size"] = torch.cuda.device_count()
    return Topology(world_size=ctx.world_size, compute_device=ctx.device.type, **kw)


def hbm_cache(cfg: DictConfig) -> tuple[str | None, float | None]:
    """Optional `sharding.compute_kernel` (stock: e.g. fused_uvm_caching) and `sharding.cache_load_factor` (stock
    tables and Herald's MANAGED_CACHING tables on CUDA); absent keys leave the planner's / module's defaults."""
    sc = cfg.get("sharding") or {}
    clf = sc.get("cache_load_factor")
    kernel = sc.get("compute_kernel")
    if kernel is not None:
        kernel = str(kernel)
        known = sorted(k.value for k in EmbeddingComputeKernel)
        if kernel not in known:
            raise ValueError(f"sharding.compute_kernel: unknown {kernel!r}; choose from {known}")
    if clf is not None:
        try:
            clf = float(clf)
        except (TypeError, ValueError):
            clf = float("nan")  # reported below with the value as given
        if not 0.0 < clf <= 1.0:
            raise ValueError(
                f"sharding.cache_load_factor must be a number in (0, 1] (the share of a table's rows the "
                f"HBM cache holds), got {sc.get('cache_load_factor')!r}"
            )
    return kernel, clf


def check_kernel_device(kernel: str | None, device: torch.device) -> None:
    """TorchRec's UVM kernels keep tables in CUDA unified memory: on CPU its planner finds no kernel for any table and
    fails with a long trace, so say here which setting cannot work and what to use."""
    if kernel is not None and "uvm" in kernel and device.type != "cuda":
        raise ValueError(
            f"sharding.compute_kernel={kernel} keeps the tables in CUDA unified memory and needs a GPU; "
            f"this run is on {device.type}: use fused, or leave sharding.compute_kernel out"
        )


def _torchrec(
    model: TrainModel, features: FeatureSpec, source: DataSource, cfg: DictConfig, ctx: DistContext
) -> ShardedSetup:
    init = {n: bag.weight.detach().clone() for n, bag in model.model.ebc.embedding_bags.items()}
    opt_cls, opt_kw = fused_optimizer(cfg)
    apply_optimizer_in_backward(opt_cls, model.model.ebc.parameters(), opt_kw)
    types = stock_sharding_types(cfg)
    kernel, clf = hbm_cache(cfg)
    check_kernel_device(kernel, ctx.device)
    constraints = (
        {
            table_name(n): ParameterConstraints(
                sharding_types=types,
                compute_kernels=[kernel] if kernel else None,
                cache_params=CacheParams(load_factor=clf) if clf else None,
            )
            for n in features.names
        }
        if (types or kernel or clf)
        else None
    )
    sharders = [StockSharder(fused_params={"gather_uvm_cache_stats": True} if ctx.device.type == "cuda" else None)]
    pg = dist.GroupMember.WORLD
    planner = EmbeddingShardingPlanner(topology=planner_topology(ctx), constraints=constraints)
    plan = planner.collective_plan(model, sharders, pg)
    dmp = DistributedModelParallel(
        module=model, device=ctx.device, env=ShardingEnv.from_process_group(pg), plan=plan, sharders=sharders
    )
    load_torchrec_tables(dmp, init)
    dense = dense_optimizer(dmp, cfg)
    pipeline = TrainPipelineSparseDist(
        dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), ctx.device, execute_all_batches=True
    )
    convert = batch_converter(features, source)
    return ShardedSetup(
        "torchrec",
        dmp,
        pipeline,
        convert,
        convert,
        dense_optimizer=dense,
        final_stats=lambda steps: {
            **hbm_cache_stats(dmp),
            "embedding_kernels": sorted({ps.compute_kernel for mp in dmp.plan.plan.values() for ps in mp.values()}),
        },
    )


PROFILE_BATCHES = 4  # global batches the adaptive choice of unscheduled tables looks at


def unscheduled_features(
    cfg: DictConfig, features: FeatureSpec, source: DataSource, world_size: int, options: HeraldOptions
) -> list[str]:
    """`scheduler.unscheduled`: the features whose tables stay with TorchRec's own sharding.

    A list of feature (or table) names, or `auto`: the tables the adaptive policy would not schedule on the first
    global batches of the training data (tables hot everywhere or cold everywhere, docs/scheduler.md). Every rank
    reads the same global batches, so every rank makes the same choice without communicating."""
    from herald_torchrec.distributed.train_pipeline.input_layout import ManagedTables, one_process_global_batch
    from herald_torchrec.schedule import make_policy

    sc = cfg.scheduler
    u = sc.get("unscheduled") or []
    if u == "auto":
        B = cfg.trainer.batch_size
        probe = make_policy("herald", list(features.rows), world_size, B, cache_ratio=options.cache_ratio, lookahead=0)
        tables = ManagedTables(
            tuple(table_name(n) for n in features.names),
            tuple(features.rows),
            tuple((n,) for n in features.names),
            (0,),
        )
        convert = sample_converter(features, source)
        batches = [
            one_process_global_batch(convert(g), tables)
            for _, g in zip(range(PROFILE_BATCHES), source.train_batches(world_size * B))
        ]
        probe.profile(batches)
        chosen = set(probe.tables)
        if not chosen:  # nothing looks worth scheduling: keep every table Herald's rather than none
            return []
        return [n for t, n in enumerate(features.names) if t not in chosen]
    names = [u] if isinstance(u, str) else list(u)
    by_table = {table_name(n): n for n in features.names}
    names = [by_table.get(n, n) for n in names]
    unknown = [n for n in names if n not in features.names]
    if unknown:
        raise ValueError(
            f"scheduler.unscheduled: {unknown} are not features of the model {list(features.names)} (or use auto)"
        )
    if len(set(names)) == len(features.names):
        raise ValueError(
            "scheduler.unscheduled names every feature: leave at least one to Herald, or use scheduler=torchrec"
        )
    return [n for n in features.names if n in set(names)]


def herald_options(sc: DictConfig) -> HeraldOptions:
    """The Herald settings of `scheduler.*` as one HeraldOptions, for the sharder and the pipeline (a bad value's
    error names its config key, e.g. scheduler.plan_on). `unscheduled_tables` is left to `unscheduled_features`."""
    from herald_torchrec.app import baselines

    settings: dict[str, Any] = {
        "cache_ratio": sc.cache_ratio,
        "policy": sc.policy,
        "lookahead": sc.lookahead,
        "policy_options": baselines.policy_options(sc),
    }
    settings.update({k: sc[k] for k in ("plan_on", "input_priority", "native") if sc.get(k)})  # empty: the default
    if "prefetch" in sc:
        settings["prefetch"] = sc.prefetch
    if "host_relay" in sc:
        settings["host_relay"] = sc.host_relay
    if "cut_thread" in sc:
        settings["cut_thread"] = sc.cut_thread
    return HeraldOptions.named(CONFIG_KEY, **settings)


# From this many ranks on several machines, one planner per machine planning the whole global batch (`herald`) falls
# behind: projected on GPUs from 32 (RESULTS.md, "Projection"), and at 32 ranks as 4 machines of 8 here its input
# stage took 1.4-1.6x herald_hier's CPU (RESULTS.md, "16 and 32 ranks"; at 16 they were level).
PLAN_PER_MACHINE_FROM = 32


def planner_scale_note(policy: str, world_size: int, machines: int) -> str | None:
    """A note for `scheduler=herald` on several machines from PLAN_PER_MACHINE_FROM ranks: its planners each plan
    the whole global batch, a cost that grows with the ranks, where `herald_hier` plans per machine. None elsewhere."""
    if policy != "herald" or machines < 2 or world_size < PLAN_PER_MACHINE_FROM:
        return None
    return (
        f"note: scheduler=herald on {machines} machines ({world_size} ranks): each machine's planner plans the whole "
        f"global batch of {world_size} ranks, a cost that grows with the ranks (projected behind a GPU step from "
        f"{PLAN_PER_MACHINE_FROM}; the planning budget then makes cheaper plans, counted as plans_reduced / "
        "plans_static). scheduler=herald_hier plans per machine for its own ranks (README, Configuration: several "
        "machines)"
    )


def machines_from_env(world_size: int) -> int:
    """Machines in a job: its ranks over `ranks_per_machine` (equal ranks per machine, as torchrun places them)."""
    return world_size // ranks_per_machine(world_size)


def use_native_kernels(setting: str) -> None:
    """`scheduler.native`: Herald's compiled kernels (the scheduler's and the data plane's, herald_torchrec/_native.py)
    where they build (auto), always (on: an error if they cannot), or never (off: numpy only). The plans and the
    model are the same either way."""
    from herald_torchrec import _native

    with settings_named(CONFIG_KEY):
        check_native(setting)
    try:
        _native.set_mode({"auto": None, "on": True, "off": False}[setting])
    except (OSError, RuntimeError) as e:  # only `on` loads now
        raise ValueError(f"scheduler.native=on, but Herald's compiled kernels are unavailable: {e}") from e


def _herald(
    model: TrainModel, features: FeatureSpec, source: DataSource, cfg: DictConfig, ctx: DistContext
) -> ShardedSetup:
    """Herald-managed tables: our sharder (ROW_WISE home placement, the scheduler's settings) + HeraldTrainPipeline,
    which schedules the same `Batch` stream the stock pipeline trains; tables left unscheduled
    (`scheduler.unscheduled`) are planned by TorchRec's planner within `sharding.types`."""
    from herald_torchrec.app import baselines
    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder
    from herald_torchrec.distributed.train_pipeline.pipeline import HeraldTrainPipeline, herald_modules

    sc, t = cfg.scheduler, cfg.trainer
    options = herald_options(sc)
    options.runnable_policy()  # before the (possibly profiling) choice of unscheduled tables
    note = planner_scale_note(options.policy, ctx.world_size, machines_from_env(ctx.world_size))
    if note and ctx.is_main:
        print(note, file=sys.stderr, flush=True)
    use_native_kernels(options.native)
    kwargs = _embedding_optimizer_kwargs(cfg)
    fused = {"optimizer": EMBEDDING_OPTIMIZERS[t.embedding_optimizer][1], "learning_rate": kwargs.pop("lr"), **kwargs}
    _, cache_load_factor = hbm_cache(cfg)
    if cache_load_factor:
        fused["cache_load_factor"] = cache_load_factor
    if ctx.device.type == "cuda":
        fused["gather_uvm_cache_stats"] = True
    unsched = unscheduled_features(cfg, features, source, ctx.world_size, options)
    options = dataclasses.replace(options, unscheduled_tables=[table_name(n) for n in unsched])
    sharder = HeraldEmbeddingBagCollectionSharder(options=options, fused_params=fused)
    pg = dist.GroupMember.WORLD
    plan, init = None, {}
    if unsched:
        ebc = model.model.ebc
        init = {table_name(n): ebc.embedding_bags[table_name(n)].weight.detach().clone() for n in unsched}
        types = stock_sharding_types(cfg, model_parallel_only=True)
        constraints = sharder.planner_constraints(ebc, types, world_size=ctx.world_size, device_type=ctx.device.type)
        planner = EmbeddingShardingPlanner(topology=planner_topology(ctx), constraints=constraints)
        plan = planner.collective_plan(model, [sharder], pg)
    dmp = DistributedModelParallel(
        module=model, device=ctx.device, env=ShardingEnv.from_process_group(pg), plan=plan, sharders=[sharder]
    )
    load_torchrec_tables(dmp, init)  # the unscheduled tables' shards (TorchRec draws its own values otherwise)
    (herald,) = herald_modules(dmp)
    dense = dense_optimizer(dmp, cfg)
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    stats = PlanStats()
    profile, reorder = None, None
    if options.policy in baselines.REPLICA_POLICIES:  # replicated rows from a profiled prefix; fae reorders the stream
        from herald_torchrec.distributed.train_pipeline.pipeline import managed_tables

        tables = managed_tables([herald])
        convert_one = sample_converter(features, source)
        profile = baselines.profile_batches(cfg, options, source, ctx.world_size, tables, convert_one)
        if options.policy == "fae":
            from herald_torchrec.schedule import make_policy

            fae = make_policy(
                "fae",
                list(tables.rows),
                ctx.world_size,
                t.batch_size,
                cache_ratio=options.cache_ratio,
                lookahead=options.lookahead,
                **options.policy_options,
            )
            fae.profile(profile)
            reorder = baselines.fae_reorder(fae, tables, convert_one, fae.window)
    pipeline = HeraldTrainPipeline(dmp, optimizer, ctx.device, options=options, on_plan=stats.add, profile=profile)
    sched_ms, sched_cpu_ms = pipeline.input_stage.sched_ms, pipeline.input_stage.sched_cpu_ms

    links_at_log = dict.fromkeys(HOST_ROW_KINDS, 0)
    levels_at_log: dict[str, Any] = {"policy": None, "plans_reduced": 0, "plans_static": 0}

    def plan_levels() -> dict[str, int]:
        """Plans made so far below the full plan by the planning budget (schedule/herald/budget.py), on a rank
        that plans with a policy that has one; else empty."""
        levels = getattr(pipeline.policy, "plan_levels", None)
        if levels is None:
            return {}
        counts = levels()
        return {"plans_reduced": counts.reduced, "plans_static": counts.static}

    def step_stats() -> dict[str, float]:
        out = stats.window()
        # this rank's rows per step by link since the last line, where ranks share machines (host relays)
        steps = max(stats.last_window_steps, 1)
        sent = {k: pipeline.trained_counters.get(k, 0) for k in HOST_ROW_KINDS}
        if any(sent.values()):
            for k in HOST_ROW_KINDS:
                out[f"rank0_rows_{k}"] = (sent[k] - links_at_log[k]) / steps  # printed by rank 0
        links_at_log.update(sent)
        # medians over the logging window: planning time (wall, and the planner's CPU on a rank that plans), and the
        # training thread's wait for its batch (~0 while the input stage keeps ahead)
        for key, recent in (
            ("sched_ms", sched_ms),
            ("sched_cpu_ms", sched_cpu_ms),
            ("input_wait_ms", pipeline.input_wait_ms),
        ):
            window = list(itertools.islice(reversed(recent), cfg.trainer.log_interval))
            if window:
                out[key] = float(np.median(window))
        # plans made cheaper since the last line because planning fell behind training (a new policy after a
        # checkpoint load counts from 0)
        levels = plan_levels()
        if levels:
            same = levels_at_log["policy"] is pipeline.policy
            for k, v in levels.items():
                out[k] = v - (levels_at_log[k] if same else 0)
            levels_at_log.update(levels, policy=pipeline.policy)
        return out

    def final_stats(steps: int) -> dict[str, Any]:
        ms = np.array(sched_ms) if sched_ms else np.zeros(1)
        kinds = sorted(pipeline.trained_counters)
        executed = torch.tensor([pipeline.trained_counters[k] for k in kinds], dtype=torch.int64)
        if ctx.world_size > 1:
            dist.all_reduce(executed)
        return {
            "module_rows_by_kind": dict(zip(kinds, executed.tolist())),  # what the data plane executed (all ranks)
            "plan_rows_by_kind": dict(stats.total.rows),  # what the scheduler planned
            "hit_rate": stats.total.hit_rate(),
            "rows_by_kind_per_step": {k: v / max(steps, 1) for k, v in stats.total.rows.items()},
            "sched_ms_median": float(np.median(ms)),
            "sched_ms_p90": float(np.percentile(ms, 90)),
            # the planner's CPU per plan on this rank (0 on a rank that receives its plans)
            "sched_cpu_ms_median": float(np.median(sched_cpu_ms)) if sched_cpu_ms else 0.0,
            # over the last WAITS_KEPT batches at most
            "input_wait_ms_median": float(np.median(pipeline.input_wait_ms)) if pipeline.input_wait_ms else 0.0,
            # plans made with fewer scheduled tables / static plans because planning fell behind training (the planning
            # budget, schedule/herald/budget.py; counted where plans are made, rank 0 included)
            **plan_levels(),
            "guest_occupancy": float(np.mean(list(herald.guest_occupancy().values()))),
            "unscheduled_tables": [table_name(n) for n in unsched],
            "dropped_samples": pipeline.input_stage.dropped_samples,
            "stale_reads": stats.total.stale_reads,  # reads of a value older than the latest (het with S > 0)
            **({"policy": pipeline.policy.describe()} if pipeline.policy is not None else {}),
            **({"fae_hot_sample_share": reorder.hot_samples / max(reorder.samples, 1)} if reorder is not None else {}),
            **hbm_cache_stats(dmp),
        }

    convert = batch_converter(features, source)
    return ShardedSetup(
        sc.name,
        dmp,
        pipeline,
        convert,
        convert,
        dense_optimizer=dense,
        step_stats=step_stats,
        final_stats=final_stats,
        host_bytes=lambda: pipeline.input_stage.comm.counter.total_bytes(),
        reorder=reorder,
    )


SCHEDULERS: dict[str, Callable[..., ShardedSetup]] = {
    "torchrec": _torchrec,
    "herald": _herald,
    "herald_hier": _herald,
    "static": _herald,
    "p2res": _herald,
    "fae": _herald,
    "het": _herald,
}


def shard_model(
    model: TrainModel, features: FeatureSpec, source: DataSource, cfg: DictConfig, ctx: DistContext
) -> ShardedSetup:
    name = cfg.scheduler.name
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {sorted(SCHEDULERS)}, got '{name}'")
    return SCHEDULERS[name](model, features, source, cfg, ctx)
