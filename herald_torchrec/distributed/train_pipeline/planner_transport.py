"""The herald_hier planners' messages between machines (schedule/herald/hierarchy.py `Transport`) over a gloo group
of the planning ranks, one per machine: group rank h plans host h.

Each phase, the plan parts routed to the hosts that need them included, is one all-to-all of sizes (one int64 per
pair) then one all-to-all of bytes. A message (a list of numpy arrays) travels
as a header of int64 words (its array count, then each array's dtype code and length) and the arrays' bytes. The
control plane never imports torch.distributed: this is the data plane's side of its `Transport`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import all_to_all_single as _all_to_all_single

from herald_torchrec.distributed.comm import CommCounter, default_group_timeout, hold_for_gloo, phase
from herald_torchrec.schedule.herald.hierarchy import Message, Transport

PLANNER_KIND = "planner_messages"  # the CommCounter kind of these bytes


def encode_message(m: Message) -> np.ndarray:
    """A message as bytes: [n, (dtype code, length) * n] int64, then every array's bytes."""
    head = [len(m)]
    for a in m:
        head += [ord(a.dtype.char), a.shape[0]]
    return np.concatenate([np.asarray(head, dtype=np.int64).view(np.uint8)]
                          + [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in m])  # fmt: skip


def decode_message(buf: np.ndarray) -> Message:
    n = int(buf[:8].view(np.int64)[0])
    head = buf[8 : 8 + 16 * n].view(np.int64).reshape(n, 2)
    at = 8 + 16 * n
    out = []
    for code, length in head.tolist():
        dt = np.dtype(chr(code))
        out.append(buf[at : at + dt.itemsize * length].copy().view(dt))
        at += dt.itemsize * length
    return out


def planner_group(planner_ranks: list[int]) -> dist.ProcessGroup:
    """A gloo group of the planning ranks (default-group ranks, increasing). Collective: every process calls it."""
    return dist.new_group(ranks=planner_ranks, backend="gloo", timeout=default_group_timeout())


class GroupTransport(Transport):
    """Host `host`'s side of the planners' messages, over `group` (group rank = host). Counts what it sends to the
    other planners in `counter` (PLANNER_KIND) and in `last_bytes` by phase."""

    def __init__(self, group: dist.ProcessGroup, host: int, num_hosts: int, counter: CommCounter | None = None) -> None:
        super().__init__()
        if dist.get_world_size(group) != num_hosts or dist.get_rank(group) != host:
            raise ValueError(
                f"herald_hier planners: group of {dist.get_world_size(group)} ranks (this one {dist.get_rank(group)}) "
                f"for {num_hosts} hosts (this one {host})"
            )
        self.group, self.host, self.H = group, host, num_hosts
        self.counter = counter if counter is not None else CommCounter()
        self.sent_total = 0  # bytes sent to other planners since construction

    def _sent(self, kind: str, nbytes: int) -> None:
        self.count(kind, nbytes)
        self.sent_total += nbytes
        self.counter.add(PLANNER_KIND, nbytes)

    def exchange(self, kind: str, out: dict[int, dict[int, Message]]) -> dict[int, dict[int, Message]]:
        H, h = self.H, self.host
        mine = out.get(h, {})
        blocks = [encode_message(mine[t]) if t in mine else np.zeros(0, np.uint8) for t in range(H)]
        sizes = torch.tensor([b.shape[0] for b in blocks], dtype=torch.int64)
        recv_sizes = torch.empty(H, dtype=torch.int64)
        with phase("input.plan_exchange"):
            _all_to_all_single(recv_sizes, sizes, group=self.group)
            recv = recv_sizes.tolist()
            got = torch.empty(int(sum(recv)), dtype=torch.uint8)
            send = torch.from_numpy(np.concatenate(blocks))
            _all_to_all_single(got, send, recv, sizes.tolist(), group=self.group)
            hold_for_gloo(recv_sizes, sizes, got, send)
        self._sent(kind, int(sum(b.shape[0] for t, b in enumerate(blocks) if t != h)) + 8 * (H - 1))
        parts = np.split(got.numpy(), np.cumsum(recv)[:-1])
        return {h: {s: decode_message(p) for s, p in enumerate(parts) if p.shape[0]}}
