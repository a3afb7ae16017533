"""benchmarks/simulate.py: the trace simulator's CLI and JSON output."""

from __future__ import annotations

import json

import pytest

from tests.helpers.benchmarks import load_benchmark


def load_simulate():
    return load_benchmark("simulate")


SMALL = ["--scale", "0.0005", "--batch", "8", "--steps", "6", "--lookahead", "2", "--cache-ratio", "0.2"]


def test_single_run_json(capsys):
    sim = load_simulate()
    res = sim.main(["--workers", "4", "--policies", "static,het_bsp,herald_greedy,herald", "--json", *SMALL])
    out = json.loads(capsys.readouterr().out)
    assert out == json.loads(json.dumps(res))
    assert out["config"]["workers"] == [4] and out["config"]["data"] == "synthetic"
    for name, st in out["policies"].items():
        assert st["stale_reads"] == 0 and "check_errors" not in st
        assert set(st) >= {
            "rows_per_step",
            "bytes_per_step",
            "by_kind",
            "hit_rate",
            "stale_reads",
            "sched_ms_median",
            "sched_ms_p90",
            "sched_cpu_ms_last_quarter",
            "rows_per_sample",
        }
        assert (
            abs(st["rows_per_step"] - sum(v for k, v in st["by_kind"].items() if k != "hit"))
            < 1e-6 * max(1.0, st["rows_per_step"]) + 0.05
        )
        assert 0.0 <= st["hit_rate"] <= 1.0
    assert "herald/het_bsp" in out["ratios"]
    # the plan digest: the same plans give the same digest run after run, different policies different ones
    again = sim.main(["--workers", "4", "--policies", "static,herald", "--json", *SMALL])
    capsys.readouterr()
    for name in ("static", "herald"):
        assert again["policies"][name]["plan_digest"] == out["policies"][name]["plan_digest"]
    assert len({st["plan_digest"] for st in out["policies"].values()}) == len(out["policies"])


def test_sweep_and_plot(tmp_path, capsys):
    sim = load_simulate()
    png = tmp_path / "rows.png"
    sim.main(["--workers", "2,4", "--policies", "static,herald", "--json", "--plot", str(png), *SMALL])
    out = json.loads(capsys.readouterr().out)
    assert set(out["sweep"]) == {"2", "4"}
    assert set(out["sweep"]["4"]["policies"]) == {"static", "herald"}
    assert png.stat().st_size > 1000


def test_host_split_fields(capsys):
    """The host split adds up to the rows moved, in both modes; aggregation never adds crossings; one host for all
    ranks crosses nothing; the plans (digests) do not depend on the host size."""
    sim = load_simulate()
    pols = "static,het_bsp,p2res,herald"
    out = sim.main(["--workers", "4", "--ranks-per-host", "2", "--policies", pols, "--json", *SMALL])
    one = sim.main(["--workers", "4", "--ranks-per-host", "4", "--policies", pols, "--json", *SMALL])
    capsys.readouterr()
    assert out["config"]["ranks_per_host"] == 2
    for name, st in out["policies"].items():
        assert "unattributed_by_kind" not in st
        for suffix in ("", "_host_aggregated"):
            split = st[f"cross_host_rows_per_sample{suffix}"] + st[f"intra_host_rows_per_sample{suffix}"]
            assert split == pytest.approx(st["rows_per_sample"], abs=2e-4), (name, suffix)
            by_kind = sum(st[f"cross_host_by_kind{suffix}"].values())
            assert by_kind == pytest.approx(st[f"cross_host_rows_per_sample{suffix}"] * 4 * 8, rel=1e-3, abs=0.05)
            by_class = sum(st[f"cross_host_by_kind_table_class{suffix}"].values())
            assert by_class <= by_kind + 0.05
        assert 0 < st["cross_host_rows_per_sample_host_aggregated"] <= st["cross_host_rows_per_sample"]
        assert st["busiest_rank_over_mean"] >= 1.0
        assert one["policies"][name]["cross_host_rows_per_sample"] == 0
        assert one["policies"][name]["plan_digest"] == st["plan_digest"]
    assert out["policies"]["static"]["cross_host_by_kind"].keys() == {"shared_value", "shared_grad"}
    assert out["policies"]["het_bsp"]["cross_host_by_kind"].keys() <= {"miss_pull", "update_pull", "update_push"}
    with pytest.raises(SystemExit):
        sim.main(["--ranks-per-host", "0", *SMALL])


