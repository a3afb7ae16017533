"""An emulated cluster on one machine: one network namespace per host, linked by veths into a bridge, shaped with tc.

Why: gloo over an unshaped loopback moves bytes almost for free, so a scheme that sends fewer bytes only shows it in
time when every host sits behind a link of a real rate. Each host holds `ranks_per_host` ranks (H; ranks h*H ..
h*H+H-1 on host h, as torchrun numbers them): those talk over the namespace's loopback, the hosts over the bridge.

    ns <run>-r0 [eth <addr0>] --veth-- [port0] \\
    ns <run>-r1 [eth <addr1>] --veth-- [port1] --- bridge, in a namespace <run>-br of its own
    ...

(with H > 1 the host namespaces are named <run>-h0, <run>-h1, ...; with H = 1 every rank is its own host.)
Shaping (`tc qdisc ... tbf`) sits on both ends of each host's veth: the host's end limits what it sends, the bridge's
end what it receives, so every host has a full-duplex link of the given rate. "none" is the same topology unshaped.

Everything the run creates lives in namespaces it made (nothing is added to the root namespace), so deleting those
namespaces removes every veth and the bridge with them; `Network` does that in `__exit__` (normal exit, exceptions,
Ctrl-C). The bytes really on the wire are read from the bridge-side veth counters (`ip -s -j link`): what a host sends
is what its bridge port receives, Ethernet/IP/TCP headers included; traffic between the ranks of one host never
reaches them.

The pure parts (name and address planning, rate parsing, tc command lines, counter parsing) need no root and are
unit-tested in tests/benchmarks/test_netem.py.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

PREFIX = "hnet"  # every namespace this module creates starts with it (and the run id)
IFNAME_MAX = 15  # Linux IFNAMSIZ - 1
TBF_MIN_BURST = 256 * 1024  # bytes; must exceed a veth's largest (GSO) packet of 64 KiB, or tbf drops it
TBF_LATENCY_MS = 100  # queueing a packet may wait before tbf drops it
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)?bit$")
_UNITS = {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}


class NetemUnavailable(RuntimeError):
    """This machine cannot build the emulated network (not root, no iproute2, or no network namespaces)."""


def parse_rate(text: str) -> int | None:
    """A tc-style rate ("1gbit", "200mbit", "500kbit") in bits per second; "none" -> None (unshaped)."""
    t = text.strip().lower()
    if t == "none":
        return None
    m = _RATE.match(t)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--bandwidth entries must be 'none' or a rate like 1gbit / 200mbit / 500kbit, got '{text}'")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def parse_bandwidths(text: str) -> list[str]:
    """The comma list of --bandwidth, validated, in the given order, without repeats."""
    items = [b.strip().lower() for b in text.split(",") if b.strip()]
    if not items:
        raise ValueError("--bandwidth needs at least one entry (none, 1gbit, 200mbit, ...)")
    for b in items:
        parse_rate(b)
    return list(dict.fromkeys(items))


@dataclass(frozen=True)
class NetPlan:
    """Names and addresses of one emulated cluster; the `host_*` lists and `addrs` are indexed by host."""

    run_id: str
    bridge_ns: str
    bridge: str
    ranks_per_host: int
    host_ns: tuple[str, ...]
    host_eth: tuple[str, ...]  # the host's end of its veth (inside host_ns): GLOO_SOCKET_IFNAME of its ranks
    bridge_port: tuple[str, ...]  # the bridge's end of that veth (inside bridge_ns): where the wire counters are read
    addrs: tuple[str, ...]
    prefixlen: int

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (*self.host_ns, self.bridge_ns)

    @property
    def hosts(self) -> int:
        return len(self.host_ns)

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    def host_of(self, rank: int) -> int:
        """The host a global rank runs on (torchrun: global rank = group rank * local world size + local rank)."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is not in 0..{self.ranks - 1}")
        return rank // self.ranks_per_host


def new_run_id() -> str:
    """Six hex digits: short enough for 15-character interface names, random enough for concurrent runs."""
    return secrets.token_hex(3)


