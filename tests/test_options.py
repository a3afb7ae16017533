"""`HeraldOptions`: every Herald setting checked once, the same way whichever door it comes through (the options, the
sharder's keywords, the pipeline's keywords, the app's config keys), without importing torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from herald_torchrec.options import INPUT_PRIORITIES, PLAN_ON, PREFETCH, HeraldOptions, OptionError

BAD = [
    ({"cache_ratio": 1.5}, "cache_ratio must be in (0, 1], got 1.5"),
    ({"cache_ratio": True}, "cache_ratio must be in (0, 1], got True"),
    ({"policy": ""}, "policy must be a non-empty string, got ''"),
    ({"lookahead": -1}, "lookahead must be an integer >= 0"),
    ({"lookahead": "many"}, "lookahead must be an integer >= 0"),
    ({"policy_options": [("staleness", 0)]}, "policy_options must be a mapping"),
    ({"policy_options": {"replicate": "yes"}}, "policy_options replicate must be true or false"),
    ({"unscheduled_tables": "t0"}, "unscheduled_tables must be a collection of table names, got the string 't0'"),
    ({"plan_on": "everyone"}, "plan_on must be one of ['host', 'rank0', 'every_rank'] (where plans are made)"),
    ({"prefetch": 2.5}, "prefetch must be an integer >= 0 (batches the input stage schedules ahead of training"),
    ({"prefetch": True}, "prefetch must be an integer >= 0"),
    ({"input_priority": "high"}, "input_priority must be one of ['normal', 'low', 'idle']"),
    ({"native": "maybe"}, "native must be one of ['auto', 'on', 'off']"),
    ({"cut_thread": "yes"}, "cut_thread must be true or false, got 'yes'"),
]


@pytest.mark.parametrize("settings, message", BAD, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_a_bad_setting_is_one_line_naming_it(settings: dict, message: str) -> None:
    with pytest.raises(OptionError) as plain:
        HeraldOptions(**settings)
    assert str(plain.value).startswith(message) and "\n" not in str(plain.value)
    with pytest.raises(OptionError) as replaced:  # replace() checks with the same code
        dataclasses.replace(HeraldOptions(), **settings)
    assert str(replaced.value) == str(plain.value)
    with pytest.raises(ValueError) as named:  # as the app names its config keys
        HeraldOptions.named("scheduler.", **settings)
    assert str(named.value) == "scheduler." + str(plain.value)


def test_values_are_normalised_and_frozen() -> None:
    o = HeraldOptions(cache_ratio=1, lookahead="3", unscheduled_tables=["t1", "t1"], policy_options={"staleness": 0})
    assert o.cache_ratio == 1.0 and isinstance(o.cache_ratio, float) and o.lookahead == 3
    assert o.unscheduled_tables == frozenset({"t1"}) and dict(o.policy_options) == {"staleness": 0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.prefetch = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        o.policy_options["staleness"] = 1  # type: ignore[index]
    assert hash(o) == hash(dataclasses.replace(o)) and o == dataclasses.replace(o)
    assert o.scheduler_settings() == {"policy": "herald", "cache_ratio": 1.0, "lookahead": 3}


def test_runnable_policy_is_checked_on_demand() -> None:
    HeraldOptions(policy="random")  # the sharder takes any name (modules driven by a plan source of one's own)
    assert HeraldOptions(policy="het", policy_options={"staleness": 0}).runnable_policy() == "het"
    with pytest.raises(ValueError, match="unknown scheduling policy 'random'"):
        HeraldOptions(policy="random").runnable_policy()


def test_no_torch() -> None:
    code = "import sys, herald_torchrec; herald_torchrec.HeraldOptions(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
    assert (PLAN_ON, INPUT_PRIORITIES, PREFETCH) == (("host", "rank0", "every_rank"), ("normal", "low", "idle"), 2)


def test_the_sharder_takes_options_or_keywords() -> None:
    from herald_torchrec import HeraldEmbeddingBagCollectionSharder

    by_keywords = HeraldEmbeddingBagCollectionSharder(cache_ratio=0.2, policy="static", lookahead=3)
    assert by_keywords.options == HeraldOptions(cache_ratio=0.2, policy="static", lookahead=3)
    assert (by_keywords.cache_ratio, by_keywords.policy, by_keywords.lookahead) == (0.2, "static", 3)
    given = HeraldOptions(policy="het", lookahead=2, plan_on="rank0")
    over = HeraldEmbeddingBagCollectionSharder(0.3, unscheduled_tables=["t0"], options=given)  # keywords replace
    assert over.options == dataclasses.replace(given, cache_ratio=0.3, unscheduled_tables=frozenset({"t0"}))
    assert HeraldEmbeddingBagCollectionSharder().options == HeraldOptions()
    with pytest.raises(ValueError, match="lookahead must be an integer >= 0"):
        HeraldEmbeddingBagCollectionSharder(lookahead=-2, options=given)
