"""Shared rows delivered once per host: one reader of each host relays a row's value to the others and sums their
gradients before one sum crosses back.

Why: a shared row read by several ranks of another host would otherwise cross the slow link between hosts once per
reader, value out and gradient back. With a relay, the row's owner (before the step's moves) sends the value to one
reader per host, the *relay* (the lowest-ranked reader there that does not receive the row itself in the moves);
the relay hands it to the host's other readers over the fast intra-host links; after the backward those readers send
their gradients to the relay, which adds them to its own and sends one sum to the owner (after the moves). The owner
still applies ONE update with the sum of every reader's gradient, so the model is the same (sums in another order:
float32 rounding only). Readers on the owner's own host, and a host with one reader, keep the direct path.

Worked example (4 ranks, hosts {0, 1} and {2, 3}; row k owned by rank 0, read by ranks 1, 2 and 3):

    values     stage 1 (with the moves): 0 -> 1, 0 -> 2          stage 2: 2 -> 3  (rank 2 relays for host 1)
    gradients  stage 1: 3 -> 2  (rank 2 adds it to its own)      stage 2: 1 -> 0, 2 -> 0  (one sum from host 1)

Rows crossing hosts: 2 (one value, one gradient sum) instead of 4. Rows on the wire in all: the same 6.

This module only decides the routes (numpy, or one compiled pass: identical on every rank, a pure function of the
plan and the host map); prepare.py lays them out and embedding_lookup.py runs the two extra intra-host all-to-alls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from herald_torchrec.distributed import host_kernels

FROM_OWNER, FROM_RELAY = 1, 2  # a pair's value: sent by the owner with the moves, or forwarded by its host's relay
TO_RELAY, TO_OWNER = 1, 2  # a pair's gradient: sent to its host's relay first, or to the owner


@dataclass(frozen=True)
class HostMap:
    """The host of every rank (dense ids 0..H-1) and whether shared rows go through relays."""

    host: np.ndarray
    relay: bool = True

    @property
    def num_hosts(self) -> int:
        return int(self.host.max()) + 1 if self.host.shape[0] else 0

    @property
    def shares_hosts(self) -> bool:
        """Some host has several ranks and there are several hosts: the only case where relays change anything."""
        return 1 < self.num_hosts < self.host.shape[0]

    @property
    def relays(self) -> bool:
        return self.relay and self.shares_hosts

    def crossing(self, src: np.ndarray | int, dst: np.ndarray) -> np.ndarray:
        """Whether each transfer src -> dst crosses hosts."""
        return self.host[src] != self.host[dst]


@dataclass(frozen=True)
class LinkRows:
    """Rows one rank sends to ranks of another host (`cross`) and to the other ranks of its own host (`intra`)."""

    cross: int = 0
    intra: int = 0

    @classmethod
    def of(cls, hosts: HostMap, rank: int, dst: np.ndarray) -> LinkRows:
        dst = dst[dst != rank]  # a self-send is a local copy, not a transfer
        cross = int(hosts.crossing(rank, dst).sum())
        return cls(cross, int(dst.shape[0]) - cross)

    def __add__(self, other: LinkRows) -> LinkRows:
        return LinkRows(self.cross + other.cross, self.intra + other.intra)


@dataclass
class PairRoutes:
    """Where each (row, reader) pair of a step's shared rows gets its value and sends its gradient."""

    value_src: np.ndarray  # the rank sending the pair's value: its owner before the moves, or its host's relay
    value_stage: np.ndarray  # FROM_OWNER or FROM_RELAY
    grad_dst: np.ndarray  # the rank the pair's gradient goes to: its owner after the moves, or its host's relay
    grad_stage: np.ndarray  # TO_RELAY or TO_OWNER
    relay_pair: np.ndarray  # the relay's own pair of the same row and host (the pair itself where it is direct)

    @property
    def relayed(self) -> bool:
        """Some pair goes through a relay (the plan is the same on every rank, so this is a global fact)."""
        return bool((self.value_stage == FROM_RELAY).any() or (self.grad_stage == TO_RELAY).any())


def pair_routes(
    pair_row: np.ndarray,
    readers: np.ndarray,
    owner_before: np.ndarray,
    owner_after: np.ndarray,
    fill: np.ndarray,
    hosts: HostMap | None,
) -> PairRoutes:
    """The routes of every pair (`pair_row`: the pair's row index, non-decreasing; `fill`: the reader receives the row
    itself in the moves and needs no value). Without relays (no host map, relays off, or no host with two ranks)
    every pair is direct: the value from the owner before the moves, the gradient to the owner after them."""
    P = readers.shape[0]
    own_pair = np.arange(P, dtype=np.int64)
    if hosts is None or not hosts.relays or P == 0:
        return PairRoutes(
            owner_before.copy(),
            np.full(P, FROM_OWNER, dtype=np.int64),
            owner_after.copy(),
            np.full(P, TO_OWNER, dtype=np.int64),
            own_pair,
        )
    got = host_kernels.pair_routes(
        pair_row, readers, owner_before, owner_after, fill, hosts.host, (FROM_OWNER, FROM_RELAY, TO_RELAY, TO_OWNER)
    )
    if got is not None:  # compiled, in one pass (the pairs of a row together)
        return PairRoutes(*got)
    host = hosts.host
    reader_host = host[readers]
    code = pair_row * hosts.num_hosts + reader_host  # (row, reading host)
    cand = np.flatnonzero(~fill)  # a fill reader gets the row itself: it cannot relay its value
    order = cand[np.lexsort((readers[cand], code[cand]))]  # by (row, host), then rank
    codes = code[order]
    first = np.ones(order.shape[0], dtype=bool)
    first[1:] = codes[1:] != codes[:-1]
    relay_code, relay_of_code = codes[first], order[first]  # the lowest non-fill reader of every (row, host)
    relay_pair = own_pair  # a (row, host) with no non-fill reader has no relay: its pairs are direct
    if relay_code.shape[0]:
        at = np.minimum(np.searchsorted(relay_code, code), relay_code.shape[0] - 1)
        relay_pair = np.where(relay_code[at] == code, relay_of_code[at], own_pair)
    is_relay = relay_pair == own_pair
    direct_value = is_relay | fill | (reader_host == host[owner_before])  # (a fill pair needs no value at all)
    direct_grad = is_relay | (reader_host == host[owner_after])
    return PairRoutes(
        np.where(direct_value, owner_before, readers[relay_pair]),
        np.where(direct_value, FROM_OWNER, FROM_RELAY).astype(np.int64),
        np.where(direct_grad, owner_after, readers[relay_pair]),
        np.where(direct_grad, TO_OWNER, TO_RELAY).astype(np.int64),
        relay_pair,
    )
