"""benchmarks/simulate.py: the trace simulator's CLI and JSON output."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.helpers.ranks import REPO_ROOT


def load_simulate():
    spec = importlib.util.spec_from_file_location("simulate", REPO_ROOT / "benchmarks" / "simulate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def test_cli_errors():
    sim = load_simulate()
    with pytest.raises(SystemExit):
        sim.main(["--policies", "nope", *SMALL])
    with pytest.raises(SystemExit, match="--path"):
        sim.main(["--data", "criteo", *SMALL])
    with pytest.raises(SystemExit, match="--workers"):
        sim.main(["--workers", "a,b", *SMALL])


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
