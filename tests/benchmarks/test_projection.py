"""benchmarks/projection.py: the cost model's pure functions on a hand-computed case (R=16, two hosts of 8), and
the script end to end on the committed inputs (no plot)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.ranks import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

import projection as pj  # noqa: E402

# 26 single-id features, rows of 64 floats, 13 dense inputs, 100 dense parameters
WL = pj.Workload("hand", features=26, dim=64, bag=1, num_dense=13, dense_params=100, source="test")


def test_table_wise_two_hosts_by_hand() -> None:
    t = pj.table_wise(16, 8, 256, WL)
    # hosts: 13 tables each; 2,048 samples on the other host; pooled rows of 256 B, forward + backward
    assert t.parts["embedding"] == 2 * 13 * 2048 * 256 == 13_631_488
    # ids: 2,048 local samples x 13 remote features x (8 B id + 4 B length)
    assert t.parts["ids"] == 2048 * 13 * 12 == 319_488
    assert t.host_bytes == 13_950_976
    # GPUs: the busiest holds 2 tables and sends them to 15 x 256 samples
    assert t.gpu_bytes == 2 * (2 * 3840 * 256) + 2 * 3840 * 12 == 4_024_320
    assert t.collectives == 4
    assert pj.table_wise(8, 8, 256, WL).host_bytes == 0.0  # one host: nothing crosses


def test_row_wise_reduce_scatter_and_gloo_allreduce() -> None:
    n = 16 * 256 * 26 * 64 * 4  # every sample's partial pooled sums from every shard
    assert n == 27_262_976
    rs = pj.row_wise(16, 8, 256, WL)
    assert rs.parts["embedding"] == pytest.approx(2 * 15 / 16 * n) == 51_118_080
    assert rs.parts["ids"] == pytest.approx(8 * 256 * 26 * 12 * 8 / 16) == 319_488
    assert rs.gpu_bytes == pytest.approx(51_118_080 + 256 * 26 * 12 * 15 / 16)
    ar = pj.row_wise(16, 8, 256, WL, forward="allreduce")
    assert ar.parts["embedding"] == pytest.approx(3 * 15 / 16 * n) == 76_677_120
    with pytest.raises(ValueError, match="forward must be"):
        pj.row_wise(16, 8, 256, WL, forward="tree")


def test_dense_simulated_rows_and_herald_input_stage() -> None:
    assert pj.dense_allreduce(16, 8, WL).host_bytes == pytest.approx(2 * 15 / 16 * 100 * 4) == 750
    assert pj.dense_allreduce(8, 8, WL).host_bytes == 0.0
    t = pj.simulated_rows(
        16, 8, 256, WL, cross_per_sample=2.0, intra_per_sample=1.0, busiest_over_mean=1.5, collectives=4
    )
    assert t.host_bytes == 2.0 * 16 * 256 * 256 / 2 == 1_048_576  # the mean host sends and receives half
    assert t.gpu_bytes == 3.0 * 256 * 256 * 1.5 == 294_912
    h = pj.herald_input_stage(16, 8, 256, WL)
    assert WL.sample_bytes == 13 * 4 + 4 + 26 * 4 == 160
    assert h.parts["ids"] == 8 * 256 * 26 * 4 == 212_992  # the 26.6 KB per rank and planner
    assert h.parts["samples"] == 8 * 256 * 0.5 * 160 == 163_840
    assert h.host_bytes == 212_992 + 163_840 and h.collectives == 0
    # planned per host: ids stay on the host, only the planners' messages and routed parts cross
    hh = pj.hier_input_stage(16, 8, messages_per_rank=30_000, parts_per_host=160_000)
    assert hh.host_bytes == 8 * 30_000 + 160_000 and hh.gpu_bytes == 0.0 and hh.collectives == 0
    assert pj.hier_input_stage(8, 8, 30_000, 160_000).host_bytes == 0.0  # one host


def test_table_row_wise_two_hosts_by_hand() -> None:
    """TorchRec's TABLE_ROW_WISE: between hosts what TABLE_WISE moves; inside a host the reduce-scatter (and the
    backward all-gather) of partial pooled sums over the host's 8 GPUs, and each GPU's share of the host's traffic."""
    t = pj.table_row_wise(16, 8, 256, WL)
    assert t.host_bytes == pj.table_wise(16, 8, 256, WL).host_bytes == 13_950_976
    assert t.parts == {"embedding": 13_631_488, "ids": 319_488}
    # 13 tables per host: 2 x 7/8 x (16 x 256 samples x 13 x 256 B) + 1/8 of the ids of 13 tables + 1/8 of the host's
    assert t.gpu_bytes == 23_855_104 + 16 * 256 * 13 * 12 / 8 + 13_950_976 / 8 == 25_678_848
    assert t.collectives == 6
    one = pj.table_row_wise(8, 8, 256, WL)  # one host: ROW_WISE over its 8 GPUs, nothing crosses
    assert one.host_bytes == 0.0 and one.gpu_bytes == 2 * 7 / 8 * 8 * 256 * 26 * 256 + 8 * 256 * 26 * 12 / 8


