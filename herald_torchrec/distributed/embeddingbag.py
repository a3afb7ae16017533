"""`ShardedHeraldEmbeddingBagCollection`: the cache-aware sharded EmbeddingBagCollection that executes `Plan`s.

TorchRec contract (torchrec.distributed.types.ShardedModule): DMP / the train pipelines call
`input_dist(ctx, kjt)` -> `compute(ctx, ...)` -> `output_dist(ctx, ...)`. Here the input is already *local*: the
Herald input-permutation stage has given this rank exactly its B samples of the step (`plan.sample_order`), so
`input_dist` moves nothing (it may run ahead of time in a pipeline) and the pooled outputs are local, so
`output_dist` moves nothing either. All the communication of a step happens in `compute` and `finish_step`,
driven by the plan that the pipeline handed over with `set_plan(plan)` (docs/ARCHITECTURE.md §2, schedule/plan.py):

(a) moves: one all-to-all of rows + optimizer state (every row leaves, then every row arrives; directories updated);
(b) every local id is classified: *exclusive* (owned here after the moves and not in `plan.shared`) -> this rank's
    FBGEMM TBE over local slots, updated by the TBE's fused optimizer in backward; *shared* -> the owner sends the
    value to each reader (one all-to-all; the owner's own reads take the same path), readers feed the received
    values as a leaf tensor requiring grad, sum-pooled per bag and added to the TBE's pooled output;
(c) `finish_step()` (called by the fused optimizer's `step()`, or at the latest by the next forward): readers return
    their shared-row gradients (the reverse all-to-all), each owner sums them per key and applies ONE update through
    its TBE (a forward over one-row bags, then a backward: bit-exact with the fused path).

Every split size comes from the plan, identical on every rank, so no sizes are exchanged and a plan without moves
or shared keys costs no data collective (only the 8-byte error-check all-reduce, see `check_errors_globally`; in
other steps the error flags ride on the first all-to-all). The per-step work is vectorised over all tables: ids,
moves and shared pairs are handled by global key (`RowStore.key_base[t] + row`) in one numpy pass each.
A step that raises ValueError (bad input, plan inconsistent with the batch or the directory) has consumed its plan
but changed nothing: the module stays usable. In eval mode, or with no plan queued, the module builds the *static*
plan itself (an all-gather of the local ids; owners never move, every non-owner read is shared): eval forwards at
any time (they never consume a queued training plan) and runs without a scheduler work.

Counters (rows, this rank's part of the step; the sum over ranks equals `plan.counters` of the same plan, with the
scheduler's definitions): `hit` distinct keys read here that this rank owns after the moves and that did not move
this step (exclusive keys and the owner's own reads of shared keys: no transfer at all), `migrate` / `evict_home` /
`forward` rows sent by move kind, `shared_value` values sent to other readers, `shared_grad` gradients sent to other
owners. Bytes by kind are in `comm_counter` (see comm.py). Hit rate per table = hits / distinct keys read here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

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

from herald_torchrec.distributed.checkpoint import (
    CheckpointedOptimizerMixin,
    HeraldCheckpoint,
    install_state_dict_hooks,
    optimizer_layout,
)
from herald_torchrec.distributed.comm import CommCounter, PlanComm, phase
from herald_torchrec.distributed.row_store import (
    RowStore,
    TableSpec,
    check_cache_ratio,
    exclusive_cumsum,
    home_range,
    ragged_arange,
)
from herald_torchrec.distributed.optimizer_params import resolve_table_settings
from herald_torchrec.schedule.plan import EVICT_HOME, MOVE_KIND_NAMES, Plan, SharedRows

COUNTER_KINDS = ("hit", "migrate", "evict_home", "forward", "shared_value", "shared_grad")


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


class HeraldFusedOptimizer(CheckpointedOptimizerMixin, FusedOptimizer):
    """The module's entry in DMP's fused optimizer: exclusive rows are updated in backward (FBGEMM's fused
    optimizer); `step()` finishes the step's shared rows (gradient all-to-all + one update per row at its owner).
    Params, state and param_groups are TorchRec's (checkpoint.py): `state_dict()` / `load_state_dict()` carry the
    row-wise optimizer state under TorchRec's keys (both collective)."""

    def __init__(self, module: "ShardedHeraldEmbeddingBagCollection") -> None:
        super().__init__(*optimizer_layout(module._checkpoint))
        self._module_ref = [module]  # a list, so that the module is not registered as an optimizer attribute
        self._checkpoint_ready = True

    def _follow_lr(self) -> None:
        # LR schedulers edit param_groups; like TorchRec's fused optimizers, the TBE takes the new rate at step() /
        # zero_grad(), i.e. from the next backward on. Never between a backward and its shared-row update, so
        # every row of a step is updated with the same rate.
        module = self._module_ref[0]
        lr = float(next(iter(self.param_groups))["lr"])
        if lr != module.learning_rate and module._pending is None:
            module.set_learning_rate(lr)

    def step(self, closure: Any = None) -> None:
        self._module_ref[0].finish_step()
        self._follow_lr()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._follow_lr()


