"""Process-group set-up: torchrun's environment when present, else a one-process group (so DMP still works)."""

from __future__ import annotations

import os
import socket
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

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str = "auto") -> DistContext:
    """gloo on CPU, NCCL on GPU; world size from torchrun's environment (a single process also works)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = torch.cuda.is_available() and backend in ("auto", "nccl")
    # more local ranks than GPUs (e.g. 2 ranks on one GPU): NCCL refuses two ranks on one device, gloo takes CUDA tensors
    shared_gpu = use_cuda and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if backend == "auto":
        backend = "nccl" if use_cuda and not shared_gpu else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"dist backend must be auto, gloo or nccl, got '{backend}'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend nccl needs CUDA, but no GPU is visible; use dist_backend=gloo")
    if use_cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # with NCCL, CPU tensors (host-side counters, metrics) need a gloo side in the same default group
        pg_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
        dist.init_process_group(backend=pg_backend, rank=rank, world_size=world)
    return DistContext(rank, world, local_rank, device, backend)


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