def test_hier_alone_inputs_by_r(tmp_path) -> None:
    """herald_hier's planner ms per R: the slowest replayed host (alone + its wire's codec) with its cut, only from
    runs with the sweep's settings; the input stage's time: the plan + bookkeeping, or the cut on the cut thread
    where that is longer."""
    import json

    cfg = {"scale": 0.01, "batch": 256, "cache_ratio": 0.1, "lookahead": 4, "ranks_per_host": 8}
    for r, ms, scale in ((16, (3.0, 4.5), 0.01), (64, (5.0, 4.0), 0.01), (32, (9.0, 9.0), 1.0)):
        hosts = [{"host": h, "alone_ms": m, "codec_raw_ms": 0.25, "cut_ms": 2.0 + h} for h, m in enumerate(ms)]
        body = {"config": cfg | {"workers": r, "scale": scale}, "hosts": hosts}
        (tmp_path / f"hier_alone_r{r}.json").write_text(json.dumps(body))
    assert pj.hier_alone_ms(str(tmp_path / "hier_alone_r*.json"), cfg) == {16: (4.75, 3.0), 64: (5.25, 2.0)}
    book = pj.INPUT_BOOKKEEPING_MS
    assert pj.planner_thread_ms({"planner_cpu_ms": 4.75, "cut_ms": 3.0}) == 4.75 + book
    assert pj.planner_thread_ms({"planner_cpu_ms": 1.0, "cut_ms": 9.0}) == 9.0  # the cut thread is the slower one
    assert pj.planner_thread_ms({"planner_cpu_ms": 4.75, "cut_ms": 3.0}, wire_ms=0.5) == 4.75 + book + 0.5


def test_input_stage_wire_by_hand() -> None:
    """Across hosts a Herald's input stage waits for its bytes besides the rows at the link's rate and for a latency
    per collective: herald its round's one, herald_hier also its planners' 6 exchanges of sizes then bytes."""
    ln = pj.Links("test", host_gbit=8.0, latency_inter_ms=0.05)  # 1e9 bytes/s: 1 ms per MB
    sim = {"planner_messages_per_rank": 30_000, "plan_parts_per_host": 160_000}
    hier = pj.input_wire_ms("herald_hier", 16, 8, 256, WL, sim, ln)
    assert hier == pytest.approx((8 * 30_000 + 160_000) / 1e6 + (1 + 2 * 6) * 0.05)
    ids_and_samples = pj.herald_input_stage(16, 8, 256, WL).host_bytes
    assert pj.input_wire_ms("herald", 16, 8, 256, WL, {}, ln) == pytest.approx(ids_and_samples / 1e6 + 0.05)
    assert pj.input_wire_ms("herald_hier", 8, 8, 256, WL, sim, ln) == 0.0  # one host: nothing crosses


