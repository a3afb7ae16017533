"""benchmarks/netem.py and the network mode of benchmarks/e2e.py: the parts that need no root run everywhere;
building a real namespace network is marked slow and needs root + iproute2."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.ranks import REPO_ROOT

BENCH = REPO_ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import e2e  # noqa: E402
import e2e_common  # noqa: E402
import e2e_net  # noqa: E402
import netem  # noqa: E402


def test_parse_rate_units_and_none() -> None:
    assert netem.parse_rate("none") is None
    assert netem.parse_rate("1gbit") == 1_000_000_000
    assert netem.parse_rate("200mbit") == 200_000_000
    assert netem.parse_rate("500Kbit") == 500_000
    assert netem.parse_rate("2.5gbit") == 2_500_000_000
    assert netem.parse_bandwidths("none, 1gbit,200mbit,1gbit") == ["none", "1gbit", "200mbit"]


@pytest.mark.parametrize("bad", ["", "fast", "200mb", "0mbit", "-1gbit", "1gbps"])
def test_parse_rate_rejects_bad_input_naming_the_option(bad: str) -> None:
    with pytest.raises(ValueError, match="--bandwidth"):
        netem.parse_bandwidths(bad)


def test_plan_names_addresses_and_limits() -> None:
    plan = netem.plan_network(3, "a1b2c3", ipaddress.ip_network("10.42.7.0/24"))
    assert plan.host_ns == ("hneta1b2c3-r0", "hneta1b2c3-r1", "hneta1b2c3-r2")
    assert plan.bridge_ns == "hneta1b2c3-br" and plan.namespaces[-1] == plan.bridge_ns
    assert plan.addrs == ("10.42.7.1", "10.42.7.2", "10.42.7.3") and plan.prefixlen == 24
    names = [*plan.host_eth, *plan.bridge_port, plan.bridge]
    assert len(set(names)) == len(names) and all(len(n) <= netem.IFNAME_MAX for n in names)
    other = netem.plan_network(3, "ffffff", ipaddress.ip_network("10.42.7.0/24"))
    assert not set(other.namespaces) & set(plan.namespaces)  # runs do not collide
    assert len(netem.new_run_id()) == 6
    with pytest.raises(ValueError, match="--ranks"):
        netem.plan_network(0, "a1", ipaddress.ip_network("10.0.0.0/24"))
    with pytest.raises(ValueError, match="--ranks"):
        netem.plan_network(7, "a1", ipaddress.ip_network("10.0.0.0/29"))  # 6 hosts
    with pytest.raises(ValueError, match="run id"):
        netem.plan_network(2, "Bad-Id", ipaddress.ip_network("10.0.0.0/24"))


def test_plan_with_several_ranks_per_host_has_one_namespace_and_link_per_host() -> None:
    subnet = ipaddress.ip_network("10.42.7.0/24")
    plan = netem.plan_network(8, "a1b2c3", subnet, ranks_per_host=4)
    assert plan.hosts == 2 and plan.ranks == 8 and plan.ranks_per_host == 4
    assert plan.host_ns == ("hneta1b2c3-h0", "hneta1b2c3-h1") and plan.namespaces[-1] == "hneta1b2c3-br"
    assert plan.host_eth == ("ea1b2c3h0", "ea1b2c3h1") and plan.bridge_port == ("ha1b2c3h0", "ha1b2c3h1")
    assert plan.addrs == ("10.42.7.1", "10.42.7.2")
    assert [plan.host_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # ranks h*H .. h*H+H-1 on host h
    pairs = netem.plan_network(8, "a1b2c3", subnet, ranks_per_host=2)
    assert pairs.hosts == 4 and [pairs.host_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert pairs.host_ns[3] == "hneta1b2c3-h3" and pairs.addrs[3] == "10.42.7.4"
    one = netem.plan_network(8, "a1b2c3", subnet, ranks_per_host=1)
    assert one == netem.plan_network(8, "a1b2c3", subnet)  # the default: every rank its own host, named r0, r1, ..
    assert one.hosts == 8 and one.host_ns[7] == "hneta1b2c3-r7" and [one.host_of(r) for r in range(8)] == list(range(8))
    with pytest.raises(ValueError, match="rank 8"):
        plan.host_of(8)
    for bad in (3, 0, -2, 16):
        with pytest.raises(ValueError, match="--ranks-per-host"):
            netem.plan_network(8, "a1", subnet, ranks_per_host=bad)


def test_host_addresses_sort_as_text_in_host_order() -> None:
    """torchrun's c10d rendezvous numbers the agents by address text: host h must sort h-th."""
    subnet = ipaddress.ip_network("10.3.4.0/24")
    assert netem.host_addresses(9, subnet) == [f"10.3.4.{i}" for i in range(1, 10)]  # as before: .1, .2, ...
    for n, first in ((10, 10), (90, 10), (91, 100), (155, 100)):
        addrs = netem.host_addresses(n, subnet)
        assert addrs[0] == f"10.3.4.{first}" and len(set(addrs)) == n and sorted(addrs) == addrs
        assert all(ipaddress.ip_address(a) in subnet for a in addrs)
    plan = netem.plan_network(24, "abc", subnet, ranks_per_host=2)
    assert list(plan.addrs) == sorted(plan.addrs) and plan.addrs[0] == "10.3.4.10"
    with pytest.raises(ValueError, match="--ranks 312"):
        netem.plan_network(312, "abc", subnet, ranks_per_host=2)  # 156 hosts