def pick_subnet(routes_text: str, token: int) -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that overlaps none of the root namespace's routes (`ip -4 route show` text).

    The ranks' addresses live only inside the run's namespaces, so a clash could not misroute anything; avoiding the
    host's own subnets anyway keeps the addresses unambiguous in logs. `token` picks the starting candidate.
    """
    used = [ipaddress.ip_network(w, strict=False) for w in re.findall(r"\b\d+\.\d+\.\d+\.\d+/\d+\b", routes_text)]
    for k in range(256 * 256):
        i = (token + k) % (256 * 256)
        cand = ipaddress.ip_network(f"10.{i // 256}.{i % 256}.0/24")
        if not any(cand.overlaps(u) for u in used):
            return cand
    raise NetemUnavailable("no free 10.x.y.0/24 subnet for the emulated network")


def host_addresses(hosts: int, subnet: ipaddress.IPv4Network) -> list[str]:
    """`hosts` addresses of `subnet` whose text sorts in host order: .1-.9 for up to 9 hosts, else .10-.99 or
    .100-.254 (all with the same number of digits).

    Why: torchrun's c10d rendezvous numbers its agents (GROUP_RANK, hence the global ranks) by their address *as
    text*, so "10.0.0.10" would come before "10.0.0.2" and host h would not run ranks h*H..h*H+H-1.
    """
    usable = list(subnet.hosts())
    base = int(subnet.network_address)
    for first in (1, 10, 100):
        last = first + hosts - 1
        if len(str(last)) == len(str(first)) and last <= len(usable):
            return [str(ipaddress.ip_address(base + first + h)) for h in range(hosts)]
    raise ValueError(f"{hosts} hosts do not fit the subnet {subnet} ({len(usable)} addresses)")


def plan_network(ranks: int, run_id: str, subnet: ipaddress.IPv4Network, ranks_per_host: int = 1) -> NetPlan:
    """Namespace, interface and address names for `ranks` ranks, `ranks_per_host` of them per host (one namespace
    and one link each); hosts get addresses of `subnet` that sort in host order (`host_addresses`)."""
    if ranks < 1:
        raise ValueError(f"--ranks must be >= 1, got {ranks}")
    if ranks_per_host < 1 or ranks % ranks_per_host:
        raise ValueError(f"--ranks-per-host must be >= 1 and divide --ranks {ranks}, got {ranks_per_host}")
    if not re.fullmatch(r"[0-9a-z]{1,8}", run_id):
        raise ValueError(f"run id must be 1-8 lowercase letters or digits, got '{run_id}'")
    hosts = ranks // ranks_per_host
    try:
        addrs = host_addresses(hosts, subnet)
    except ValueError:
        raise ValueError(f"--ranks {ranks} ({hosts} hosts) does not fit the subnet {subnet}") from None
    base = f"{PREFIX}{run_id}"
    tag = "r" if ranks_per_host == 1 else "h"  # every rank its own host, or hosts of several ranks
    host_eth = tuple(f"e{run_id}{tag}{h}" for h in range(hosts))
    bridge_port = tuple(f"h{run_id}{tag}{h}" for h in range(hosts))
    bridge = f"b{run_id}"
    for name in (*host_eth, *bridge_port, bridge):
        if len(name) > IFNAME_MAX:
            raise ValueError(f"interface name '{name}' is longer than {IFNAME_MAX} characters (shorter run id)")
    return NetPlan(
        run_id=run_id,
        bridge_ns=f"{base}-br",
        bridge=bridge,
        ranks_per_host=ranks_per_host,
        host_ns=tuple(f"{base}-{tag}{h}" for h in range(hosts)),
        host_eth=host_eth,
        bridge_port=bridge_port,
        addrs=tuple(addrs),
        prefixlen=subnet.prefixlen,
    )


def setup_commands(plan: NetPlan) -> list[list[str]]:
    """The `ip` command lines that build the topology (unshaped), in order."""
    b = plan.bridge_ns
    cmds = [["ip", "netns", "add", ns] for ns in plan.namespaces]
    cmds += [
        ["ip", "-n", b, "link", "add", plan.bridge, "type", "bridge"],
        ["ip", "-n", b, "link", "set", plan.bridge, "up"],
    ]
    for ns, eth, port, addr in zip(plan.host_ns, plan.host_eth, plan.bridge_port, plan.addrs):
        cmds += [
            ["ip", "-n", b, "link", "add", port, "type", "veth", "peer", "name", eth, "netns", ns],
            ["ip", "-n", b, "link", "set", port, "master", plan.bridge],
            ["ip", "-n", b, "link", "set", port, "up"],
            ["ip", "-n", ns, "addr", "add", f"{addr}/{plan.prefixlen}", "dev", eth],
            ["ip", "-n", ns, "link", "set", eth, "up"],
            # torchrun's agent talks to its workers over localhost, and a host's ranks to each other (the kernel
            # routes traffic to the namespace's own address over lo, so it never reaches the shaped veth)
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]
    return cmds


def tbf_burst_bytes(rate_bps: int) -> int:
    """tbf bucket: at least 256 KiB (a GSO packet must fit) and at least 2 ms of traffic at the rate."""
    return max(TBF_MIN_BURST, int(rate_bps / 8 * 0.002))


def shaping_commands(plan: NetPlan, rate_bps: int | None) -> list[list[str]]:
    """tc command lines that put both ends of every host's veth at `rate_bps` (None: remove shaping).

    `replace` and `del` make the commands idempotent, so one topology serves every bandwidth of a sweep. Removing a
    root qdisc that is not there fails harmlessly; callers run those with check=False.
    """
    ends = [(ns, i) for ns, i in zip(plan.host_ns, plan.host_eth)] + [(plan.bridge_ns, i) for i in plan.bridge_port]
    if rate_bps is None:
        return [["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"] for ns, dev in ends]
    shape = ["tbf", "rate", f"{rate_bps}bit", "burst", str(tbf_burst_bytes(rate_bps)), "latency", f"{TBF_LATENCY_MS}ms"]
    return [["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *shape] for ns, dev in ends]


def parse_link_stats(json_text: str) -> dict[str, dict[str, int]]:
    """`ip -s -j link show` output -> {ifname: {"rx_bytes", "tx_bytes", "rx_packets", "tx_packets"}}."""
    out: dict[str, dict[str, int]] = {}
    for link in json.loads(json_text or "[]"):
        stats = link.get("stats64") or link.get("stats")
        if not stats:
            raise ValueError(f"no counters for {link.get('ifname')} (use `ip -s -j link show`)")
        out[link["ifname"]] = {
            "rx_bytes": int(stats["rx"]["bytes"]),
            "tx_bytes": int(stats["tx"]["bytes"]),
            "rx_packets": int(stats["rx"]["packets"]),
            "tx_packets": int(stats["tx"]["packets"]),
        }
    return out


@dataclass(frozen=True)
class WireBytes:
    """Bytes on the host links between two counter reads, by host: `sent` onto its link, `received` from it."""

    sent: tuple[int, ...]
    received: tuple[int, ...]

    @property
    def total(self) -> int:
        """Every byte the hosts put on the wire (each crosses the bridge once: what one sends, another receives)."""
        return sum(self.sent)


def wire_delta(
    before: Mapping[str, Mapping[str, int]], after: Mapping[str, Mapping[str, int]], bridge_port: Sequence[str]
) -> WireBytes:
    """Bytes the hosts put on and took off the wire between two counter reads, per host (by bridge port).

    A host's sends are its bridge port's receives (`rx_bytes`), and what it receives its port's sends (`tx_bytes`:
    the bridge also floods the odd broadcast, such as ARP, to every port).
    """
    sent = tuple(after[i]["rx_bytes"] - before[i]["rx_bytes"] for i in bridge_port)
    received = tuple(after[i]["tx_bytes"] - before[i]["tx_bytes"] for i in bridge_port)
    if any(p < 0 for p in (*sent, *received)):
        raise ValueError(f"interface counters went backwards: sent {sent}, received {received}")
    return WireBytes(sent, received)


def check_prerequisites() -> None:
    """Raise NetemUnavailable with the reason if this process cannot create namespaces, veths and qdiscs."""
    if os.geteuid() != 0:
        raise NetemUnavailable("the emulated network needs root (network namespaces, veth, tc)")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise NetemUnavailable(f"the emulated network needs iproute2; not found: {', '.join(missing)}")
    probe = f"{PREFIX}probe{new_run_id()}"
    p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if p.returncode != 0:
        raise NetemUnavailable(f"cannot create a network namespace: {p.stderr.strip()}")


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"netem: `{' '.join(cmd)}` failed: {p.stderr.strip()}")
    return p


class Network:
    """Context manager owning one emulated cluster: built on enter, removed on exit, whatever ended the block.

    SIGTERM and SIGHUP are turned into KeyboardInterrupt while it is open, so a killed benchmark still cleans up.
    """

    def __init__(self, ranks: int, ranks_per_host: int = 1, run_id: str | None = None) -> None:
        check_prerequisites()
        run_id = run_id or new_run_id()
        routes = _run(["ip", "-4", "route", "show", "table", "all"], check=False).stdout
        self.plan = plan_network(ranks, run_id, pick_subnet(routes, int(run_id, 16)), ranks_per_host)
        self.rate_bps: int | None = None
        self._old_handlers: dict[int, object] = {}

    def __enter__(self) -> "Network":
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, _interrupt)
        try:
            for cmd in setup_commands(self.plan):
                _run(cmd)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pids(self) -> list[int]:
        """Processes now inside the run's namespaces (`ip netns pids`)."""
        pids = []
        for ns in self.plan.namespaces:
            pids += [int(x) for x in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]
        return pids

    def kill_processes(self) -> list[int]:
        """SIGKILL every process still inside the run's namespaces (by pid); returns the pids.

        torchrun starts its worker in a session of its own, so killing the launched process group is not enough.
        """
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def close(self) -> list[str]:
        """Delete the run's namespaces (their veths and bridge go with them); returns what could not be removed.

        Ctrl-C and SIGTERM are held back meanwhile, so a second Ctrl-C cannot interrupt the clean-up.
        """
        held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            self.kill_processes()
            left = []
            for ns in self.plan.namespaces:
                p = _run(["ip", "netns", "del", ns], check=False)
                if p.returncode != 0 and "No such file" not in p.stderr:
                    left.append(f"{ns}: {p.stderr.strip()}")
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old)  # type: ignore[arg-type]
            self._old_handlers.clear()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
        if left:
            print(f"netem: could not remove {left}", file=sys.stderr)
        return left

    def shape(self, rate_bps: int | None) -> None:
        """Set every host's link to `rate_bps` (None: unshaped)."""
        for cmd in shaping_commands(self.plan, rate_bps):
            _run(cmd, check=rate_bps is not None)
        self.rate_bps = rate_bps

    def counters(self) -> dict[str, dict[str, int]]:
        """Counters of the bridge-side veths."""
        return parse_link_stats(_run(["ip", "-n", self.plan.bridge_ns, "-s", "-j", "link", "show"]).stdout)

    def exec_prefix(self, host: int) -> list[str]:
        """The command prefix that runs a command inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.plan.host_ns[host]]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def leftover_namespaces() -> list[str]:
    """Namespaces named like ours that exist now: another run's, or a run killed with SIGKILL left them behind."""
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.startswith(PREFIX)]