def test_planner_exchanges_per_plan_as_the_projection_counts_them(monkeypatch) -> None:
    """PLANNER_EXCHANGES is the number of times herald_hier's planners meet per plan after the first (which also
    sends the settings): counted on the transport of a 2-host policy."""
    import numpy as np

    from herald_torchrec.schedule import make_policy
    from herald_torchrec.schedule.herald import host_messages
    from tests.schedule.test_hierarchy import L, synthetic_window

    R, B, steps = 16, 16, 4
    rows, batches = synthetic_window(R, B, steps)
    kinds: list[str] = []
    exchange = host_messages.InProcessTransport.exchange

    def counted(self, kind, out):
        kinds.append(kind)
        return exchange(self, kind, out)

    monkeypatch.setattr(host_messages.InProcessTransport, "exchange", counted)
    pol = make_policy("herald_hier", rows, R, B, 0.1, L, hosts=8)
    per_plan = []
    for s in range(steps):
        kinds.clear()
        pol.plan(batches[s : s + L + 1])
        per_plan.append(list(kinds))
    assert per_plan[0][0] == "settings" and len(per_plan[0]) == pj.PLANNER_EXCHANGES + 1
    assert all(len(k) == pj.PLANNER_EXCHANGES for k in per_plan[1:]), per_plan
    assert np.unique([k for p in per_plan[1:] for k in p]).tolist() == sorted(per_plan[1])  # one of each kind


def test_herald_cut_inputs_by_r(tmp_path) -> None:
    """herald's cut of its host's parts per R, only from a plan_bytes run of herald with the sweep's settings."""
    import json

    cfg = {"scale": 0.01, "batch": 256, "cache_ratio": 0.1, "lookahead": 4, "ranks_per_host": 8}
    by = {"16": {"cut_cpu_ms_per_host": 1.5}, "64": {"cut_cpu_ms_per_host": 3.25}}
    path = tmp_path / "pb.json"
    path.write_text(json.dumps({"config": cfg | {"policy": "herald"}, "by_workers": by}))
    assert pj.plan_cut_ms(path, cfg) == {16: 1.5, 64: 3.25}
    for bad in ({"policy": "herald_hier"}, {"policy": "herald", "scale": 1.0}):
        path.write_text(json.dumps({"config": cfg | bad, "by_workers": by}))
        with pytest.raises(SystemExit, match="not plan_bytes.py --policy herald with the sweep's settings"):
            pj.plan_cut_ms(path, cfg)


def test_validation_checks_each_herald_against_its_own_simulated_run(tmp_path) -> None:
    """Emulated herald across machines is checked against host-aware LAIA (`herald_host`), herald_hier against its
    own rows plus its planners' messages and routed parts (ids and samples stay on their host); on one machine
    both are herald. The validation file is collected from simulate.py runs, one R each."""
    import json

    row = {
        "cross_host_rows_per_sample": 3.0,
        "intra_host_rows_per_sample": 1.0,
        "cross_host_rows_per_sample_host_aggregated": 2.0,
        "intra_host_rows_per_sample_host_aggregated": 2.0,
        "busiest_rank_over_mean": 1.1,
        "sched_cpu_ms_median": 4.0,
    }
    hier = row | {
        "protocol_bytes_per_rank": {"between_hosts_busiest_host": 30_000},
        "parts_bytes_per_host": {"routed": 160_000},
    }
    cfg = {
        "workers": [16],
        "ranks_per_host": 8,
        "steps": 100,
        "warmup": 10,
        "policies": ["herald_host", "herald_hier"],
        "dim": 64,
        "hier_clock": "cpu",
    }
    sim = tmp_path / "r16.json"
    sim.write_text(json.dumps({"config": cfg, "policies": {"herald_host": row, "herald_hier": hier}}))
    out = tmp_path / "validation.json"
    body = pj.main(["--collect-validation", str(out), str(sim)])
    assert json.loads(out.read_text()) == body and "--workers 16 --ranks-per-host 8" in body["commands"][0]
    by_policy = pj.sim_validation([out])["16/8"]
    assert by_policy["herald_hier"]["planner_messages_per_rank"] == 30_000
    assert pj.validation_sim(by_policy, "herald", 2) is by_policy["herald_host"]
    assert pj.validation_sim(by_policy, "herald_hier", 2) is by_policy["herald_hier"]
    assert pj.validation_sim({"herald": row}, "herald_hier", 1) == row
    t = pj.validation_point(WL, "herald_hier", 16, 8, 256, by_policy["herald_hier"], relay=True)
    rows = 2.0 * 16 * 256 * 256 / 2  # the mean host's aggregated rows of 64 floats
    assert t.host_bytes == pytest.approx(rows + 8 * 30_000 + 160_000 + 2 * 15 / 16 * 100 * 4)
    h = pj.validation_point(WL, "herald", 16, 8, 256, by_policy["herald_host"], relay=True)
    assert h.host_bytes == pytest.approx(rows + pj.herald_input_stage(16, 8, 256, WL).host_bytes + 750)
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"config": cfg | {"workers": [16, 32]}, "policies": {}}))
    with pytest.raises(SystemExit, match="one simulate.py run per R"):
        pj.collect_validation([str(sweep)])