def test_setup_and_shaping_commands_per_host() -> None:
    plan = netem.plan_network(8, "abc", ipaddress.ip_network("10.9.9.0/24"), ranks_per_host=4)
    cmds = netem.setup_commands(plan)
    assert cmds[:3] == [["ip", "netns", "add", ns] for ns in ("hnetabc-h0", "hnetabc-h1", "hnetabc-br")]
    veths = [c for c in cmds if "veth" in c]
    assert veths == [
        ["ip", "-n", "hnetabc-br", "link", "add", f"habch{h}", "type", "veth", "peer", "name", f"eabch{h}", "netns"]
        + [f"hnetabc-h{h}"]
        for h in range(2)
    ]
    assert ["ip", "-n", "hnetabc-h1", "addr", "add", "10.9.9.2/24", "dev", "eabch1"] in cmds
    assert sum(c == ["ip", "-n", f"hnetabc-h{h}", "link", "set", "lo", "up"] for c in cmds for h in range(2)) == 2
    shape = netem.shaping_commands(plan, 1_000_000_000)
    assert [(c[2], c[6]) for c in shape] == [
        ("hnetabc-h0", "eabch0"),
        ("hnetabc-h1", "eabch1"),
        ("hnetabc-br", "habch0"),
        ("hnetabc-br", "habch1"),
    ]  # both ends of each host's link, none per rank
    assert all(c[8:11] == ["tbf", "rate", "1000000000bit"] for c in shape)
    assert len(netem.shaping_commands(plan, None)) == 4


def test_wire_bytes_per_host_link() -> None:
    """Counters of two hosts' bridge ports: per host sent (port rx) and received (port tx), in host order."""
    plan = netem.plan_network(8, "abc", ipaddress.ip_network("10.9.9.0/24"), ranks_per_host=4)

    def stats(sent: list[int], received: list[int]) -> dict:
        ports = [
            {"ifname": port, "stats64": {"rx": {"bytes": s, "packets": 1}, "tx": {"bytes": r, "packets": 1}}}
            for port, s, r in zip(plan.bridge_port, sent, received)
        ]
        lo = {"ifname": "lo", "stats64": {"rx": {"bytes": 9, "packets": 1}, "tx": {"bytes": 9, "packets": 1}}}
        return netem.parse_link_stats(json.dumps([lo, *ports]))

    wire = netem.wire_delta(stats([100, 200], [50, 60]), stats([1100, 700], [560, 1070]), plan.bridge_port)
    assert wire.sent == (1000, 500) and wire.received == (510, 1010) and wire.total == 1500
    marks = {
        "start": netem.Snapshot(0.0, 0.0, stats([0, 0], [0, 0])),
        "end": netem.Snapshot(1.0, 2.0, stats([40, 80], [84, 36])),
    }
    f = e2e_net.loop_figures(marks, plan.bridge_port, steps=4)
    assert f["wire_bytes_per_step_by_host"] == [10.0, 20.0] and f["wire_rx_bytes_per_step_by_host"] == [21.0, 9.0]
    assert f["wire_bytes_per_step"] == 30.0
    assert e2e_net.busiest_link(f) == "0.00 / 0.00" and e2e_net.busiest_link({}) == "-"
    assert e2e_net.busiest_link(
        {"wire_bytes_per_step_by_host": [1e6, 3e6], "wire_rx_bytes_per_step_by_host": [2e6, 1e6]}
    ) == ("3.00 / 2.00")


def test_pick_subnet_avoids_the_hosts_routes() -> None:
    routes = "default via 10.0.0.1 dev eth0\n10.0.0.0/16 dev eth0 proto kernel scope link src 10.0.3.4\n"
    assert str(netem.pick_subnet(routes, 0)) == "10.1.0.0/24"  # 10.0.x.x is taken
    assert str(netem.pick_subnet(routes, 256 * 5 + 9)) == "10.5.9.0/24"
    with pytest.raises(netem.NetemUnavailable):
        netem.pick_subnet("10.0.0.0/8 dev x\n", 3)


def test_setup_commands_build_every_link_inside_the_runs_namespaces() -> None:
    plan = netem.plan_network(2, "abc", ipaddress.ip_network("10.9.9.0/24"))
    cmds = netem.setup_commands(plan)
    assert cmds[:3] == [["ip", "netns", "add", ns] for ns in plan.namespaces]
    # nothing is created in the root namespace: every link/addr command names one of the run's namespaces
    for c in cmds[3:]:
        assert c[:2] == ["ip", "-n"] and c[2] in plan.namespaces
    veths = [c for c in cmds if "veth" in c]
    assert veths == [
        [
            "ip",
            "-n",
            plan.bridge_ns,
            "link",
            "add",
            plan.bridge_port[r],
            "type",
            "veth",
            "peer",
            "name",
            plan.host_eth[r],
            "netns",
            plan.host_ns[r],
        ]
        for r in range(2)
    ]
    assert ["ip", "-n", plan.host_ns[1], "addr", "add", "10.9.9.2/24", "dev", plan.host_eth[1]] in cmds
    assert ["ip", "-n", plan.bridge_ns, "link", "set", plan.bridge_port[0], "master", plan.bridge] in cmds


def test_shaping_commands_both_ends_of_every_link() -> None:
    plan = netem.plan_network(2, "abc", ipaddress.ip_network("10.9.9.0/24"))
    cmds = netem.shaping_commands(plan, 200_000_000)
    assert len(cmds) == 4
    ends = {(c[2], c[6]) for c in cmds}
    assert ends == {
        (plan.host_ns[0], plan.host_eth[0]),
        (plan.host_ns[1], plan.host_eth[1]),
        (plan.bridge_ns, plan.bridge_port[0]),
        (plan.bridge_ns, plan.bridge_port[1]),
    }
    assert cmds[0] == [
        "tc",
        "-n",
        plan.host_ns[0],
        "qdisc",
        "replace",
        "dev",
        plan.host_eth[0],
        "root",
        "tbf",
        "rate",
        "200000000bit",
        "burst",
        str(256 * 1024),
        "latency",
        "100ms",
    ]
    assert netem.tbf_burst_bytes(10_000_000_000) == 2_500_000  # 2 ms at 10 Gbit/s beats the 256 KiB floor
    unshape = netem.shaping_commands(plan, None)
    assert all(c[3:5] == ["qdisc", "del"] and c[-1] == "root" for c in unshape) and len(unshape) == 4