def proc_cpu_seconds(stat_text: str, clk_tck: int) -> float:
    """user+sys CPU seconds of a process from its /proc/<pid>/stat line (fields 14 and 15, after the `(comm)`)."""
    fields = stat_text[stat_text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / clk_tck  # fields[0] is field 3 (state)


def cpu_seconds(pids: Sequence[int]) -> float:
    """Summed user+sys CPU seconds of the live processes among `pids` (ones that are gone count 0)."""
    tck, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                total += proc_cpu_seconds(f.read(), tck)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


INPUT_THREAD = (
    "herald-input"  # the OS name Herald gives its input stage's thread (distributed/train_pipeline/input_thread.py)
)
THREAD_KINDS = ("training", "input", "other")
THREAD_POLL_S = 0.25  # how often run_ranks reads the threads' CPU between marks (a thread that ends loses < this)


def _is_launcher(pid: int) -> bool:
    """A torchrun agent (it starts the training process), not a rank's training process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return any(a.endswith(b"torchrun") or a == b"torch.distributed.run" for a in argv)


def thread_cpu_seconds(pids: Sequence[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """CPU seconds of every thread of the live processes among `pids`, by (pid, tid), each with its kind:
    `training` (a training process's main thread), `input` (Herald's input stage, named INPUT_THREAD) or `other`
    (gloo's threads, torchrun's agents, the rest). Read from /proc/<pid>/task/<tid>/schedstat (ns on the CPU)."""
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for pid in pids:
        launcher = _is_launcher(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ns = int(f.read().split()[0])
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except (OSError, ValueError, IndexError):
                continue
            kind = "input" if name == INPUT_THREAD else "training" if int(tid) == pid and not launcher else "other"
            out[(pid, int(tid))] = (kind, ns / 1e9)
    return out


def thread_cpu_delta(
    a: Mapping[tuple[int, int], tuple[str, float]], b: Mapping[tuple[int, int], tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds by kind of thread between two readings: each thread in `b` counts what it used since `a` (all of
    it if it started in between). `run_ranks` keeps the last reading of threads that ended (an input stage whose data
    ran out) in its snapshots; a thread missing from `b` counts nothing."""
    out = dict.fromkeys(THREAD_KINDS, 0.0)
    for key, (kind, sec) in b.items():
        out[kind] += sec - (a[key][1] if key in a else 0.0)
    return out


@dataclass
class Snapshot:
    """What was measured when a mark first appeared in a host's output."""

    t: float  # time.monotonic()
    cpu_s: float  # CPU seconds of the processes `pids()` named at that moment (cumulative since their start)
    extra: object  # whatever `probe()` returned (e.g. interface counters)
    threads: dict = field(default_factory=dict)  # `thread_cpu_seconds` of those processes


# the lines of each command's output kept (a host's agent and its ranks): with `--phase-times` every rank prints a
# record at exit, 8 per host of 8, besides the agent's and the run's last lines
TAIL_LINES = 40


@dataclass
class RanksResult:
    codes: list[int | None]
    tails: list[str]  # the last TAIL_LINES lines of each command's output (a host's torchrun agent and its ranks)
    cpu_s: float  # user+sys of every process over the whole run (set-up and evaluation included)
    marks: dict[str, Snapshot]


def run_ranks(
    cmds: Sequence[Sequence[str]],
    env: Mapping[str, str],
    cwd: str,
    timeout_s: float,
    grace_s: float = 60.0,
    stop: Callable[[], object] | None = None,
    marks: Mapping[str, str] = {},
    pids: Callable[[], Sequence[int]] | None = None,
    probe: Callable[[], object] | None = None,
    poll_s: float = 0.02,
) -> RanksResult:
    """Start one process per host (its torchrun agent) and wait for all, snapshotting when given lines appear in their
    output.

    `marks` maps a name to a regex; the first time it matches a line of any host's output, the CPU seconds of the
    processes `pids()` lists at the first mark (the ranks' torchrun agents and workers) and `probe()` are recorded --
    e.g. marks around the training loop give its CPU time and wire bytes without set-up and evaluation. A mark
    printed just before every process exits may be missed (nothing is snapshotted after the processes are gone).
    Each command runs in a session of its own; on a failure, a timeout or Ctrl-C the ones still running get SIGTERM
    (torchrun passes it to its workers), then SIGKILL, then `stop()` (e.g. `Network.kill_processes`). Once one exits,
    the others get `grace_s` to finish (a rank that failed leaves the rest blocked in a collective). The whole-run
    CPU time is the user+sys of the reaped children (RUSAGE_CHILDREN covers descendants their parents waited for).
    """
    import resource
    import tempfile

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    logs = [tempfile.NamedTemporaryFile(mode="w+", prefix="netem-rank-") for _ in cmds]
    readers = [open(log.name) for log in logs]
    pending = {name: re.compile(rx, re.MULTILINE) for name, rx in marks.items()}
    seen: dict[str, Snapshot] = {}
    partial = ["" for _ in cmds]
    watched: list[int] = []
    threads: dict = {}  # the latest `thread_cpu_seconds` of every thread seen since the first mark
    threads_read = 0.0
    procs: list[subprocess.Popen] = []
    try:
        for cmd, log in zip(cmds, logs):
            procs.append(
                subprocess.Popen(
                    list(cmd), cwd=cwd, env=dict(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                break
            if any(p.returncode is not None for p in procs):
                deadline = min(deadline, time.monotonic() + grace_s)
            if pending:
                for i, rd in enumerate(readers):
                    text = partial[i] + rd.read()
                    complete, _, partial[i] = text.rpartition("\n")
                    for name, rx in list(pending.items()):
                        if rx.search(complete):
                            if not watched and pids is not None:
                                watched = list(pids())
                            threads.update(thread_cpu_seconds(watched))
                            seen[name] = Snapshot(
                                time.monotonic(), cpu_seconds(watched), probe() if probe else None, dict(threads)
                            )
                            del pending[name]
            if watched and time.monotonic() - threads_read >= THREAD_POLL_S:  # threads that end keep their last read
                threads.update(thread_cpu_seconds(watched))
                threads_read = time.monotonic()
            time.sleep(poll_s)
    finally:
        alive = [p for p in procs if p.poll() is None]
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for p in alive:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + wait_s
            while any(p.poll() is None for p in alive) and time.monotonic() < end:
                time.sleep(0.1)
        if alive and stop is not None:
            stop()
        for rd in readers:
            rd.close()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    tails = []
    for log in logs:
        log.seek(0)
        tails.append("\n".join(log.read().splitlines()[-TAIL_LINES:]))
        log.close()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return RanksResult([p.returncode for p in procs], tails, cpu, seen)
