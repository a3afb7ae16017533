"""The central correctness claim (docs/ARCHITECTURE.md §2): Herald's data plane trains the same model as TorchRec.

Two gloo ranks train a small model (an EBC over 4 tables of 50..500 rows, dim 8, one multi-hot feature and one
table read by two features, plus a dense MLP; no dropout / batch norm) for 30 steps on Zipf-skewed ids, for
EXACT_ROWWISE_ADAGRAD and EXACT_SGD, in four ways:
  (i)   ShardedHeraldEmbeddingBagCollection executing "static" plans (no moves; every non-owner read is shared),
  (ii)  the same module executing plans with real migrations, evictions home, forwards and shared rows, drawn by
        a random but deterministic, capacity-respecting test planner (`RandomPlanner`, below),
  (iii) stock TorchRec ROW_WISE sharding via DMP,
  (iv)  a single-process reference: one FBGEMM TBE over the full tables with the same fused optimizer, on the same
        global batches, with TorchRec's gradient convention (sum over ranks of per-rank mean losses for the
        embeddings, dense gradients averaged over ranks).
Final tables, optimizer states and dense parameters must agree to 1e-5; the module's per-kind row counters must
equal plan.counters at every step.

The planner here is test-only; the real scheduler (herald_torchrec.schedule) plugs into the same `Plan` contract.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from herald_torchrec.schedule.plan import EVICT_HOME, FORWARD, MIGRATE, MOVE_KIND_NAMES, Plan, RowMoves, SharedRows
from tests.helpers.ranks import rank_result, run_ranks

# ------------------------------------------------------------------------------------------ test data & planner
TABLE_ROWS = (50, 120, 300, 500)
DIM = 8
# (feature, table): table 1 is read by two features; f2 is multi-hot (0..3 ids per sample)
FEATURES = (("f0", 0), ("f1", 1), ("f1b", 1), ("f2", 2), ("f3", 3))
MULTI_HOT = {"f2"}
NUM_DENSE = 4
BATCH = 16  # per rank
STEPS = 30
CACHE_RATIO = 0.1
LR_EMB = {"exact_rowwise_adagrad": 0.05, "exact_sgd": 0.5}
LR_DENSE = 0.1
EPS = 1e-8


def make_batches(
    world: int, steps: int = STEPS, batch: int = BATCH, seed: int = 0, weighted: bool = False
) -> list[dict]:
    """Global batches: per feature CSR (offsets [N+1], values int64), dense [N, 4], labels [N]; Zipf-skewed ids.
    `weighted`: also per feature a float32 weight per id in [0.2, 2) (`batch["weights"]`, id-score lists), drawn from
    a stream of their own, so the ids are those of the unweighted batches."""
    rng = np.random.default_rng(seed)
    wrng = np.random.default_rng(seed + 1000) if weighted else None
    n = world * batch
    perms = [rng.permutation(r) for r in TABLE_ROWS]  # hot rows spread over the home blocks
    probs = []
    for r in TABLE_ROWS:
        p = 1.0 / np.arange(1, r + 1) ** 1.1
        probs.append(p / p.sum())
    out = []
    for _ in range(steps):
        feats = {}
        for name, t in FEATURES:
            lengths = rng.integers(0, 4, size=n) if name in MULTI_HOT else np.ones(n, dtype=np.int64)
            vals = perms[t][rng.choice(TABLE_ROWS[t], size=int(lengths.sum()), p=probs[t])].astype(np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            feats[name] = (offsets, vals)
        dense = rng.standard_normal((n, NUM_DENSE)).astype(np.float32)
        labels = (rng.random(n) < 0.3).astype(np.float32)
        out.append({"features": feats, "dense": dense, "labels": labels})
        if wrng is not None:
            out[-1]["weights"] = {
                name: wrng.uniform(0.2, 2.0, size=v.shape[0]).astype(np.float32) for name, (_, v) in feats.items()
            }
    return out


def table_reads(batch: dict, samples: np.ndarray) -> list[np.ndarray]:
    """Per table, the rows read by the given samples (with repetition)."""
    per_table: list[list[np.ndarray]] = [[] for _ in TABLE_ROWS]
    for name, t in FEATURES:
        offsets, vals = batch["features"][name]
        lengths = np.diff(offsets)[samples]
        idx = np.repeat(offsets[:-1][samples], lengths) + (
            np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        )
        per_table[t].append(vals[idx])
    return [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in per_table]


class RandomPlanner:
    """Test-only planner: exact-ownership plans with random (deterministic) moves that respect guest capacity.

    mode "static": identity sample order, no moves, every read whose reader set is not {owner} is shared.
    mode "random": random sample order; single non-owner readers migrate with p=0.6 (room permitting), shared keys
    move to one of their readers with p=0.25, guests are evicted home (p=0.15) or forwarded to another rank (p=0.15;
    guest to guest when R > 2).
    """

    def __init__(self, world: int, batch: int, mode: str, seed: int = 0, cache_ratio: float = CACHE_RATIO) -> None:
        self.R, self.B, self.mode = world, batch, mode
        self.rng = np.random.default_rng(seed)
        self.block = [-(-r // world) for r in TABLE_ROWS]
        self.cap = [math.ceil(round(cache_ratio * r, 9)) for r in TABLE_ROWS]
        self.owner = [np.arange(r, dtype=np.int64) // b for r, b in zip(TABLE_ROWS, self.block)]
        self.guests = np.zeros((world, len(TABLE_ROWS)), dtype=np.int64)
        self.step_no = 0

    def home(self, t: int, k: int) -> int:
        return int(k // self.block[t])

    def plan(self, batch: dict) -> Plan:
        R, B, rng = self.R, self.B, self.rng
        n = R * B
        if self.mode == "static":
            order = np.arange(n, dtype=np.int64)
        else:
            order = rng.permutation(n).astype(np.int64)
            order = np.concatenate([np.sort(order[r * B : (r + 1) * B]) for r in range(R)])
        readers: list[dict[int, set]] = [dict() for _ in TABLE_ROWS]
        for r in range(R):
            for t, rows in enumerate(table_reads(batch, order[r * B : (r + 1) * B])):
                for k in np.unique(rows).tolist():
                    readers[t].setdefault(k, set()).add(r)
        mv: list[tuple[int, int, int, int, int]] = []  # table, row, src, dst, kind
        if self.mode == "random":
            gc = self.guests.copy()
            moved = set()

            def try_move(t: int, k: int, dst: int, kind: int) -> None:
                src = int(self.owner[t][k])
                if (t, k) in moved or src == dst:
                    return
                h = self.home(t, k)
                if dst != h and gc[dst, t] >= self.cap[t]:
                    return
                if src != h:
                    gc[src, t] -= 1
                if dst != h:
                    gc[dst, t] += 1
                moved.add((t, k))
                mv.append((t, k, src, dst, kind))

            # evictions first (they make room), over every current guest, read or not
            for t in range(len(TABLE_ROWS)):
                guests = np.flatnonzero(self.owner[t] != np.arange(TABLE_ROWS[t]) // self.block[t])
                for k in guests.tolist():
                    u = rng.random()
                    if u < 0.15:
                        try_move(t, k, self.home(t, k), EVICT_HOME)
                    elif u < 0.30:  # straight to another rank (its "next reader"; on 2 ranks that is home)
                        others = [q for q in range(R) if q != self.owner[t][k]]
                        try_move(t, k, int(rng.choice(others)), FORWARD)
            for t in range(len(TABLE_ROWS)):
                for k in sorted(readers[t]):
                    rs = sorted(readers[t][k])
                    o = int(self.owner[t][k])
                    if len(rs) == 1 and rs[0] != o and rng.random() < 0.6:
                        try_move(t, k, rs[0], MIGRATE)
                    elif len(rs) > 1 and rng.random() < 0.25:
                        try_move(t, k, int(rng.choice(rs)), MIGRATE)
            if (gc > np.array(self.cap)[None, :]).any():  # pragma: no cover - planner invariant
                raise AssertionError("test planner broke capacity")
            for t, k, src, dst, kind in mv:
                self.owner[t][k] = dst
            self.guests = gc
        moves = RowMoves(
            table=np.array([m[0] for m in mv], dtype=np.int64),
            row=np.array([m[1] for m in mv], dtype=np.int64),
            src=np.array([m[2] for m in mv], dtype=np.int64),
            dst=np.array([m[3] for m in mv], dtype=np.int64),
            kind=np.array([m[4] for m in mv], dtype=np.int8),
        )
        s_t, s_k, s_o, s_off, s_r = [], [], [], [0], []
        hits = 0  # (key, reader) pairs read by the owner, of keys that did not move (the scheduler's definition)
        moved_keys = {(m[0], m[1]) for m in mv}
        for t in range(len(TABLE_ROWS)):
            for k in sorted(readers[t]):
                rs = sorted(readers[t][k])
                o = int(self.owner[t][k])
                hits += int(o in rs and (t, k) not in moved_keys)
                if rs == [o]:
                    continue
                s_t.append(t), s_k.append(k), s_o.append(o), s_r.extend(rs), s_off.append(len(s_r))
        shared = SharedRows(
            table=np.array(s_t, dtype=np.int64),
            row=np.array(s_k, dtype=np.int64),
            owner=np.array(s_o, dtype=np.int64),
            reader_offsets=np.array(s_off, dtype=np.int64),
            readers=np.array(s_r, dtype=np.int64),
        )
        counters = {"hit": hits, "shared_value": shared.remote_reads(), "shared_grad": shared.remote_reads()}
        for kid, name in MOVE_KIND_NAMES.items():
            counters[name] = int((moves.kind == kid).sum())
        p = Plan(self.step_no, R, B, order, moves, shared, counters)
        self.step_no += 1
        return p


# ------------------------------------------------------------------------------------------ model & helpers
def table_configs(mean_tables: tuple[str, ...] = ()):
    """The test tables (`mean_tables`: those pooled by MEAN instead of SUM)."""
    from torchrec import EmbeddingBagConfig, PoolingType

    return [
        EmbeddingBagConfig(
            name=f"t{t}",
            embedding_dim=DIM,
            num_embeddings=r,
            feature_names=[f for f, tt in FEATURES if tt == t],
            pooling=PoolingType.MEAN if f"t{t}" in mean_tables else PoolingType.SUM,
        )
        for t, r in enumerate(TABLE_ROWS)
    ]


def make_model(mean_tables: tuple[str, ...] = (), weighted: bool = False):
    import torch.nn as nn
    from torchrec import EmbeddingBagCollection

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=table_configs(mean_tables), is_weighted=weighted, device=torch.device("cpu")
            )
            self.bottom = nn.Linear(NUM_DENSE, 8)
            self.over = nn.Sequential(nn.Linear(DIM * len(FEATURES) + 8, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, dense: torch.Tensor, kjt) -> torch.Tensor:
            kt = self.ebc(kjt)  # by key: stock's sharded EBC orders its keys by pooling type when tables mix them
            emb = torch.cat([kt[f] for f, _ in FEATURES], dim=1)
            return self.over(torch.cat([emb, torch.relu(self.bottom(dense))], dim=1)).squeeze(1)

    torch.manual_seed(1234)  # identical dense init everywhere
    return Net()


def init_tables() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"t{t}": (torch.rand(r, DIM, generator=g) - 0.5) * 0.2 for t, r in enumerate(TABLE_ROWS)}


def local_kjt(batch: dict, samples: np.ndarray):
    from torchrec import KeyedJaggedTensor

    keys, vals, lens, weights = [], [], [], []
    for name, _ in FEATURES:
        offsets, v = batch["features"][name]
        lengths = np.diff(offsets)[samples]
        idx = np.repeat(offsets[:-1][samples], lengths) + (
            np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        )
        keys.append(name), vals.append(v[idx]), lens.append(lengths)
        if "weights" in batch:  # id-score lists: each id's weight travels with it
            weights.append(batch["weights"][name][idx])
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.from_numpy(np.concatenate(vals)),
        lengths=torch.from_numpy(np.concatenate(lens).astype(np.int64)),
        weights=torch.from_numpy(np.concatenate(weights)) if weights else None,
    )


def dense_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith("ebc")}


def fused_params(opt: str) -> dict:
    return {"optimizer": opt, "learning_rate": LR_EMB[opt], "eps": EPS}


# ------------------------------------------------------------------------------------------ variants
def run_reference(opt: str, batches: list[dict], world: int, division: bool) -> dict:
    """(iv) single process: one TBE over the full tables and the dense model, on the whole global batch.

    Per-rank loss = mean over the rank's B samples; dense gradients are averaged over ranks (DDP); embedding rows get
    the sum over ranks of the per-rank gradients, divided by R when TorchRec's gradient division is on (default).
    So: loss = sum over the R chunks of each chunk's mean = sum / B; one backward (the fused embedding update sees
    the summed gradient: the loss is pre-divided by R under division); dense gradients divided by R."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from herald_torchrec.distributed.storage.optimizer_params import parse_optimizer

    tables = init_tables()
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(r, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in TABLE_ROWS],
        feature_table_map=[t for _, t in FEATURES],
        optimizer=parse_optimizer(opt),
        learning_rate=LR_EMB[opt],
        eps=EPS,
    )
    with torch.no_grad():
        for t, w in enumerate(tbe.split_embedding_weights()):
            w.copy_(tables[f"t{t}"])
        for st in tbe.split_optimizer_states():
            for x in st:
                x.zero_()
    model = make_model()
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("ebc")]
    opt_dense = torch.optim.SGD(dense_params, lr=LR_DENSE)
    losses = []
    n = world * BATCH
    for b in batches:
        kjt = local_kjt(b, np.arange(n))
        # KJT key-major layout == TBE feature-major layout; weighted batches: FBGEMM's per-sample weights
        emb = tbe(kjt.values(), kjt.offsets(), per_sample_weights=kjt.weights_or_none())
        x = torch.cat([emb, torch.relu(model.bottom(torch.from_numpy(b["dense"])))], dim=1)
        logits = model.over(x).squeeze(1)
        loss = (
            torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(b["labels"]), reduction="sum")
            / BATCH
        )  # = sum over the R chunks of each chunk's mean loss
        if division:
            loss = loss / world  # the global mean: what every gradient is under TorchRec's gradient division
        loss.backward()
        if not division:
            with torch.no_grad():
                for p in dense_params:
                    p.grad /= world  # DDP averages dense gradients
        opt_dense.step()
        opt_dense.zero_grad()
        losses.append(loss.item() / (1 if division else world))
    weights = {f"t{t}": w.detach().clone() for t, w in enumerate(tbe.split_embedding_weights())}
    states = {}
    if tbe.split_optimizer_states():
        states = {f"t{t}": st[0].detach().clone() for t, st in enumerate(tbe.split_optimizer_states())}
    return {"weights": weights, "states": states, "dense": dense_state(model), "losses": losses}


