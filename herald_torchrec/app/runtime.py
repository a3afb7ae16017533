"""Process-group set-up: torchrun's environment when present, else a one-process group (so DMP still works), and
the CPU cores each local rank runs on.

Why bind cores: on a CPU-only machine, R ranks of one host each run a training thread, gloo's threads and (Herald) an
input thread. Left to the OS, these threads migrate between cores and evict each other's caches; bound to disjoint
blocks of cores (local rank i on the i-th block) every scheduler's step got ~25 % faster on the 2-core CI machine
(DCN, R=2: table_wise 29-31 -> 22-23 ms, herald 33-35 -> 25-26 ms; docs/performance.md). It costs
Herald some of its lead in one way: the rank that plans for the others (`plan_on`) can no longer spill onto an idle
core, so Herald's ratio to table_wise does not improve with it. torchrun's
own `--numa-binding` places ranks next to their GPUs; on CPU it has nothing to go by, hence this.

Why the store is set up here under torchrun: since torch 2.5 the elastic agent hosts the rendezvous TCP store and
hands it to its workers (TORCHELASTIC_USE_AGENT_STORE), and that store outlives a restart (`--max-restarts`). The
keys the previous attempt's process groups wrote are still in it, so the restarted ranks read the dead ranks'
addresses: gloo fails to connect or waits forever (pytorch/pytorch#135712). On one machine (one agent, so one restart
count for every rank) each attempt gets keys of its own here; across machines the agents count restarts
separately, so only `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` in torchrun's environment helps, and the run says so.
Every group also has a timeout (`dist_timeout_s`): a rank that waits on a dead peer fails within it (torchrun
then restarts the job) instead of hanging for torch's default half hour.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    cpus: tuple[int, ...] | None = None  # the cores this rank is bound to (cpu_affinity), None: not bound

    @property
    def is_main(self) -> bool:
        return self.rank == 0


CPU_AFFINITY = ("auto", "off")


def affinity_mode(value: str | bool) -> str:
    """`cpu_affinity` as one of CPU_AFFINITY (YAML reads `off` as False); ValueError for anything else."""
    mode = "off" if value is False else value
    if mode not in CPU_AFFINITY:
        raise ValueError(f"cpu_affinity must be one of {CPU_AFFINITY}, got {value!r}")
    return mode  # type: ignore[return-value]


def cpu_blocks(cpus: list[int], local_world_size: int) -> list[list[int]]:
    """One block of `cpus` (sorted) per local rank: disjoint, contiguous and near-equal when there are at least as
    many CPUs as ranks; otherwise one CPU each, shared by at most ceil(ranks / CPUs) neighbouring ranks (R=4 on the
    2-core machine, DCN: table_wise 61.7 -> 53-55 ms, herald 70-72 -> 66 ms, whole runs of 500 steps)."""
    cpus = sorted(cpus)
    n, L = len(cpus), local_world_size
    if n == 0 or L < 1:
        raise ValueError(f"cpu_blocks: {n} CPUs for {L} local ranks")
    if n < L:
        return [[cpus[i * n // L]] for i in range(L)]
    return [cpus[i * n // L : (i + 1) * n // L] for i in range(L)]


def bind_local_rank(mode: str | bool, local_rank: int, local_world_size: int) -> list[int] | None:
    """Bind this process (every thread it has, and so every thread it starts later) to its block of the CPUs it may
    use (`cpu_blocks`). `mode`: "auto" binds when several ranks share the machine; "off" (or False, as YAML reads
    `off`) never binds. Returns the CPUs bound to, or None."""
    if affinity_mode(mode) == "off" or local_world_size <= 1 or not hasattr(os, "sched_setaffinity"):
        return None
    blocks = cpu_blocks(list(os.sched_getaffinity(0)), local_world_size)
    mine = set(blocks[local_rank % local_world_size])
    for tid in os.listdir("/proc/self/task"):  # sched_setaffinity(0) would bind the calling thread only
        try:
            os.sched_setaffinity(int(tid), mine)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass
    return sorted(mine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DIST_TIMEOUT_S = 300.0  # default of every process group's timeout: a collective or connection waits at most this
SHARE_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # read by torchrun's agent, before any worker starts


@dataclass(frozen=True)
class ElasticLaunch:
    """What torchrun's agent told this worker about restarts and its rendezvous store (environment variables)."""

    restart_count: int  # TORCHELASTIC_RESTART_COUNT: 0 on the first attempt
    max_restarts: int  # TORCHELASTIC_MAX_RESTARTS
    agent_store: bool  # TORCHELASTIC_USE_AGENT_STORE: the agent's store, which outlives restarts, is shared
    machines: int  # GROUP_WORLD_SIZE: how many agents (machines) take part

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "ElasticLaunch | None":
        """None outside torchrun (no TORCHELASTIC_RESTART_COUNT)."""
        env = os.environ if env is None else env
        if "TORCHELASTIC_RESTART_COUNT" not in env:
            return None
        return cls(
            restart_count=int(env["TORCHELASTIC_RESTART_COUNT"]),
            max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            machines=int(env.get("GROUP_WORLD_SIZE", "1")),
        )

    @property
    def isolates_attempts(self) -> bool:
        """Each attempt's store keys can be kept apart here: one agent, so every rank agrees on the restart count."""
        return self.agent_store and self.machines == 1

    def restart_hazard(self) -> str | None:
        """One line when restarts may hang or fail to connect (the shared store across machines), else None."""
        if not self.agent_store or self.isolates_attempts or (self.max_restarts == 0 and self.restart_count == 0):
            return None
        return (
            f"warning: torchrun shares its rendezvous store with the workers across {self.machines} machines, so a "
            f"restart (this is attempt {self.restart_count + 1} of at most {self.max_restarts + 1}) can fail to "
            f"connect or hang until dist_timeout_s; launch torchrun with {SHARE_STORE_VAR}=1 (README, Restarts)"
        )


