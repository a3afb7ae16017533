"""Phase 2b of `herald_hier` (`move_samples="swap"`; off by default): samples move between hosts towards their rows.

Why: a host plans only its own samples, so a sample whose rows live on another host costs remote reads there. The
demand also carries each key's reader count (COUNT) and the owners' answer the other host that reads it most and its
count (RANK + COUNT); every host offers (h -> host 0, the coordinator: INDEX + RANK + COUNT each) its samples whose
keys are owned or read more on another host (by `sample_gain` of first-pass LAIA weight); the coordinator swaps
offers pairwise between two hosts, highest gains first, so every rank keeps B samples, and tells the loading host
(swaps: INDEX each); the sample travels to its new host (samples: ID + RANK per id, its owner known, +
DENSE_LABEL_BYTES), which demands its keys new to it. Measured: -0.5 % rows at R=16, nothing at R >= 32, for about as
many sample bytes as the rows it saves: off. It needs every host in one process (the simulator); the message bytes
are counted as the protocol would send them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.herald.host_messages import (
    COUNT_BYTES,
    DENSE_LABEL_BYTES,
    ID_BYTES,
    INDEX_BYTES,
    RANK_BYTES,
    MessageBytes,
)
from herald_torchrec.schedule.herald.host_planner import HostPlanner
from herald_torchrec.schedule.reads import BatchKeys

COORDINATOR = 0  # the host that matches the offers (its own are free)

# every function takes the HeraldHierPolicy that drives the step (hierarchy.py imports this module, not the reverse)
Policy = Any


@dataclass
class Offers:
    """A host's offers: global sample, the host it would go to, the gain (first-pass LAIA weight)."""

    sample: np.ndarray  # int64
    host: np.ndarray  # int64
    gain: np.ndarray  # float64


def swap_samples(
    pol: Policy,
    b: list[GlobalBatch],
    hosts: dict[int, HostPlanner],
    msg: MessageBytes,
    seconds: tuple[np.ndarray, np.ndarray],
    clock: Callable[[], float],
) -> bool:
    """Phase 2b, all hosts in this process (the simulator): the offers, the coordinator's swaps, and every
    host's new samples (their keys and owners); the phase's seconds added to each host's (host, directory)
    `seconds` by `clock`. True if some sample moved."""
    H = pol.num_hosts
    host_s, dir_s = seconds
    firsts = [(hp.sub, hp.bk, hp.own, hp.members) for hp in (hosts[h] for h in range(H))]
    readers = _other_readers(pol, firsts, msg)
    offers = []
    for h, (sub, bk, own, _) in enumerate(firsts):
        t0 = clock()
        offers.append(_offers(pol, sub, bk, own, h, *readers[h]))
        host_s[h] += clock() - t0
    t0 = clock()
    members = _swap(pol, b[0], offers, [f[3] for f in firsts], msg)
    dir_s[COORDINATOR] += clock() - t0
    moved = False
    for h in range(H):
        if members[h] is not firsts[h][3]:  # samples arrived: their keys too (owners came with them)
            t0 = clock()
            hosts[h].take_samples(b[0].take(members[h]), members[h])
            host_s[h] += clock() - t0
            moved = True
    return moved