def _dense_optimizer(dmp):
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    params = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return torch.optim.SGD(params, lr=LR_DENSE)


def _train_step(dmp, dense_opt, batch: dict, samples: np.ndarray) -> float:
    kjt = local_kjt(batch, samples)
    logits = dmp(torch.from_numpy(batch["dense"][samples]), kjt)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(batch["labels"][samples]))
    loss.backward()
    dense_opt.step()
    dmp.fused_optimizer.step()  # Herald: shared-row gradients to owners + one update each (no-op for TorchRec)
    dense_opt.zero_grad()
    return loss.item()


def _row_wise_plan(model, sharder, world: int):
    """A manual ROW_WISE (FUSED) plan for every table of `model.ebc`."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    return ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                model.ebc,
                {c.name: row_wise(compute_kernel="fused") for c in table_configs()},
                sharder=sharder,
                local_size=world,
                world_size=world,
                device_type="cpu",
            )
        }
    )


def _table_wise_plan(model, sharder, world: int):
    """A manual TABLE_WISE (FUSED) plan: table t on rank t % world."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    return ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                model.ebc,
                {c.name: table_wise(rank=t % world, compute_kernel="fused") for t, c in enumerate(table_configs())},
                sharder=sharder,
                local_size=world,
                world_size=world,
                device_type="cpu",
            )
        }
    )


