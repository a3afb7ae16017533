"""Optimizer settings exactly as TorchRec takes them: `fused_params` and `apply_optimizer_in_backward`
resolved with TorchRec's precedence, every supported TBE setting reaching Herald's row store, unsupported ones a
ValueError naming the setting (sharder and module), and 2-rank runs where Herald trains exactly like stock
TorchRec ROW_WISE with gradient clipping, with in-backward optimizers and with Adagrad's per-element state (moved
with its rows, and shown by `fused_optimizer.state_dict()` in stock's keys, shapes and shards)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

from tests.distributed.test_embeddingbag import make_ebc, make_module
from tests.helpers.ranks import rank_result, run_ranks

MAX_GRADIENT = 2e-4  # small enough that clipping changes most updates of the parity model
STEPS = 10


def _in_backward(ebc, cls, kwargs: dict) -> None:
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)


# ------------------------------------------------------------------------------------------ in-process
@pytest.mark.parametrize(
    "settings, name",
    [
        ({"foo": 1}, "foo"),
        ({"optimizer": "adam"}, "optimizer"),
        ({"optimizer": EmbOptimType.ROWWISE_ADAGRAD}, "optimizer"),  # not exact: duplicate rows updated in turn
        ({"optimizer": EmbOptimType.PARTIAL_ROWWISE_ADAM}, "optimizer"),  # reads the step counter
        ({"optimizer": "exact_adagrad", "weight_decay": 0.1}, "weight_decay"),  # FBGEMM's Adagrad has none
        ({"momentum": 0.9}, "momentum"),
        ({"optimizer": "exact_sgd", "weight_decay": 0.1}, "weight_decay"),
        ({"optimizer": "exact_sgd", "max_norm": 1.0}, "max_norm"),
        (
            {"optimizer": "exact_rowwise_adagrad", "weight_decay": 0.1},
            "weight_decay",
        ),  # no mode: FBGEMM would not apply it
        (
            {"optimizer": "exact_rowwise_adagrad", "weight_decay": 0.1, "weight_decay_mode": WeightDecayMode.COUNTER},
            "weight_decay_mode",
        ),
        ({"output_dtype": SparseType.FP16}, "output_dtype"),  # pooled embeddings in float32, as TorchRec's
        ({"prefetch_pipeline": True}, "prefetch_pipeline"),
        ({"max_gradient": 0.0}, "max_gradient"),
        ({"gradient_clipping": 1}, "gradient_clipping"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"__register_tbes_in_named_modules": True}, "__register_tbes_in_named_modules"),
    ],
)
def test_unsupported_settings_raise_from_sharder_and_module(settings: dict, name: str) -> None:
    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder
    from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec

    with pytest.raises(ValueError, match=name):
        HeraldEmbeddingBagCollectionSharder(fused_params=settings)
    from torchrec.distributed.types import ShardingEnv

    from herald_torchrec.distributed import ShardedHeraldEmbeddingBagCollection

    with pytest.raises(ValueError, match=name):
        ShardedHeraldEmbeddingBagCollection(make_ebc(), None, ShardingEnv(1, 0, None), fused_params=settings)
    own = {k: v for k, v in settings.items() if k in ("optimizer", "learning_rate")}
    extra = {k: v for k, v in settings.items() if k not in own}
    with pytest.raises(ValueError, match=name):
        RowStore([TableSpec("t", 8, 4)], 0, 1, **own, tbe_settings=extra)


def test_in_backward_optimizer_is_checked_by_the_module() -> None:
    from torchrec.distributed.types import ShardingEnv

    from herald_torchrec.distributed import ShardedHeraldEmbeddingBagCollection

    def build(cls, kwargs, fused_params=None):
        ebc = make_ebc()
        _in_backward(ebc, cls, kwargs)
        return ShardedHeraldEmbeddingBagCollection(ebc, None, ShardingEnv(1, 0, None), fused_params=fused_params)

    with pytest.raises(ValueError, match="optimizer"):
        build(torch.optim.Adam, {"lr": 0.1})
    with pytest.raises(ValueError, match="momentum"):
        build(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match="lr_decay"):
        build(__import__("torchrec").optim.RowWiseAdagrad, {"lr": 0.1, "lr_decay": 0.5})
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        build(torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1})
    with pytest.raises(ValueError, match="weight_decay"):
        build(torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 0.01})
    # torch.optim.Adagrad is FBGEMM's EXACT_ADAGRAD, as TorchRec maps it
    m = build(torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-2})
    assert (m.optimizer_type, m.learning_rate, m._store.tbe.optimizer_args.eps) == (
        EmbOptimType.EXACT_ADAGRAD,
        0.2,
        pytest.approx(1e-2),
    )
    # neutral torch arguments are accepted; in-backward overrides the sharder's (and Herald's default) optimizer
    m = build(
        torch.optim.SGD, {"lr": 0.25, "momentum": 0.0}, {"optimizer": "exact_rowwise_adagrad", "learning_rate": 0.01}
    )
    assert m.optimizer_type == EmbOptimType.EXACT_SGD and m.learning_rate == 0.25
    assert m._store.tbe.optimizer == EmbOptimType.EXACT_SGD
    assert m._store.tbe.get_learning_rate() == pytest.approx(0.25)


def test_resolution_follows_torchrec_precedence() -> None:
    from torchrec.optim import RowWiseAdagrad

    from herald_torchrec.distributed.storage.optimizer_params import resolve_table_settings

    ebc = make_ebc()
    fp32 = {"weights_precision": SparseType.FP32}  # the tables' own data_type, as TorchRec's sharding makes the TBE
    assert resolve_table_settings(ebc, None) == {
        "optimizer": EmbOptimType.EXACT_SGD,
        "learning_rate": 0.01,
        **fp32,
    }  # FBGEMM default
    fp = {"optimizer": "exact_sgd", "learning_rate": 0.3, "gradient_clipping": True, "max_gradient": 0.5}
    assert resolve_table_settings(ebc, fp) == {**fp, "optimizer": EmbOptimType.EXACT_SGD, **fp32}
    # settings at their "not used" value are accepted and dropped (torch.optim.SGD's momentum=0, no weight decay)
    neutral = {"momentum": 0.0, "nesterov": False, "weight_decay": 0.0, "weight_decay_mode": WeightDecayMode.NONE}
    assert resolve_table_settings(ebc, {**fp, **neutral}) == {**fp, "optimizer": EmbOptimType.EXACT_SGD, **fp32}
    _in_backward(ebc, RowWiseAdagrad, {"lr": 0.07, "eps": 1e-3})
    got = resolve_table_settings(ebc, fp)  # in-backward kwargs win; the sharder's other settings stay
    assert got == {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": 0.07,
        "eps": 1e-3,
        "gradient_clipping": True,
        "max_gradient": 0.5,
        **fp32,
    }
    assert ebc.embedding_bags["t0"].weight._optimizer_kwargs == [{"lr": 0.07, "eps": 1e-3}]  # left as the user set it
    # tables of one Herald TBE must agree
    ebc = make_ebc()
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    apply_optimizer_in_backward(RowWiseAdagrad, [ebc.embedding_bags["t0"].weight], {"lr": 0.01})  # t1: SGD, 0.01
    with pytest.raises(ValueError, match="optimizer: tables 't0' and 't1'"):
        resolve_table_settings(ebc, None)


def test_every_setting_reaches_the_tbe() -> None:
    m = make_module()  # rowwise adagrad, lr 0.1
    assert not m._store.tbe.optimizer_args.gradient_clipping
    from torchrec.distributed.types import ShardingEnv

    from herald_torchrec.distributed import ShardedHeraldEmbeddingBagCollection

    fp = {
        "optimizer": "exact_rowwise_adagrad",
        "learning_rate": 0.2,
        "eps": 1e-3,
        "gradient_clipping": True,
        "max_gradient": 0.125,
        "stochastic_rounding": False,
    }
    m = ShardedHeraldEmbeddingBagCollection(make_ebc(), None, ShardingEnv(1, 0, None), fused_params=fp)
    args = m._store.tbe.optimizer_args
    assert args.gradient_clipping and args.max_gradient == pytest.approx(0.125)
    assert m._store.tbe.get_learning_rate() == pytest.approx(0.2) and args.eps == pytest.approx(1e-3)
    assert m._store.tbe.stochastic_rounding is False


def test_cpu_kernels_ignore_weight_decay_so_herald_refuses_it_there() -> None:
    """Pins the fact behind CPU_IGNORED_SETTINGS: FBGEMM's CPU row-wise Adagrad leaves weight_decay / max_norm
    unapplied (if this starts failing, FBGEMM applies them on CPU now and the refusal can go)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    def train(**kw) -> torch.Tensor:
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(6, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=0.5,
            pooling_mode=PoolingMode.SUM,
            **kw,
        )
        with torch.no_grad():
            tbe.split_embedding_weights()[0].copy_(torch.arange(24.0).view(6, 4) / 10)
        out = tbe(torch.tensor([1, 2, 1]), torch.tensor([0, 2, 3]))
        out.backward(torch.ones_like(out))
        return tbe.split_embedding_weights()[0].detach().clone()

    base = train()
    assert torch.equal(train(weight_decay=1.0, weight_decay_mode=WeightDecayMode.L2), base)
    assert torch.equal(train(max_norm=0.01), base)
    assert not torch.equal(train(gradient_clipping=True, max_gradient=0.01), base)  # clipping is applied
    from torchrec.distributed.types import ShardingEnv

    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder, ShardedHeraldEmbeddingBagCollection

    fp = {"optimizer": "exact_rowwise_adagrad", "weight_decay": 0.1, "weight_decay_mode": WeightDecayMode.L2}
    HeraldEmbeddingBagCollectionSharder(fused_params=fp)  # device unknown yet: accepted (applied on CUDA)
    with pytest.raises(ValueError, match="weight_decay=0.1: FBGEMM's CPU kernels"):
        ShardedHeraldEmbeddingBagCollection(make_ebc(), None, ShardingEnv(1, 0, None), fused_params=fp)