IP_S_J = json.dumps(
    [
        {"ifname": "lo", "stats64": {"rx": {"bytes": 10, "packets": 1}, "tx": {"bytes": 10, "packets": 1}}},
        {"ifname": "habcr0", "stats64": {"rx": {"bytes": 1000, "packets": 5}, "tx": {"bytes": 700, "packets": 4}}},
        {"ifname": "habcr1", "stats": {"rx": {"bytes": 300, "packets": 2}, "tx": {"bytes": 90, "packets": 1}}},
    ]
)


def test_parse_link_stats_and_wire_delta() -> None:
    before = netem.parse_link_stats(IP_S_J)
    assert before["habcr0"] == {"rx_bytes": 1000, "tx_bytes": 700, "rx_packets": 5, "tx_packets": 4}
    assert before["habcr1"]["rx_bytes"] == 300
    after = json.loads(IP_S_J)
    after[1]["stats64"]["rx"]["bytes"] = 5000
    after[2]["stats"]["rx"]["bytes"] = 2300
    after[1]["stats64"]["tx"]["bytes"] = 2700  # host 0 received 2000 bytes, host 1 none
    delta = netem.wire_delta(before, netem.parse_link_stats(json.dumps(after)), ["habcr0", "habcr1"])
    assert delta == netem.WireBytes(sent=(4000, 2000), received=(2000, 0)) and delta.total == 6000
    with pytest.raises(ValueError, match="backwards"):
        netem.wire_delta(netem.parse_link_stats(json.dumps(after)), before, ["habcr0"])
    with pytest.raises(ValueError, match="counters"):
        netem.parse_link_stats(json.dumps([{"ifname": "x"}]))


def test_summary_reports_the_fastest_round_and_medians() -> None:
    rec = {
        "step_ms": 50.0,
        "samples_per_s": 1.0,
        "auc": 0.7,
        "comm_bytes_per_step": 100.0,
        "wire_bytes_per_step": 500.0,
    }
    slow = rec | {"step_ms": 80.0, "auc": 0.6}
    mid = rec | {"step_ms": 60.0, "auc": 0.9}
    s = e2e_net.summarize([slow, rec, mid])
    assert s["best"]["step_ms"] == 50.0 and s["best"]["auc"] == 0.7  # the fastest round's own numbers
    assert s["median"]["step_ms"] == 60.0 and s["median"]["auc"] == 0.7 and s["median"]["wire_bytes_per_step"] == 500
    assert len(s["rounds"]) == 3
    # herald's runs carry the training thread's median wait for its batch; stock runs have none (not a 0)
    waits = e2e_net.summarize([rec | {"input_wait_ms_median": w} for w in (0.5, 0.02, 7.0)])
    assert waits["best"]["input_wait_ms_median"] == 0.5 and waits["median"]["input_wait_ms_median"] == 0.5
    assert "input_wait_ms_median" not in s["best"] and "input_wait_ms_median" not in s["median"]
    # wire bytes per host link: the best round's lists, and the median host by host
    hosts = e2e_net.summarize(
        [
            r | {"wire_bytes_per_step_by_host": [h0, 9.0], "wire_rx_bytes_per_step_by_host": [1.0, h0]}
            for r, h0 in ((slow, 3.0), (rec, 5.0), (mid, 4.0))
        ]
    )
    assert hosts["best"]["wire_bytes_per_step_by_host"] == [5.0, 9.0]
    assert hosts["median"]["wire_bytes_per_step_by_host"] == [4.0, 9.0]
    assert hosts["median"]["wire_rx_bytes_per_step_by_host"] == [1.0, 4.0]
    assert "wire_bytes_per_step_by_host" not in s["best"] and "wire_bytes_per_step_by_host" not in s["median"]


def test_proc_cpu_seconds_parses_user_and_sys() -> None:
    # pid (comm with spaces and a paren) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime
    # stime
    line = "4242 (python (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 1 2 3"
    assert netem.proc_cpu_seconds(line, 100) == pytest.approx(3.0)
    assert netem.cpu_seconds([os.getpid()]) > 0
    assert netem.cpu_seconds([2**22 + 12345]) == 0.0  # no such process


def test_loop_figures_use_the_counters_and_cpu_between_the_marks() -> None:
    stats = netem.parse_link_stats(IP_S_J)
    later = {k: dict(v) for k, v in stats.items()}
    later["habcr0"]["rx_bytes"] += 4000
    later["habcr1"]["rx_bytes"] += 1000
    marks = {"start": netem.Snapshot(10.0, 5.0, stats), "end": netem.Snapshot(12.0, 9.0, later)}
    later["habcr1"]["tx_bytes"] += 3000
    f = e2e_net.loop_figures(marks, ("habcr0", "habcr1"), steps=10)
    assert f == {
        "wire_bytes_per_step": 500.0,
        "wire_bytes_per_step_by_host": [400.0, 100.0],
        "wire_rx_bytes_per_step_by_host": [0.0, 300.0],
        "cpu_s_per_step": 0.4,
        "steady_step_ms": pytest.approx(200.0),
    }
    assert e2e_net.loop_figures({"start": marks["start"]}, ("habcr0",), 10) == {}