def run_herald(opt: str, batches: list[dict], rank: int, world: int, mode: str, use_planner: bool) -> dict:
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel, get_unwrapped_module
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.types import ShardingEnv

    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder, ShardedHeraldEmbeddingBagCollection

    model = make_model()
    with torch.no_grad():
        for name, w in init_tables().items():
            model.ebc.embedding_bags[name].weight.copy_(w)  # copied into the home rows at shard time
    sharder = HeraldEmbeddingBagCollectionSharder(cache_ratio=CACHE_RATIO, policy=mode, fused_params=fused_params(opt))
    if use_planner:
        plan = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu")).collective_plan(
            model, [sharder], dist.group.WORLD
        )
    else:
        plan = _row_wise_plan(model, sharder, world)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    dmp = DistributedModelParallel(model, env=env, device=torch.device("cpu"), sharders=[sharder], plan=plan)
    sebc = get_unwrapped_module(dmp).ebc
    assert isinstance(sebc, ShardedHeraldEmbeddingBagCollection)
    dense_opt = _dense_optimizer(dmp)
    planner = RandomPlanner(world, BATCH, mode, seed=11)
    losses, mismatches, totals = [], [], {}
    for b in batches:
        p = planner.plan(b)
        sebc.set_plan(p)
        losses.append(_train_step(dmp, dense_opt, b, p.local_samples(rank)))
        got = sebc.global_step_counters()
        want = {k: p.counters.get(k, 0) for k in got}
        if got != want:
            mismatches.append((p.step, got, want))
        for k, v in got.items():
            totals[k] = totals.get(k, 0) + v
    weights, states = sebc.full_tables()
    return {
        "weights": weights,
        "states": states,
        "dense": dense_state(get_unwrapped_module(dmp)),
        "losses": losses,
        "counter_mismatches": mismatches,
        "counter_totals": totals,
        "hit_rate": sebc.hit_rate(cumulative=True),
        "occupancy": sebc.guest_occupancy(),
        "comm_bytes": dict(sebc.comm_counter.bytes),
    }


