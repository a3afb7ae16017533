"""Weighted features (id-score lists: `EmbeddingBagCollection(is_weighted=True)`, KJTs with `weights`) in
Herald-managed tables train exactly as under stock TorchRec: each id's row is scaled by its weight in its bag, in
FBGEMM's TBE (per-sample weights) for exclusive ids and by torch ops for shared values, whose gradients come back
scaled by the same weights. Two gloo ranks with a planner that moves rows and shares them every step, against stock
TABLE_WISE and a one-process reference; what Herald cannot run weighted is refused by name."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_embeddingbag import kjt, make_ebc, make_module
from tests.helpers.ranks import rank_result, run_ranks

STEPS = 10
# name -> fused_params (the same for Herald and stock); the weighted model pools every table by SUM
RUNS = {
    "sgd": {"optimizer": "exact_sgd", "learning_rate": 0.5},
    "rowwise_adagrad": {"optimizer": "exact_rowwise_adagrad", "learning_rate": 0.05, "eps": 1e-2},
    "clip_sgd": {"optimizer": "exact_sgd", "learning_rate": 0.5, "gradient_clipping": True, "max_gradient": 2e-4},
}


def weighted_kjt(ids0: list[int], ids1: list[int], w0: list[float], w1: list[float], lengths=None):
    from torchrec import KeyedJaggedTensor

    n = len(ids0) + len(ids1)
    return KeyedJaggedTensor(
        keys=["f0", "f1"],
        values=torch.tensor(ids0 + ids1, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64) if lengths is not None else torch.ones(n, dtype=torch.int64),
        weights=torch.tensor(w0 + w1, dtype=torch.float32),
    )


# ----------------------------------------------------------------------------------------------- one rank
def test_one_rank_weighted_forward_equals_the_unsharded_ebc() -> None:
    ebc = make_ebc(weighted=True)
    m = make_module(ebc=ebc)
    # bags: f0 [1 x0.5, 19 x2] [] [1 x3]; f1 [0 x1.5] [32 x0.25, 5 x4] []
    x = weighted_kjt([1, 19, 1], [0, 32, 5], [0.5, 2.0, 3.0], [1.5, 0.25, 4.0], lengths=[2, 0, 1, 1, 2, 0])
    got = m(x).wait()
    want = ebc(x)
    assert torch.allclose(got.values(), want.values(), atol=1e-6)
    assert float(got.values().abs().max()) > 0
    unweighted = ebc(weighted_kjt([1, 19, 1], [0, 32, 5], [1.0] * 3, [1.0] * 3, lengths=[2, 0, 1, 1, 2, 0]))
    assert float((got.values() - unweighted.values()).abs().max()) > 1e-3  # the weights are applied


def test_weighted_inputs_and_modules_are_checked_by_name() -> None:
    from torchrec.distributed.types import ShardingEnv

    from herald_torchrec.distributed import ShardedHeraldEmbeddingBagCollection

    weighted = make_module(ebc=make_ebc(weighted=True))
    with pytest.raises(ValueError, match="is_weighted=True\\), its input KJT has no weights"):
        weighted(kjt([1], [2]))
    unweighted = make_module()
    with pytest.raises(ValueError, match="the input KJT has weights but the EBC is not weighted"):
        unweighted(weighted_kjt([1], [2], [1.0], [1.0]))
    with pytest.raises(ValueError, match="HET's cache does not run weighted features"):
        ShardedHeraldEmbeddingBagCollection(
            make_ebc(weighted=True),
            None,
            ShardingEnv(1, 0, None),
            fused_params={"optimizer": "exact_sgd"},
            policy="het",
        )


# ------------------------------------------------------------------------------------------ 2 ranks
def weighted_worker(rank: int, world: int, out_dir: str) -> None:
    import tests.scenarios.test_module_parity as P
    from tests.distributed.storage.test_optimizer_params import _run_herald, _run_stock

    batches = P.make_batches(world, STEPS, weighted=True)
    result = {}
    for name, fp in RUNS.items():
        result[name] = {
            "herald": _run_herald(fp, None, batches, rank, world, weighted=True),
            "stock": _run_stock(fp, None, batches, rank, world, table_wise=True, weighted=True),
        }
    result["reference"] = P.run_reference("exact_sgd", batches, world, True)["weights"]
    unweighted = P.make_batches(world, STEPS)
    result["unweighted_reference"] = P.run_reference("exact_sgd", unweighted, world, True)["weights"]
    torch.save(result if rank == 0 else {}, rank_result(out_dir, rank))


@pytest.fixture(scope="module")
def weighted_runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("weighted_runs")
    return torch.load(
        run_ranks("tests.distributed.test_weighted_features:weighted_worker", out, world_size=2, timeout=400)[0],
        weights_only=False,
    )


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("name", list(RUNS))
def test_weighted_ebc_trains_like_stock_table_wise(weighted_runs: dict, name: str) -> None:
    import tests.scenarios.test_module_parity as P

    h, s = weighted_runs[name]["herald"], weighted_runs[name]["stock"]
    assert _max_diff(h["weights"], s["weights"]) <= 1e-5, name
    assert _max_diff(h["weights"], P.init_tables()) > 1e-3  # the tables trained: the comparison is not vacuous
    assert h["counters"]["shared_value"] > 0 and h["counters"]["migrate"] + h["counters"]["forward"] > 0
    if "adagrad" in name:
        assert h["states"] and _max_diff(h["states"], s["states"]) <= 1e-5
    if name.startswith("clip"):  # clipping changed the model (the SGD run is the same model unclipped)
        assert _max_diff(h["weights"], weighted_runs["sgd"]["herald"]["weights"]) > 1e-3


def test_weighted_ebc_equals_the_one_process_reference(weighted_runs: dict) -> None:
    h = weighted_runs["sgd"]["herald"]["weights"]
    assert _max_diff(h, weighted_runs["reference"]) <= 1e-5
    # the weights changed the model: an implementation that dropped them would train the unweighted one
    assert _max_diff(h, weighted_runs["unweighted_reference"]) > 1e-3