@dataclass
class _SharedStep:
    """One step's shared-row exchange as seen by this rank (built from the plan; identical sizes everywhere)."""

    send_table: np.ndarray  # pairs this rank owns, in send order (by reader): table, row, global key
    send_row: np.ndarray
    send_gkey: np.ndarray
    send_off: np.ndarray  # float offset of each pair in the send buffer
    send_splits: list[int]
    recv_table: np.ndarray  # pairs this rank reads, in receive order (by owner)
    recv_row: np.ndarray
    recv_off: np.ndarray
    recv_splits: list[int]
    n_values_out: int  # pairs sent to other ranks
    n_grads_out: int  # pairs received from other ranks (their gradients go back)
    globally_empty: bool
    marked: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # global keys marked this step
    values: torch.Tensor | None = None  # received values (flat, leaf requiring grad when training)


@dataclass
class _MoveStep:
    send_idx: np.ndarray  # move indices this rank sends, in send order (by dst)
    recv_idx: np.ndarray  # move indices this rank receives, in receive order (by src)
    send_splits: list[int]
    recv_splits: list[int]
    globally_empty: bool
    table: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # every move: table, row, dst, kind
    row: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    dst: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    kind: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    gkey_sorted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # moved global keys, sorted
    dst_sorted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # their destinations


@dataclass
class _LocalInput:
    """This rank's ids, all module features in one flat array (feature order = table order): numpy passes over
    all features at once instead of one per feature."""

    batch_size: int
    values: np.ndarray  # int64, feature after feature
    lengths: np.ndarray  # int64 [F, B]
    gkeys: np.ndarray  # global key (store.key_base[table] + id) of every value
    seg: np.ndarray  # f * B + bag of every value


@dataclass
class _ErrorCheck:
    """A step's rank-local error (or None), to be raised on every rank by the first collective of the step, which
    carries `flag` (0, or this rank + 1) to the others."""

    err: Exception | None
    flag: int


def _stable_order(keys: np.ndarray) -> np.ndarray:
    return np.argsort(keys, kind="stable")


def _routes(src: np.ndarray, dst: np.ndarray, width: np.ndarray, rank: int, world: int):
    """Items going src -> dst: this rank's send / receive positions (grouped by peer, stable) and the all-to-all
    split sizes in elements (`width` elements per item)."""
    send = np.flatnonzero(src == rank)
    send = send[_stable_order(dst[send])]
    recv = np.flatnonzero(dst == rank)
    recv = recv[_stable_order(src[recv])]
    send_splits = np.bincount(dst[send], weights=width[send], minlength=world).astype(np.int64).tolist()
    recv_splits = np.bincount(src[recv], weights=width[recv], minlength=world).astype(np.int64).tolist()
    return send, recv, send_splits, recv_splits