def run_torchrec(opt: str, batches: list[dict], rank: int, world: int) -> dict:
    """(iii) stock TorchRec ROW_WISE (FUSED) through DMP; tables copied into / read out of its TBE shards."""
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel, get_unwrapped_module
    from torchrec.distributed.types import ShardingEnv, ShardingType

    from herald_torchrec.distributed.storage.optimizer_params import parse_optimizer

    class RowWiseSharder(EmbeddingBagCollectionSharder):  # the stock sharder offers ROW_WISE on CUDA only
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return [ShardingType.ROW_WISE.value]

    fp = fused_params(opt)
    fp["optimizer"] = parse_optimizer(fp["optimizer"])
    sharder = RowWiseSharder(fused_params=fp)
    model = make_model()
    plan = _row_wise_plan(model, sharder, world)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    dmp = DistributedModelParallel(model, env=env, device=torch.device("cpu"), sharders=[sharder], plan=plan)
    sebc = get_unwrapped_module(dmp).ebc
    shards = []  # (table name, row offset, weight view, state view or None)
    for lookup in sebc._lookups:
        for em in lookup._emb_modules:
            tbe = em.emb_module
            ws = tbe.split_embedding_weights()
            ss = tbe.split_optimizer_states()
            for i, cfg in enumerate(em.config.embedding_tables):
                shards.append((cfg.name, int(cfg.local_metadata.shard_offsets[0]), ws[i], ss[i][0] if ss else None))
    tables = init_tables()
    with torch.no_grad():
        for name, off, w, s in shards:
            w.copy_(tables[name][off : off + w.shape[0]])
            if s is not None:
                s.zero_()
    dense_opt = _dense_optimizer(dmp)
    losses = [_train_step(dmp, dense_opt, b, np.arange(rank * BATCH, (rank + 1) * BATCH)) for b in batches]
    weights = {f"t{t}": torch.zeros(r, DIM) for t, r in enumerate(TABLE_ROWS)}
    states = {f"t{t}": torch.zeros(r) for t, r in enumerate(TABLE_ROWS)}
    for name, off, w, s in shards:
        weights[name][off : off + w.shape[0]] = w
        if s is not None:
            states[name][off : off + s.shape[0]] = s
    for d in (weights, states):
        for v in d.values():
            dist.all_reduce(v)
    if not any(s is not None for _, _, _, s in shards):
        states = {}
    return {"weights": weights, "states": states, "dense": dense_state(get_unwrapped_module(dmp)), "losses": losses}


