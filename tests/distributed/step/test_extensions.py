"""Step extensions (distributed/step/extension.py): a module gets the comparison system of its policy when it is
built, Herald's modules get none, and a plan whose actions only an extension runs is refused by a module without it.
One process, no collectives."""

from __future__ import annotations

import dataclasses

import pytest

from tests.distributed.test_embeddingbag import empty_plan, make_ebc


def make(policy: str):
    from torchrec.distributed.types import ShardingEnv

    from herald_torchrec.distributed import ShardedHeraldEmbeddingBagCollection

    return ShardedHeraldEmbeddingBagCollection(
        make_ebc(), None, ShardingEnv(1, 0, None), policy=policy, fused_params={"optimizer": "exact_rowwise_adagrad"}
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