def test_run_ranks_snapshots_at_marks_and_stops_the_rest_after_a_failure() -> None:
    import re
    import time

    body = (
        "import time, sys; print('[herald] dcn on x', flush=True); time.sleep(0.5); "
        "print('step     3  loss 1', flush=True); time.sleep(0.5)"
    )
    probes = []
    res = netem.run_ranks(
        [[sys.executable, "-c", body], [sys.executable, "-c", "import time; time.sleep(0.3)"]],
        os.environ,
        ".",
        timeout_s=60,
        marks=e2e_net.loop_marks(0, 3),
        pids=lambda: [os.getpid()],
        probe=lambda: probes.append(1) or len(probes),
    )
    assert res.codes == [0, 0] and set(res.marks) == {"start", "end"}  # the "end" line is followed by evaluation
    assert res.marks["start"].extra == 1 and res.marks["end"].extra == 2
    assert 0.4 < res.marks["end"].t - res.marks["start"].t < 5
    assert res.cpu_s > 0 and "step     3" in res.tails[0]
    end = e2e_net.loop_marks(0, 3)["end"]
    assert re.search(end, "x\nstep      3  loss 0.5  12 samples/s\n", re.M)
    assert not re.search(end, "step    30  loss 1", re.M) and not re.search(end, "step    13  loss 1", re.M)
    assert e2e_net.loop_marks(10, 60)["start"] == e2e_net.STEP_MARK.format(step=10)
    t0 = time.monotonic()
    res = netem.run_ranks(
        [[sys.executable, "-c", "import sys; sys.exit(3)"], [sys.executable, "-c", "import time; time.sleep(120)"]],
        os.environ,
        ".",
        timeout_s=60,
        grace_s=1,
    )
    assert res.codes[0] == 3 and res.codes[1] is not None and res.codes[1] < 0  # killed by a signal
    assert time.monotonic() - t0 < 30


def test_rotated_rounds_start_at_different_configs() -> None:
    configs = list(range(6))
    orders = [e2e_net.rotated(configs, k, 3) for k in range(3)]
    assert [o[0] for o in orders] == [0, 2, 4]
    assert all(sorted(o) == configs for o in orders)


def test_runs_dir_keeps_every_run_dir_else_a_temporary_folder_goes(tmp_path: Path) -> None:
    keep = tmp_path / "runs" / "e2e"
    with e2e_common.runs_folder(keep, "herald-e2e-") as where:
        (Path(where) / "r2-herald").mkdir()
    assert where == str(keep) and (keep / "r2-herald").is_dir()  # kept, created with its parents
    with e2e_common.runs_folder(None, "herald-e2e-") as where:
        assert Path(where).is_dir() and Path(where).name.startswith("herald-e2e-")
    assert not Path(where).exists()


def test_phase_records_of_ranks_sharing_a_line_are_each_read(capsys: pytest.CaptureFixture[str]) -> None:
    tag = e2e_common.PHASE_TIMES_TAG
    one = '{"input.plan": {"ms": 8.0, "cpu_ms": 4.0, "calls": 2}}'
    two = '{"input.plan": {"ms": 6.0, "calls": 2}}'
    output = "\n".join(
        [
            f"{tag} rank=1 {one}{tag} rank=5 {two}",  # two ranks' records run together (no newline between)
            f"[default2]:{tag} rank=2 {one}",  # an agent's prefix
            f'{tag} rank=3 {{"input.plan": {{"ms"',  # cut short: left out, with a note
            "another line",
        ]
    )
    got = dict(e2e_common.phase_records(output))
    assert sorted(got) == ["1", "2", "5"]
    assert got["1"]["input.plan"]["cpu_ms"] == 4.0 and got["5"]["input.plan"]["ms"] == 6.0
    assert "rank=3 is cut short" in capsys.readouterr().err


def test_host_commands_are_multi_node_torchrun_inside_each_namespace(tmp_path: Path) -> None:
    class FakeNet:
        plan = netem.plan_network(2, "abc", ipaddress.ip_network("10.9.9.0/24"))

        def exec_prefix(self, r: int) -> list[str]:
            return ["ip", "netns", "exec", self.plan.host_ns[r]]

    args = argparse.Namespace(
        batch=64, locality=0.5, cache_ratio=0.1, extra=[], phase_times=False, warmup_steps=2, host_cpus="shared"
    )
    cmds = e2e_net.host_commands(FakeNet(), "torchrec_planner", e2e.WORKLOADS["wdl64"], 7, tmp_path, args, "rid")
    for r, c in enumerate(cmds):
        assert c[:4] == ["ip", "netns", "exec", FakeNet.plan.host_ns[r]]
        assert f"GLOO_SOCKET_IFNAME={FakeNet.plan.host_eth[r]}" in c
        flags = dict(
            zip(
                c[c.index("torch.distributed.run") + 1 : c.index("train.py") : 2],
                c[c.index("torch.distributed.run") + 2 : c.index("train.py") : 2],
            )
        )
        assert flags["--nnodes"] == "2" and flags["--node_rank"] == str(r) and flags["--nproc_per_node"] == "1"
        assert (
            flags["--rdzv-endpoint"] == f"10.9.9.1:{e2e_net.RDZV_PORT}"
            and flags["--local-addr"] == FakeNet.plan.addrs[r]
        )
        assert flags["--rdzv-conf"] == f"is_host={int(r == 0)}"
        tail = c[c.index("train.py") + 1 :]
        assert {
            "scheduler=torchrec",
            "sharding.types=null",
            "model=wdl",
            "model.embedding_dim=64",
            "model.deep_layers=[64,32]",
            "trainer.steps=7",
            "trainer.batch_size=64",
            "trainer.log_interval=1",
        } <= set(tail)  # gcd(2, 7): the log lines of steps 2 and 7 are the marks
        assert "taskset" not in c  # shared: every emulated host may use every core
    if len(os.sched_getaffinity(0)) >= 2:  # split: each host its own block of cores, disjoint
        args.host_cpus = "split"
        cmds = e2e_net.host_commands(FakeNet(), "herald", e2e.WORKLOADS["wdl64"], 7, tmp_path, args, "rid")
        blocks = [c[c.index("taskset") + 2] for c in cmds]
        assert all(c[4:6] == ["taskset", "-c"] for c in cmds)
        cores = [set(map(int, b.split(","))) for b in blocks]
        assert not cores[0] & cores[1] and cores[0] | cores[1] <= os.sched_getaffinity(0)
    assert e2e_net.host_cpus("shared", 2) is None


