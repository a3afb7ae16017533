"""The sharded model as whole tensors, whatever the scheduler: final_state.pt's layout (every table, its optimizer
state and the dense parameters, read through DMP.state_dict() and the fused optimizer's state_dict(), which Herald's
modules present as TorchRec's ROW_WISE shards), and TorchRec's shards filled from whole tables (the common initial
tables, a resumed run)."""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from herald_torchrec.app.runtime import DistContext


def _is_dense(key: str, value: Any) -> bool:
    return ".ebc." not in key and isinstance(value, torch.Tensor) and not isinstance(value, ShardedTensor)


def full_state(model: torch.nn.Module, ctx: DistContext) -> dict[str, Any]:
    """final_state.pt's layout (collective; complete on rank 0): full unsharded tables, their optimizer state, and
    every dense parameter — the same for every scheduler (all read through DMP.state_dict() and the fused optimizer's
    state_dict(), which Herald's modules present as TorchRec's ROW_WISE shards), so runs compare tensor by tensor."""
    weights, states = full_tables(model, ctx)
    dense = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if _is_dense(k, v)}
    return {"tables": weights, "optimizer_state": states, "dense": dense}


def _torchrec_sharded_tensors(dmp: torch.nn.Module) -> Iterator[tuple[str, str, ShardedTensor]]:
    """TorchRec's sharded tables and their fused-optimizer state as ("weight" | "state", table name, ShardedTensor).
    A rank lists only what it holds: a TABLE_WISE table's optimizer state exists only where the table lives."""
    for k, v in dmp.state_dict().items():
        if isinstance(v, ShardedTensor) and k.endswith(".weight"):
            yield "weight", k.split(".")[-2], v
    for k, v in dmp.fused_optimizer.state_dict()["state"].items():
        for sv in v.values() if isinstance(v, dict) else []:
            if isinstance(sv, ShardedTensor):
                yield "state", k.split(".")[-2], sv


def full_tables(dmp: torch.nn.Module, ctx: DistContext) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Assemble the sharded tables (stock and Herald alike) and fused-optimizer state into full tensors (collective;
    result on rank 0).

    Every rank sends its local shards with their offsets: which keys a rank has differs between ranks, so per-key
    collectives would not line up."""
    mine = [
        (kind, name, tuple(sh.metadata.shard_offsets), sh.tensor.detach().cpu(), tuple(st.size()))
        for kind, name, st in _torchrec_sharded_tensors(dmp)
        for sh in st.local_shards()
    ]
    parts: list = [None] * ctx.world_size if ctx.is_main else None
    if ctx.world_size > 1:
        dist.gather_object(mine, parts, dst=0)
    else:
        parts = [mine]
    weights: dict[str, torch.Tensor] = {}
    states: dict[str, torch.Tensor] = {}
    for kind, key, offsets, tensor, size in (x for p in (parts or []) for x in p):
        out = weights if kind == "weight" else states
        full = out.setdefault(key, torch.zeros(size, dtype=tensor.dtype))
        full[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = tensor
    states = {k: v.reshape(-1) if v.dim() > 1 and v.shape[-1] == 1 else v for k, v in states.items()}
    return weights, states


def _copy_into_shards(st: ShardedTensor, full: torch.Tensor) -> None:
    full = full.reshape(st.size())
    for shard in st.local_shards():
        idx = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
        shard.tensor.copy_(full[idx])


@torch.no_grad()
def load_torchrec_tables(
    dmp: torch.nn.Module, weights: dict[str, torch.Tensor], states: dict[str, torch.Tensor] | None = None
) -> None:
    """Full tables (and fused-optimizer state) into TorchRec's shards, for the tables named in `weights`. Used for the
    initial tables (TorchRec draws its own otherwise: every scheduler starts from the same model and, being exact,
    ends at the same model) and for resuming from a checkpoint."""
    for kind, name, st in _torchrec_sharded_tensors(dmp):
        if name not in weights:
            continue
        if kind == "weight":
            _copy_into_shards(st, weights[name])
        elif states and name in states:
            _copy_into_shards(st, states[name])
