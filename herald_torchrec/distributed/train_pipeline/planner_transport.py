"""The herald_hier planners' messages between machines (schedule/herald/host_messages.py `Transport`) over a gloo
group of the planning ranks, one per machine: group rank h plans host h.

Each phase, the plan parts routed to the hosts that need them included, is one all-to-all of sizes (one int64 per
pair) then one all-to-all of bytes. A message (a list of numpy arrays) travels in the control plane's wire form
(schedule/message_wire.py: its arrays raw, or each in the form of fewest bytes for its values with the policy's
`planner_wire: compact`), a phase's messages encoded and decoded in one pass each (what a planner receives field by
field, as an `Inbox`). The control plane never imports torch.distributed: this is the data plane's side of its
`Transport`.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import all_to_all_single as _all_to_all_single

from herald_torchrec.distributed.comm import CommCounter, default_group_timeout, hold_for_gloo, phase
from herald_torchrec.schedule.herald.host_messages import Outgoing, Transport, decode_inbox, encode_outgoing
from herald_torchrec.schedule.message_wire import Message

PLANNER_KIND = "planner_messages"  # the CommCounter kind of these bytes


def planner_group(planner_ranks: list[int]) -> dist.ProcessGroup:
    """A gloo group of the planning ranks (default-group ranks, increasing). Collective: every process calls it."""
    return dist.new_group(ranks=planner_ranks, backend="gloo", timeout=default_group_timeout())


class GroupTransport(Transport):
    """Host `host`'s side of the planners' messages, over `group` (group rank = host). Counts what it sends to the
    other planners in `counter` (PLANNER_KIND) and in `last_bytes` by phase; `compact`: the policy's planner_wire."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        host: int,
        num_hosts: int,
        counter: CommCounter | None = None,
        compact: bool = False,
    ) -> None:
        super().__init__()
        if dist.get_world_size(group) != num_hosts or dist.get_rank(group) != host:
            raise ValueError(
                f"herald_hier planners: group of {dist.get_world_size(group)} ranks (this one {dist.get_rank(group)}) "
                f"for {num_hosts} hosts (this one {host})"
            )
        self.group, self.host, self.H = group, host, num_hosts
        self.counter = counter if counter is not None else CommCounter()
        self.compact = compact  # each array in its form of fewest bytes, else raw (the policy's planner_wire)
        self.sent_total = 0  # bytes sent to other planners since construction

    def _sent(self, kind: str, nbytes: int) -> None:
        self.count(kind, nbytes)
        self.sent_total += nbytes
        self.counter.add(PLANNER_KIND, nbytes)

    def exchange(self, kind: str, out: dict[int, Outgoing]) -> dict[int, Mapping[int, Message]]:
        H, h = self.H, self.host
        # its message to itself included; the messages come back to back in host order: the send buffer as it is
        dests, enc = encode_outgoing(out.get(h, {}), None, self.compact)
        per_host = np.zeros(H, dtype=np.int64)
        per_host[dests] = enc.sizes()
        sizes = torch.from_numpy(per_host)
        recv_sizes = torch.empty(H, dtype=torch.int64)
        with phase("input.plan_exchange"):
            _all_to_all_single(recv_sizes, sizes, group=self.group)
            recv = recv_sizes.tolist()
            got = torch.empty(int(sum(recv)), dtype=torch.uint8)
            send = torch.from_numpy(enc.buf)
            _all_to_all_single(got, send, recv, per_host.tolist(), group=self.group)
            hold_for_gloo(recv_sizes, sizes, got, send)
        self._sent(kind, int(per_host.sum() - per_host[h]) + 8 * (H - 1))
        return {h: decode_inbox(got.numpy(), recv)}
