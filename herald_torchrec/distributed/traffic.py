"""Count the bytes every scheduler hands to torch.distributed collectives, the same way for all of them.

Why a wrapper around `torch.distributed` instead of each module's own counters: stock TorchRec's input and output
dists, Herald's plan-sized all-to-alls and the sample exchange all call the same Python entry points, so patching
those entry points measures every system with one ruler. Counted: bytes this rank sends to *other* ranks
(all_to_all: off-rank splits; all_gather: input x (R-1); reduce_scatter: input x (R-1)/R; all_reduce /
broadcast: input bytes). DDP's dense gradient all-reduce runs inside its C++ reducer and is not counted: it is the
same for every scheduler.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.distributed as dist

from herald_torchrec.distributed.comm import CommCounter

_PATCHED = (
    "all_to_all_single",
    "all_to_all",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
)


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _sent_bytes(name: str, args: tuple, kwargs: dict, group) -> int:
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world <= 1:
        return 0
    if name == "all_to_all_single":
        inp = kwargs.get("input", args[1] if len(args) > 1 else None)
        splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
        total = _nbytes(inp)
        if not splits:
            return total * (world - 1) // world
        row = total // max(1, inp.shape[0]) if inp.shape[0] else 0
        return row * (sum(splits) - splits[rank])
    if name == "all_to_all":
        inputs = kwargs.get("input_tensor_list", args[1] if len(args) > 1 else [])
        return sum(_nbytes(t) for i, t in enumerate(inputs) if i != rank)
    if name in ("all_gather", "all_gather_into_tensor"):
        inp = kwargs.get("tensor", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
        return _nbytes(inp) * (world - 1)
    if name in ("reduce_scatter", "reduce_scatter_tensor"):
        inp = kwargs.get("input_list", kwargs.get("input", args[1] if len(args) > 1 else None))
        return _nbytes(inp) * (world - 1) // world
    inp = kwargs.get("tensor", args[0] if args else None)  # all_reduce, broadcast
    return _nbytes(inp)


@contextlib.contextmanager
def count_collectives(counter: CommCounter, kind: str = "collective") -> Iterator[CommCounter]:
    """Within the block, every patched torch.distributed collective adds its sent bytes to `counter[kind]`."""
    saved = {n: getattr(dist, n) for n in _PATCHED}

    def wrap(name: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            counter.add(kind, _sent_bytes(name, args, kwargs, group))
            return fn(*args, **kwargs)

        return counted

    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    try:
        yield counter
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