# ------------------------------------------------------------------------------------------ 2 ranks
# name -> (sharder fused_params, in-backward (class name, kwargs) or None, unclipped reference optimizer or None)
RUNS = {
    "clip_adagrad": (
        {
            "optimizer": "exact_rowwise_adagrad",
            "learning_rate": 0.05,
            "eps": 1e-8,
            "gradient_clipping": True,
            "max_gradient": MAX_GRADIENT,
        },
        None,
        "exact_rowwise_adagrad",
    ),
    "clip_sgd": (
        {"optimizer": "exact_sgd", "learning_rate": 0.5, "gradient_clipping": True, "max_gradient": MAX_GRADIENT},
        None,
        "exact_sgd",
    ),
    "in_backward_sgd": (None, ("torch.optim.SGD", {"lr": 0.5}), None),
    "in_backward_adagrad": (None, ("torchrec.optim.RowWiseAdagrad", {"lr": 0.05, "eps": 1e-3}), None),
    # Adagrad's state is per element ([rows, dim]): each moved row carries its whole state row
    "exact_adagrad": ({"optimizer": "exact_adagrad", "learning_rate": 0.05, "eps": 1e-2}, None, None),
    "in_backward_exact_adagrad": (None, ("torch.optim.Adagrad", {"lr": 0.05, "eps": 1e-2}), None),
    # nothing names the optimizer: stock trains FBGEMM's default (EXACT_SGD, lr 0.01), and so must Herald
    "unnamed_default": (None, None, None),
    "unnamed_lr_only": ({"learning_rate": 0.5}, None, None),  # what TorchRec's create_test_sharder passes
    # MEAN pooling on t2 (multi-hot bags of 0-3 ids, empty ones included) and t1 (two features)
    "mean_pooling_rowwise_adagrad": (
        {"optimizer": "exact_rowwise_adagrad", "learning_rate": 0.05, "eps": 1e-2},
        None,
        None,
    ),
}
# runs whose model pools these tables by MEAN (compared with stock ROW_WISE, as every run here)
MEAN_TABLES = {"mean_pooling_rowwise_adagrad": ("t1", "t2")}


