"""Step extensions (distributed/step/extension.py): a module gets the comparison system of its policy when it is
built, Herald's modules none unless their policy replicates (the replica region), and a plan whose actions only an
extension runs is refused by a module without it; the replica region refuses a plan that moves or shares a row it
reads through replicas. One process, no collectives."""

from __future__ import annotations

import dataclasses

import pytest

from tests.distributed.test_embeddingbag import empty_plan, make_ebc


def make(policy: str, replicate: bool = False):
    from torchrec.distributed.types import ShardingEnv

    from herald_torchrec.distributed import ShardedHeraldEmbeddingBagCollection

    return ShardedHeraldEmbeddingBagCollection(
        make_ebc(),
        None,
        ShardingEnv(1, 0, None),
        policy=policy,
        fused_params={"optimizer": "exact_rowwise_adagrad"},
        replicate=replicate,
    )


@pytest.mark.parametrize(
    "policy, extensions",
    [
        ("herald", []),
        ("static", []),
        ("het_bsp", []),
        ("fae", ["ReplicaExtension"]),
        ("p2res", ["ReplicaExtension"]),
        ("het", ["HetCacheExtension"]),
    ],
)
def test_the_policy_chooses_the_extensions(policy: str, extensions: list[str]) -> None:
    assert [type(e).__name__ for e in make(policy)._extensions] == extensions


def test_herald_replicating_gets_the_replica_region() -> None:
    """Herald's replicated rows run in the region fae / p2res use (one of it, also when asked twice)."""
    from herald_torchrec import HeraldEmbeddingBagCollectionSharder, HeraldOptions

    assert [type(e).__name__ for e in make("herald", replicate=True)._extensions] == ["ReplicaExtension"]
    assert [type(e).__name__ for e in make("p2res", replicate=True)._extensions] == ["ReplicaExtension"]
    assert make("herald", replicate=True).runs_replicas and not make("herald").runs_replicas
    sharder = HeraldEmbeddingBagCollectionSharder(options=HeraldOptions(policy_options={"replicate": True}))
    assert sharder.options.replicates and not HeraldOptions().replicates
    with pytest.raises(ValueError, match="replicate must be True or False"):
        make("herald", replicate="yes")  # type: ignore[arg-type]


def test_a_plan_needing_an_extension_the_module_lacks_is_refused() -> None:
    from herald_torchrec.schedule.plan import ReplicaSync

    plan = dataclasses.replace(empty_plan(1, 3), replicas=ReplicaSync())
    with pytest.raises(ValueError, match="carries `replicas`"):
        make("herald").set_plan(plan)
    with pytest.raises(ValueError, match="carries `replicas`"):
        make("het").set_plan(plan)
    m = make("p2res")
    m.set_plan(plan)
    assert m.queued_plans == 1


def test_a_plan_moving_or_sharing_a_row_read_through_replicas_is_refused() -> None:
    """Herald pins its replicated rows; a plan that moves a row it all-reduces or declares, or shares one it
    all-reduces, would update a slot the row left, or the row twice: a ValueError before any collective."""
    import numpy as np

    from herald_torchrec.schedule.plan import ReplicaSync, RowMoves, SharedRows

    region = make("herald", replicate=True)._extensions[0].region
    i64 = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731

    def plan(moves=None, shared=None, declare=False):
        sync = ReplicaSync(allreduce_table=i64(0), allreduce_row=i64(3))
        if declare:
            sync.replicated_table, sync.replicated_row = i64(0, 1), i64(3, 5)
        return dataclasses.replace(
            empty_plan(1, 3), moves=moves or RowMoves(), shared=shared or SharedRows(), replicas=sync
        )

    move = lambda t, r: RowMoves(i64(t), i64(r), i64(0), i64(0), np.zeros(1, dtype=np.int8))  # noqa: E731
    share = lambda t, r: SharedRows(i64(t), i64(r), i64(0), i64(0, 1), i64(0))  # noqa: E731
    with pytest.raises(ValueError, match=r"plan 0 moves replicated rows \(e.g. table 't0' row 3, 1 in all\)"):
        region.check_order(plan(moves=move(0, 3)))
    with pytest.raises(ValueError, match="plan 0 shares replicated rows"):
        region.check_order(plan(shared=share(0, 3)))
    with pytest.raises(ValueError, match=r"moves replicated rows \(e.g. table 't1' row 5"):
        region.check_order(plan(moves=move(1, 5), declare=True))  # declared in the step
    region.check_order(plan(moves=move(0, 4), shared=share(1, 5)))  # other rows: fine
    region.check_order(plan(shared=share(1, 5), declare=True))  # a declared row not all-reduced may be shared (fae)
    with pytest.raises(ValueError, match="moves replicated rows"):
        region.begin(plan(moves=move(0, 3)), None)  # begin checks first: no collective, no region built
    assert region.copies is None


def test_a_replicating_pipeline_over_modules_without_the_region_is_refused() -> None:
    """policy_options={"replicate": True} given to the pipeline alone: its plans would carry replicas that the
    modules (sharded without it) cannot run; refused when the pipeline is built, naming the cure."""
    import torch

    from herald_torchrec import HeraldTrainPipeline

    model = torch.nn.ModuleDict({"ebc": make("herald")})
    with pytest.raises(ValueError, match=r"replicate=True, but the modules were sharded without a replica region"):
        HeraldTrainPipeline(
            model,
            torch.optim.SGD([torch.zeros(1)], lr=0.1),
            torch.device("cpu"),
            policy_options={"replicate": True},
        )