# (optimizer, TorchRec gradient division): division is TorchRec's default; without it rows get the plain sum over
# ranks of the per-rank gradients (SGD shows the difference; row-wise Adagrad is nearly scale-invariant)
CONFIGS = [("exact_rowwise_adagrad", True), ("exact_sgd", True), ("exact_sgd", False)]


def config_name(opt: str, division: bool) -> str:
    return f"{opt}/{'div' if division else 'sum'}"


def parity_worker(
    rank: int,
    world: int,
    out_dir: str,
    steps: int = STEPS,
    configs: list | None = None,
    static: bool = True,
    torchrec: bool = True,
) -> None:
    import time

    from torchrec.distributed.comm_ops import set_gradient_division

    batches = make_batches(world, steps)
    result = {}
    for opt, division in configs or CONFIGS:
        set_gradient_division(division)  # TorchRec's switch; the Herald module follows it
        res = {}
        t0 = time.time()
        res["reference"] = run_reference(opt, batches, world, division)
        if division and static:  # the static plans once per optimizer is enough
            res["static"] = run_herald(opt, batches, rank, world, "static", use_planner=True)
        res["random"] = run_herald(opt, batches, rank, world, "random", use_planner=False)
        if torchrec:
            res["torchrec"] = run_torchrec(opt, batches, rank, world)
        res["seconds"] = time.time() - t0
        result[config_name(opt, division)] = res
    set_gradient_division(True)
    torch.save(result, rank_result(out_dir, rank))