def _optimizer_class(name: str) -> type:
    import importlib

    mod, cls = name.rsplit(".", 1)
    return getattr(importlib.import_module(mod), cls)


def _model(in_backward, mean_tables: tuple[str, ...] = (), weighted: bool = False):
    import tests.scenarios.test_module_parity as P

    model = P.make_model(mean_tables, weighted)
    with torch.no_grad():
        for name, w in P.init_tables().items():
            model.ebc.embedding_bags[name].weight.copy_(w)
    if in_backward is not None:
        _in_backward(model.ebc, _optimizer_class(in_backward[0]), dict(in_backward[1]))
    return model


def _optimizer_state_layout(dmp) -> dict:
    """`fused_optimizer.state_dict()["state"]` as a checkpoint sees it: per parameter and state key, the global shape
    and this rank's shards (offsets, sizes)."""
    out = {}
    for param, states in dmp.fused_optimizer.state_dict()["state"].items():
        out[param] = {
            k: (
                tuple(v.size()),
                [(tuple(sh.metadata.shard_offsets), tuple(sh.metadata.shard_sizes)) for sh in v.local_shards()],
            )
            for k, v in states.items()
        }
    return out


def _run_herald(
    fp, in_backward, batches, rank: int, world: int, mean_tables: tuple[str, ...] = (), weighted: bool = False
) -> dict:
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel, get_unwrapped_module
    from torchrec.distributed.types import ShardingEnv

    import tests.scenarios.test_module_parity as P
    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder

    model = _model(in_backward, mean_tables, weighted)
    sharder = HeraldEmbeddingBagCollectionSharder(cache_ratio=P.CACHE_RATIO, policy="random", fused_params=fp)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        sharders=[sharder],
        plan=P._row_wise_plan(model, sharder, world),
    )
    sebc = get_unwrapped_module(dmp).ebc
    dense_opt = P._dense_optimizer(dmp)
    planner = P.RandomPlanner(world, P.BATCH, "random", seed=11)  # moves, guests and shared rows every step
    for b in batches:
        p = planner.plan(b)
        sebc.set_plan(p)
        P._train_step(dmp, dense_opt, b, p.local_samples(rank))
    weights, states = sebc.full_tables()
    args = sebc._store.tbe.optimizer_args
    return {
        "weights": weights,
        "states": states,
        "optimizer_state_layout": _optimizer_state_layout(dmp),
        "optimizer": sebc.optimizer_type.name,
        "lr": sebc._store.tbe.get_learning_rate(),
        "eps": args.eps,
        "clip": (args.gradient_clipping, args.max_gradient),
        "counters": dict(sebc.total_counters),
    }


