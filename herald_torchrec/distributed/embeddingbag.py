"""`ShardedHeraldEmbeddingBagCollection`: the cache-aware sharded EmbeddingBagCollection that executes `Plan`s.

TorchRec contract (torchrec.distributed.types.ShardedModule): DMP / the train pipelines call
`input_dist(ctx, kjt)` -> `compute(ctx, ...)` -> `output_dist(ctx, ...)`. Here the input is already *local*: the
Herald input-permutation stage has given this rank exactly its B samples of the step (`plan.sample_order`), so
`input_dist` moves nothing (it may run ahead of time in a pipeline) and the pooled outputs are local, so
`output_dist` moves nothing either. All the communication of a step happens in `compute` and `finish_step`,
driven by the plan that the pipeline handed over with `set_plan(plan)` (docs/ARCHITECTURE.md §2, schedule/plan.py):

(a) one all-to-all carries the step's moves (rows + optimizer state; every row leaves, then every row arrives;
    directories updated) and the shared rows' values, which the owners *before* the moves send to every reader (a
    moving row has the same value on both sides of its move; a reader that receives the row itself in the moves
    reads it from its store once they have landed);
(b) every local id is classified: *exclusive* (owned here after the moves and not in `plan.shared`) -> this rank's
    FBGEMM TBE over local slots, updated by the TBE's fused optimizer in its backward; *shared* -> its value came in
    (a) (the owner's own reads take the same path), readers feed the values as a leaf tensor requiring grad,
    sum-pooled per bag and added to the TBE's pooled output;
(c) `finish_step()` (called by the fused optimizer's `step()` or at the end of `HeraldTrainPipeline.progress`, else
    at the latest by the next forward): readers return their shared-row gradients to the owners after the moves (a
    second all-to-all), each owner sums them per key and applies ONE update through its TBE. In training the owner's
    shared rows are extra one-row bags of the step's own TBE call, whose backward waits for these sums: one fused
    update for every row of the step (exclusive rows included; bit-exact with the fused path). With mixed dims or
    gradient clipping, exclusive rows are updated in the TBE's backward and shared rows by a separate pass over
    one-row bags.

Every split size comes from the plan (each rank's own part of it where a planner sends parts: step/plan_part.py,
which lays out the same step), so no sizes are exchanged and a plan without moves or shared keys costs no data
collective (only the 8-byte error-check all-reduce, see `check_errors_globally`; in
other steps the error flags ride on the step's all-to-all). The per-step work is vectorised over all tables: ids,
moves and shared pairs are handled by global key (`RowStore.key_base[t] + row`) in one numpy pass each.
A step that raises ValueError (bad input, plan inconsistent with the batch or the directory) has consumed its plan
but changed nothing: the module stays usable. In eval mode, or with no plan queued, the module builds the *static*
plan itself (an all-gather of the local ids; owners never move, every non-owner read is shared): eval forwards at
any time (they never consume a queued training plan) and runs without a scheduler work. A *training* forward with
no plan queued (a loop of `model(batch)` / `loss.backward()` without HeraldTrainPipeline) trains correctly but
unscheduled, so it warns once per module (`UNSCHEDULED_WARNING`): nothing else would tell the user.

Layout, as TorchRec splits embeddingbag.py / dist_data.py / sharding/*: this module is the ShardedModule adapter
(it orders a step: plans, error checks, counters); step/prepare.py prepares the step in numpy (what to send where, no
process group), lookup_layout.py its lookup's index layouts, static_plan.py the plan when none is queued;
dist_data.py holds the step's collectives as awaitable dist objects; embedding_lookup.py does the store-side work
(moves applied, values read and pooled, shared-row updates); rows replicated on every rank (step/replicas.py: Herald
with `replicate`, fae, p2res) and HET's cache run in step extensions beside this step (step/extension.py,
comparison/extensions.py), which a module gets only when it is built for a policy that uses them; state/ holds the
checkpoint view and the fused optimizer.

Counters (rows, this rank's part of the step; the sum over ranks equals `plan.counters` of the same plan, with the
scheduler's definitions): `hit` distinct keys read here that this rank owns after the moves and that did not move
this step (exclusive keys and the owner's own reads of shared keys: no transfer at all), `migrate` / `evict_home` /
`forward` rows sent by move kind, `shared_value` values sent to other readers, `shared_grad` gradients sent to other
owners. Bytes by kind are in `comm_counter` (see comm.py). Hit rate per table = hits / distinct keys read here.
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import (
    Awaitable,
    LazyAwaitable,
    LazyGetItemMixin,
    Multistreamable,
    NoWait,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, get_embedding_names_by_table
from torchrec.optim.fused import FusedOptimizer, FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from herald_torchrec.distributed.comm import CommCounter, PlanComm, host_subgroups, phase
from herald_torchrec.distributed.comparison.extensions import comparison_extensions
from herald_torchrec.distributed.manageable import config_refusal, settings_refusal
from herald_torchrec.distributed.state.checkpoint import HeraldCheckpoint, install_state_dict_hooks
from herald_torchrec.distributed.state.fused_optimizer import HeraldFusedOptimizer
from herald_torchrec.distributed.step.dist_data import ErrorCheck, ErrorFlagDist
from herald_torchrec.distributed.step.embedding_lookup import HeraldLookup
from herald_torchrec.distributed.step.extension import (
    ExtensionResources,
    ExtensionStep,
    StepExtension,
    check_plan_served,
)
from herald_torchrec.distributed.step.host_relay import HostMap, LinkRows
from herald_torchrec.distributed.step.prepare import (
    LocalInput,
    MoveStep,
    SharedStep,
    classify,
    local_input,
    prepare_moves,
    prepare_shared,
)
from herald_torchrec.distributed.step.replicas import ReplicaExtension
from herald_torchrec.distributed.storage.optimizer_params import resolve_table_settings
from herald_torchrec.distributed.storage.row_layout import check_cache_ratio, home_range
from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec
from herald_torchrec.distributed.variable_batch import expand_variable_batch
from herald_torchrec.schedule.herald.planner import host_ids
from herald_torchrec.schedule.plan import Plan, PlanPart

COUNTER_KINDS = ("hit", "migrate", "evict_home", "forward", "shared_value", "shared_grad")
HOST_ROW_KINDS = ("cross_host", "intra_host")  # rows sent to ranks of another host / of the own host
UNSCHEDULED_WARNING = (
    "a Herald-managed EmbeddingBagCollection trained with no plan queued runs unscheduled: the static plan (rows stay "
    "at their home rank, the same model as stock TorchRec, no embedding scheduling); to schedule it, drive training "
    "with HeraldTrainPipeline (pipeline.progress(batches)) instead of calling model(batch) yourself (warned once)"
)


@dataclass
class HeraldEmbeddingBagCollectionContext(Multistreamable):
    batch_size: int = 0

    def record_stream(self, stream: torch.Stream) -> None:  # nothing asynchronous to protect
        pass


class _KeyedTensorAwaitable(LazyGetItemMixin[str, torch.Tensor], LazyAwaitable[KeyedTensor]):
    def __init__(self, kt: KeyedTensor) -> None:
        super().__init__()
        self._kt = kt

    def _wait_impl(self) -> KeyedTensor:
        return self._kt


class _DivideGrad(torch.autograd.Function):
    """Identity forward; backward divides the gradient by the world size (TorchRec's GRADIENT_DIVISION)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, world_size: int) -> torch.Tensor:
        ctx.world_size = world_size
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.world_size, None


class ShardedHeraldEmbeddingBagCollection(
    ShardedModule[KJTList, torch.Tensor, KeyedTensor, HeraldEmbeddingBagCollectionContext],
    FusedOptimizerModule,
):
    """Herald-managed EmbeddingBagCollection (SUM or MEAN pooling; weighted features pool by SUM) on one FBGEMM TBE
    per rank.

    Args:
        module: the unsharded EBC; its weights (unless on meta) are copied into the home rows.
        table_name_to_parameter_sharding: DMP's plan for the module (every table ROW_WISE); may be None.
        env: TorchRec sharding env (process group, rank, world size).
        fused_params: as TorchRec's sharders take them ({"optimizer": EmbOptimType or name, "learning_rate", "eps",
            "gradient_clipping", ...}); `apply_optimizer_in_backward` on `module` overrides them per table, as in
            TorchRec. Unsupported settings raise ValueError (optimizer_params.check_settings).
            `gather_uvm_cache_stats` (CUDA) turns on FBGEMM's HBM-cache counters, read with `_store.cache_stats()`.
        cache_ratio: guest capacity per rank and table, as a share of the table's rows, in (0, 1].
        policy, lookahead: the scheduler configuration, kept for the pipeline (the data plane decides nothing).
        check_errors_globally: before changing anything, exchange a flag so that a rank-local input error (id out of
            range, batch not matching the plan) raises on every rank instead of leaving the others in a collective
            (one header element on the step's first all-to-all; an all-reduce only in steps without one).
        gradient_division: divide the embedding gradients by the world size, as TorchRec's sharded modules do in
            their backward comms (so that with per-rank mean losses and DDP-averaged dense gradients every parameter
            gets the gradient of the global mean loss). None (default) follows TorchRec's global switch
            `torchrec.distributed.comm_ops.set_gradient_division` (on by default), read at every step; False gives
            rows the plain sum over ranks of the per-rank gradients.
        replicate: the policy replicates rows on every rank (Herald's `policy_options={"replicate": True}`, read by
            the sharder as `HeraldOptions.replicates`): the module runs the replica region (step/replicas.py) beside
            its step, as fae / p2res modules do. Without it a plan carrying replicas is refused.
    """

    def __init__(
        self,
        module: EmbeddingBagCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding] | None,
        env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | None = None,
        cache_ratio: float = 0.1,
        policy: str = "herald",
        lookahead: int = 1,
        module_fqn: str | None = None,
        check_errors_globally: bool = True,
        gradient_division: bool | None = None,
        qcomm_codecs_registry: dict | None = None,
        replicate: bool = False,
    ) -> None:
        super().__init__(qcomm_codecs_registry=qcomm_codecs_registry)
        if not isinstance(replicate, bool):
            raise ValueError(f"replicate must be True or False, got {replicate!r}")
        self.gradient_division = gradient_division
        self.cache_ratio = check_cache_ratio(cache_ratio)
        if not isinstance(module, EmbeddingBagCollection):
            raise ValueError(f"expected an EmbeddingBagCollection, got {type(module).__name__}")
        self.weighted_features = bool(module.is_weighted())  # id-score lists: each id's row scaled by its weight
        configs = module.embedding_bag_configs()
        for c in configs:  # the predicate the sharder leaves tables to TorchRec by (manageable.py)
            refusal = config_refusal(c, self.weighted_features)
            if refusal is not None:
                raise refusal.error(c.name)
        self._env = env
        self.rank, self.world_size = env.rank, env.world_size
        self.policy, self.lookahead, self.module_fqn = policy, int(lookahead), module_fqn
        self.check_errors_globally = check_errors_globally
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "meta":
            raise ValueError("ShardedHeraldEmbeddingBagCollection cannot be built on the meta device")
        # fused_params + apply_optimizer_in_backward, resolved as TorchRec resolves them (optimizer_params.py)
        self.optimizer_settings = resolve_table_settings(
            module, fused_params, table_name_to_parameter_sharding, self.device
        )
        for c in configs:
            refusal = settings_refusal(c, self.optimizer_settings)
            if refusal is not None:
                raise refusal.error(c.name)
        fp = dict(self.optimizer_settings)
        self.optimizer_type = fp.pop("optimizer")
        self.learning_rate = float(fp.pop("learning_rate", 0.01))
        self.eps = float(fp.pop("eps", 1e-8))
        cache_load_factor = float(fp.pop("cache_load_factor", 0.2))
        cache_stats = bool(fp.pop("gather_uvm_cache_stats", False))  # FBGEMM's HBM-cache counters (CUDA)

        self.table_names = [c.name for c in configs]
        self._check_parameter_sharding(configs, table_name_to_parameter_sharding)
        names_by_table = get_embedding_names_by_table(configs)
        self.embedding_names = [n for names in names_by_table for n in names]  # output keys, EBC order
        self.feature_names = [f for c in configs for f in c.feature_names]  # input keys, same order
        self.feature_table = [t for t, c in enumerate(configs) for _ in c.feature_names]
        self.feature_dims = [configs[t].embedding_dim for t in self.feature_table]
        # MEAN pooling: a bag's sum (from every source: the TBE, shared values, extensions) times 1 / its length,
        # as FBGEMM's MEAN mode pools (0 for an empty bag); None when every table sums
        mean = np.array([configs[t].pooling == PoolingType.MEAN for t in self.feature_table], dtype=bool)
        self._mean_features = mean if mean.any() else None

        self._store = RowStore(
            [TableSpec(c.name, c.num_embeddings, c.embedding_dim) for c in configs],
            rank=self.rank,
            world_size=self.world_size,
            cache_ratio=self.cache_ratio,
            optimizer=self.optimizer_type,
            learning_rate=self.learning_rate,
            eps=self.eps,
            features_per_table=[len(c.feature_names) for c in configs],
            device=self.device,
            cache_load_factor=cache_load_factor,
            tbe_settings=fp,
            cache_stats=cache_stats,
        )
        self._init_home_rows(module, configs)
        self.comm_counter = CommCounter()
        self._pg = env.process_group
        self._comm = PlanComm(env.process_group, self.comm_counter)
        self._exec = HeraldLookup(self._store, self._comm, self.device)  # the step's store-side work
        self._error_dist = ErrorFlagDist(self._comm, self.rank, self.world_size, self.device)
        self._plans: deque[Plan | None] = deque()
        self._warned_unscheduled = False  # UNSCHEDULED_WARNING given (once per module)
        self._pending: SharedStep | None = None
        self.hosts: HostMap | None = None  # which ranks share a host (`set_hosts`; None: not known, no relays)
        self._relay_group_ready = False
        self.step_host_rows = {k: 0 for k in HOST_ROW_KINDS}  # this rank's rows of the step by link (host map set)
        # the comparison system of the module's policy (fae / p2res replicas, HET's cache), if any, beside its step;
        # Herald's replica region when its policy replicates
        resources = ExtensionResources(
            self._store, self._comm, self.device, self.optimizer_type, self.learning_rate, self.eps, fp
        )
        extensions = comparison_extensions(policy, resources)
        if self.weighted_features and any(e.plan_part == "cache" for e in extensions):
            raise ValueError(
                f"policy {policy!r}: HET's cache does not run weighted features; use another policy for a weighted "
                "EmbeddingBagCollection"
            )
        if self._store.row_dtype != torch.float32 and any(e.plan_part == "cache" for e in extensions):
            raise ValueError(  # a comparison baseline: its pulls read moved rows as values, which FP16 rows are not
                f"policy {policy!r}: HET's cache runs FP32 tables only; use another policy for FP16 tables"
            )
        if replicate and not any(e.plan_part == "replicas" for e in extensions):
            extensions += (ReplicaExtension(resources),)
        self._extensions: tuple[StepExtension, ...] = extensions
        self._extension_pending: list[ExtensionStep] = []
        self.ownership_version = 0  # +1 whenever ownership is reset to home (a load): schedulers rebuild from home
        # TorchRec-layout state dicts and the fused optimizer, given this module's public surface
        self._checkpoint = HeraldCheckpoint(
            self, self._exec, self._comm, env.process_group, table_name_to_parameter_sharding
        )
        install_state_dict_hooks(self, self._checkpoint)
        self._optim = HeraldFusedOptimizer(self, self._checkpoint)
        T = len(configs)
        self.step_counters: dict[str, int] = {k: 0 for k in COUNTER_KINDS}
        self.total_counters: dict[str, int] = {k: 0 for k in COUNTER_KINDS}
        self._reads = np.zeros((2, T), dtype=np.int64)  # last step: [hits, distinct keys read] per table
        self._reads_total = np.zeros((2, T), dtype=np.int64)
        self._key_index: dict[tuple[str, ...], np.ndarray] = {}  # KJT keys -> position of each module feature
        self.steps = 0

    # ------------------------------------------------------------------ setup
    def _check_parameter_sharding(self, configs: list, plan: dict[str, ParameterSharding] | None) -> None:
        if plan is None:
            return
        for c in configs:
            ps = plan.get(c.name)
            if ps is None:
                raise ValueError(
                    f"table {c.name!r} has no sharding in the plan: every table of a Herald-managed EBC is managed"
                )
            if ps.sharding_type != ShardingType.ROW_WISE.value:
                raise ValueError(
                    f"table {c.name!r}: Herald-managed tables are ROW_WISE (home placement), got {ps.sharding_type}"
                )
            spec = ps.sharding_spec
            shards = getattr(spec, "shards", None)
            if not shards:
                continue
            got = sorted(
                (int(s.shard_offsets[0]), int(s.shard_offsets[0]) + int(s.shard_sizes[0]))
                for s in shards
                if int(s.shard_sizes[0]) > 0
            )
            want = [home_range(c.num_embeddings, self.world_size, r) for r in range(self.world_size)]
            want = [w for w in want if w[1] > w[0]]
            if got != want:
                raise ValueError(f"table {c.name!r}: ROW_WISE shards {got} differ from the home blocks {want}")

    @torch.no_grad()
    def _init_home_rows(self, module: EmbeddingBagCollection, configs: list) -> None:
        st = self._store
        for t, c in enumerate(configs):
            lo, hl = st.home_lo[t], st.home_len[t]
            if hl == 0:
                continue
            w = module.embedding_bags[c.name].weight
            if w.device.type == "meta":
                block = torch.empty(hl, c.embedding_dim, device=self.device)
                c.init_fn(block)  # same distribution as the unsharded table (not the same values)
            else:
                block = w.detach()[lo : lo + hl]
            st.write_slots(t, np.arange(hl), block)

    # ---------------------------------------------------------------- plans
    def set_plan(self, plan: Plan | None) -> None:
        """Queue the plan of the next training step (plans are consumed in order, one per training forward). None
        queues the static plan: a step whose scheduled plan no longer applies (planned before a checkpoint load moved
        every row home) keeps its place, so the plans queued after it stay aligned with their batches."""
        if plan is None:
            self._plans.append(None)
            return
        if not isinstance(plan, Plan):
            raise ValueError(f"set_plan expects a schedule.plan.Plan, got {type(plan).__name__}")
        if not plan.executable:
            raise ValueError("set_plan: this plan is counting-only (executable=False); its policy cannot be executed")
        if plan.num_ranks != self.world_size:
            raise ValueError(f"set_plan: plan is for {plan.num_ranks} ranks, the process group has {self.world_size}")
        if isinstance(plan, PlanPart):
            if plan.rank != self.rank:
                raise ValueError(f"set_plan: the plan is rank {plan.rank}'s part, this is rank {self.rank}")
            if plan.sample_order.shape[0] != plan.batch_per_rank:
                raise ValueError(
                    f"set_plan: the part's sample_order has {plan.sample_order.shape[0]} entries, expected "
                    f"{plan.batch_per_rank}"
                )
        elif plan.sample_order.shape[0] != plan.num_ranks * plan.batch_per_rank:
            raise ValueError(
                f"set_plan: sample_order has {plan.sample_order.shape[0]} entries, expected "
                f"{plan.num_ranks} x {plan.batch_per_rank}"
            )
        check_plan_served(plan, self._extensions, self.policy)
        self._plans.append(plan)

    @property
    def runs_replicas(self) -> bool:
        """Whether the module runs a replica region (plans carrying `replicas`: Herald replicating, fae, p2res)."""
        return any(e.plan_part == "replicas" for e in self._extensions)

    @property
    def queued_plans(self) -> int:
        """Scheduled plans waiting for their step (static-plan placeholders not counted)."""
        return sum(p is not None for p in self._plans)

    def clear_plans(self) -> None:
        """Drop the queued plans (a checkpoint load moved every row home). A pipeline that has already drawn the
        batches of those plans queues `set_plan(None)` for each, so its later plans stay aligned."""
        self._plans.clear()

    # ------------------------------------------------------- TorchRec contract
    def create_context(self) -> HeraldEmbeddingBagCollectionContext:
        return HeraldEmbeddingBagCollectionContext()

    def input_dist(
        self, ctx: HeraldEmbeddingBagCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KJTList]]:
        # The batch is already local (the permutation stage placed it): nothing to distribute. The awaitable has
        # the type TorchRec's train pipelines fuse (KJTListSplitsAwaitable of no-op awaitables), so the module can
        # be pipelined like a stock sharded EBC; input_dist may run a step ahead there, which is why it is pure.
        # A VBE input gets one bag per sample, as the unsharded EBC's output does (variable_batch.py).
        features = expand_variable_batch(features, "Herald-managed EBC")
        ctx.batch_size = features.stride()
        return KJTListSplitsAwaitable([NoWait(NoWait(features))], ctx)

    def compute(self, ctx: HeraldEmbeddingBagCollectionContext, dist_input: KJTList) -> torch.Tensor:
        return self._step(dist_input[0])

    def output_dist(self, ctx: HeraldEmbeddingBagCollectionContext, output: torch.Tensor) -> LazyAwaitable[KeyedTensor]:
        return _KeyedTensorAwaitable(
            KeyedTensor(keys=self.embedding_names, length_per_key=self.feature_dims, values=output, key_dim=1)
        )

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optim

    @property
    def unsharded_module_type(self) -> type:
        return EmbeddingBagCollection

    # ----------------------------------------------------------------- step
    def _parse_input(self, features: KeyedJaggedTensor) -> LocalInput:
        weights = features.weights_or_none()
        if self.weighted_features and weights is None:
            raise ValueError("Herald-managed EBC: the EBC is weighted (is_weighted=True), its input KJT has no weights")
        if not self.weighted_features and weights is not None:
            raise ValueError(
                "Herald-managed EBC: the input KJT has weights but the EBC is not weighted (build it is_weighted=True)"
            )
        keys = tuple(features.keys())
        idx = self._key_index.get(keys)
        if idx is None:
            index = {k: i for i, k in enumerate(keys)}
            missing = [f for f in self.feature_names if f not in index]
            if missing:
                raise ValueError(f"input KeyedJaggedTensor lacks features {missing} (has {list(keys)})")
            idx = self._key_index[keys] = np.array([index[f] for f in self.feature_names], dtype=np.int64)
        vals = features.values().detach().to("cpu").numpy().astype(np.int64, copy=False)
        lens = features.lengths().detach().to("cpu").numpy().astype(np.int64, copy=False)
        w = None if weights is None else weights.detach().to("cpu", torch.float32).numpy()
        return local_input(vals, lens, len(keys), features.stride(), idx, self._store, self.feature_names, w)

    def _sync_error(self, err: Exception | None) -> None:
        """Raise on every rank if any rank failed its local checks (so that no rank is left in a collective)."""
        self._error_dist(err, self.check_errors_globally)

    def _step(self, features: KeyedJaggedTensor) -> torch.Tensor:
        with phase("step"):
            return self._step_impl(features)

    def _step_impl(self, features: KeyedJaggedTensor) -> torch.Tensor:
        # Collectives must be issued in the same order on every rank: plan-level (global) checks raise alike
        # everywhere; rank-local failures (the input, the input against the plan) are gathered into `err` and
        # raised on every rank together before anything moves: their flag rides on the step's all-to-all (moves
        # and shared values), and only a step with neither pays a separate all-reduce (`_sync_error`).
        if self.step_pending:
            self.finish_step()  # the previous step's shared rows, if the optimizer step did not do it
        self._checkpoint.settle()  # values written into the state dicts' tensors reach their rows first
        err: Exception | None = None
        local: LocalInput | None = None
        try:
            with phase("step.parse_input"):
                local = self._parse_input(features)
        except ValueError as e:
            err = e
        lost_write = self._checkpoint.exposed_writes()  # named_parameters() entries of rows away, written
        if lost_write is not None and err is None:
            err = ValueError(lost_write)
        if self.training and not self._plans and not self._warned_unscheduled:
            self._warned_unscheduled = True
            warnings.warn(UNSCHEDULED_WARNING, stacklevel=2)
        plan = self._plans.popleft() if self._plans and self.training else None  # eval never consumes training plans
        if isinstance(plan, PlanPart):
            self._store.directory_exact = False  # a part holds some of the step's moves only
        else:
            self.sync_directory()  # a whole plan (or the static one) is checked against every rank's rows
        if plan is None:
            self._sync_error(err)  # the static plan needs every rank's ids
            plan = self._exec.static_plan(local)
        # extensions (none for Herald's policies): their collectives, driven by the plan alone so that every rank
        # runs them, then the ids they serve are set aside; a ValueError (plan vs batch) joins `err`
        extension_steps: list[ExtensionStep] = []
        try:
            for extension in self._extensions:
                extension_steps.append(extension.begin(plan, local, self.ownership_version))
                local = extension_steps[-1].remaining
        except ValueError as e:
            err, local = e, None
        with phase("step.prepare_moves"):
            moves = prepare_moves(plan, self._store)  # global checks: every rank raises alike
        with phase("step.prepare_shared"):
            shared = prepare_shared(plan, self._store, moves, self.hosts)
        if shared.relayed and not self._relay_group_ready:
            self._make_relay_group()
        self._exec.marks.mark(shared)
        try:
            cls = None
            if err is None:
                try:
                    if plan.batch_per_rank != local.batch_size:
                        raise ValueError(
                            f"plan {plan.step} is for batch {plan.batch_per_rank} per rank, the local batch has "
                            f"{local.batch_size}"
                        )
                    with phase("step.classify"):
                        cls = classify(plan, local, moves, self._exec.marks, self._store)
                except ValueError as e:
                    err = e
            ride = (
                self.world_size > 1
                and self.check_errors_globally
                and not (moves.globally_empty and shared.globally_empty)
            )
            check = ErrorCheck(err, 0 if err is None else self.rank + 1) if ride else None
            if check is None:
                with phase("step.sync_error"):
                    self._sync_error(err)
            training = self.training and torch.is_grad_enabled()
            with phase("step.exchange"):
                moved = self._exec.exchange(moves, shared, training, check)
            with phase("step.lookup"):
                out = self._exec.pooled(local, shared, training)
                for part in extension_steps:
                    out = part.pooled(out, training)
                if self._mean_features is not None:
                    out = out * self._mean_scale(local.lengths)
        finally:
            self._exec.marks.reset(shared)
        if training and self.world_size > 1 and self._divides_gradients():
            out = _DivideGrad.apply(out, self.world_size)
        self.step_counters = {k: 0 for k in COUNTER_KINDS}
        hits, nreads = cls
        for part in extension_steps:
            hits, nreads = part.count(hits, nreads, self.step_counters)
        self._reads[0], self._reads[1] = hits, nreads
        self._reads_total += self._reads
        counts = {**moved, "hit": int(hits.sum()), "shared_value": 0 if shared.globally_empty else shared.n_values_out}
        for k, v in counts.items():
            self.step_counters[k] += v
            self.total_counters[k] += v
        self._count_host_rows(moves, shared, training)
        self._pending = shared if training else None
        self._extension_pending = [part for part in extension_steps if part.pending] if training else []
        self.steps += 1
        return out

    def _mean_scale(self, lengths: np.ndarray) -> torch.Tensor:
        """[B, sum of feature dims]: 1 / the bag's length in the columns of MEAN features (1 for an empty bag, whose
        sum is 0), 1 elsewhere."""
        inv = np.where(self._mean_features[:, None], 1.0 / np.maximum(lengths, 1), 1.0)  # [F, B]
        cols = np.repeat(inv.T, self.feature_dims, axis=1).astype(np.float32)
        return torch.from_numpy(cols).to(self.device)

    def set_hosts(self, host_keys: Any, relay: bool = True) -> None:
        """Which ranks share a host: one integer key per rank (equal keys, one host; HeraldTrainPipeline passes the
        keys it gathered for planning). Where some host has several ranks, every shared row crosses to a reading host
        once and one gradient sum crosses back (`relay`; step/host_relay.py), and `step_host_rows` counts this rank's
        rows by link. Call it between steps, on every rank with the same keys."""
        keys = np.asarray(host_keys)
        if keys.ndim != 1 or keys.shape[0] != self.world_size or keys.dtype.kind not in "iu":
            raise ValueError(
                f"set_hosts: expected one integer host key per rank ({self.world_size}), got {host_keys!r}"
            )
        hosts = HostMap(host_ids(keys.tolist(), self.world_size), bool(relay))
        if self.hosts is None or not np.array_equal(hosts.host, self.hosts.host):
            self._relay_group_ready = False  # made at the first step that relays (collective)
        self.hosts = hosts

    def _make_relay_group(self) -> None:
        """The relay stages run among the ranks of one host: a process group per host, made once, at the first step
        that relays (every rank reaches it: `relayed` comes from the plan). Where no group can be made (the module's
        group does not span every process) they run over the module's group, with zero splits outside the host."""
        made = host_subgroups(self._pg, self.hosts.host)
        if made is not None:
            group, members = made
            self._exec.use_relay_comm(PlanComm(group, self.comm_counter), members)
        self._relay_group_ready = True

    def _count_host_rows(self, moves: MoveStep, shared: SharedStep, training: bool) -> None:
        """This rank's rows of the step by link, where ranks share hosts: moves, values and forwards, and the
        gradients that `finish_step` will send (training only)."""
        hm = self.hosts
        links = LinkRows()
        if hm is not None and hm.shares_hosts:
            if not moves.globally_empty:
                links += LinkRows.of(hm, self.rank, moves.dst[moves.send_idx])
            if not shared.globally_empty:
                links += shared.value_links or LinkRows()
                if training:
                    links += shared.grad_links or LinkRows()
        self.step_host_rows = {"cross_host": links.cross, "intra_host": links.intra}

    def _divides_gradients(self) -> bool:
        if self.gradient_division is not None:
            return bool(self.gradient_division)
        from torchrec.distributed.comm_ops import get_gradient_division

        return bool(get_gradient_division())

    @property
    def step_pending(self) -> bool:
        """A trained step whose collective updates (shared rows, extensions' updates) wait for `finish_step`."""
        return self._pending is not None or bool(self._extension_pending)

    def drop_pending(self) -> None:
        """Forget the pending step's updates (a load replaces the model they belong to)."""
        self._pending, self._extension_pending = None, []

    def finish_step(self) -> None:
        """Send shared-row gradients to their owners; each owner applies one update per row with their sum; then
        the extensions' updates (the replicas' all-reduce, HET's pushes).

        Collective (every rank calls it, in the same order). Called by the fused optimizer's `step()`; a no-op
        when nothing is pending (eval forwards, or already finished)."""
        sh, extension_steps = self._pending, self._extension_pending
        self._pending, self._extension_pending = None, []
        if sh is not None and not sh.globally_empty:
            with phase("finish_step"):
                self._exec.apply_shared_grads(sh)
                self.step_counters["shared_grad"] += sh.n_grads_out
                self.total_counters["shared_grad"] += sh.n_grads_out
        for part in extension_steps:
            part.finish()

    # ------------------------------------------------------------- exports
    def set_learning_rate(self, lr: float) -> None:
        """Learning rate of the fused embedding optimizer (exclusive and shared rows alike)."""
        self.learning_rate = float(lr)
        self._store.tbe.set_learning_rate(self.learning_rate)
        for extension in self._extensions:
            extension.set_learning_rate(self.learning_rate)
        for g in self._optim.param_groups:
            g["lr"] = self.learning_rate

    @property
    def store(self) -> RowStore:
        return self._store

    def owners(self, table: int | str) -> np.ndarray:
        """Global owner rank of every row of a table (int32 [rows], identical on every rank) as this rank knows it:
        exact for every row after `sync_directory()` (collective), and for this rank's own rows always."""
        t = self.table_names.index(table) if isinstance(table, str) else int(table)
        return self._store.owner[t]

    def sync_directory(self) -> None:
        """Make this rank's ownership map exact for every row (collective; nothing to do, and no communication,
        where it is). A rank that trains with its parts of the plans (step/plan_part.py) applies only the moves in
        them, so it knows its own rows exactly and other ranks' as they were; a static plan (eval), a whole plan and a
        checkpoint read every rank's rows, so they call this first: one all-gather of every rank's guests."""
        st = self._store
        if st.directory_exact:
            return
        if self.world_size == 1:
            st.directory_exact = True
            return
        with phase("step.sync_directory"):
            got = self._comm.all_gather_uneven(torch.from_numpy(st.guest_gkeys()), "control")
            st.rebuild_directory([g.numpy() for g in got])

    def hit_rate(self, cumulative: bool = False) -> dict[str, float]:
        """Per table: hits / distinct keys read here (last step, or over all steps), as the `hit` counter counts
        them: reads served by the rank's own rows with no transfer this step. NaN for a table not read."""
        reads = self._reads_total if cumulative else self._reads
        return {
            n: float(reads[0, t] / reads[1, t]) if reads[1, t] else float("nan") for t, n in enumerate(self.table_names)
        }

    def guest_occupancy(self) -> dict[str, float]:
        """Per table: guests held by this rank / guest capacity."""
        return {n: self._store.occupancy(t) for t, n in enumerate(self.table_names)}

    def global_step_counters(self) -> dict[str, int]:
        """Sum over ranks of `step_counters` (collective): equals `plan.counters` of the step's plan."""
        v = torch.tensor([self.step_counters[k] for k in COUNTER_KINDS], dtype=torch.int64, device=self.device)
        self._comm.all_reduce(v, "control")
        return {k: int(x) for k, x in zip(COUNTER_KINDS, v.cpu().tolist())}

    @torch.no_grad()
    def full_tables(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Unsharded tables assembled from their current owners, on every rank (collective: one all-reduce).

        Returns ({table: weight [rows, dim]}, {table: optimizer state [rows] (row-wise) or [rows, w]}); the state
        dict is empty for optimizers without state (EXACT_SGD). Exact: each row is non-zero on one rank only."""
        if self.step_pending:
            self.finish_step()
        self._checkpoint.settle()
        return self._exec.full_tables()

    def load_full_tables(self, weights: dict[str, torch.Tensor], states: dict[str, torch.Tensor] | None = None) -> None:
        """Write the rows this rank owns from unsharded tables (same on every rank; no communication, except to
        settle values written into the state dicts' tensors first, see `HeraldCheckpoint.settle`)."""
        self._checkpoint.settle()
        self._checkpoint.invalidate()
        self._exec.load_full_tables(weights, states)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """As TorchRec's sharded EBC with FUSED tables: `embedding_bags.<table>.weight`, this rank's home block as a
        `TableBatchedEmbeddingSlice` of the TBE (no TBE internals). No communication; rows living as guests on other
        ranks are current here only after a `state_dict()` (`HeraldCheckpoint.expose_parameters` says why)."""
        for name, p in zip(self.table_names, self._checkpoint.expose_parameters()):
            yield (f"{prefix}." if prefix else "") + f"embedding_bags.{name}.weight", p

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        """The table names of `named_parameters()` and the TBE's own parameters (which `nn.Module` walks reach, e.g.
        DDP's): DMP keeps both out of data parallelism."""
        yield from (key for key, _ in nn.Module.named_parameters(self, prefix))
        for name in self.table_names:
            yield (f"{prefix}." if prefix else "") + f"embedding_bags.{name}.weight"