def _store_for_attempt(launch: ElasticLaunch, timeout: datetime.timedelta) -> dist.Store:
    """A client of the agent's store whose keys belong to this attempt alone (see the module docstring)."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"herald/attempt_{launch.restart_count}", store)


def init_distributed(
    backend: str = "auto", cpu_affinity: str | bool = "off", timeout_s: float = DIST_TIMEOUT_S
) -> DistContext:
    """gloo on CPU, NCCL on GPU; world size from torchrun's environment (a single process also works).
    `cpu_affinity="auto"` binds each local rank of a CPU run to its own cores (`bind_local_rank`), before any
    process-group thread starts; GPU runs are left to torchrun's `--numa-binding`. `timeout_s` bounds every wait of
    the default group (and of the groups that inherit its timeout, e.g. the pipeline's host group); under torchrun
    each restart attempt gets store keys of its own where that is safe (the module docstring says why)."""
    try:
        seconds = float(timeout_s)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(timeout_s, bool) or not 0 < seconds < float("inf"):
        raise ValueError(f"dist_timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = torch.cuda.is_available() and backend in ("auto", "nccl")
    # more local ranks than GPUs (e.g. 2 ranks on one GPU): NCCL refuses two ranks on one device, gloo takes CUDA
    # tensors
    shared_gpu = use_cuda and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if backend == "auto":
        backend = "nccl" if use_cuda and not shared_gpu else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"dist backend must be auto, gloo or nccl, got '{backend}'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend nccl needs CUDA, but no GPU is visible; use dist_backend=gloo")
    cpus = None
    if use_cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        cpus = bind_local_rank(cpu_affinity, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if not dist.is_initialized():
        # with NCCL, CPU tensors (host-side counters, metrics) need a gloo side in the same default group
        pg_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
        timeout = datetime.timedelta(seconds=seconds)
        launch = ElasticLaunch.from_env()
        hazard = launch.restart_hazard() if launch is not None else None
        if hazard and rank == 0:
            print(hazard, file=sys.stderr, flush=True)
        if launch is not None and launch.isolates_attempts:
            store = _store_for_attempt(launch, timeout)
            dist.init_process_group(backend=pg_backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend=pg_backend, rank=rank, world_size=world, timeout=timeout)
    return DistContext(rank, world, local_rank, device, backend, None if cpus is None else tuple(cpus))


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
