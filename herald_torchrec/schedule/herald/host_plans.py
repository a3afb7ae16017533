"""The plans of `herald_hier`'s hosts from their parts: each host's `HostPlan` from the entries routed to it, the
moves that bring its replica up to date, and (the simulator) the whole `Plan` from every host's part.

Why: the last phase of a host's step (hierarchy.py's docstring, phase 8 and after) turns what the directory hosts
routed to it into the plan its ranks execute and applies the step's moves to what its replica keeps (the owners of
its home rows, its ranks' guests); no process builds the whole plan in training, but the simulator's checker and
counts need it. One compiled pass where the kernels are on (`native.host_plan`), else numpy: the same arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from herald_torchrec.schedule import native
from herald_torchrec.schedule.herald.host_messages import MOVED, RELAYED, SHARED, concatenated
from herald_torchrec.schedule.herald.host_planner import HostPlanner
from herald_torchrec.schedule.message_wire import Message
from herald_torchrec.schedule.plan import EVICT_HOME, MIGRATE, HostPlan, Plan, RowMoves, SharedRows
from herald_torchrec.schedule.policy import order_from_assignment
from herald_torchrec.schedule.reads import in_sorted, stable_order

# every function takes the HeraldHierPolicy that drives the step (hierarchy.py imports this module, not the reverse)
Policy = Any


@dataclass
class HostMoves:
    """The moves a host applies to its replica after a step (`host_plan`), aligned by row: key, destination, source,
    home rank, table; `ranks`: the host's ranks (lo, hi), whose guests it keeps."""

    ranks: tuple[int, int]
    gid: np.ndarray
    dst: np.ndarray
    src: np.ndarray
    home: np.ndarray
    table: np.ndarray


@dataclass
class PartRows:
    """A step's moves and shared rows (`part_rows`), with every move's key and home rank and the number of victims
    among the moves."""

    moves: RowMoves
    shared: SharedRows
    gid: np.ndarray
    home: np.ndarray
    victims: int  # of the moves, the victims sent home


def host_plan(pol: Policy, hp: HostPlanner, part: Message, inbox: Mapping[int, Message]) -> tuple[HostPlan, HostMoves]:
    """Host h's plan (`HostPlan`) from what every host routed to it (`HostPlanner.routed`), and the moves that
    bring h's replica up to date for what h reads of it (`apply_host_moves`): the owners of its home rows (every
    migration it decided, and the victims sent home to it) and its ranks' guests (the moves into and out of
    them). One compiled pass where the kernels are on (`native.host_plan`), else numpy: the same arrays."""
    h, P = hp.h, pol.ranks_per_host
    cat = concatenated(inbox, part_dtypes(pol.rank_dtype))
    fin = hp.final
    own, samples = (fin.mig, hp.keys, hp.want, hp.k_own), (part[9], part[10])
    got = None
    if native.enabled():
        got = native.host_plan(cat, pol.layout.offsets, pol.directory.block, h, P, own, samples, *_KINDS_BITS)
    if got is None:
        return _host_plan_numpy(pol, hp, part, cat)
    moves = HostMoves(
        ranks=(h * P, (h + 1) * P),
        gid=got.replica_gid,
        dst=got.replica_dst,
        src=got.replica_src,
        home=got.replica_home,
        table=got.replica_table,
    )
    return _host_plan_of(
        pol,
        h,
        got.sample_order,
        RowMoves(got.moves_table, got.moves_row, got.moves_src, got.moves_dst, got.moves_kind),
        _shared_rows(got),
        _counters(got.hit, got.remote, got.migrations, got.victims),
        got.slice_ranks,
        (got.moved_tables, got.shared_tables, got.relayed_tables),
    ), moves


