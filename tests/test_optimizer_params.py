"""Optimizer settings exactly as TorchRec takes them (issue 8): `fused_params` and `apply_optimizer_in_backward`
resolved with TorchRec's precedence, every supported TBE setting reaching Herald's row store, unsupported ones a
ValueError naming the setting (sharder and module), and 2-rank runs where Herald trains exactly like stock
TorchRec ROW_WISE with gradient clipping and with in-backward optimizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

from _dist_helpers import rank_result, run_ranks
from test_distributed_module import make_ebc, make_module

MAX_GRADIENT = 2e-4  # small enough that clipping changes most updates of the parity model
STEPS = 10


def _in_backward(ebc, cls, kwargs: dict) -> None:
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward

    apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)


# ------------------------------------------------------------------------------------------ in-process
@pytest.mark.parametrize(
    "settings, name",
    [
        ({"foo": 1}, "foo"),
        ({"optimizer": "adam"}, "optimizer"),
        ({"optimizer": EmbOptimType.EXACT_ADAGRAD}, "optimizer"),
        ({"momentum": 0.9}, "momentum"),
        ({"optimizer": "exact_sgd", "weight_decay": 0.1}, "weight_decay"),
        ({"optimizer": "exact_sgd", "max_norm": 1.0}, "max_norm"),
        ({"weight_decay": 0.1}, "weight_decay"),  # no mode: FBGEMM would not apply it
        ({"weight_decay": 0.1, "weight_decay_mode": WeightDecayMode.COUNTER}, "weight_decay_mode"),
        ({"weights_precision": SparseType.FP16}, "weights_precision"),
        ({"prefetch_pipeline": True}, "prefetch_pipeline"),
        ({"max_gradient": 0.0}, "max_gradient"),
        ({"gradient_clipping": 1}, "gradient_clipping"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"__register_tbes_in_named_modules": True}, "__register_tbes_in_named_modules"),
    ],
)
def test_unsupported_settings_raise_from_sharder_and_module(settings: dict, name: str) -> None:
    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder
    from herald_torchrec.distributed.row_store import RowStore, TableSpec

    with pytest.raises(ValueError, match=name):
        HeraldEmbeddingBagCollectionSharder(fused_params=settings)
    from herald_torchrec.distributed import ShardedHeraldEmbeddingBagCollection
    from torchrec.distributed.types import ShardingEnv

    with pytest.raises(ValueError, match=name):
        ShardedHeraldEmbeddingBagCollection(make_ebc(), None, ShardingEnv(1, 0, None), fused_params=settings)
    own = {k: v for k, v in settings.items() if k in ("optimizer", "learning_rate")}
    extra = {k: v for k, v in settings.items() if k not in own}
    with pytest.raises(ValueError, match=name):
        RowStore([TableSpec("t", 8, 4)], 0, 1, **own, tbe_settings=extra)


def test_in_backward_optimizer_is_checked_by_the_module() -> None:
    from herald_torchrec.distributed import ShardedHeraldEmbeddingBagCollection
    from torchrec.distributed.types import ShardingEnv

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
    # neutral torch arguments are accepted; in-backward overrides the sharder's (and Herald's default) optimizer
    m = build(torch.optim.SGD, {"lr": 0.25, "momentum": 0.0}, {"optimizer": "exact_rowwise_adagrad", "learning_rate": 0.01})
    assert m.optimizer_type == EmbOptimType.EXACT_SGD and m.learning_rate == 0.25
    assert m._store.tbe.optimizer == EmbOptimType.EXACT_SGD
    assert m._store.tbe.get_learning_rate() == pytest.approx(0.25)


def test_resolution_follows_torchrec_precedence() -> None:
    from torchrec.optim import RowWiseAdagrad

    from herald_torchrec.distributed.optimizer_params import resolve_table_settings

    ebc = make_ebc()
    assert resolve_table_settings(ebc, None) == {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01}
    fp = {"optimizer": "exact_sgd", "learning_rate": 0.3, "gradient_clipping": True, "max_gradient": 0.5}
    assert resolve_table_settings(ebc, fp) == {**fp, "optimizer": EmbOptimType.EXACT_SGD}
    _in_backward(ebc, RowWiseAdagrad, {"lr": 0.07, "eps": 1e-3})
    got = resolve_table_settings(ebc, fp)  # in-backward kwargs win; the sharder's other settings stay
    assert got == {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.07, "eps": 1e-3,
                   "gradient_clipping": True, "max_gradient": 0.5}
    assert ebc.embedding_bags["t0"].weight._optimizer_kwargs == [{"lr": 0.07, "eps": 1e-3}]  # left as the user set it
    # tables of one Herald TBE must agree
    ebc = make_ebc()
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward

    apply_optimizer_in_backward(torch.optim.SGD, [ebc.embedding_bags["t0"].weight], {"lr": 0.5})
    with pytest.raises(ValueError, match="optimizer: tables 't0' and 't1'"):
        resolve_table_settings(ebc, None)


def test_every_setting_reaches_the_tbe() -> None:
    m = make_module()  # rowwise adagrad, lr 0.1
    assert not m._store.tbe.optimizer_args.gradient_clipping
    from herald_torchrec.distributed import ShardedHeraldEmbeddingBagCollection
    from torchrec.distributed.types import ShardingEnv

    fp = {"optimizer": "exact_rowwise_adagrad", "learning_rate": 0.2, "eps": 1e-3, "gradient_clipping": True,
          "max_gradient": 0.125, "stochastic_rounding": False}
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
        tbe = SplitTableBatchedEmbeddingBagsCodegen([(6, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                                    optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.5,
                                                    pooling_mode=PoolingMode.SUM, **kw)
        with torch.no_grad():
            tbe.split_embedding_weights()[0].copy_(torch.arange(24.0).view(6, 4) / 10)
        out = tbe(torch.tensor([1, 2, 1]), torch.tensor([0, 2, 3]))
        out.backward(torch.ones_like(out))
        return tbe.split_embedding_weights()[0].detach().clone()

    base = train()
    assert torch.equal(train(weight_decay=1.0, weight_decay_mode=WeightDecayMode.L2), base)
    assert torch.equal(train(max_norm=0.01), base)
    assert not torch.equal(train(gradient_clipping=True, max_gradient=0.01), base)  # clipping is applied
    from herald_torchrec.distributed import HeraldEmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingEnv
    from herald_torchrec.distributed import ShardedHeraldEmbeddingBagCollection

    fp = {"weight_decay": 0.1, "weight_decay_mode": WeightDecayMode.L2}
    HeraldEmbeddingBagCollectionSharder(fused_params=fp)  # device unknown yet: accepted (applied on CUDA)
    with pytest.raises(ValueError, match="weight_decay=0.1: FBGEMM's CPU kernels"):
        ShardedHeraldEmbeddingBagCollection(make_ebc(), None, ShardingEnv(1, 0, None), fused_params=fp)