def test_host_commands_run_one_agent_per_host_with_its_ranks(tmp_path: Path) -> None:
    """8 ranks as 2 hosts of 4: two torchrun agents, each with --nproc_per_node 4 and node rank = host index (so its
    workers get LOCAL_WORLD_SIZE=4 and GROUP_RANK=host); with --host-cpus split each host gets a block of cores."""

    class FakeNet:
        plan = netem.plan_network(8, "abc", ipaddress.ip_network("10.9.9.0/24"), ranks_per_host=4)

        def exec_prefix(self, h: int) -> list[str]:
            return ["ip", "netns", "exec", self.plan.host_ns[h]]

    args = argparse.Namespace(
        batch=64, locality=0.5, cache_ratio=0.1, extra=[], phase_times=False, warmup_steps=5, host_cpus="shared"
    )
    cmds = e2e_net.host_commands(FakeNet(), "herald", e2e.WORKLOADS["wdl64"], 30, tmp_path, args, "rid")
    assert len(cmds) == 2
    for h, c in enumerate(cmds):
        assert c[:4] == ["ip", "netns", "exec", f"hnetabc-h{h}"] and f"GLOO_SOCKET_IFNAME=eabch{h}" in c
        run = c.index("torch.distributed.run")
        flags = dict(zip(c[run + 1 : c.index("train.py") : 2], c[run + 2 : c.index("train.py") : 2]))
        assert flags["--nnodes"] == "2" and flags["--node_rank"] == str(h) and flags["--nproc_per_node"] == "4"
        assert (
            flags["--rdzv-endpoint"] == f"10.9.9.1:{e2e_net.RDZV_PORT}" and flags["--local-addr"] == f"10.9.9.{h + 1}"
        )
        assert flags["--rdzv-conf"] == f"is_host={int(h == 0)}"
    args.host_cpus = "split"
    cmds = e2e_net.host_commands(FakeNet(), "herald", e2e.WORKLOADS["wdl64"], 30, tmp_path, args, "rid")
    blocks = [set(map(int, c[c.index("taskset") + 2].split(","))) for c in cmds]
    assert blocks == [set(b) for b in e2e_net.host_cpus("split", 2)]  # a block per host, not per rank
    if len(os.sched_getaffinity(0)) >= 2:
        assert not blocks[0] & blocks[1]


def test_ranks_per_host_must_divide_the_ranks_and_needs_network_mode(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    args = argparse.Namespace(
        bandwidth="none", workload="dcn", model="dcn", rounds=1, steps=20, warmup_steps=5, ranks_per_host=4
    )
    monkeypatch.setattr(netem, "check_prerequisites", lambda: pytest.fail("checked the machine before the options"))
    with pytest.raises(ValueError, match="--ranks-per-host .* 4 for \\[6\\]"):
        e2e_net.main_net(args, [8, 6], ["herald"])
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--ranks", "8", "--ranks-per-host", "4", "--steps", "20"])
    with pytest.raises(SystemExit, match="--ranks-per-host need --bandwidth"):
        e2e.main()
    assert e2e_net.ranks_per_host(argparse.Namespace()) == 1  # benchmarks/compare.py's options lack it


def test_compare_py_options_launch_one_rank_per_host_on_shared_cores(tmp_path: Path) -> None:
    """benchmarks/compare.py passes its own options to main_net: no --ranks-per-host, no --host-cpus."""

    class FakeNet:
        plan = netem.plan_network(2, "abc", ipaddress.ip_network("10.9.9.0/24"))

        def exec_prefix(self, h: int) -> list[str]:
            return ["ip", "netns", "exec", self.plan.host_ns[h]]

    args = argparse.Namespace(batch=64, locality=0.5, cache_ratio=0.1, extra=[], phase_times=False, warmup_steps=2)
    cmds = e2e_net.host_commands(FakeNet(), "herald", e2e.WORKLOADS["dcn"], 4, tmp_path, args, "rid")
    assert len(cmds) == 2 and not any("taskset" in c for c in cmds)
    assert all(c[c.index("--nproc_per_node") + 1] == "1" for c in cmds)


def test_without_root_the_benchmark_says_so_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)  # as a normal user, whoever runs the test
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--bandwidth", "none", "--steps", "20"])
    with pytest.raises(SystemExit) as exit_info:
        e2e.main()
    assert exit_info.value.code == 2
    assert "needs root" in capsys.readouterr().err


def test_missing_iproute2_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netem.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netem.shutil, "which", lambda name: None if name == "tc" else "/usr/sbin/ip")
    with pytest.raises(netem.NetemUnavailable, match="iproute2.*tc"):
        netem.check_prerequisites()


