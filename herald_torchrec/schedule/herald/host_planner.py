"""What one host's planner runs in a step of `herald_hier` (hierarchy.py's docstring, phases 1-8): from its own
samples' window and the messages the other hosts send it, the messages it sends them and its part of the plan.

Why a module of its own: it is the per-host half of the protocol, the same code whether every host runs in one
process (the simulator, the tests) or each machine's planner runs its own host in training; the policy
(`HeraldHierPolicy`, hierarchy.py) holds the shared state and the rules (LAIA over a host's ranks, the decision, the
capacity phase) and drives the phases through a `Transport` (host_messages.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from herald_torchrec.schedule import native
from herald_torchrec.schedule.global_batch import GlobalBatch
from herald_torchrec.schedule.herald.budget import STATIC
from herald_torchrec.schedule.herald.host_messages import (
    COUNT_BYTES,
    INDEX_BYTES,
    KEY_BYTES,
    MOVED,
    RANK_BYTES,
    RELAYED,
    SHARED,
    MessageBytes,
    Outbox,
    Outgoing,
    concatenated,
    source_counts,
)
from herald_torchrec.schedule.herald.tables import TableSelection
from herald_torchrec.schedule.message_wire import Message
from herald_torchrec.schedule.plan import relayed_pairs
from herald_torchrec.schedule.reads import sort_ints, sorted_distinct, stable_order, step_reads


class HostPlanner:
    """What host h runs in one step (hierarchy.py's docstring, phases 1-8): from its own samples' window and what the
    other hosts send it. `policy` is this process's replica of the shared state (the directory, the guest slots and
    eviction pool of h's ranks, the per-host settings); h reads the directory only for its own rows' entries (as
    their directory host: owners, decisions) and its own guests (capacity), and keeps only those up to date."""

    def __init__(self, policy: Any, h: int, window: Sequence[GlobalBatch], msg: MessageBytes) -> None:
        # policy: the HeraldHierPolicy that drives the phases (hierarchy.py imports this module, not the reverse)
        self.pol, self.h, self.window, self.msg = policy, h, list(window), msg
        P, B = policy.ranks_per_host, policy.batch_per_rank
        self.members = np.arange(h * P * B, (h + 1) * P * B, dtype=np.int64)  # global samples planned here
        self._keys(window[0])
        # as a directory host: the keys every host asked about (in host order), where each host's begin
        self.demanded, self.demand_start = np.zeros(0, dtype=np.int64), {}
        self.demand_owner = np.zeros(0, dtype=np.int32)  # the owner of every demanded key, read in phase 2
        self.victims = np.zeros(0, dtype=np.int64)

    def _keys(self, sub: GlobalBatch) -> None:
        pol = self.pol
        self.sub = sub
        self.bk = pol.keys_of(sub)
        keys, H = self.bk.keys, pol.num_hosts
        # every key's directory host; the demand's order (by host, each host's keys in key order) and every key's
        # index in it: one compiled pass over the sorted keys where the kernels are on
        if native.enabled():
            got = native.demand(keys, pol.layout.offsets, pol.directory.block, pol.ranks_per_host, H)
            self.dir_host, self.demand_order, self.demand_index, self.demand_counts = got
        else:
            self.dir_host = pol.directory_host_of(keys)
            self.demand_counts = np.bincount(self.dir_host, minlength=H)
            self.demand_order = stable_order(self.dir_host)
            starts = np.cumsum(self.demand_counts) - self.demand_counts
            self.demand_index = np.empty(keys.shape[0], dtype=np.int64)
            self.demand_index[self.demand_order] = np.arange(keys.shape[0]) - np.repeat(starts, self.demand_counts)
        self.own = np.zeros(0, dtype=np.int64)

    # ---- settings, once ---------------------------------------------------------------------------------------
    def settings(self) -> dict[int, Message]:
        """Host 0 chooses the per-host tables and refine rounds from its first window and tells every host."""
        if self.h != 0:
            return {}
        sel = self.pol.choose_settings(self.window)
        m = [np.asarray(sel.tables, dtype=np.int64), np.asarray(sel.benefit, dtype=np.float64),
             np.array([sel.refine, sel.est_ms, np.nan if sel.budget_ms is None else sel.budget_ms])]  # fmt: skip
        return {t: m for t in range(1, self.pol.num_hosts)}

    def adopt_settings(self, m: Message | None) -> None:
        if self.pol.has_settings:
            return
        if m is None:
            raise RuntimeError(f"herald_hier: host {self.h} received no settings from host 0")
        tables, benefit, (refine, est_ms, budget) = m
        self.pol.adopt_settings(TableSelection(
            tables=tables, refine=int(refine), benefit=benefit, est_ms=float(est_ms),
            budget_ms=None if np.isnan(budget) else float(budget),
        ))  # fmt: skip

    # ---- phases 1-2: demand, owners ---------------------------------------------------------------------------
    def demand(self, count: bool = True) -> Outgoing:
        """Phase 1: the distinct keys of h's samples, to their directory hosts."""
        H, k = self.pol.num_hosts, self.demand_counts
        if count and self.msg.on:
            self.msg.add_many("demand", self.h, np.arange(H), k * KEY_BYTES, H)
            self.msg.add_many("owners", np.arange(H), self.h, k * RANK_BYTES, H)
            self.msg.add_many("decisions", np.arange(H), self.h, k * RANK_BYTES, H)
        bounds = np.concatenate([[0], np.cumsum(k)])
        t = np.flatnonzero(k)
        # the keys by directory host, each host's in key order; the owners come back in this order
        return Outbox.from_bounds(t, [self.bk.keys[self.demand_order]], bounds[t], bounds[t + 1])

    def owners(self, inbox: Mapping[int, Message]) -> Outgoing:
        """Phase 2, as a directory host: the current owner of every key each host demanded."""
        sources = sorted(inbox)
        (self.demanded,) = concatenated(inbox, (np.int64,))  # every host's demand, in host order
        n = source_counts(inbox)
        at = np.cumsum(n) - n
        self.demand_start = dict(zip(sources, at.tolist()))
        # kept for phase 5 (no move lands in between): its decision reads no array over every row a second time
        self.demand_owner = self.pol.directory.owner[self.demanded]
        owner = self.demand_owner.astype(self.pol.rank_dtype)
        return Outbox.from_bounds(np.array(sources, dtype=np.int64), [owner], at, at + n)

    def receive_owners(self, inbox: Mapping[int, Message]) -> None:
        """Phase 2's answers: every directory host's (in host order) aligned with the demand it got."""
        (owners,) = concatenated(inbox, (np.int64,))
        if owners.shape[0] != self.demand_order.shape[0]:
            raise RuntimeError(
                f"herald_hier: host {self.h} got {owners.shape[0]} owners for {self.bk.keys.shape[0]} keys"
            )
        self.own = np.empty(self.bk.keys.shape[0], dtype=np.int64)
        self.own[self.demand_order] = owners

    def take_samples(self, sub: GlobalBatch, members: np.ndarray) -> None:
        """Phase 2b (in-process only): h's samples after the swaps; the keys new to h are demanded, and their owners
        come with the samples."""
        pol, H = self.pol, self.pol.num_hosts
        old = self.bk.keys
        self.members = members
        self._keys(sub)
        self.own = pol.directory.owner[self.bk.keys].astype(np.int64)
        new_keys = np.setdiff1d(self.bk.keys, old, assume_unique=True)
        hk = np.bincount(pol.directory_host_of(new_keys), minlength=H)
        self.msg.add_many("demand", self.h, np.arange(H), hk * KEY_BYTES, H)
        self.msg.add_many("decisions", np.arange(H), self.h, hk * RANK_BYTES, H)

    # ---- phases 3-4: LAIA over h's ranks, reads --------------------------------------------------------------
    def assign_and_read(self) -> Outgoing:
        """Phase 3 (LAIA over h's P ranks) and phase 4: every (key, reader rank) pair of h with its element count, to
        the key's directory host (the key as its index in h's demand)."""
        pol, h = self.pol, self.h
        P, H = pol.ranks_per_host, pol.num_hosts
        bk = self.bk
        own_local = np.where(self.own // P == h, self.own - h * P, -1)
        if pol.level == STATIC:  # every sample on the rank that loaded it
            a = np.repeat(np.arange(P, dtype=np.int64), pol.batch_per_rank)
        else:
            a = pol.host_assign(self.sub, bk, own_local)
        self.local_rank = a
        pol.directory.last_use[bk.keys] = pol.step  # h's keys are read: its guests among them are pinned
        self.window_keys = [pol.keys_of(x).keys for x in self.window[1:]]
        out, hosts_p = self._reads(a)
        if self.msg.on:
            self.msg.add_many("reads", h, np.arange(H), hosts_p * (INDEX_BYTES + RANK_BYTES + COUNT_BYTES), H)
        return out

    def _reads(self, a: np.ndarray) -> tuple[Outbox, np.ndarray]:
        """Phase 4's messages for the assignment `a` (rank 0..P-1 of every sample): to each directory host, its keys'
        (index in the demand, reader rank, elements) triples in (key, rank) order; and the pairs per host. One
        compiled pass where the kernels are on."""
        pol, h, bk = self.pol, self.h, self.bk
        P, H, rk = pol.ranks_per_host, pol.num_hosts, pol.rank_dtype
        if native.enabled():
            smp = None if bk.width is not None else bk.smp
            K = bk.keys.shape[0]
            bounds, idx, rank, cnt = native.host_reads(
                bk.cid, bk.width, smp, a, K, P, self.dir_host, H, self.demand_index, h * P
            )
            rank = rank.astype(rk)
            hosts_p = np.diff(bounds)
            t = np.flatnonzero(hosts_p)
            return Outbox.from_bounds(t, [idx, rank, cnt], bounds[t], bounds[t + 1]), hosts_p
        rd = step_reads(bk, a, P)
        cnt = np.bincount(bk.cid * P + bk.element_ranks(a), minlength=bk.keys.shape[0] * P)[
            rd.pair_key * P + rd.pair_rank
        ]
        dest = self.dir_host[rd.pair_key]
        out = Outbox.by_host(
            dest,
            H,
            [self.demand_index[rd.pair_key].astype(np.int32), (rd.pair_rank + h * P).astype(rk), cnt.astype(np.int32)],
        )
        return out, np.bincount(dest, minlength=H)

    # ---- phases 5-6, as a directory host: decisions, arrivals -------------------------------------------------
    def decide(self, inbox: Mapping[int, Message]) -> Outgoing:
        """Phase 5: herald's decision for h's keys on the union of their reads; phase 6: every move into a rank of
        host t, to t (key, source, destination, whether one rank reads it), with the pins: h's keys held as guests
        on host t and read only by other hosts (t must not evict them this step). One compiled pass where the kernels
        are on (`HeraldHierPolicy.decide_host`), else numpy."""
        pol = self.pol
        R, P, H = pol.num_ranks, pol.ranks_per_host, pol.num_hosts
        start = np.array([self.demand_start[s] for s in sorted(inbox)], dtype=np.int64)  # each sender's demand
        if native.enabled():  # one compiled pass, owner balancing included (HeraldHierPolicy.decide_host)
            idx, r, c = concatenated(inbox, (np.int32, pol.rank_dtype, np.int32))  # as `_reads` sends them
            got = pol.decide_host(self.h, start, source_counts(inbox), idx, r, c, self.demanded, self.demand_owner)
            self.keys, self.k_own, self.want, self.single = got.keys, got.own, got.want, got.single
            self.sole, self.pk, self.pr = got.sole, got.pair_key, got.pair_rank
            if self.msg.on:
                self.msg.add_many("arrivals", self.h, np.arange(H), got.arrivals_to * (KEY_BYTES + 2 * RANK_BYTES), H)
                self.msg.add_many("pins", self.h, np.arange(H), got.pins_to * KEY_BYTES, H)
            return Outbox(got.dests.tolist(), got.fields, got.starts, got.stops)
        idx, r, c = concatenated(inbox, (np.int64, np.int64, np.int64))
        # each pair's key: its index in the demand of the host that sent it
        g = self.demanded[idx + np.repeat(start, source_counts(inbox))]
        srt = stable_order(g * R + r)
        g, r, c = g[srt], r[srt], c[srt]
        self.keys, self.k_own, self.want, self.single, self.sole, self.pk, self.pr = pol.decide_keys(g, r, c, self.h)
        if pol.level == STATIC:  # every row stays with its owner: a read by another rank is a shared read
            self.want = self.k_own.copy()
        keys, own, want, pk = self.keys, self.k_own, self.want, self.pk
        owner_host_reads = np.zeros(keys.shape[0], dtype=bool)
        owner_host_reads[pk[self.pr // P == own[pk] // P]] = True
        pin = np.flatnonzero((own != pol.home_of(keys)) & ~owner_host_reads)
        mv = np.flatnonzero(want != own)
        if self.msg.on:
            self.msg.add_many("arrivals", self.h, want[mv] // P, KEY_BYTES + 2 * RANK_BYTES, H)
            self.msg.add_many("pins", self.h, own[pin] // P, KEY_BYTES, H)
        rk = pol.rank_dtype
        arrivals = [keys[mv], own[mv].astype(rk), want[mv].astype(rk), self.single[mv].astype(np.int8)]
        pins = [keys[pin]]
        return Outbox.joined([Outbox.by_host(want[mv] // P, H, arrivals), Outbox.by_host(own[pin] // P, H, pins)])

    # ---- phase 7, for h's ranks: room for the arrivals ---------------------------------------------------------
    def make_room(self, inbox: Mapping[int, Message]) -> Outgoing:
        """Phase 7: victims among h's guests, else cancelled arrivals (`HeraldHierPolicy.room_for_arrivals`); the
        cancellations go back to the keys' directory hosts."""
        pol, t = self.pol, self.h
        H = pol.num_hosts
        d = pol.directory
        keys, own, want, single, pins = concatenated(inbox, (np.int64, np.int64, np.int64, bool, np.int64))
        d.last_use[pins] = pol.step
        if pol.guests_compiled:  # the whole phase in one compiled pass, from the arrivals as they came
            got = native.host_room(
                d, pol.eviction, keys, own, want, single, t, pol.ranks_per_host, H, pol.layout.offsets, d.block,
                self.window_keys, pol.step, pol.lookahead + 1,
            )  # fmt: skip
            self.victims, cancelled = got.victims, got.cancelled
            bounds = np.concatenate([[0], np.cumsum(got.per_host)])
            to = np.flatnonzero(got.per_host)
            out = Outbox.from_bounds(to, [cancelled], bounds[to], bounds[to + 1])
        else:
            o = stable_order(keys)
            keys, own, want, single = keys[o], own[o], want[o], single[o]
            before = want.copy()
            self.victims = pol.room_for_arrivals(t, keys, own, pol.home_of(keys), want, single, self.window_keys)
            cancelled = keys[want != before]
            out = Outbox.by_host(pol.directory_host_of(cancelled), H, [cancelled])
        if self.msg.on:
            self.msg.add_many("cancels", t, pol.directory_host_of(cancelled), INDEX_BYTES, H)
            self.msg.add_many("evictions", t, pol.directory_host_of(self.victims), KEY_BYTES, H)
        return out

    # ---- phase 8: the final decisions, h's part of the plan ----------------------------------------------------
    def part(self, inbox: Mapping[int, Message]) -> Message:
        """Phase 8: h's part of the plan, for every host: as a directory host, its keys' migrations (key, source,
        destination) and shared rows (key, owner, reader count, readers), with its hit and remote-read counts; as a
        capacity host, its victims and their owners; as a sample host, the rank of each of its samples. One compiled
        pass where the kernels are on (`native.host_part`), else numpy."""
        pol = self.pol
        P, H = pol.ranks_per_host, pol.num_hosts
        keys, own, want, single, sole = self.keys, self.k_own, self.want, self.single, self.sole
        (cancelled,) = concatenated(inbox, (np.int64,))
        rk = pol.rank_dtype  # ranks and reader counts (<= R)
        if native.enabled():  # one compiled pass
            got = native.host_part(keys, own, want, single, sole, self.pk, self.pr, cancelled, self.victims,
                                   pol.directory.owner, self.local_rank, self.h * P, rk)  # fmt: skip
            if self.msg.on:
                self.msg.add_many("departures", self.h, got.mig_src.astype(np.int64) // P, KEY_BYTES + RANK_BYTES, H)
                nbytes = KEY_BYTES + COUNT_BYTES + RANK_BYTES * got.sh_count.astype(np.int64)
                self.msg.add_many("shares", self.h, got.sh_owner.astype(np.int64) // P, nbytes, H)
            self.final = _HostDecisions(mig=got.mig, shared=got.shared, shared_pair_row=got.shared_pair_row,
                                        readers=got.readers, counts=got.counts)  # fmt: skip
            return [
                got.mig_key, got.mig_src, got.mig_dst, got.sh_key, got.sh_owner, got.sh_count, got.readers_rk,
                self.victims, got.victim_src, self.members, got.sample_rank, got.counts,
            ]  # fmt: skip
        at = np.searchsorted(keys, cancelled)
        want[at] = own[at]
        pk, pr = self.pk, self.pr  # the pairs, sorted by key then rank (`decide`)
        count = np.bincount(pk, minlength=keys.shape[0])
        mig = np.flatnonzero(want != own)
        if self.msg.on:
            self.msg.add_many("departures", self.h, own[mig] // P, KEY_BYTES + RANK_BYTES, H)
        exclusive = single & (sole == want)
        moved = want != own
        pair_owner = want[pk]
        hit = int(((pair_owner == pr) & ~moved[pk]).sum())
        remote = int((pair_owner != pr).sum())
        ids = np.flatnonzero(~exclusive)
        if self.msg.on:
            self.msg.add_many("shares", self.h, want[ids] // P, KEY_BYTES + COUNT_BYTES + RANK_BYTES * count[ids], H)
        shared_pair = (~exclusive)[pk]
        self.final = _HostDecisions(
            mig=mig, shared=ids, shared_pair_row=np.cumsum(~exclusive)[pk[shared_pair]] - 1,
            readers=pr[shared_pair], counts=np.array([hit, remote], dtype=np.int64),
        )  # fmt: skip
        victim_src = pol.directory.owner[self.victims].astype(rk)  # h's own guests: its replica knows them
        return [
            keys[mig], own[mig].astype(rk), want[mig].astype(rk),
            keys[ids], want[ids].astype(rk), count[ids].astype(rk), self.final.readers.astype(rk),
            self.victims, victim_src, self.members, (self.local_rank + self.h * P).astype(rk),
            self.final.counts,
        ]  # fmt: skip

    def routed(self, part: Message) -> dict[int, Outbox]:
        """Phase 8 where every host keeps only its own ranks' plan (`plan_host`): `part` (h's, from `part`) split by
        the host that needs each entry (HostPlan's rule): a migration to its source's and destination's hosts and to
        every host that receives its row as shared; a shared row with all its readers to the hosts of its owners
        before and after the moves, and to every other host with its readers there; a victim to its owner's host
        (h), its home host and its directory host. Every host also gets h's step summary: its counts (hit, remote,
        migrations, victims) and its tables with moves, shared rows and relayed (row, host) groups (a bit each:
        MOVED, SHARED, RELAYED). One compiled pass where the kernels are on (`native.route_part`), else numpy."""
        pol, h, fin = self.pol, self.h, self.final
        P, H, T = pol.ranks_per_host, pol.num_hosts, pol.layout.num_tables
        if native.enabled():
            got = native.route_part(
                h, P, H, pol.layout.offsets, pol.directory.block, self.k_own, fin.mig, fin.shared, fin.readers,
                fin.counts, part,
            )  # fmt: skip
            if got is not None:
                return {h: Outbox(list(range(H)), got.fields, got.starts, got.stops)}
        mig_key, mig_src, mig_dst, sh_key, sh_owner, sh_count, sh_readers, victims, victim_src = part[:9]
        before = self.k_own[fin.shared].astype(np.int64)
        after = sh_owner.astype(np.int64)
        row, readers = fin.shared_pair_row, fin.readers
        routes = _route_shared(sh_count, readers, row, before, after, P, H)
        run_dest = np.repeat(np.arange(H, dtype=np.int64), np.diff(routes.run_bounds))
        run_row, pair = routes.run_row, routes.pair  # every (host, row) sent, by host then key; their pairs
        # migrations: to both ends' hosts, and a shared row's to every host its row goes to (both ends' included)
        n_mig = mig_key.shape[0]
        k_mig = np.full(self.keys.shape[0], -1, dtype=np.int64)
        k_mig[fin.mig] = np.arange(n_mig)
        row_mig = k_mig[fin.shared]  # each shared row's migration (-1: none)
        plain = np.ones(n_mig, dtype=bool)
        plain[row_mig[row_mig >= 0]] = False
        m_src_h, m_dst_h = mig_src.astype(np.int64) // P, mig_dst.astype(np.int64) // P
        pm = np.flatnonzero(plain)
        pm2 = pm[m_dst_h[pm] != m_src_h[pm]]
        shm = row_mig[run_row]
        m_code = sort_ints(np.concatenate([m_src_h[pm] * n_mig + pm, m_dst_h[pm2] * n_mig + pm2,
                                         run_dest[shm >= 0] * n_mig + shm[shm >= 0]]))  # fmt: skip
        m_dest, m_idx = np.divmod(m_code, max(n_mig, 1))
        # victims: to h, to their home host (the row goes there) and to their directory host (its owner changes)
        n_vic = victims.shape[0]
        v_home, v_dir = pol.home_of(victims) // P, pol.directory_host_of(victims)
        at = np.arange(n_vic)
        v_code = sorted_distinct(np.concatenate([h * n_vic + at, v_home * n_vic + at, v_dir * n_vic + at]))
        v_dest, v_idx = np.divmod(v_code, max(n_vic, 1))
        # the summary: counts and table bits
        flags = np.zeros(T, dtype=np.uint8)
        flags[pol.sorted_tables(mig_key)] |= MOVED  # (each part's keys come sorted)
        flags[pol.sorted_tables(victims)] |= MOVED
        sh_table = pol.sorted_tables(sh_key)
        flags[sh_table] |= SHARED
        flags[sh_table[routes.relayed]] |= RELAYED
        summary = np.concatenate([fin.counts, [n_mig, victims.shape[0]]]).astype(np.int64)
        # gathered once, then sliced per host
        s_key, s_owner, s_readers = sh_key[run_row], sh_owner[run_row], sh_readers[pair]
        run_count = routes.run_count.astype(pol.rank_dtype)
        g_key, g_src, g_dst = mig_key[m_idx], mig_src[m_idx], mig_dst[m_idx]
        g_victims, g_vsrc = victims[v_idx], victim_src[v_idx]
        hosts = np.arange(H + 1)
        rb, pb = np.asarray(routes.run_bounds), np.asarray(routes.dest_bounds)
        mb, vb = np.searchsorted(m_dest, hosts), np.searchsorted(v_dest, hosts)
        fields = [g_key, g_src, g_dst, s_key, s_owner, run_count, s_readers, g_victims, g_vsrc, summary, flags]
        whole = np.zeros(H + 1, dtype=np.int64)  # the summary and the table bits: whole, to every host
        lo = np.stack([mb, mb, mb, rb, rb, rb, pb, vb, vb, whole, whole], axis=1)
        hi = np.stack([mb, mb, mb, rb, rb, rb, pb, vb, vb, whole + summary.shape[0], whole + T], axis=1)
        return {h: Outbox(list(range(H)), fields, lo[:-1], hi[1:])}


@dataclass
class _SharedRoutes:
    """A home host's shared pairs by the host that executes them (`HostPlanner.routed`, numpy): host t gets pairs
    `pair[dest_bounds[t]:dest_bounds[t + 1]]` (indices into the readers, in order), as runs of one row's pairs
    (`run_row`, `run_count`, host t's runs at `run_bounds[t]:run_bounds[t + 1]`); `relayed`: the rows with a (row,
    host) group a host relay serves."""

    dest_bounds: np.ndarray
    pair: np.ndarray
    run_bounds: np.ndarray
    run_row: np.ndarray
    run_count: np.ndarray
    relayed: np.ndarray


def _route_shared(
    count: np.ndarray, readers: np.ndarray, row: np.ndarray, before: np.ndarray, after: np.ndarray, P: int, H: int
) -> _SharedRoutes:
    """A directory host's shared pairs by the host that executes them (`HostPlanner.routed`;
    `_SharedRoutes`): every pair to the hosts of its row's owners before and after the moves, and each other
    host its own pairs, the pairs' order (key, then rank) kept within a host; and the rows a host relay serves
    somewhere (`relayed_pairs`). numpy: (host, pair) codes, one sort (the kernels route the whole part,
    `native.route_part`)."""
    n_pairs = readers.shape[0]
    r_host = readers // P
    b_host, a_host = before // P, after // P
    alone = (r_host != b_host[row]) & (r_host != a_host[row])
    dest = np.concatenate([np.repeat(b_host, count), np.repeat(np.where(a_host != b_host, a_host, H), count),
                           np.where(alone, r_host, H)])  # fmt: skip
    code = dest * max(n_pairs, 1) + np.tile(np.arange(n_pairs, dtype=np.int64), 3)
    code = np.sort(code[dest < H])
    dest, pair = np.divmod(code, max(n_pairs, 1))
    p_row = row[pair]
    run = np.flatnonzero(np.r_[True, (dest[1:] != dest[:-1]) | (p_row[1:] != p_row[:-1])]) if pair.shape[0] else pair
    hosts = np.arange(H + 1)
    relayed = np.zeros(count.shape[0], dtype=bool)
    relayed[row[relayed_pairs(row, readers, before, after, np.arange(H * P) // P)]] = True
    return _SharedRoutes(
        dest_bounds=np.searchsorted(dest, hosts),
        pair=pair,
        run_bounds=np.searchsorted(dest[run], hosts),
        run_row=p_row[run],
        run_count=np.diff(np.append(run, pair.shape[0])),
        relayed=relayed,
    )


@dataclass
class _HostDecisions:
    """A directory host's final decisions of a step (`HostPlanner.part`), indices into its keys: the migrations `mig`,
    the shared keys `shared`, each shared pair's row (index into `shared`) and reader, and its (hit, remote)
    counts."""

    mig: np.ndarray
    shared: np.ndarray
    shared_pair_row: np.ndarray
    readers: np.ndarray
    counts: np.ndarray