class ShardedHeraldEmbeddingBagCollection(
    ShardedModule[KJTList, torch.Tensor, KeyedTensor, HeraldEmbeddingBagCollectionContext],
    FusedOptimizerModule,
):
    """Herald-managed EmbeddingBagCollection (sum pooling, unweighted) on one FBGEMM TBE per rank.

    Args:
        module: the unsharded EBC; its weights (unless on meta) are copied into the home rows.
        table_name_to_parameter_sharding: DMP's plan for the module (every table ROW_WISE); may be None.
        env: TorchRec sharding env (process group, rank, world size).
        fused_params: as TorchRec's sharders take them ({"optimizer": EmbOptimType or name, "learning_rate", "eps",
            "gradient_clipping", ...}); `apply_optimizer_in_backward` on `module` overrides them per table, as in
            TorchRec. Unsupported settings raise ValueError (optimizer_params.check_settings). `gather_uvm_cache_stats` (CUDA) turns on FBGEMM's
            HBM-cache counters, read with `_store.cache_stats()`.
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
    ) -> None:
        super().__init__(qcomm_codecs_registry=qcomm_codecs_registry)
        self.gradient_division = gradient_division
        self.cache_ratio = check_cache_ratio(cache_ratio)
        if not isinstance(module, EmbeddingBagCollection):
            raise ValueError(f"expected an EmbeddingBagCollection, got {type(module).__name__}")
        if module.is_weighted():
            raise ValueError("Herald-managed EmbeddingBagCollection: weighted (per-sample weight) features are not supported")
        configs = module.embedding_bag_configs()
        for c in configs:
            if c.pooling != PoolingType.SUM:
                raise ValueError(f"table {c.name!r}: only SUM pooling is supported, got {c.pooling}")
        self._env = env
        self.rank, self.world_size = env.rank, env.world_size
        self.policy, self.lookahead, self.module_fqn = policy, int(lookahead), module_fqn
        self.check_errors_globally = check_errors_globally
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "meta":
            raise ValueError("ShardedHeraldEmbeddingBagCollection cannot be built on the meta device")
        # fused_params + apply_optimizer_in_backward, resolved as TorchRec resolves them (optimizer_params.py)
        self.optimizer_settings = resolve_table_settings(module, fused_params, table_name_to_parameter_sharding, self.device)
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
        self._comm = PlanComm(env.process_group, self.comm_counter)
        self._plans: deque[Plan | None] = deque()
        self._pending: _SharedStep | None = None
        self.ownership_version = 0  # +1 whenever ownership is reset to home (a load): schedulers rebuild from home
        self._checkpoint = HeraldCheckpoint(self, table_name_to_parameter_sharding)  # TorchRec-layout state dicts
        install_state_dict_hooks(self)
        self._optim = HeraldFusedOptimizer(self)
        T = len(configs)
        self.step_counters: dict[str, int] = {k: 0 for k in COUNTER_KINDS}
        self.total_counters: dict[str, int] = {k: 0 for k in COUNTER_KINDS}
        self._reads = np.zeros((2, T), dtype=np.int64)  # last step: [hits, distinct keys read] per table
        self._reads_total = np.zeros((2, T), dtype=np.int64)
        # step scratch by global key: index of a shared key among the pairs this rank receives (-1 not shared, -2
        # shared but not read here); reset after each step
        self._mark_all = np.full(int(self._store.key_base[-1]), -1, dtype=np.int64)
        self._feature_table_arr = np.array(self.feature_table, dtype=np.int64)
        self._feature_dims_arr = np.array(self.feature_dims, dtype=np.int64)
        self._feature_col = exclusive_cumsum(self._feature_dims_arr)  # output column of each feature
        self._key_index: dict[tuple[str, ...], np.ndarray] = {}  # KJT keys -> position of each module feature
        self.steps = 0

    # ------------------------------------------------------------------ setup
    def _check_parameter_sharding(self, configs: list, plan: dict[str, ParameterSharding] | None) -> None:
        if plan is None:
            return
        for c in configs:
            ps = plan.get(c.name)
            if ps is None:
                raise ValueError(f"table {c.name!r} has no sharding in the plan: every table of a Herald-managed EBC is managed")
            if ps.sharding_type != ShardingType.ROW_WISE.value:
                raise ValueError(f"table {c.name!r}: Herald-managed tables are ROW_WISE (home placement), got {ps.sharding_type}")
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
        if plan.sample_order.shape[0] != plan.num_ranks * plan.batch_per_rank:
            raise ValueError(
                f"set_plan: sample_order has {plan.sample_order.shape[0]} entries, expected "
                f"{plan.num_ranks} x {plan.batch_per_rank}"
            )
        self._plans.append(plan)

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
    def _parse_input(self, features: KeyedJaggedTensor) -> _LocalInput:
        if features.variable_stride_per_key():
            raise ValueError("Herald-managed EBC: variable batch size per feature is not supported")
        if features.weights_or_none() is not None:
            raise ValueError("Herald-managed EBC: weighted KeyedJaggedTensors are not supported")
        B = features.stride()
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
        K, F = len(keys), len(self.feature_names)
        if lens.shape[0] != B * K:
            raise ValueError(f"input KeyedJaggedTensor: {lens.shape[0]} lengths for {K} keys x batch {B}")
        lens = lens.reshape(K, B)
        if K == F and (idx == np.arange(F)).all():  # the module's features, in its order: use the KJT as it is
            values, lengths = vals, lens
        else:
            per_key_len = lens.sum(axis=1)
            values = vals[ragged_arange(exclusive_cumsum(per_key_len)[idx], per_key_len[idx])]
            lengths = lens[idx]
        st = self._store
        flen = lengths.sum(axis=1)
        ftab = self._feature_table_arr
        bad = (values < 0) | (values >= np.repeat(st.rows_arr[ftab], flen))
        if bad.any():
            f = int(np.searchsorted(np.cumsum(flen), np.argmax(bad), side="right"))
            t = self.feature_table[f]
            v = values[exclusive_cumsum(flen)[f] : exclusive_cumsum(flen)[f] + flen[f]]
            raise ValueError(
                f"feature {self.feature_names[f]!r} (table {self.table_names[t]!r}, {st.rows[t]} rows): ids out of range "
                f"{v[(v < 0) | (v >= st.rows[t])][:5].tolist()}"
            )
        gkeys = values + np.repeat(st.key_base[ftab], flen)
        seg = np.repeat(np.arange(F * B, dtype=np.int64), lengths.reshape(-1))
        return _LocalInput(B, values, lengths, gkeys, seg)

    def _raise_step_error(self, err: Exception | None, worst_flag: int) -> None:
        """Raise this rank's own error, or a ValueError naming the failed rank (flag = rank + 1) if another failed."""
        if err is not None:
            raise err
        if worst_flag:
            raise ValueError(f"step aborted: rank {worst_flag - 1} rejected its input or the plan (see its error)")

    def _sync_error(self, err: Exception | None) -> None:
        """Raise on every rank if any rank failed its local checks (so that no rank is left in a collective)."""
        worst = 0
        if self.world_size > 1 and self.check_errors_globally:
            flag = torch.tensor([0 if err is None else self.rank + 1], dtype=torch.int64, device=self.device)
            self._comm.all_reduce(flag, "control", op=dist.ReduceOp.MAX)  # on the device: NCCL needs CUDA tensors
            worst = int(flag.item())
        self._raise_step_error(err, worst)

    def _step(self, features: KeyedJaggedTensor) -> torch.Tensor:
        with phase("step"):
            return self._step_impl(features)

    def _step_impl(self, features: KeyedJaggedTensor) -> torch.Tensor:
        # Collectives must be issued in the same order on every rank: plan-level (global) checks raise alike
        # everywhere; rank-local failures (the input, the input against the plan) are gathered into `err` and
        # raised on every rank together before anything moves: their flag rides on the step's first all-to-all
        # (moves, else shared values), and only a step with neither pays a separate all-reduce (`_sync_error`).
        if self._pending is not None:
            self.finish_step()  # the previous step's shared rows, if the optimizer step did not do it
        err: Exception | None = None
        local: _LocalInput | None = None
        try:
            with phase("step.parse_input"):
                local = self._parse_input(features)
        except ValueError as e:
            err = e
        plan = self._plans.popleft() if self._plans and self.training else None  # eval never consumes training plans
        if plan is None:
            self._sync_error(err)  # the static plan needs every rank's ids
            plan = self._static_plan(local)
        with phase("step.prepare_moves"):
            moves = self._prepare_moves(plan)  # global checks: every rank raises alike
        with phase("step.prepare_shared"):
            shared = self._prepare_shared(plan, moves)
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
                        cls = self._classify(plan, local, moves)
                except ValueError as e:
                    err = e
            ride = self.world_size > 1 and self.check_errors_globally and not (moves.globally_empty and shared.globally_empty)
            check = _ErrorCheck(err, 0 if err is None else self.rank + 1) if ride else None
            if check is None:
                with phase("step.sync_error"):
                    self._sync_error(err)
            with phase("step.execute_moves"):
                moved = self._execute_moves(moves, check)
            training = self.training and torch.is_grad_enabled()
            with phase("step.exchange_values"):
                self._exchange_values(shared, training, check if moves.globally_empty else None)
            with phase("step.lookup"):
                out = self._lookup(local, shared)
        finally:
            self._reset_marks(shared)
        if training and self.world_size > 1 and self._divides_gradients():
            out = _DivideGrad.apply(out, self.world_size)
        self.step_counters = {k: 0 for k in COUNTER_KINDS}
        hits, nreads = cls
        self._reads[0], self._reads[1] = hits, nreads
        self._reads_total += self._reads
        counts = {**moved, "hit": int(hits.sum()), "shared_value": 0 if shared.globally_empty else shared.n_values_out}
        for k, v in counts.items():
            self.step_counters[k] += v
            self.total_counters[k] += v
        self._pending = shared if training else None
        self.steps += 1
        return out

    def _divides_gradients(self) -> bool:
        if self.gradient_division is not None:
            return bool(self.gradient_division)
        from torchrec.distributed.comm_ops import get_gradient_division

        return bool(get_gradient_division())

    # ------------------------------------------------------------- moves
    def _prepare_moves(self, plan: Plan) -> _MoveStep:
        st, R, r = self._store, self.world_size, self.rank
        mv = plan.moves
        n = len(mv)
        if n == 0:
            z = np.zeros(0, dtype=np.int64)
            return _MoveStep(z, z, [0] * R, [0] * R, True)
        table = np.asarray(mv.table, dtype=np.int64)
        row = np.asarray(mv.row, dtype=np.int64)
        src = np.asarray(mv.src, dtype=np.int64)
        dst = np.asarray(mv.dst, dtype=np.int64)
        kind = np.asarray(mv.kind, dtype=np.int64)
        if not (table.shape == row.shape == src.shape == dst.shape == kind.shape):
            raise ValueError(f"plan {plan.step}: moves arrays differ in length")
        T = st.num_tables
        if table.min() < 0 or table.max() >= T:
            raise ValueError(f"plan {plan.step}: move table index out of range [0, {T})")
        if src.min() < 0 or src.max() >= R or dst.min() < 0 or dst.max() >= R:
            raise ValueError(f"plan {plan.step}: move src/dst rank out of range [0, {R})")
        if (src == dst).any():
            raise ValueError(f"plan {plan.step}: move with src == dst")
        if not np.isin(kind, list(MOVE_KIND_NAMES)).all():
            raise ValueError(f"plan {plan.step}: unknown move kind in {np.unique(kind).tolist()}")
        # all tables in one pass, on global keys
        st.check_keys_many(table, row, f"plan {plan.step}: moved rows")
        gkey = st.gkeys(table, row)
        owner = st.owner_all[gkey]
        if (owner != src).any():
            i = int(np.argmax(owner != src))
            raise ValueError(
                f"plan {plan.step}: table {self.table_names[table[i]]!r} row {row[i]} moves from rank {src[i]} "
                f"but is owned by rank {owner[i]}"
            )
        home = row // st.home_block_arr[table]
        if ((kind == EVICT_HOME) & ((dst != home) | (src == home))).any():
            raise ValueError(f"plan {plan.step}: an evict_home move does not send a guest to its home rank")
        gc = st.guest_count_all.copy()
        leaves, arrives = src != home, dst != home  # a guest leaves src / arrives at dst
        gc -= np.bincount(table[leaves] * R + src[leaves], minlength=T * R).reshape(T, R)
        gc += np.bincount(table[arrives] * R + dst[arrives], minlength=T * R).reshape(T, R)
        over = gc > np.asarray(st.capacity, dtype=np.int64)[:, None]
        if over.any():
            t = int(np.argmax(over.any(axis=1)))
            q = int(np.argmax(gc[t]))
            raise ValueError(
                f"plan {plan.step}: after the moves rank {q} holds {gc[t, q]} guests of table "
                f"{self.table_names[t]!r}, capacity {st.capacity[t]}"
            )
        order = np.argsort(gkey, kind="stable")
        gkey_sorted = gkey[order]
        if (gkey_sorted[1:] == gkey_sorted[:-1]).any():
            raise ValueError(f"plan {plan.step}: a row moves twice in one step")
        width = st.packed_widths(table)
        send_idx, recv_idx, send_splits, recv_splits = _routes(src, dst, width, r, R)
        return _MoveStep(send_idx, recv_idx, send_splits, recv_splits, False, table, row, dst, kind, gkey_sorted, dst[order])

    def _execute_moves(self, ms: _MoveStep, check: _ErrorCheck | None) -> dict[str, int]:
        """Every row leaves, then every row arrives (one all-to-all of rows + optimizer state, all tables at once).
        With `check`, the all-to-all also carries the step's error flags, and any rank's error raises on every rank
        before anything changes. Returns the rows this rank sent, by move kind."""
        if ms.globally_empty:
            return {}
        st = self._store
        s_tab, s_row = ms.table[ms.send_idx], ms.row[ms.send_idx]
        s_slot = st.slot_of_all[st.gkeys(s_tab, s_row)].astype(np.int64)
        if (s_slot < 0).any():  # pragma: no cover - the plan checks guarantee ownership
            raise RuntimeError("a moved row sent by a rank that does not own it")
        send = st.read_packed(s_tab, s_slot)  # departing rows (value + optimizer state), in send order
        if check is not None:
            recv, worst = self._comm.all_to_all_flagged(send, ms.send_splits, ms.recv_splits, "moves", check.flag)
            self._raise_step_error(check.err, worst)
        else:
            recv = self._comm.all_to_all(send, ms.send_splits, ms.recv_splits, "moves")
        st.release_many(s_tab, s_row)
        st.set_owner_many(ms.table, ms.row, ms.dst)  # every rank applies every move to the global ownership map
        r_tab, r_row = ms.table[ms.recv_idx], ms.row[ms.recv_idx]
        st.write_packed(r_tab, st.allocate_many(r_tab, r_row), recv)
        sent_kind = ms.kind[ms.send_idx]
        return {name: int((sent_kind == k).sum()) for k, name in MOVE_KIND_NAMES.items()}

    # ------------------------------------------------------------ shared rows
    def _prepare_shared(self, plan: Plan, ms: _MoveStep) -> _SharedStep:
        st, R, r = self._store, self.world_size, self.rank
        sh = plan.shared
        n = len(sh)
        z = np.zeros(0, dtype=np.int64)
        if n == 0:
            return _SharedStep(z, z, z, z, [0] * R, z, z, z, [0] * R, 0, 0, True)
        table = np.asarray(sh.table, dtype=np.int64)
        row = np.asarray(sh.row, dtype=np.int64)
        owner = np.asarray(sh.owner, dtype=np.int64)
        ro = np.asarray(sh.reader_offsets, dtype=np.int64)
        readers = np.asarray(sh.readers, dtype=np.int64)
        T = st.num_tables
        if not (table.shape == row.shape == owner.shape) or ro.shape[0] != n + 1 or ro[0] != 0 or ro[-1] != readers.shape[0]:
            raise ValueError(f"plan {plan.step}: malformed shared rows (array lengths / reader_offsets)")
        counts = np.diff(ro)
        if (counts < 1).any():
            raise ValueError(f"plan {plan.step}: a shared row has no reader")
        if table.min() < 0 or table.max() >= T:
            raise ValueError(f"plan {plan.step}: shared table index out of range [0, {T})")
        if owner.min() < 0 or owner.max() >= R or readers.min() < 0 or readers.max() >= R:
            raise ValueError(f"plan {plan.step}: shared owner/reader rank out of range [0, {R})")
        pair_key = np.repeat(np.arange(n, dtype=np.int64), counts)
        if (np.diff(readers)[np.diff(pair_key) == 0] <= 0).any():
            raise ValueError(f"plan {plan.step}: readers of a shared row must be sorted and distinct")
        # owner after this step's moves (moves are validated separately; apply them virtually here)
        st.check_keys_many(table, row, f"plan {plan.step}: shared rows")
        gkey = st.gkeys(table, row)
        owner_after = self._owners_after_moves(ms, gkey)
        if (owner_after != owner).any():
            i = int(np.flatnonzero(owner_after != owner)[0])
            raise ValueError(
                f"plan {plan.step}: shared row {row[i]} of table {self.table_names[table[i]]!r} names owner {owner[i]}, "
                f"but its owner after the moves is {owner_after[i]}"
            )
        if np.unique(gkey).shape[0] != n:
            raise ValueError(f"plan {plan.step}: a row is listed twice in shared")
        p_tab, p_row, p_own, p_key = table[pair_key], row[pair_key], owner[pair_key], gkey[pair_key]
        p_w = st.dims_arr[p_tab]
        send_sel, recv_sel, send_splits, recv_splits = _routes(p_own, readers, p_w, r, R)
        sh_step = _SharedStep(
            send_table=p_tab[send_sel],
            send_row=p_row[send_sel],
            send_gkey=p_key[send_sel],
            send_off=exclusive_cumsum(p_w[send_sel]),
            send_splits=send_splits,
            recv_table=p_tab[recv_sel],
            recv_row=p_row[recv_sel],
            recv_off=exclusive_cumsum(p_w[recv_sel]),
            recv_splits=recv_splits,
            n_values_out=int((readers[send_sel] != r).sum()),
            n_grads_out=int((p_own[recv_sel] != r).sum()),
            globally_empty=False,
            marked=gkey,
        )
        # marks: -2 for every shared key, then, for the keys read here, their index among the received pairs
        self._mark_all[gkey] = -2
        self._mark_all[p_key[recv_sel]] = np.arange(recv_sel.shape[0], dtype=np.int64)
        return sh_step

    def _reset_marks(self, sh: _SharedStep) -> None:
        self._mark_all[sh.marked] = -1

    def _owners_after_moves(self, ms: _MoveStep, gkey: np.ndarray) -> np.ndarray:
        """Owner of global keys once this step's moves are applied (the moves themselves are not applied here)."""
        out = self._store.owner_all[gkey].astype(np.int64)
        if ms.gkey_sorted.shape[0]:
            pos = np.minimum(np.searchsorted(ms.gkey_sorted, gkey), ms.gkey_sorted.shape[0] - 1)
            hit = ms.gkey_sorted[pos] == gkey
            out[hit] = ms.dst_sorted[pos[hit]]
        return out

    def _moved(self, ms: _MoveStep, gkey: np.ndarray) -> np.ndarray:
        if ms.gkey_sorted.shape[0] == 0:
            return np.zeros(gkey.shape[0], dtype=bool)
        pos = np.minimum(np.searchsorted(ms.gkey_sorted, gkey), ms.gkey_sorted.shape[0] - 1)
        return ms.gkey_sorted[pos] == gkey

    def _classify(self, plan: Plan, local: _LocalInput, ms: _MoveStep) -> tuple[np.ndarray, np.ndarray]:
        """Check every local id against the plan. Returns, per table, the hits (distinct keys read here that this
        rank owns after the moves and that did not move this step: no transfer at all, whether the key is exclusive
        or this rank is the owner reading a shared key) and the distinct keys read here."""
        st = self._store
        T = st.num_tables
        gk = local.gkeys
        not_reader = self._mark_all[gk] == -2
        if not_reader.any():
            g = int(gk[np.argmax(not_reader)])
            t = int(np.searchsorted(st.key_base, g, side="right")) - 1
            raise ValueError(
                f"plan {plan.step} does not match the batch: rank {self.rank} reads shared row {g - st.key_base[t]} of "
                f"table {self.table_names[t]!r} but is not among its readers"
            )
        u = np.unique(gk)
        tab = np.searchsorted(st.key_base, u, side="right").astype(np.int64) - 1
        own = self._owners_after_moves(ms, u)
        foreign = (self._mark_all[u] == -1) & (own != self.rank)
        if foreign.any():
            i = int(np.argmax(foreign))
            raise ValueError(
                f"plan {plan.step} does not match the batch: rank {self.rank} reads row {u[i] - st.key_base[tab[i]]} of "
                f"table {self.table_names[tab[i]]!r}, owned by rank {int(own[i])} after the moves and not in plan.shared"
            )
        hit = (own == self.rank) & ~self._moved(ms, u)
        return np.bincount(tab[hit], minlength=T).astype(np.int64), np.bincount(tab, minlength=T).astype(np.int64)

    def _exchange_values(self, sh: _SharedStep, training: bool, check: _ErrorCheck | None) -> None:
        """Owners send the shared rows' values to their readers (one all-to-all, all tables at once). With `check`,
        it also carries the step's error flags (see `_execute_moves`)."""
        if sh.globally_empty:
            sh.values = None
            return
        st = self._store
        slots = st.slot_of_all[sh.send_gkey].astype(np.int64)
        if (slots < 0).any():  # pragma: no cover - the plan checks guarantee ownership
            raise RuntimeError("shared row sent by a rank that does not own it")
        send = st.read_packed(sh.send_table, slots, with_state=False)  # laid out as send_off
        if check is not None:
            vals, worst = self._comm.all_to_all_flagged(send, sh.send_splits, sh.recv_splits, "shared_value", check.flag)
            self._raise_step_error(check.err, worst)
        else:
            vals = self._comm.all_to_all(send, sh.send_splits, sh.recv_splits, "shared_value")
        if training:
            vals.requires_grad_(True)
        sh.values = vals

    def _lookup(self, local: _LocalInput, sh: _SharedStep) -> torch.Tensor:
        """Pooled embeddings [B, sum of dims]: the TBE over exclusive ids, plus the received values of shared ids
        summed into their bags (differentiable w.r.t. the received values), all features in one pass."""
        st = self._store
        B, F = local.batch_size, len(self.feature_names)
        mark = self._mark_all[local.gkeys]
        ex = mark == -1
        indices = st.slot_of_all[local.gkeys[ex]].astype(np.int64)
        if (indices < 0).any():  # pragma: no cover - guarded by _classify
            raise RuntimeError("exclusive id without a local slot after the moves")
        offsets = np.zeros(F * B + 1, dtype=np.int64)
        np.cumsum(np.bincount(local.seg[ex], minlength=F * B), out=offsets[1:])
        out = st.lookup(torch.from_numpy(indices).to(self.device), torch.from_numpy(offsets).to(self.device))
        shared = np.flatnonzero(~ex)
        if shared.size:
            j = mark[shared]  # index of the value among the received pairs
            f, bag = np.divmod(local.seg[shared], B)
            d = self._feature_dims_arr[f]
            src = torch.from_numpy(ragged_arange(sh.recv_off[j], d)).to(self.device)
            dst = torch.from_numpy(ragged_arange(bag * out.shape[1] + self._feature_col[f], d)).to(self.device)
            v = sh.values.index_select(0, src)
            extra = torch.zeros(out.numel(), dtype=v.dtype, device=self.device).index_add(0, dst, v)
            out = out + st.clip_pooled_gradient(extra.view(out.shape))  # clipped per bag, as the TBE clips its own
        return out

    def finish_step(self) -> None:
        """Send shared-row gradients to their owners; each owner applies one update per row with their sum.

        Collective (every rank calls it, in the same order). Called by the fused optimizer's `step()`; a no-op
        when nothing is pending (eval forwards, or already finished)."""
        sh = self._pending
        self._pending = None
        if sh is None or sh.globally_empty:
            return
        with phase("finish_step"):
            self._finish_shared(sh)

    def _finish_shared(self, sh: _SharedStep) -> None:
        st = self._store
        vals = sh.values
        grad = vals.grad if vals is not None and vals.grad is not None else None
        if grad is None:
            grad = torch.zeros(int(sum(sh.recv_splits)), dtype=torch.float32, device=self.device)
        grad = grad.detach()
        sh.values = None
        back = self._comm.all_to_all(grad, sh.recv_splits, sh.send_splits, "shared_grad")  # laid out as send_off
        self.step_counters["shared_grad"] += sh.n_grads_out
        self.total_counters["shared_grad"] += sh.n_grads_out
        if sh.send_gkey.shape[0] == 0:
            return
        # sum the readers' gradients per key (in send order: readers in rank order), all tables at once
        keys, inv = np.unique(sh.send_gkey, return_inverse=True)
        tab = np.searchsorted(st.key_base, keys, side="right").astype(np.int64) - 1
        kd = st.dims_arr[tab]
        dst = ragged_arange(exclusive_cumsum(kd)[inv.reshape(-1)], st.dims_arr[sh.send_table])
        summed = torch.zeros(int(kd.sum()), dtype=back.dtype, device=self.device)
        summed.index_add_(0, torch.from_numpy(dst).to(self.device), back)
        with phase("finish_step.apply"):
            st.apply_summed_gradients_packed(tab, st.slot_of_all[keys].astype(np.int64), summed)

    # ------------------------------------------------------ fallback static plan
    def _static_plan(self, local: _LocalInput) -> Plan:
        """The plan of the `static` policy for this batch (collective): owners stay, every non-owner read is shared.

        Used when no plan is queued (eval batches, runs without a scheduler); sample_order is the identity."""
        st, R, T = self._store, self.world_size, self._store.num_tables
        u = np.unique(local.gkeys)  # by table, then row
        t_u = np.searchsorted(st.key_base, u, side="right").astype(np.int64) - 1
        keys = (u - st.key_base[t_u]) * T + t_u  # (row, table) packed; ids are < rows, so no overflow for realistic sizes
        mine = torch.from_numpy(keys).to(self.device)
        gathered = [g.cpu().numpy() for g in self._comm.all_gather_uneven(mine, "control")]
        k_all = np.concatenate(gathered)
        rk_all = np.concatenate([np.full(g.shape[0], q, dtype=np.int64) for q, g in enumerate(gathered)])
        order = np.lexsort((rk_all, k_all))
        k_all, rk_all = k_all[order], rk_all[order]
        uk, start, cnt = np.unique(k_all, return_index=True, return_counts=True)
        tab, row = uk % T, uk // T
        owner = st.owner_all[st.gkeys(tab, row)].astype(np.int64)
        excl = (cnt == 1) & (rk_all[start] == owner)
        hit = int((rk_all == np.repeat(owner, cnt)).sum())  # (key, reader) pairs read by the owner
        sel = np.flatnonzero(~excl)
        keep = np.repeat(~excl, cnt)
        readers = rk_all[keep]
        ro = np.concatenate([[0], np.cumsum(cnt[sel])]).astype(np.int64)
        shared = SharedRows(table=tab[sel], row=row[sel], owner=owner[sel], reader_offsets=ro, readers=readers)
        remote = shared.remote_reads()
        B = local.batch_size
        return Plan(
            step=-1,
            num_ranks=R,
            batch_per_rank=B,
            sample_order=np.arange(R * B, dtype=np.int64),
            shared=shared,
            counters={"hit": hit, "migrate": 0, "evict_home": 0, "forward": 0, "shared_value": remote,
                      "shared_grad": remote},
        )

    # ------------------------------------------------------------- exports
    def set_learning_rate(self, lr: float) -> None:
        """Learning rate of the fused embedding optimizer (exclusive and shared rows alike)."""
        self.learning_rate = float(lr)
        self._store.tbe.set_learning_rate(self.learning_rate)
        for g in self._optim.param_groups:
            g["lr"] = self.learning_rate

    @property
    def store(self) -> RowStore:
        return self._store

    def owners(self, table: int | str) -> np.ndarray:
        """Global owner rank of every row of a table (int32 [rows], identical on every rank)."""
        t = self.table_names.index(table) if isinstance(table, str) else int(table)
        return self._store.owner[t]

    def hit_rate(self, cumulative: bool = False) -> dict[str, float]:
        """Per table: hits / distinct keys read here (last step, or over all steps), as the `hit` counter counts
        them: reads served by the rank's own rows with no transfer this step. NaN for a table not read."""
        reads = self._reads_total if cumulative else self._reads
        return {n: float(reads[0, t] / reads[1, t]) if reads[1, t] else float("nan") for t, n in enumerate(self.table_names)}

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
        if self._pending is not None:
            self.finish_step()
        st = self._store
        parts, shapes = [], []
        for t in range(st.num_tables):
            W = torch.zeros(st.rows[t], st.row_width(t), dtype=torch.float32, device=self.device)
            keys = st.owned_keys(t)
            if keys.size:
                w, s = st.read_slots(t, st.slots(t, keys))
                idx = torch.from_numpy(keys).to(self.device)
                W[idx, : st.dims[t]] = w
                if s.shape[1]:
                    W[idx, st.dims[t] :] = s
            parts.append(W.reshape(-1))
            shapes.append(W.shape)
        flat = torch.cat(parts)
        self._comm.all_reduce(flat, "full_tables")
        weights, states = {}, {}
        off = 0
        for t, shp in enumerate(shapes):
            n = shp[0] * shp[1]
            W = flat[off : off + n].view(shp).cpu()
            off += n
            name = self.table_names[t]
            weights[name] = W[:, : st.dims[t]].clone()
            sw = st.state_widths[t]
            if sw:
                states[name] = W[:, st.dims[t] :].clone().squeeze(1) if sw == 1 else W[:, st.dims[t] :].clone()
        return weights, states

    @torch.no_grad()
    def load_full_tables(self, weights: dict[str, torch.Tensor], states: dict[str, torch.Tensor] | None = None) -> None:
        """Write the rows this rank owns from unsharded tables (same on every rank; no communication)."""
        st = self._store
        self._checkpoint.invalidate()
        for t, name in enumerate(self.table_names):
            keys = st.owned_keys(t)
            if name not in weights or keys.size == 0:
                continue
            W = weights[name]
            if tuple(W.shape) != (st.rows[t], st.dims[t]):
                raise ValueError(f"load_full_tables: {name!r} has shape {tuple(W.shape)}, expected {(st.rows[t], st.dims[t])}")
            idx = torch.from_numpy(keys)
            rows = W[idx]
            s = None
            if states is not None and name in states and st.state_widths[t]:
                s = states[name][idx].reshape(keys.size, -1)
            st.write_slots(t, st.slots(t, keys), rows, s)

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        for key, _ in self.named_parameters(prefix):
            yield key