def test_bad_bandwidth_is_rejected_before_anything_runs() -> None:
    p = subprocess.run(
        [sys.executable, str(BENCH / "e2e.py"), "--bandwidth", "fast", "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "--bandwidth" in p.stderr and "fast" in p.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root and iproute2")
def test_network_is_built_shaped_and_removed() -> None:
    with netem.Network(2) as net:
        plan = net.plan
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(ns in names for ns in plan.namespaces)
        net.shape(200_000_000)
        q = subprocess.run(
            ["tc", "-n", plan.host_ns[0], "qdisc", "show", "dev", plan.host_eth[0]], capture_output=True, text=True
        ).stdout
        assert "tbf" in q and "200Mbit" in q
        before = net.counters()
        send = (
            "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            f"[s.sendto(bytes(1000), ('{plan.addrs[1]}', 9)) for _ in range(50)]"
        )
        subprocess.run([*net.exec_prefix(0), sys.executable, "-c", send], check=True, timeout=60)
        wire = netem.wire_delta(before, net.counters(), plan.bridge_port)
        assert wire.sent[0] >= 50 * 1000 and wire.total >= wire.sent[0]  # UDP payloads + headers + ARP
        assert wire.received[1] >= 50 * 1000
        net.shape(None)
        q = subprocess.run(
            ["tc", "-n", plan.host_ns[0], "qdisc", "show", "dev", plan.host_eth[0]], capture_output=True, text=True
        ).stdout
        assert "tbf" not in q
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in names for ns in plan.namespaces)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root and iproute2")
def test_ranks_of_one_host_talk_off_the_wire() -> None:
    """4 ranks as 2 hosts of 2: traffic inside a host's namespace (to its own address) stays off its shaped link,
    traffic to the other host is counted on both host links (sent by one, received by the other)."""
    with netem.Network(4, ranks_per_host=2) as net:
        plan = net.plan
        assert len(plan.namespaces) == 3 and plan.host_ns[0].endswith("-h0")
        net.shape(200_000_000)

        def send(to: str) -> netem.WireBytes:
            body = (
                "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                f"[s.sendto(bytes(1000), ('{to}', 9)) for _ in range(200)]"
            )
            before = net.counters()
            subprocess.run([*net.exec_prefix(0), sys.executable, "-c", body], check=True, timeout=60)
            return netem.wire_delta(before, net.counters(), plan.bridge_port)

        inside = send(plan.addrs[0])
        assert inside.total < 5_000  # at most an odd broadcast: 200 kB went over host 0's loopback
        across = send(plan.addrs[1])
        assert across.sent[0] >= 200 * 1000 and across.received[1] >= 200 * 1000


def _fake_result() -> dict:
    def cfg(step_ms: float, app: float) -> dict:
        best = {
            "step_ms": step_ms + 5,
            "steady_step_ms": step_ms,
            "samples_per_s": 512e3 / step_ms,
            "auc": 0.7,
            "comm_bytes_per_step": app,
            "wire_bytes_per_step": 3 * app,
            "wire_bytes_per_step_raw": 4 * app,
            "cpu_s_per_step": 0.05,
            "cpu_s_per_step_raw": 0.3,
        }
        if app < 1e6:  # herald's runs measured their threads and the wire per host link
            best |= {"cpu_ms_per_step_training": 30.0, "cpu_ms_per_step_input": 12.5, "cpu_ms_per_step_other": 7.5}
            best |= {"wire_bytes_per_step_by_host": [1.2e6, 0.6e6], "wire_rx_bytes_per_step_by_host": [0.9e6, 0.9e6]}
        return {"best": best, "median": best, "rounds": [best]}

    runs = {
        w: {
            b: {
                "2": {
                    "torchrec_tw": cfg(40.0 * k, 3e6),
                    "torchrec_planner": cfg(50.0 * k, 3e6),
                    "herald": cfg(60.0 * k / (k * k), 0.6e6),
                }
            }
            for k, b in ((1, "none"), (3, "200mbit"))
        }
        for w in ("wdl64", "dcn")
    }
    return {
        "config": {
            "bandwidth": ["none", "200mbit"],
            "ranks": [2],
            "schedulers": ["torchrec_tw", "torchrec_planner", "herald"],
            "cores": 4,
        },
        "runs": runs,
    }


def test_ratios_and_markdown_table_compare_with_the_best_stock_config() -> None:
    result = _fake_result()
    r = e2e_net.ratios(result["runs"])
    assert r["dcn"]["none"]["2"]["best_stock"] == "torchrec_tw"
    assert r["dcn"]["none"]["2"]["herald_vs_best_stock_step_time"] == pytest.approx(60 / 40)
    assert r["dcn"]["200mbit"]["2"]["herald_vs_best_stock_step_time"] == pytest.approx(20 / 120)
    assert r["wdl64"]["none"]["2"]["herald_vs_best_stock_app_bytes"] == pytest.approx(0.2)
    table = e2e_net.markdown_table(result).splitlines()
    assert len(table) == 2 + 2 * 2 * 3
    assert "CPU floor ms (CPU / 4 cores)" in table[0]  # the step time if the run's CPU kept every core busy
    assert (
        "| dcn | 200mbit | 2 | herald | 25.0 | 20.0 | 0.17x | 0.60 | 1.80 | 1.20 / 0.90 | 0.7000 | 0.050 | 12.5 | "
        "30.0 / 12.5 / 7.5 |" in table
    )  # the busiest host link: 1.2 MB sent, 0.9 MB received per step
    assert (
        "| dcn | 200mbit | 2 | torchrec_tw | 125.0 | 120.0 | 1.00x | 3.00 | 9.00 | - | 0.7000 | 0.050 | 12.5 | - |"
        in table
    )
    result["config"]["ranks_per_host"] = 2  # 2 ranks on one emulated host
    assert "| dcn | 200mbit | 2 (2/host) | torchrec_tw | 125.0 |" in e2e_net.markdown_table(result)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "sub" / "e2e_net.png"
    e2e_net.plot(_fake_result(), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.parent.glob(".*"))  # the temporary file was renamed


def _our_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(netem.PREFIX)}


NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root and iproute2")