def _host_plan_numpy(pol: Policy, hp: HostPlanner, part: Message, cat: list[np.ndarray]) -> tuple[HostPlan, HostMoves]:
    """`host_plan` in numpy, from the inbox's fields concatenated (`cat`)."""
    h, P, T = hp.h, pol.ranks_per_host, pol.layout.num_tables
    summary, flags = cat[9], cat[10]
    rows = _part_rows_numpy(pol, cat[:9])
    # the replica: this plan's moves, and the rest of h's own decisions (only their owners change here)
    fin = hp.final
    mine = hp.keys[fin.mig]
    extra = ~in_sorted(mine, rows.gid)  # (the moves come in key order)
    moves = HostMoves(
        ranks=(h * P, (h + 1) * P),
        gid=np.concatenate([rows.gid, mine[extra]]),
        dst=np.concatenate([rows.moves.dst, hp.want[fin.mig][extra]]),
        src=np.concatenate([rows.moves.src, hp.k_own[fin.mig][extra]]),
        home=np.concatenate([rows.home, pol.home_of(mine[extra])]),
        table=np.concatenate([rows.moves.table, pol.table_of(mine[extra])]),
    )
    hit, remote, n_mig, n_victims = (int(x) for x in summary.reshape(-1, 4).sum(axis=0))
    bits = np.bitwise_or.reduce(flags.reshape(-1, T), axis=0) if flags.shape[0] else np.zeros(T, np.uint8)
    members, ranks = part[9], part[10].astype(np.int64)
    local = ranks - h * P
    order = members[order_from_assignment(local, P)]
    mv = rows.moves  # less the victims that came for their directory entry only
    k = np.flatnonzero((mv.kind != EVICT_HOME) | (mv.src // P == h) | (mv.dst // P == h))
    return _host_plan_of(
        pol,
        h,
        order,
        RowMoves(mv.table[k], mv.row[k], mv.src[k], mv.dst[k], mv.kind[k]),
        rows.shared,
        _counters(hit, remote, n_mig, n_victims),
        ranks[np.argsort(members, kind="stable")],
        tuple(np.flatnonzero(bits & b) for b in (MOVED, SHARED, RELAYED)),
    ), moves


def _host_plan_of(pol: Policy, h, order, moves, shared, counters, slice_ranks, tables) -> HostPlan:
    """Host h's `HostPlan` of these arrays; `tables`: those with moves, shared rows and relayed groups."""
    P = pol.ranks_per_host
    return HostPlan(
        step=pol.step,
        num_ranks=pol.num_ranks,
        batch_per_rank=pol.batch_per_rank,
        sample_order=order,
        moves=moves,
        shared=shared,
        counters=counters,
        host=h,
        ranks=np.arange(h * P, (h + 1) * P, dtype=np.int64),
        hosts=pol.host_of_rank.astype(np.int64),
        slice_ranks=slice_ranks,
        moved_tables=tables[0],
        shared_tables=tables[1],
        relayed_tables=tables[2],
    )


def apply_host_moves(pol: Policy, m: HostMoves, stage: str) -> None:
    """A host's moves (`host_plan`) applied to what its replica keeps: the owners of the rows, the guests of its
    own ranks, in two stages: "release", then "land" (every host's rows leave before any arrives, where several
    hosts apply theirs to one directory); "both" for a host alone (one compiled call)."""
    d = pol.directory
    if pol.guests_compiled and stage == "both":
        native.move_guests(d, pol.eviction, m.gid, m.src, m.dst, m.home, m.table, *m.ranks)
        return
    if stage in ("release", "both"):
        if pol.guests_compiled:
            native.release_guests(d, m.gid, m.src, m.home, m.table, *m.ranks)
        else:
            d.release_guests(m.gid, m.src, m.home, m.table, m.ranks)
    if stage in ("land", "both"):
        if pol.guests_compiled:
            native.land_guests(d, pol.eviction, m.gid, m.dst, m.home, m.table, *m.ranks)
        else:
            got = d.land_guests(m.gid, m.dst, m.home, m.table, m.ranks)
            pol.eviction.arrived(got.pos, got.keys, got.groups)


def whole_plan(pol: Policy, parts: list[list[np.ndarray]], apply: bool = True) -> Plan:
    """The whole Plan from every host's part (`HostPlanner.part`): the same arrays, in the same order, as one
    planner deciding every key at once (`part_rows`); its moves applied to this process's directory (`apply`), unless
    every host applied its own (`apply_host_moves`)."""
    R, B = pol.num_ranks, pol.batch_per_rank
    members, ranks, counts = [np.concatenate([p[i] for p in parts]) for i in (9, 10, 11)]
    rows = part_rows(pol, concatenated(dict(enumerate(parts)), part_dtypes(pol.rank_dtype)[:9]))
    if apply:
        mv = rows.moves
        got = pol.directory.apply_known_moves(rows.gid, mv.dst, mv.src, rows.home, mv.table)
        pol.eviction.arrived(got.pos, got.keys, got.groups)
    sample_rank = np.empty(R * B, dtype=np.int64)
    sample_rank[members] = ranks
    hit, remote = (int(x) for x in counts.reshape(-1, 2).sum(axis=0))
    return Plan(
        step=pol.step,
        num_ranks=R,
        batch_per_rank=B,
        sample_order=order_from_assignment(sample_rank, R),
        moves=rows.moves,
        shared=rows.shared,
        counters=_counters(hit, remote, len(rows.moves) - rows.victims, rows.victims),
    )


def part_dtypes(rank_dtype: type) -> tuple:
    """The dtypes of a routed part's fields (`HostPlanner.routed`): migrations (key, source, destination), shared
    rows (key, owner, reader count, readers), victims (key, owner), the step summary and the table bits."""
    rk = rank_dtype
    return (np.int64, rk, rk, np.int64, rk, rk, rk, np.int64, rk, np.int64, np.uint8)


def part_rows(pol: Policy, cat: list[np.ndarray]) -> PartRows:
    """Moves and shared rows from the hosts' parts, whole (`HostPlanner.part`) or routed (`HostPlanner.routed`),
    each field concatenated over the parts in host order (`cat`): their migrations (key, source,
    destination), shared rows (key, owner, reader count, readers) and victims (key, owner). Every move and shared
    row in key order, as one planner deciding every key at once: a part's keys come sorted and are distinct across
    parts (a key has one directory host; a victim is a guest nobody read, never a migrating key), so one stable
    sort orders every move and one the shared keys (numpy's timsort merges the parts' sorted runs; the compiled
    pass, `native.host_plan` where the kernels are on, merges them the same way), and the keys' tables come from
    the sorted keys and the layout's offsets: no array over every row is read (every planner runs this in
    training). The directory gets the moves in key order: its slots only keep the arrivals' order within a group,
    which is the migrations' key order either way."""
    got = None
    if native.enabled():
        got = native.host_plan(cat, pol.layout.offsets, pol.directory.block, -1, 1, None, None, *_KINDS_BITS)
    if got is not None:
        moves = RowMoves(got.moves_table, got.moves_row, got.moves_src, got.moves_dst, got.moves_kind)
        return PartRows(moves, _shared_rows(got), gid=got.replica_gid, home=got.replica_home, victims=cat[7].shape[0])
    return _part_rows_numpy(pol, cat)


def _part_rows_numpy(pol: Policy, cat: list[np.ndarray]) -> PartRows:
    """`part_rows` in numpy (where the kernels are off or declined the inputs)."""
    mig_key, mig_src, mig_dst, sh_key, sh_owner, sh_count, sh_readers, victims, victim_src = cat
    n_mig, n_vic = mig_key.shape[0], victims.shape[0]
    # moves: the migrations, then the victims (sent home from their owner), in one order by key
    mv_gid = np.concatenate([mig_key, victims])
    o = stable_order(mv_gid)
    mv_gid = mv_gid[o]
    mv_src = np.concatenate([mig_src.astype(np.int64), victim_src.astype(np.int64)])[o]
    mv_table = pol.sorted_tables(mv_gid)
    mv_row = mv_gid - pol.layout.offsets[mv_table]
    mv_home = mv_row // pol.directory.block[mv_table]
    mv_dst = np.concatenate([mig_dst.astype(np.int64), np.zeros(n_vic, dtype=np.int64)])[o]
    is_victim = o >= n_mig
    mv_dst[is_victim] = mv_home[is_victim]
    mv_kind = np.where(is_victim, np.int8(EVICT_HOME), np.int8(MIGRATE))
    moves = RowMoves(table=mv_table, row=mv_row, src=mv_src, dst=mv_dst, kind=mv_kind)
    # shared rows: every directory host's keys, sorted by key, each with its readers (sorted by rank)
    sh_count = sh_count.astype(np.int64)
    o = stable_order(sh_key)
    keys, cnt = sh_key[o], sh_count[o]
    offs = np.zeros(keys.shape[0] + 1, dtype=np.int64)
    np.cumsum(cnt, out=offs[1:])
    starts = np.cumsum(sh_count) - sh_count  # each key's readers in the parts' order
    if native.enabled():
        readers = native.gather_segments(sh_readers, starts, sh_count, o)
    else:
        readers = sh_readers[np.repeat(starts[o] - offs[:-1], cnt) + np.arange(int(offs[-1]), dtype=np.int64)]
    sh_table = pol.sorted_tables(keys)
    shared = SharedRows(
        table=sh_table,
        row=keys - pol.layout.offsets[sh_table],
        owner=sh_owner[o].astype(np.int64),
        reader_offsets=offs,
        readers=readers.astype(np.int64, copy=False),
    )
    return PartRows(moves=moves, shared=shared, gid=mv_gid, home=mv_home, victims=n_vic)


_KINDS_BITS = ((MIGRATE, EVICT_HOME), (MOVED, SHARED, RELAYED))  # native.host_plan's move kinds and table bits


def _shared_rows(got: native.HostPlanArrays) -> SharedRows:
    return SharedRows(got.shared_table, got.shared_row, got.shared_owner, got.shared_offsets, got.shared_readers)


def _counters(hit: int, remote: int, migrations: int, victims: int) -> dict[str, int]:
    return {
        "hit": hit,
        "migrate": int(migrations),
        "evict_home": int(victims),
        "forward": 0,
        "shared_value": remote,
        "shared_grad": remote,
    }