def _run_stock(
    fp,
    in_backward,
    batches,
    rank: int,
    world: int,
    mean_tables: tuple[str, ...] = (),
    table_wise: bool = False,
    weighted: bool = False,
) -> dict:
    """Stock TorchRec ROW_WISE (FUSED; or TABLE_WISE) with the same settings; tables read out of its TBE shards."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel, get_unwrapped_module
    from torchrec.distributed.types import ShardingEnv

    import tests.scenarios.test_module_parity as P
    from herald_torchrec.app.model_setup import StockSharder
    from herald_torchrec.distributed.storage.optimizer_params import parse_optimizer

    if fp is not None and "optimizer" in fp:
        fp = {**fp, "optimizer": parse_optimizer(fp["optimizer"])}
    model = _model(in_backward, mean_tables, weighted)
    sharder = StockSharder(fused_params=fp)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        sharders=[sharder],
        plan=(P._table_wise_plan if table_wise else P._row_wise_plan)(model, sharder, world),
    )
    sebc = get_unwrapped_module(dmp).ebc
    shards = []  # (table, row offset, weight view, state view or None)
    for lookup in sebc._lookups:
        for em in lookup._emb_modules:
            ws, ss = em.emb_module.split_embedding_weights(), em.emb_module.split_optimizer_states()
            for i, cfg in enumerate(em.config.embedding_tables):
                shards.append((cfg.name, int(cfg.local_metadata.shard_offsets[0]), ws[i], ss[i][0] if ss else None))
    init = P.init_tables()
    with torch.no_grad():  # TorchRec draws its own initial values: start from the same tables
        for name, off, w, st in shards:
            w.copy_(init[name][off : off + w.shape[0]])
            if st is not None:
                st.zero_()
    dense_opt = P._dense_optimizer(dmp)
    for b in batches:
        P._train_step(dmp, dense_opt, b, np.arange(rank * P.BATCH, (rank + 1) * P.BATCH))
    weights = {f"t{t}": torch.zeros(r, P.DIM) for t, r in enumerate(P.TABLE_ROWS)}
    has_state = any(st is not None for *_, st in shards)
    per_element = has_state and shards[0][3].dim() == 2  # EXACT_ADAGRAD: [rows, dim]; row-wise: [rows]
    states = {f"t{t}": torch.zeros((r, P.DIM) if per_element else (r,)) for t, r in enumerate(P.TABLE_ROWS)}
    for name, off, w, st in shards:
        weights[name][off : off + w.shape[0]] = w.detach()
        if st is not None:
            states[name][off : off + st.shape[0]] = st.detach()
    for d in (weights, states):
        for v in d.values():
            dist.all_reduce(v)
    return {
        "weights": weights,
        "states": states if has_state else {},
        "optimizer_state_layout": _optimizer_state_layout(dmp),
    }


def optimizer_worker(rank: int, world: int, out_dir: str, runs: list[str]) -> None:
    import tests.scenarios.test_module_parity as P

    batches = P.make_batches(world, STEPS)
    result = {}
    for name in runs:
        fp, in_backward, unclipped = RUNS[name]
        mean = MEAN_TABLES.get(name, ())
        res = {
            "herald": _run_herald(fp, in_backward, batches, rank, world, mean),
            "stock": _run_stock(fp, in_backward, batches, rank, world, mean),
        }
        if unclipped is not None:
            res["unclipped"] = P.run_reference(unclipped, batches, world, True)["weights"]
        result[name] = res
    if rank == 0:
        torch.save(result, rank_result(out_dir, rank))
    else:
        torch.save({}, rank_result(out_dir, rank))


@pytest.fixture(scope="module")
def optimizer_runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("optimizer_runs")
    return torch.load(
        run_ranks(
            "tests.distributed.storage.test_optimizer_params:optimizer_worker",
            out,
            world_size=2,
            timeout=400,
            runs=list(RUNS),
        )[0],
        weights_only=False,
    )


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("name", list(RUNS))
def test_herald_trains_like_stock_row_wise(optimizer_runs: dict, name: str) -> None:
    import tests.scenarios.test_module_parity as P

    r = optimizer_runs[name]
    h, s = r["herald"], r["stock"]
    assert _max_diff(h["weights"], s["weights"]) <= 1e-5, name
    trained = 1e-5 if name == "unnamed_default" else 1e-3  # lr 0.01 for 10 SGD steps moves rows less
    assert _max_diff(h["weights"], P.init_tables()) > trained  # the tables trained: the comparison is not vacuous
    if "adagrad" in name:
        assert h["states"] and _max_diff(h["states"], s["states"]) <= 1e-5
    else:
        assert h["states"] == {} and s["states"] == {}
    if name.startswith("clip"):
        assert h["clip"] == (True, pytest.approx(MAX_GRADIENT))
        # clipping changed the model: a run that dropped the setting would train the unclipped tables
        assert _max_diff(h["weights"], r["unclipped"]) > 1e-3, name
    if name == "in_backward_sgd":
        assert (h["optimizer"], h["lr"]) == ("EXACT_SGD", pytest.approx(0.5))
    if name.startswith("unnamed"):
        assert (h["optimizer"], h["lr"]) == ("EXACT_SGD", pytest.approx(0.01 if name == "unnamed_default" else 0.5))
    if name == "in_backward_adagrad":
        assert (h["optimizer"], h["lr"], h["eps"]) == (
            "EXACT_ROWWISE_ADAGRAD",
            pytest.approx(0.05),
            pytest.approx(1e-3),
        )
    if "exact_adagrad" in name:
        assert (h["optimizer"], h["lr"], h["eps"]) == ("EXACT_ADAGRAD", pytest.approx(0.05), pytest.approx(1e-2))
        for t, rows in enumerate(P.TABLE_ROWS):  # per element: [rows, dim], its elements not all alike per row
            state = h["states"][f"t{t}"]
            assert tuple(state.shape) == (rows, P.DIM)
            assert float((state - state[:, :1]).abs().max()) > 1e-5
        # the sums of squared gradients are small (~2e-4): also equal relative to their size
        scale = max(float(v.abs().max()) for v in s["states"].values())
        assert scale > 1e-5 and _max_diff(h["states"], s["states"]) <= 1e-5 * scale
    # the checkpoint's view of the optimizer state: stock ROW_WISE's keys, global shapes and this rank's shards
    assert h["optimizer_state_layout"] == s["optimizer_state_layout"], name
    if "adagrad" in name:
        dim = P.DIM if "exact_adagrad" in name else None
        for param, states in h["optimizer_state_layout"].items():
            t = param.split(".")[-2]
            shape, shards = states[f"{t}.momentum1"]
            assert shape == ((P.TABLE_ROWS[int(t[1:])], dim) if dim else (P.TABLE_ROWS[int(t[1:])],))
            assert len(shards) == 1 and len(shards[0][0]) == len(shape)


def test_clipping_is_per_bag_and_the_shared_row_pass_does_not_clip_again() -> None:
    """FBGEMM clips each pooled bag's gradient before summing per row (CPU and CUDA alike): a row read by two bags
    with gradient 0.1 each, max_gradient 0.15, moves by 0.2. Herald's readers clip their shared values' bag
    gradients the same way (clip_pooled_gradient) and the owner applies the sum unclipped."""
    from herald_torchrec.distributed.storage.row_store import RowStore, TableSpec

    st = RowStore(
        [TableSpec("t", 4, 4)],
        0,
        1,
        optimizer="exact_sgd",
        learning_rate=1.0,
        tbe_settings={"gradient_clipping": True, "max_gradient": 0.15},
    )
    out = st.lookup(torch.tensor([1, 1]), torch.tensor([0, 1, 2]))
    out.backward(torch.full_like(out, 0.1))
    assert torch.allclose(st.weights(0)[1], torch.full((4,), -0.2))  # per bag: 0.1 + 0.1, not clamp(0.2)
    st.apply_summed_gradients_packed(np.array([0]), np.array([2]), torch.full((4,), 0.2))
    assert torch.allclose(st.weights(0)[2], torch.full((4,), -0.2))  # the summed gradient is not clamped again
    assert st.tbe.optimizer_args.gradient_clipping  # restored after the pass
    x = torch.tensor([[0.5, -0.5, 0.05, 0.0]], requires_grad=True)
    st.clip_pooled_gradient(x).backward(torch.tensor([[1.0, -1.0, 0.1, 0.0]]))
    assert torch.allclose(x.grad, torch.tensor([[0.15, -0.15, 0.1, 0.0]]))


# ------------------------------------------------------------------------------------------ mixed EBC, 2 ranks
MIXED = {"t1": "table_wise", "t3": "column_wise"}  # unscheduled tables (TorchRec's); t0, t2 stay Herald's
MIXED_RUNS = ["clip_sgd", "in_backward_adagrad"]


def _run_mixed(fp, in_backward, batches, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel, get_unwrapped_module
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv

    import tests.scenarios.test_module_parity as P
    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder

    model = _model(in_backward)
    sharder = HeraldEmbeddingBagCollectionSharder(
        cache_ratio=P.CACHE_RATIO, fused_params=fp, unscheduled_tables=list(MIXED)
    )
    constraints = sharder.planner_constraints(model.ebc)
    for t, kind in MIXED.items():
        constraints[t] = ParameterConstraints(sharding_types=[kind])
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"), constraints=constraints
    )
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        sharders=[sharder],
        plan=planner.collective_plan(model, [sharder], dist.group.WORLD),
    )
    sebc = get_unwrapped_module(dmp).ebc
    init = P.init_tables()
    with torch.no_grad():  # the stock part draws its own values: start it from the same tables
        for k, v in dmp.state_dict().items():
            if isinstance(v, ShardedTensor):
                for sh in v.local_shards():
                    (r0, c0), (nr, nc) = sh.metadata.shard_offsets, sh.metadata.shard_sizes
                    sh.tensor.copy_(init[k.split(".")[-2]][r0 : r0 + nr, c0 : c0 + nc])
    # the settings each part's TBEs were built with
    tbes = [sebc.herald._store.tbe] + [em.emb_module for lk in sebc.stock._lookups for em in lk._emb_modules]
    settings = [
        (
            t.optimizer.name,
            round(t.get_learning_rate(), 6),
            round(t.optimizer_args.eps, 8),
            t.optimizer_args.gradient_clipping,
            round(t.optimizer_args.max_gradient, 8),
        )
        for t in tbes
    ]
    dense_opt = P._dense_optimizer(dmp)
    for b in batches:  # no plans queued: the Herald part runs its static plans (every non-owner read shared)
        P._train_step(dmp, dense_opt, b, np.arange(rank * P.BATCH, (rank + 1) * P.BATCH))
    weights, _ = sebc.herald.full_tables()
    for k, v in dmp.state_dict().items():
        if isinstance(v, ShardedTensor):
            full = torch.zeros(v.size())
            v.gather(dst=0, out=full if rank == 0 else None)
            weights[k.split(".")[-2]] = full
    return {"weights": weights, "settings": settings, "stock_tbes": len(tbes) - 1}


def mixed_worker(rank: int, world: int, out_dir: str, runs: list[str]) -> None:
    import tests.scenarios.test_module_parity as P

    batches = P.make_batches(world, STEPS)
    result = {}
    for name in runs:
        fp, in_backward, _ = RUNS[name]
        result[name] = {
            "mixed": _run_mixed(fp, in_backward, batches, rank, world),
            "stock": _run_stock(fp, in_backward, batches, rank, world),
        }
    torch.save(result if rank == 0 else {}, rank_result(out_dir, rank))


def test_mixed_ebc_torchrec_part_gets_the_same_settings(tmp_path) -> None:
    r = torch.load(
        run_ranks(
            "tests.distributed.storage.test_optimizer_params:mixed_worker",
            tmp_path,
            world_size=2,
            timeout=400,
            runs=MIXED_RUNS,
        )[0],
        weights_only=False,
    )
    want = {
        "clip_sgd": ("EXACT_SGD", 0.5, True, MAX_GRADIENT),
        "in_backward_adagrad": ("EXACT_ROWWISE_ADAGRAD", 0.05, False, None),
    }
    for name in MIXED_RUNS:
        m, s = r[name]["mixed"], r[name]["stock"]
        assert m["stock_tbes"] >= 1 and len(set(m["settings"])) == 1, (name, m["settings"])  # both parts alike
        opt, lr, clip, max_g = want[name]
        got = m["settings"][0]
        assert (got[0], got[1], got[3]) == (opt, lr, clip), (name, got)
        if clip:
            assert got[4] == pytest.approx(max_g)
        else:
            assert got[2] == pytest.approx(1e-3)
        # and the whole mixed EBC trains like stock ROW_WISE with the same settings
        assert _max_diff(m["weights"], s["weights"]) <= 1e-5, name