# ------------------------------------------------------------------------------------------ tests
CONFIG_IDS = [config_name(o, d) for o, d in CONFIGS]


@pytest.fixture(scope="module")
def parity_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("parity")
    files = run_ranks("tests.scenarios.test_module_parity:parity_worker", out, world_size=2, timeout=300)
    return [torch.load(f, weights_only=False) for f in files]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((float((a[k] - b[k]).abs().max()) for k in a), default=0.0)


@pytest.mark.parametrize("config", CONFIG_IDS)
def test_final_model_parity(parity_results: list[dict], config: str) -> None:
    ref = parity_results[0][config]["reference"]
    assert all(math.isfinite(x) for x in ref["losses"])
    for rank_res in parity_results:
        res = rank_res[config]
        variants = [v for v in ("static", "random", "torchrec") if v in res]
        assert "random" in variants and "torchrec" in variants
        _check_parity(res, config)


def _check_parity(res: dict, config: str) -> None:
    ref = res["reference"]
    for variant in [v for v in ("static", "random", "torchrec") if v in res]:
        got = res[variant]
        for what in ("weights", "states", "dense"):
            d = _max_diff(got[what], ref[what])
            assert d <= 1e-5, f"{config} {variant} {what}: max |diff| {d:.3g} vs the single-process reference"
    if config.startswith("exact_rowwise_adagrad"):
        assert res["random"]["states"], "row-wise Adagrad must export its momentum"
    else:
        assert res["random"]["states"] == {}
    # the tables really trained (parity of an untouched model would prove nothing)
    assert _max_diff(ref["weights"], init_tables()) > 1e-2


def test_three_ranks_guest_to_guest_forwards(tmp_path: Path) -> None:
    """3 ranks (odd world size: gradient division by 3; FORWARD moves go guest slot to guest slot)."""
    files = run_ranks(
        "tests.scenarios.test_module_parity:parity_worker",
        tmp_path,
        world_size=3,
        timeout=300,
        steps=12,
        configs=[["exact_rowwise_adagrad", True]],
        static=False,
    )
    for f in files:
        res = torch.load(f, weights_only=False)["exact_rowwise_adagrad/div"]
        _check_parity(res, "exact_rowwise_adagrad/div")
        assert res["random"]["counter_mismatches"] == []
        tot = res["random"]["counter_totals"]
        assert all(tot[k] > 0 for k in ("hit", "migrate", "evict_home", "forward", "shared_value")), tot


def test_gradient_division_matters(parity_results: list[dict]) -> None:
    """With SGD the two gradient conventions train different models: parity above is not vacuous."""
    a = parity_results[0]["exact_sgd/div"]["reference"]["weights"]
    b = parity_results[0]["exact_sgd/sum"]["reference"]["weights"]
    assert _max_diff(a, b) > 1e-3


@pytest.mark.parametrize("config", CONFIG_IDS)
def test_row_counters_match_plan(parity_results: list[dict], config: str) -> None:
    for rank_res in parity_results:
        for variant in ("static", "random"):
            if variant in rank_res[config]:
                res = rank_res[config][variant]
                assert res["counter_mismatches"] == [], res["counter_mismatches"][:3]
    tot_random = parity_results[0][config]["random"]["counter_totals"]
    # the random plans exercise every kind of row traffic
    for kind in ("hit", "migrate", "evict_home", "forward", "shared_value", "shared_grad"):
        assert tot_random[kind] > 0, (kind, tot_random)
    assert parity_results[0][config]["random"]["comm_bytes"].get("moves", 0) > 0
    if "static" in parity_results[0][config]:
        tot_static = parity_results[0][config]["static"]["counter_totals"]
        assert tot_static["migrate"] == tot_static["evict_home"] == tot_static["forward"] == 0
        assert tot_static["shared_value"] > 0 and tot_static["hit"] > 0
        assert "moves" not in parity_results[0][config]["static"]["comm_bytes"]