def test_merge_runs_of_one_worker_count(tmp_path, capsys):
    sim = load_simulate()
    paths = []
    for R in (2, 4):
        sim.main(["--workers", str(R), "--policies", "static,herald", "--json", *SMALL])
        paths.append(tmp_path / f"r{R}.json")
        paths[-1].write_text(capsys.readouterr().out)
    png = tmp_path / "sweep.png"
    merged = sim.main(["--merge", *map(str, paths), "--json", "--plot", str(png)])
    assert json.loads(capsys.readouterr().out) == merged
    assert merged["config"]["workers"] == [2, 4] and set(merged["sweep"]) == {"2", "4"}
    assert merged["sweep"]["4"]["policies"] == json.loads(paths[1].read_text())["policies"]
    assert png.stat().st_size > 1000
    sim.main(["--workers", "2", "--policies", "static", "--json", *SMALL[:-2], "--cache-ratio", "0.3"])
    other = tmp_path / "other.json"
    other.write_text(capsys.readouterr().out)
    with pytest.raises(SystemExit, match="other settings"):
        sim.main(["--merge", str(paths[0]), str(other)])


def test_cli_errors():
    sim = load_simulate()
    with pytest.raises(SystemExit):
        sim.main(["--policies", "nope", *SMALL])
    with pytest.raises(SystemExit, match="--path"):
        sim.main(["--data", "criteo", *SMALL])
    with pytest.raises(SystemExit, match="--workers"):
        sim.main(["--workers", "a,b", *SMALL])
    with pytest.raises(SystemExit):
        sim.main(["--owner-balance", "0.5", *SMALL])


def test_owner_balance_is_on_by_default_and_off_on_request(capsys):
    """herald and herald_rep balance owners by default (the factor and the rows handed on are reported);
    `--owner-balance off` turns it off, a factor replaces the default."""
    sim = load_simulate()
    args = ["--workers", "8", "--ranks-per-host", "4", "--policies", "herald,herald_rep", "--json", *SMALL]
    on = sim.main(args)["policies"]
    off = sim.main([*args, "--owner-balance", "off"])["policies"]
    capsys.readouterr()
    for name in ("herald", "herald_rep"):
        assert on[name]["owner_balance"] > 1 and "owner_balance" not in off[name]
        assert on[name]["stale_reads"] == off[name]["stale_reads"] == 0
    forced = sim.main([*args, "--owner-balance", "1.05"])["policies"]
    capsys.readouterr()
    assert forced["herald"]["owner_balance"] == 1.05 and forced["herald"]["stale_reads"] == 0


@pytest.mark.parametrize(
    "data, fname",
    [("movielens", "movielens_ratings_sample.csv"), ("avazu", "avazu_sample.csv"), ("criteo", "criteo_sample.tsv")],
)
def test_real_format_samples(data, fname, shared_data, capsys):
    sim = load_simulate()
    sim.main(
        [
            "--data",
            data,
            "--path",
            str(shared_data / fname),
            "--workers",
            "2",
            "--batch",
            "8",
            "--steps",
            "5",
            "--policies",
            "static,herald",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert all(st["stale_reads"] == 0 for st in out["policies"].values())


def test_hier_clock_and_peak_rss(capsys):
    sim = load_simulate()
    from herald_torchrec.schedule.herald import hierarchy

    try:
        out = sim.main(["--workers", "4", "--ranks-per-host", "2", "--policies", "herald_hier", "--hier-clock", "cpu",
                        "--json", *SMALL])  # fmt: skip
        assert hierarchy.CLOCK is __import__("time").process_time
    finally:
        hierarchy.CLOCK = __import__("time").perf_counter
    capsys.readouterr()
    assert out["config"]["hier_clock"] == "cpu" and out["peak_rss_mib"] > 0
    assert out["policies"]["herald_hier"]["plan_ms_per_host"]["max_host_ms"] > 0


def test_hier_memory_counts_one_hosts_needs(capsys):
    mod = load_benchmark("hier_memory")
    out = mod.main(["--scale", "0.0005", "--workers", "4", "--ranks-per-host", "2", "--batch", "8", "--steps", "4"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))
    (run,) = out["runs"]
    rows = run["total_rows"]
    rep, need = run["replica_bytes"], run["host_needs_bytes"]
    assert rep["owner"] == rep["home"] == rep["last_use"] == 4 * rows and rep["table"] == 2 * rows  # every row
    assert (
        need["directory_owners"] == 2 * need["directory_rows"]
        and rows / 2 - 8 <= need["directory_rows"] <= rows / 2 + 8
    )
    assert need["guests"] == need["guests_held"] * mod.GUEST_BYTES
    assert need["total"] == need["directory_owners"] + need["guests"] + need["groups_and_pools"]
    assert need["total"] <= need["total_caches_full"]
    with pytest.raises(SystemExit):
        mod.main(["--workers", "3", "--ranks-per-host", "2"])