def _other_readers(pol: Policy, firsts, msg: MessageBytes) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per host, for every key it demands: the other host whose samples read it most, and how many (0: none).
    The directory hosts learn it from the demand (which then carries each key's count) and answer it with the
    owners; simulated here in one pass over every host's demand."""
    H = pol.num_hosts
    k = np.concatenate([x[1].keys for x in firsts])
    c = np.concatenate([x[1].count for x in firsts])
    hh = np.repeat(np.arange(H, dtype=np.int64), [x[1].keys.shape[0] for x in firsts])
    o = np.lexsort((hh, -c, k))
    k, c, hh = k[o], c[o], hh[o]
    new = np.empty(k.shape[0], dtype=bool)
    new[:1] = True
    np.not_equal(k[1:], k[:-1], out=new[1:])
    start = np.flatnonzero(new)
    uniq = k[start]
    nxt = np.minimum(start + 1, k.shape[0] - 1)
    has2 = (nxt != start) & (k[nxt] == uniq)
    top_h, top_c = hh[start], c[start]
    sec_h, sec_c = np.where(has2, hh[nxt], 0), np.where(has2, c[nxt], 0)
    out = []
    for h, (_, bk, _, _) in enumerate(firsts):
        i = np.searchsorted(uniq, bk.keys)
        mine = top_h[i] == h
        out.append((np.where(mine, sec_h[i], top_h[i]), np.where(mine, sec_c[i], top_c[i])))
        hk = np.bincount(pol.directory_host_of(bk.keys), minlength=H)
        msg.add_many("demand", np.full(H, h), np.arange(H), hk * COUNT_BYTES, H)
        msg.add_many("owners", np.arange(H), np.full(H, h), hk * (RANK_BYTES + COUNT_BYTES), H)
    return out


def _offers(pol: Policy, sub, bk: BatchKeys, own: np.ndarray, h: int, other: np.ndarray, other_n: np.ndarray) -> Offers:
    """Host h's offers (phase 2b): its samples whose scheduled keys are owned or read more on another host than on
    h, by `sample_gain`: a key counts its first-pass LAIA weight (`scheduled_of`' w0) at its owner's host and 1 at
    a host whose other samples read it (h, or the other host that reads it most); each with its best host."""
    H, P = pol.num_hosts, pol.ranks_per_host
    v = pol.scheduled_of(sub, bk)
    N = sub.num_samples
    if v.es.shape[0] == 0:
        z = np.zeros(0, dtype=np.int64)
        return Offers(z, z, np.zeros(0))
    score = np.bincount(v.es * H + (own // P)[v.ec], weights=v.w0, minlength=N * H)
    score += np.bincount(v.es * H + other[v.ec], weights=(other_n[v.ec] > 0) * 1.0, minlength=N * H)
    score += np.bincount(v.es * H + h, weights=(bk.count[v.ec] > 1) * 1.0, minlength=N * H)
    score = score.reshape(N, H)
    best = np.argmax(score, axis=1)
    gain = score[np.arange(N), best] - score[:, h]
    s = np.flatnonzero(gain >= pol.sample_gain)
    return Offers(s + h * N, best[s], gain[s])


def _swap(pol: Policy, b: GlobalBatch, offers: list[Offers], members: list[np.ndarray], msg: MessageBytes):
    """The coordinator's match (phase 2b): between every two hosts, as many swaps as the fewer offers of the two
    directions, highest gains first; the swapped samples travel with their ids, dense part and label, and their
    keys' owners. Returns every host's samples (global indices, sorted)."""
    H, P, B = pol.num_hosts, pol.ranks_per_host, pol.batch_per_rank
    n = P * B
    smp = np.concatenate([o.sample for o in offers])
    dst = np.concatenate([o.host for o in offers])
    gain = np.concatenate([o.gain for o in offers])
    src = smp // n
    msg.add_many("offers", src, np.full(src.shape[0], COORDINATOR), np.full(src.shape[0], INDEX_BYTES + RANK_BYTES
                 + COUNT_BYTES), H)  # fmt: skip
    pair = src * H + dst
    counts = np.bincount(pair, minlength=H * H).reshape(H, H)
    k = np.minimum(counts, counts.T).ravel()
    o = np.lexsort((smp, -gain, pair))
    pair_o = pair[o]
    start = np.cumsum(counts.ravel()) - counts.ravel()
    keep = o[np.arange(o.shape[0]) - start[pair_o] < k[pair_o]]
    if keep.shape[0] == 0:
        return members
    moved, to = smp[keep], dst[keep]
    pol.last_swapped = int(moved.shape[0])
    msg.add_many("swaps", np.full(moved.shape[0], COORDINATOR), moved // n, np.full(moved.shape[0], INDEX_BYTES), H)
    ids = np.zeros(moved.shape[0], dtype=np.int64)
    for off in b.offsets:
        ids += off[moved + 1] - off[moved]
    msg.add_many("samples", moved // n, to, ids * (ID_BYTES + RANK_BYTES) + DENSE_LABEL_BYTES, H)
    host = np.repeat(np.arange(H, dtype=np.int64), n)
    host[moved] = to
    o = np.argsort(host, kind="stable")
    return np.split(o, np.arange(1, H) * n)