@pytest.mark.slow
@NEEDS_ROOT
def test_e2e_network_mode_runs_multi_node_and_cleans_up(tmp_path: Path) -> None:
    before = _our_namespaces()
    out = tmp_path / "net.json"
    p = subprocess.run(
        [
            sys.executable,
            str(BENCH / "e2e.py"),
            "--bandwidth",
            "200mbit",
            "--ranks",
            "2",
            "--workload",
            "dcn",
            "--schedulers",
            "torchrec_tw",
            "--steps",
            "4",
            "--warmup-steps",
            "2",
            "--batch",
            "64",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    best = json.loads(out.read_text())["runs"]["dcn"]["200mbit"]["2"]["torchrec_tw"]["best"]
    assert best["comm_bytes_per_step"] > 0 and best["cpu_s_per_step_raw"] > 0 and best["cpu_s_per_step"] > 0
    assert best["wire_bytes_per_step"] > 0.5 * best["comm_bytes_per_step"]  # app bytes cross the wire (plus DDP's)
    assert best["steady_step_ms"] > 0
    assert 0.0 <= best["auc"] <= 1.0
    assert _our_namespaces() == before


@pytest.mark.slow
@NEEDS_ROOT
def test_ctrl_c_removes_the_network(tmp_path: Path) -> None:
    import signal
    import time

    before = _our_namespaces()
    p = subprocess.Popen(
        [
            sys.executable,
            str(BENCH / "e2e.py"),
            "--bandwidth",
            "none",
            "--ranks",
            "2",
            "--workload",
            "dcn",
            "--schedulers",
            "torchrec_tw",
            "--steps",
            "50",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(_our_namespaces() - before) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_our_namespaces() - before) == 3, "the network was not built"
        time.sleep(3)  # the ranks are starting inside it
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0
    assert _our_namespaces() == before


def test_sweep_runs_rounds_in_rotating_order_saves_as_it_goes_and_survives_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class FakeNetwork:
        def __init__(self, ranks: int, ranks_per_host: int = 1) -> None:
            built.append((ranks, ranks_per_host))
            self.plan = netem.plan_network(ranks, "abc", ipaddress.ip_network("10.9.9.0/24"), ranks_per_host)

        def __enter__(self) -> "FakeNetwork":
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    calls = []
    built: list[tuple[int, int]] = []

    def fake_run(net, workload, bandwidth, scheduler, steps, args, tmp, tag):  # noqa: ANN001, ANN202
        calls.append((workload, bandwidth, scheduler))
        if scheduler == "static" and bandwidth == "200mbit":
            raise RuntimeError("rank 1 died")
        step = {"none": 10.0, "200mbit": 30.0}[bandwidth] * (2 if scheduler == "herald" else 1) + len(calls) / 100
        return {
            "step_ms": step + 1,
            "steady_step_ms": step,
            "samples_per_s": 1.0,
            "auc": 0.7,
            "comm_bytes_per_step": 100.0,
            "wire_bytes_per_step": 150.0,
            "wire_bytes_per_step_raw": 200.0,
        }

    monkeypatch.setattr(netem, "Network", FakeNetwork)
    monkeypatch.setattr(netem, "check_prerequisites", lambda: None)
    monkeypatch.setattr(netem, "leftover_namespaces", lambda: [])
    monkeypatch.setattr(e2e_net, "run_config", fake_run)
    saved = []
    args = argparse.Namespace(
        bandwidth="none,200mbit",
        workload="dcn",
        model="dcn",
        rounds=3,
        steps=20,
        host_cpus="shared",
        warmup_steps=5,
        out=None,
        plot=None,
    )
    result = e2e_net.main_net(args, [2], ["torchrec_tw", "static", "herald"], save=saved.append)
    assert len(calls) == 3 * 6 and len(saved) == 18
    assert calls[0] != calls[6] != calls[12]  # each round starts elsewhere
    assert len(result["failures"]) == 3 and result["failures"][0]["error"] == "rank 1 died"
    assert "static" not in result["runs"]["dcn"]["200mbit"]["2"] and "static" in result["runs"]["dcn"]["none"]["2"]
    herald = result["runs"]["dcn"]["none"]["2"]["herald"]
    assert len(herald["rounds"]) == 3 and herald["best"]["steady_step_ms"] == min(
        r["steady_step_ms"] for r in herald["rounds"]
    )
    assert result["ratios"]["dcn"]["200mbit"]["2"]["herald_vs_best_stock_step_time"] == pytest.approx(2.0, rel=0.02)
    assert len(saved[0]["runs"]["dcn"]) == 1  # the first save holds one run
    assert result["config"]["ranks_per_host"] == 1 and built == [(2, 1)]
    args.ranks_per_host, args.rounds, args.bandwidth = 4, 1, "none"
    result = e2e_net.main_net(args, [8], ["torchrec_tw"])
    assert built[-1] == (8, 4) and result["config"]["ranks_per_host"] == 4  # one network of 2 hosts x 4 ranks
    assert "| dcn | none | 8 (4/host) | " in e2e_net.pivot_table(result)


def test_workloads_name_their_overrides_and_bad_ones_are_rejected() -> None:
    assert e2e.workload_args("wdl64") == ["model=wdl", "model.embedding_dim=64", "model.deep_layers=[64,32]"]
    assert e2e.workload_args("deepfm") == ["model=deepfm"]  # any model of conf/model
    with pytest.raises(ValueError, match="--workload"):
        e2e.workload_args("gpt")


def test_pivot_table_has_one_row_per_workload_and_link() -> None:
    table = e2e_net.pivot_table(_fake_result()).splitlines()
    assert len(table) == 2 + 2 * 2
    assert table[0].startswith("| workload | link | R | torchrec_tw ms | torchrec_planner ms | herald ms |")
    assert (
        "| dcn | 200mbit | 2 | 120.0 | 150.0 | 20.0 | 0.17x | 3.00 (9.00), 3.00 (9.00), 0.60 (1.80) |" in table
    )  # one round


def test_round_ratios_pair_the_runs_of_each_round() -> None:
    """A machine that slows down during the run: best against best pairs stock's fast first round with herald's
    slower later one; round by round each ratio compares runs minutes apart."""

    def cfg(steps: list[float], rounds: list[int] | None = None) -> dict:
        recs = [
            {"steady_step_ms": t, "step_ms": t, "comm_bytes_per_step": 1e6, "wire_bytes_per_step": 2e6}
            | ({} if rounds is None else {"round": k})
            for t, k in zip(steps, rounds or range(len(steps)))
        ]
        return {"best": min(recs, key=e2e_net.step_of), "median": recs[0], "rounds": recs}

    per_s = {
        "torchrec_tw": cfg([20.0, 22.0, 24.0]),
        "torchrec_planner": cfg([25.0, 21.0, 26.0]),
        "herald": cfg([21.0, 22.0, 24.0]),
    }
    assert e2e_net.round_ratios(per_s, "herald") == pytest.approx([21 / 20, 22 / 21, 24 / 24])
    row = e2e_net.ratios({"dcn": {"none": {"2": per_s}}})["dcn"]["none"]["2"]
    assert row["herald_vs_best_stock_step_time"] == pytest.approx(21 / 20)
    assert row["herald_vs_best_stock_median_round"] == pytest.approx(22 / 21)
    # a round that failed for herald drops out; numbered rounds pair by number, not by position
    per_s["herald"] = cfg([22.0, 24.0], rounds=[1, 2])
    assert e2e_net.round_ratios(per_s, "herald") == pytest.approx([22 / 21, 1.0])
    table = e2e_net.pivot_table({"config": {"schedulers": list(per_s)}, "runs": {"dcn": {"none": {"2": per_s}}}})
    assert "| 1.10x (1.05, 1.00) |" in table


def test_breakeven_names_the_crossover_with_a_tie_band() -> None:
    def cfg(step_ms: float) -> dict:
        best = {"steady_step_ms": step_ms, "step_ms": step_ms}
        return {"best": best, "median": best, "rounds": [best]}

    def runs(herald: dict[str, float]) -> dict:
        stock = {"none": 40.0, "2gbit": 40.0, "1gbit": 60.0, "200mbit": 150.0}
        return {
            "wdl64": {
                b: {"2": {"torchrec_tw": cfg(stock[b]), "torchrec_planner": cfg(stock[b] + 5), "herald": cfg(h)}}
                for b, h in herald.items()
            }
        }

    got = e2e_net.breakeven(runs({"none": 46.0, "1gbit": 45.0, "200mbit": 55.0, "2gbit": 44.0}))["wdl64"]["2"]
    assert got["verdict"] == "wins at <= 1gbit, not at >= 2gbit"  # links ordered by rate, not as given
    assert got["links"]["2gbit"]["status"] == "loss" and got["links"]["200mbit"]["ratio"] == pytest.approx(55 / 150)
    even = e2e_net.breakeven(runs({"none": 46.0, "200mbit": 151.0}))["wdl64"]["2"]
    assert even["links"]["200mbit"]["status"] == "even"  # within 2 % of stock: not a win
    assert even["verdict"] == "no win at any link tested (down to 200mbit)"
    assert (
        e2e_net.breakeven(runs({"none": 30.0, "200mbit": 60.0}))["wdl64"]["2"]["verdict"]
        == "wins at every link tested (up to none)"
    )
    assert e2e_net.breakeven(runs({"none": 30.0, "1gbit": 70.0, "200mbit": 60.0}))["wdl64"]["2"]["verdict"] == "mixed"
    assert "herald vs best stock, wdl64, R=2: mixed" in e2e_net.breakeven_lines(
        {"runs": runs({"none": 30.0, "1gbit": 70.0, "200mbit": 60.0})}
    )


def test_thread_cpu_split_names_the_input_thread() -> None:
    """The benchmark's CPU split by thread: this process's main thread counts as `training`, a thread that names
    itself like Herald's input stage as `input`; the split adds up to the process's CPU."""
    import threading
    import time

    from herald_torchrec.distributed.train_pipeline.input_thread import OS_THREAD_NAME, name_os_thread

    assert OS_THREAD_NAME == netem.INPUT_THREAD
    spin_s = 0.3
    ready, done = threading.Event(), threading.Event()

    def spin() -> None:
        name_os_thread(OS_THREAD_NAME)
        ready.set()
        end = time.thread_time() + spin_s
        while time.thread_time() < end:
            pass
        done.wait()  # alive until the snapshot: a finished thread leaves /proc

    before = netem.thread_cpu_seconds([os.getpid()])
    t = threading.Thread(target=spin)
    t.start()
    ready.wait()
    end = time.thread_time() + 0.1
    while time.thread_time() < end:
        pass
    time.sleep(spin_s)
    after = netem.thread_cpu_seconds([os.getpid()])
    done.set()
    t.join()
    d = netem.thread_cpu_delta(before, after)
    assert set(d) == set(netem.THREAD_KINDS)
    assert d["input"] >= 0.9 * spin_s  # a thread started between the readings counts all its CPU
    assert d["training"] >= 0.09
    assert all(v >= 0 for v in d.values())
    gone = {k: v for k, v in after.items() if v[0] != "input"}  # the input thread ended before a third reading
    assert netem.thread_cpu_delta(after, gone)["input"] == 0.0
    assert not netem._is_launcher(os.getpid())
    assert netem.thread_cpu_seconds([2**22 + 12345]) == {}  # no such process
