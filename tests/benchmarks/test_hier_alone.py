"""benchmarks/hier_alone.py: a herald_hier host replayed alone in its own process from a recorded in-process run."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.benchmarks import load_benchmark


def load_hier_alone():
    return load_benchmark("hier_alone")


def test_a_host_replays_alone_and_times_its_steps():
    """A host of a 4-host run replayed alone (three processes: checked, and its planner's thread both ways): every
    message it sends equals the recorded run's (else the replay stops), and it has a time per step."""
    mod = load_hier_alone()
    args = ["--scale", "0.0005", "--batch", "8", "--lookahead", "2", "--cache-ratio", "0.2", "--ranks-per-host", "2"]
    res = mod.main(["--workers", "8", "--steps", "4", "--warmup", "1", "--hosts", "3", *args])
    assert [h["host"] for h in res["hosts"]] == [3]
    assert all(h["alone_ms"] > 0 and h["in_process_ms"] > 0 and h["codec_ms"] > 0 for h in res["hosts"])
    assert all(h["cut_ms"] > 0 for h in res["hosts"])  # its ranks' parts cut from its plan
    # its planner's thread as the input stage runs it: the cut on the same thread, or on one of its own
    assert all(h["planner_thread_ms"] > 0 and h["planner_thread_cut_thread_ms"] > 0 for h in res["hosts"])
    assert all(0 < h["sent_bytes"] < h["sent_raw_bytes"] for h in res["hosts"])  # the compact form is smaller
    assert res["in_process_ms"]["slowest"] >= res["in_process_ms"]["median"] > 0


def test_a_hosts_samples_alone_are_its_cut_of_the_global_batch():
    """The replay generates a host's samples alone (as training's input stage hands them to its planner): the same
    ids, layout and batch index as the global batch cut to that host by the policy."""
    mod = load_hier_alone()
    ns = mod.argparse.Namespace(scale=0.0005, batch=8, ranks_per_host=2, cache_ratio=0.2, lookahead=2,
                                first_pass="auto", refine="auto", owner_balance="auto")  # fmt: skip
    R = 8
    rows, whole = mod._trace(ns, R)
    pol = mod._policy(ns, rows, R)
    for host in (0, 3):
        rows_h, alone = mod._trace(ns, R, host)
        assert rows_h == rows
        for i in (0, 5):
            cut, mine = pol.host_batch(whole(i), host), alone(i)
            assert mine.index == cut.index == i and mine.layout == cut.layout
            assert mine.num_samples == 2 * 8
            np.testing.assert_array_equal(mine._cache["dense"], cut._cache["dense"])


def test_a_replay_that_diverges_stops():
    mod = load_hier_alone()
    sent = {0: {1: [np.array([1, 2])]}}
    log = [("demand", {0: {1: [np.array([7])]}}, sent)]
    assert mod.ReplayTransport(0, log).exchange("demand", sent)[0][1][0].tolist() == [7]
    for kind, out in (("demand", {0: {1: [np.array([1, 3])]}}), ("owners", sent), ("demand", {0: {}})):
        with pytest.raises(RuntimeError, match="host 0 diverged from the recorded run at exchange 1"):
            mod.ReplayTransport(0, log).exchange(kind, out)


def test_bad_options_are_refused():
    mod = load_hier_alone()
    for argv, why in ((["--workers", "8"], "at least two hosts"), (["--workers", "64", "--hosts", "9"], "each in 0..7"),
                      (["--hosts", "a"], "comma list"), (["--steps", "3", "--warmup", "3"], "--warmup")):  # fmt: skip
        with pytest.raises(SystemExit, match=why):
            mod.main(argv)


def test_a_bad_owner_balance_is_named(capsys):
    mod = load_hier_alone()
    with pytest.raises(SystemExit):
        mod.main(["--owner-balance", "0.5"])
    assert "expected 'auto', 'off' or a number >= 1, got '0.5'" in capsys.readouterr().err