def test_validation_leaves_out_stock_placed_as_one_machine(tmp_path) -> None:
    """Stock TABLE_WISE across machines from a run made before the planner knew the machines is left out of the
    validation; the same run's other schedulers and a later file's TABLE_WISE stay in."""
    import json

    med = {"steady_step_ms": 100.0, "cpu_s_per_step": 0.1, "wire_bytes_per_step": 2e6}
    by_s = {s: {"median": med} for s in ("torchrec_tw", "torchrec", "torchrec_twrw")}
    body = {"config": {"cores": 2, "ranks_per_host": 8, "batch": 256}, "runs": {"wdl64": {"1gbit": {"16": by_s}}}}
    old, new = tmp_path / "e2e_r16_2x8hosts_cpu2_2026-11-30.json", tmp_path / "e2e_r16_later.json"
    assert old.name in pj.STOCK_PLANNED_AS_ONE_MACHINE
    for f in (old, new):
        f.write_text(json.dumps(body))
    got = {(Path(x["file"]).name, x["scheduler"]) for x in pj.validate([str(old), str(new)])["rows"]}
    assert got == {(old.name, "torchrec"), (old.name, "torchrec_twrw")} | {(new.name, s) for s in by_s}


def test_comm_and_step_estimate() -> None:
    links = pj.Links("test", host_gbit=100.0)
    # 12.5 MB at 12.5 GB/s = 1 ms, plus two collectives at 50 us
    assert pj.comm_ms(pj.Traffic(12.5e6, 0.0, 2), links, hosts=2) == pytest.approx(1.1)
    # one host: the host link is not used; 3 GB at 300 GB/s = 10 ms, plus 20 us
    assert pj.comm_ms(pj.Traffic(1e12, 3e9, 1), links, hosts=1) == pytest.approx(10.02)
    s = pj.step_estimate(8.0, 1.0, 2.0, 1.5, input_stage_ms=15.0)
    assert (s.step_ms, s.stall_ms, s.planner_bound) == (15.0, 4.0, True)
    assert s.embedding_comm_share == pytest.approx(0.1)
    s = pj.step_estimate(8.0, 1.0, 2.0, 1.5, input_stage_ms=5.0)
    assert (s.step_ms, s.stall_ms, s.planner_bound) == (11.0, 0.0, False)
    with pytest.raises(ValueError, match="ranks_per_host"):
        pj.num_hosts(16, 0)


def test_script_end_to_end_is_labelled_a_projection(capsys) -> None:
    committed = [str(REPO_ROOT / "benchmarks/results/e2e_link_sweep_r2_split_cpu2_2026-11-26.json")]
    out = pj.main(["--e2e", *committed])
    assert out["label"] == "projection"
    assert out["table_markdown"].startswith("Projection")
    for link in ("100gbit", "25gbit"):
        rows = out["projection"][link]
        assert [int(r) for r in rows] == [8, 16, 32, 64, 128, 256]
        assert set(rows["64"]["policies"]) == set(pj.POLICIES)
    # the link sweep's 18 points, each with predicted bytes within 5 % of the measured wire bytes
    v = out["validation"]["rows"]
    assert len(v) == 18
    assert all(abs(x["predicted_host_link_mb"] / x["measured_wire_mb_busiest_host"] - 1) < 0.05 for x in v)
    assert '"label": "projection"' in capsys.readouterr().out
