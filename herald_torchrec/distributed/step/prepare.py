"""Plan execution, host side: what one rank sends and receives in a step, prepared in numpy before any collective.

The data plane of a step (embeddingbag.py) is two all-to-alls (moves + shared values, then shared gradients) whose
every split size comes from the plan, which is identical on every rank. This module turns (Plan, the RowStore's
directories, this rank's ids) into dataclasses that say exactly what moves where: the row moves (`MoveStep`), the
shared-row exchange (`SharedStep`), the classification of the local ids (exclusive / shared, hits); the index
layouts of the lookup and of the shared-row gradient sums are lookup_layout.py, and the *static* plan built from
every rank's ids is static_plan.py. It holds no process group and changes no directory: every function is a pure
function of arrays and of the store's directories (it reads `owner_all`, `slot_of_all`, `guest_count_all`, ...), so
a two-rank step can be checked in one process with two RowStores (tests/distributed/step/test_prepare.py). Like
TorchRec's sharding/*.py, it is the "who sends what" half; dist_data.py is the "send it" half.

Plan checks raise ValueError with the plan's step. Checks that only use the plan and the global directories raise
alike on every rank (so no rank is left in a collective); checks against the local batch (`local_input`,
`classify`) are rank-local and the caller makes every rank raise together (dist_data.ErrorCheck).
All tables are handled at once, on global keys (`RowStore.key_base[t] + row`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from herald_torchrec.distributed import host_kernels
from herald_torchrec.distributed.step.host_relay import (
    FROM_OWNER,
    FROM_RELAY,
    TO_OWNER,
    TO_RELAY,
    HostMap,
    LinkRows,
    pair_routes,
)
from herald_torchrec.distributed.step.plan_part import owners_before_moves
from herald_torchrec.distributed.storage.row_layout import exclusive_cumsum, ragged_arange
from herald_torchrec.distributed.storage.row_store import RowStore
from herald_torchrec.schedule.plan import EVICT_HOME, MOVE_KIND_NAMES, Plan, PlanPart


def empty_ids() -> np.ndarray:
    """An empty int64 index array (the default of the index fields below)."""
    return np.zeros(0, dtype=np.int64)


@dataclass
class MoveStep:
    """One step's row moves as seen by this rank (sizes identical everywhere, from the plan)."""

    send_idx: np.ndarray  # move indices this rank sends, in send order (by dst)
    recv_idx: np.ndarray  # move indices this rank receives, in receive order (by src)
    send_splits: list[int]  # all-to-all splits in elements (row value + optimizer state)
    recv_splits: list[int]
    globally_empty: bool  # no move on any rank: the collective is skipped everywhere
    table: np.ndarray = field(default_factory=empty_ids)  # every move: table, row, dst, kind
    row: np.ndarray = field(default_factory=empty_ids)
    dst: np.ndarray = field(default_factory=empty_ids)
    kind: np.ndarray = field(default_factory=empty_ids)
    gkey_sorted: np.ndarray = field(default_factory=empty_ids)  # moved global keys, sorted
    dst_sorted: np.ndarray = field(default_factory=empty_ids)  # their destinations


@dataclass
class SharedStep:
    """One step's shared-row exchange as seen by this rank (built from the plan; identical sizes everywhere).

    Values travel from the row's owner *before* the step's moves (a moving row has the same value on both sides of
    its move), so they ride on the step's one forward all-to-all together with the moves; a reader that receives the
    row itself in the moves (it is the owner after them) reads it from its store once the moves are applied (the
    `fill` pairs: no value is sent twice). Gradients go back to the owner *after* the moves, which applies one
    update per row. Pairs are (key, reader) pairs; `send_*` name the owner's side of the gradient return."""

    send_table: np.ndarray  # pairs this rank owns after the moves, by reader: table, row, global key
    send_row: np.ndarray
    send_gkey: np.ndarray
    send_off: np.ndarray  # float offset of each pair in the returned-gradient buffer
    send_splits: list[int]  # returned-gradient floats from each reader
    recv_table: np.ndarray  # pairs this rank reads, in value order: received by sender rank, then the fill pairs
    recv_row: np.ndarray
    recv_off: np.ndarray  # float offset of each pair in the value buffer
    recv_splits: list[int]  # value floats received from each sender (fill pairs not included)
    n_values_out: int  # pairs owned here after the moves with another reader (the plan's `shared_value` rows)
    n_grads_out: int  # pairs read here whose owner after the moves is another rank (gradients sent back)
    globally_empty: bool
    marked: np.ndarray = field(default_factory=empty_ids)  # global keys of every shared row of the step
    recv_gkey: np.ndarray = field(default_factory=empty_ids)  # global keys of the pairs read here, in value order
    value_table: np.ndarray = field(default_factory=empty_ids)  # pairs whose value this rank sends, by reader
    value_gkey: np.ndarray = field(default_factory=empty_ids)
    value_splits: list[int] = field(default_factory=list)  # value floats sent to each reader
    n_fill: int = 0  # the last n_fill pairs of the value order are read from the store after the moves
    grad_idx: np.ndarray = field(default_factory=empty_ids)  # value-order positions in gradient send order (by owner)
    grad_splits: list[int] = field(default_factory=list)  # gradient floats sent to each owner
    values: "object | None" = (
        None  # the values in value order (torch.Tensor, flat; a leaf requiring grad when training)
    )
    owner_update: "object | None" = None  # embedding_lookup.OwnerUpdate: the TBE call whose backward is deferred
    # through host relays (host_relay.py; all empty without them): values this rank forwards as a relay (value-order
    # positions, by destination) after the first all-to-all, and the values it receives so (value order: after the
    # owners' values, before the fills); gradients it sends to its relays first (value-order positions, by relay),
    # and, as a relay, the value-order position each received gradient is added to before the sums go to the owners
    relayed: bool = False  # some rank relays this step (a global fact: the collectives below run on every rank)
    fwd_idx: np.ndarray = field(default_factory=empty_ids)
    fwd_splits: list[int] = field(default_factory=list)
    fwd_recv_splits: list[int] = field(default_factory=list)
    relay_grad_idx: np.ndarray = field(default_factory=empty_ids)
    relay_grad_splits: list[int] = field(default_factory=list)
    relay_grad_recv_splits: list[int] = field(default_factory=list)
    relay_add_idx: np.ndarray = field(default_factory=empty_ids)
    # rows this rank sends by link, where ranks share hosts (None: not counted): values and forwards, gradients
    value_links: LinkRows | None = None
    grad_links: LinkRows | None = None


@dataclass
class LocalInput:
    """This rank's ids, all module features in one flat array (feature order = table order): numpy passes over
    all features at once instead of one per feature."""

    batch_size: int
    values: np.ndarray  # int64, feature after feature
    lengths: np.ndarray  # int64 [F, B]
    gkeys: np.ndarray  # global key (store.key_base[table] + id) of every value
    seg: np.ndarray  # f * B + bag of every value
    weights: np.ndarray | None = None  # float32 per-sample weight of every value (weighted features), else None


def routes(
    src: np.ndarray, dst: np.ndarray, width: np.ndarray, rank: int, world: int
) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
    """Items going src -> dst: this rank's send / receive positions (grouped by peer, stable) and the all-to-all
    split sizes in elements (`width` elements per item)."""
    send = np.flatnonzero(src == rank)
    send = send[np.argsort(dst[send], kind="stable")]
    recv = np.flatnonzero(dst == rank)
    recv = recv[np.argsort(src[recv], kind="stable")]
    send_splits = np.bincount(dst[send], weights=width[send], minlength=world).astype(np.int64).tolist()
    recv_splits = np.bincount(src[recv], weights=width[recv], minlength=world).astype(np.int64).tolist()
    return send, recv, send_splits, recv_splits


_KNOWN_KIND = np.zeros(max(MOVE_KIND_NAMES) + 1, dtype=bool)  # a table lookup: np.isin sorts, every step
_KNOWN_KIND[list(MOVE_KIND_NAMES)] = True


def _table_name(st: RowStore, t: int) -> str:
    return st.tables[int(t)].name


# ------------------------------------------------------------------------------------------------------ input
def local_input(
    vals: np.ndarray,
    lens: np.ndarray,
    num_keys: int,
    batch_size: int,
    index: np.ndarray,
    st: RowStore,
    feature_names: list[str],
    weights: np.ndarray | None = None,
) -> LocalInput:
    """A KJT's values / lengths (`num_keys` keys in its own order) -> this module's features in table order, with
    every id range-checked. `index[f]` = position in the KJT of module feature f (feature order = the store's
    `feature_table_map`); `feature_names` name the module features in errors. `weights` (weighted features: one
    float per value, laid out as `vals`) are reordered with their ids."""
    B, K, F = batch_size, num_keys, len(feature_names)
    if lens.shape[0] != B * K:
        raise ValueError(f"input KeyedJaggedTensor: {lens.shape[0]} lengths for {K} keys x batch {B}")
    lens = lens.reshape(K, B)
    ftab = st.feature_table_arr
    if weights is not None and weights.shape[0] != vals.shape[0]:
        raise ValueError(f"input KeyedJaggedTensor: {weights.shape[0]} weights for {vals.shape[0]} values")
    if K == F and (index == np.arange(F)).all():  # the module's features, in its order: use the KJT as it is
        values, lengths = vals, lens
    else:
        per_key_len = lens.sum(axis=1)
        taken = ragged_arange(exclusive_cumsum(per_key_len)[index], per_key_len[index])
        values, lengths = vals[taken], lens[index]
        weights = None if weights is None else weights[taken]
    fast = host_kernels.local_input(values, lengths, ftab, st, B)
    if fast is not None:  # the same checks and keys, compiled (None: numpy below raises)
        return LocalInput(B, values, lengths, *fast, weights=weights)
    flen = lengths.sum(axis=1)
    bad = (values < 0) | (values >= np.repeat(st.rows_arr[ftab], flen))
    if bad.any():
        f = int(np.searchsorted(np.cumsum(flen), np.argmax(bad), side="right"))
        t = int(ftab[f])
        v = values[exclusive_cumsum(flen)[f] : exclusive_cumsum(flen)[f] + flen[f]]
        raise ValueError(
            f"feature {feature_names[f]!r} (table {_table_name(st, t)!r}, {st.rows[t]} rows): ids out of range "
            f"{v[(v < 0) | (v >= st.rows[t])][:5].tolist()}"
        )
    gkeys = values + np.repeat(st.key_base[ftab], flen)
    seg = np.repeat(np.arange(F * B, dtype=np.int64), lengths.reshape(-1))
    return LocalInput(B, values, lengths, gkeys, seg, weights)


# ------------------------------------------------------------------------------------------------------ moves
def prepare_moves(plan: Plan, st: RowStore) -> MoveStep:
    """Check the plan's moves against the ownership directory and the guest capacities (global checks: every rank
    raises alike) and lay out this rank's part of the moves all-to-all. A rank's part of the plan (`PlanPart`) holds
    only some moves and this rank's directory is exact for its own rows only: its moves are checked against its own
    rows and guest capacities (rank-local checks)."""
    R, r = st.world_size, st.rank
    mv = plan.moves
    part = plan if isinstance(plan, PlanPart) else None
    if len(mv) == 0:  # the all-to-all still runs where the step moves rows on other ranks
        z = empty_ids()
        return MoveStep(z, z, [0] * R, [0] * R, part is None or not part.moved_tables.shape[0])
    table = np.asarray(mv.table, dtype=np.int64)
    row = np.asarray(mv.row, dtype=np.int64)
    src = np.asarray(mv.src, dtype=np.int64)
    dst = np.asarray(mv.dst, dtype=np.int64)
    kind = np.asarray(mv.kind, dtype=np.int64)
    if not (table.shape == row.shape == src.shape == dst.shape == kind.shape):
        raise ValueError(f"plan {plan.step}: moves arrays differ in length")
    T = st.num_tables
    if part is None and table.min() >= 0 and table.max() < T:  # the same, compiled (None: numpy below raises)
        fast = host_kernels.prepare_moves(
            st, table, row, src, dst, kind, st.packed_widths(table), _KNOWN_KIND, EVICT_HOME
        )
        if fast is not None:
            return MoveStep(*fast[:4], False, table, row, dst, kind, *fast[4:])
    if table.min() < 0 or table.max() >= T:
        raise ValueError(f"plan {plan.step}: move table index out of range [0, {T})")
    if src.min() < 0 or src.max() >= R or dst.min() < 0 or dst.max() >= R:
        raise ValueError(f"plan {plan.step}: move src/dst rank out of range [0, {R})")
    if (src == dst).any():
        raise ValueError(f"plan {plan.step}: move with src == dst")
    if kind.min() < 0 or kind.max() >= _KNOWN_KIND.shape[0] or not _KNOWN_KIND[kind].all():
        raise ValueError(f"plan {plan.step}: unknown move kind in {np.unique(kind).tolist()}")
    st.check_keys_many(table, row, f"plan {plan.step}: moved rows")
    gkey = st.gkeys(table, row)
    if part is None:
        owner = st.owner_all[gkey]
        if (owner != src).any():
            i = int(np.argmax(owner != src))
            raise ValueError(
                f"plan {plan.step}: table {_table_name(st, table[i])!r} row {row[i]} moves from rank {src[i]} "
                f"but is owned by rank {owner[i]}"
            )
    else:
        here = st.owner_all[gkey] == r  # exact for this rank's own rows
        if ((src == r) != here).any() or (here & (dst == r)).any():
            i = int(np.argmax(((src == r) != here) | (here & (dst == r))))
            raise ValueError(
                f"plan {plan.step}: table {_table_name(st, table[i])!r} row {row[i]} moves from rank {src[i]} to "
                f"rank {dst[i]}, but rank {r} {'owns' if here[i] else 'does not own'} it"
            )
    home = row // st.home_block_arr[table]
    if ((kind == EVICT_HOME) & ((dst != home) | (src == home))).any():
        raise ValueError(f"plan {plan.step}: an evict_home move does not send a guest to its home rank")
    gc = st.guest_count_all.copy()
    leaves, arrives = src != home, dst != home  # a guest leaves src / arrives at dst
    if part is not None:  # only this rank's own guest counts are known here
        leaves, arrives = leaves & (src == r), arrives & (dst == r)
    gc -= np.bincount(table[leaves] * R + src[leaves], minlength=T * R).reshape(T, R)
    gc += np.bincount(table[arrives] * R + dst[arrives], minlength=T * R).reshape(T, R)
    if part is not None:
        gc[:, np.arange(R) != r] = 0
    over = gc > np.asarray(st.capacity, dtype=np.int64)[:, None]
    if over.any():
        t = int(np.argmax(over.any(axis=1)))
        q = int(np.argmax(gc[t]))
        raise ValueError(
            f"plan {plan.step}: after the moves rank {q} holds {gc[t, q]} guests of table "
            f"{_table_name(st, t)!r}, capacity {st.capacity[t]}"
        )
    order = np.argsort(gkey, kind="stable")
    gkey_sorted = gkey[order]
    if (gkey_sorted[1:] == gkey_sorted[:-1]).any():
        raise ValueError(f"plan {plan.step}: a row moves twice in one step")
    send_idx, recv_idx, send_splits, recv_splits = routes(src, dst, st.packed_widths(table), r, R)
    return MoveStep(send_idx, recv_idx, send_splits, recv_splits, False, table, row, dst, kind, gkey_sorted, dst[order])


def moved(ms: MoveStep, gkey: np.ndarray) -> np.ndarray:
    """Whether each global key moves this step."""
    if ms.gkey_sorted.shape[0] == 0:
        return np.zeros(gkey.shape[0], dtype=bool)
    pos = np.minimum(np.searchsorted(ms.gkey_sorted, gkey), ms.gkey_sorted.shape[0] - 1)
    return ms.gkey_sorted[pos] == gkey


def owners_after_moves(st: RowStore, ms: MoveStep, gkey: np.ndarray) -> np.ndarray:
    """Owner of global keys once this step's moves are applied (the moves themselves are not applied here)."""
    out = st.owner_all[gkey].astype(np.int64)
    if ms.gkey_sorted.shape[0]:
        pos = np.minimum(np.searchsorted(ms.gkey_sorted, gkey), ms.gkey_sorted.shape[0] - 1)
        hit = ms.gkey_sorted[pos] == gkey
        out[hit] = ms.dst_sorted[pos[hit]]
    return out


def sent_by_kind(ms: MoveStep) -> dict[str, int]:
    """Rows this rank sends in the step's moves, by move kind (the `migrate` / `evict_home` / `forward` counters)."""
    if ms.globally_empty:
        return {}
    sent_kind = ms.kind[ms.send_idx]
    return {name: int((sent_kind == k).sum()) for k, name in MOVE_KIND_NAMES.items()}


# ------------------------------------------------------------------------------------------------ shared rows
def prepare_shared(plan: Plan, st: RowStore, ms: MoveStep, hosts: HostMap | None = None) -> SharedStep:
    """Check the plan's shared rows (owners as after the moves, readers sorted and distinct; global checks) and lay
    out this rank's part of the values (sent with the moves, by the owners before them) and of the gradient return
    (to the owners after them). Call it before the step's moves are applied: it reads the current owners. With a
    `hosts` map whose ranks share hosts, rows are counted by host and (`hosts.relay`) delivered through one relay
    per host (host_relay.py); the compiled layout knows neither, so numpy lays those steps out."""
    R, r = st.world_size, st.rank
    sh = plan.shared
    n = len(sh)
    by_host = hosts is not None and hosts.shares_hosts
    part = plan if isinstance(plan, PlanPart) else None
    if part is not None:
        if part.rank != r:
            raise ValueError(f"plan {plan.step}: the part of rank {part.rank} was given to rank {r}")
        if part.relayed_tables.shape[0] and not (by_host and hosts.relays):
            raise ValueError(
                f"plan {plan.step}: the part was cut for host relays, which this module does not run (set_hosts)"
            )
    if n == 0:  # no pair here; the exchange still runs where the step has shared rows on other ranks
        z, zeros = empty_ids(), [0] * R
        anywhere = part is not None and part.shared_tables.shape[0] > 0
        return SharedStep(
            *(z, z, z, z, zeros, z, z, z, zeros, 0, 0, not anywhere),
            value_splits=zeros,
            grad_splits=zeros,
            relayed=anywhere and part.relayed_tables.shape[0] > 0,
            fwd_splits=zeros,
            fwd_recv_splits=zeros,
            relay_grad_splits=zeros,
            relay_grad_recv_splits=zeros,
            value_links=LinkRows() if by_host else None,
            grad_links=LinkRows() if by_host else None,
        )
    table = np.asarray(sh.table, dtype=np.int64)
    row = np.asarray(sh.row, dtype=np.int64)
    owner = np.asarray(sh.owner, dtype=np.int64)
    ro = np.asarray(sh.reader_offsets, dtype=np.int64)
    readers = np.asarray(sh.readers, dtype=np.int64)
    fast = (
        None
        if by_host or part is not None
        else host_kernels.prepare_shared(st, table, row, owner, ro, readers, ms.gkey_sorted, ms.dst_sorted)
    )
    if fast is not None:  # the same checks and layout, compiled (None: numpy below raises or handles unsorted rows)
        return SharedStep(globally_empty=False, **fast)
    T = st.num_tables
    if (
        not (table.shape == row.shape == owner.shape)
        or ro.shape[0] != n + 1
        or ro[0] != 0
        or ro[-1] != readers.shape[0]
    ):
        raise ValueError(f"plan {plan.step}: malformed shared rows (array lengths / reader_offsets)")
    counts = np.diff(ro)
    if (counts < 1).any():
        raise ValueError(f"plan {plan.step}: a shared row has no reader")
    if table.min() < 0 or table.max() >= T:
        raise ValueError(f"plan {plan.step}: shared table index out of range [0, {T})")
    if owner.min() < 0 or owner.max() >= R or readers.min() < 0 or readers.max() >= R:
        raise ValueError(f"plan {plan.step}: shared owner/reader rank out of range [0, {R})")
    pair_key = np.repeat(np.arange(n, dtype=np.int64), counts)
    if (np.diff(readers)[np.diff(pair_key) == 0] <= 0).any():
        raise ValueError(f"plan {plan.step}: readers of a shared row must be sorted and distinct")
    st.check_keys_many(table, row, f"plan {plan.step}: shared rows")
    gkey = st.gkeys(table, row)
    owner_after = owners_after_moves(st, ms, gkey)  # the moves are validated separately; applied virtually here
    wrong = owner_after != owner
    if part is not None:  # this rank's directory is exact for its own rows only
        wrong &= (owner_after == r) | (owner == r)
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        raise ValueError(
            f"plan {plan.step}: shared row {row[i]} of table {_table_name(st, table[i])!r} names owner {owner[i]}, "
            f"but its owner after the moves is {owner_after[i]}"
        )
    if not (gkey[1:] > gkey[:-1]).all() and np.unique(gkey).shape[0] != n:  # schedulers list them sorted: no sort
        raise ValueError(f"plan {plan.step}: a row is listed twice in shared")
    p_tab, p_row, p_own, p_key = table[pair_key], row[pair_key], owner[pair_key], gkey[pair_key]
    if part is None:
        p_pre = st.owner_all[p_key].astype(np.int64)  # owner before the moves: it holds the value now
    else:  # a part holds the moves of its shared rows: their sources
        p_pre = owners_before_moves(part)[pair_key]
    p_w = st.dims_arr[p_tab]
    fill = (readers == p_own) & (p_pre != p_own)  # the reader gets the row itself in the moves
    rt = pair_routes(pair_key, readers, p_pre, p_own, fill, hosts if by_host else None)
    relayed = rt.relayed
    if part is not None:  # a global fact: the part says it for the whole step (checked where it shows here)
        relayed, here = part.relayed_tables.shape[0] > 0, rt.relayed
        if here and not relayed:
            raise ValueError(f"plan {plan.step}: rank {r}'s part relays rows, but says the step relays none")
    # values: owner before the moves (or the host's relay after them) -> reader, fill pairs excepted; this rank's
    # reads in value order = received from the owners, then from its relays, then its fills
    via = np.flatnonzero(~fill & (rt.value_stage == FROM_OWNER))
    v_send, v_recv, value_splits, recv_splits = routes(rt.value_src[via], readers[via], p_w[via], r, R)
    v_send, v_recv = via[v_send], via[v_recv]
    fwd = np.flatnonzero(~fill & (rt.value_stage == FROM_RELAY))
    f_send, f_recv, fwd_splits, fwd_recv_splits = routes(rt.value_src[fwd], readers[fwd], p_w[fwd], r, R)
    f_send, f_recv = fwd[f_send], fwd[f_recv]
    fills = np.flatnonzero(fill & (readers == r))
    mine = np.concatenate([v_recv, f_recv, fills])
    position = np.empty(readers.shape[0], dtype=np.int64)
    position[mine] = np.arange(mine.shape[0], dtype=np.int64)
    # gradients: reader -> its host's relay (added to the relay's own) -> owner after the moves
    up = np.flatnonzero(rt.grad_stage == TO_RELAY)
    u_send, u_recv, relay_grad_splits, relay_grad_recv_splits = routes(readers[up], rt.grad_dst[up], p_w[up], r, R)
    u_send, u_recv = up[u_send], up[u_recv]
    last = np.flatnonzero(rt.grad_stage == TO_OWNER)
    g_send, g_recv, grad_splits, send_splits = routes(readers[last], rt.grad_dst[last], p_w[last], r, R)
    g_send, g_recv = last[g_send], last[g_recv]
    value_links = grad_links = None
    if by_host:
        value_links = LinkRows.of(hosts, r, np.concatenate([readers[v_send], readers[f_send]]))
        grad_links = LinkRows.of(hosts, r, np.concatenate([rt.grad_dst[u_send], rt.grad_dst[g_send]]))
    return SharedStep(
        send_table=p_tab[g_recv],
        send_row=p_row[g_recv],
        send_gkey=p_key[g_recv],
        send_off=exclusive_cumsum(p_w[g_recv]),
        send_splits=send_splits,
        recv_table=p_tab[mine],
        recv_row=p_row[mine],
        recv_off=exclusive_cumsum(p_w[mine]),
        recv_splits=recv_splits,
        n_values_out=int(((p_own == r) & (readers != r)).sum()),
        n_grads_out=int(((readers == r) & (p_own != r)).sum()),
        globally_empty=False,
        marked=gkey,
        recv_gkey=p_key[mine],
        value_table=p_tab[v_send],
        value_gkey=p_key[v_send],
        value_splits=value_splits,
        n_fill=int(fills.shape[0]),
        grad_idx=position[g_send],
        grad_splits=grad_splits,
        relayed=relayed,
        fwd_idx=position[rt.relay_pair[f_send]],
        fwd_splits=fwd_splits,
        fwd_recv_splits=fwd_recv_splits,
        relay_grad_idx=position[u_send],
        relay_grad_splits=relay_grad_splits,
        relay_grad_recv_splits=relay_grad_recv_splits,
        relay_add_idx=position[rt.relay_pair[u_recv]],
        value_links=value_links,
        grad_links=grad_links,
    )


class SharedMarks:
    """Step scratch by global key: `by_key[g]` is -1 (not shared this step), -2 (shared, not read here) or the
    index of g among the pairs this rank receives. One array for the module's lifetime (allocating one per step
    would cost O(total rows)); `mark` a step's keys, and `reset` them when the step is done."""

    NOT_SHARED = -1
    NOT_READ_HERE = -2

    def __init__(self, num_keys: int) -> None:
        self.by_key = np.full(int(num_keys), self.NOT_SHARED, dtype=np.int64)
        self._last = np.zeros(int(num_keys), dtype=np.int32)  # scratch of `distinct`: never needs a reset
        self.seen = np.zeros(int(num_keys), dtype=np.uint8)  # scratch of the compiled classify: all zero between uses

    def distinct(self, keys: np.ndarray) -> np.ndarray:
        """The distinct global keys among `keys`, in no particular order: O(n) with the scratch array, where
        np.unique would sort (each key's last position is written, then read back: the positions that win are one
        per key; entries of keys not in `keys` are never read, so stale ones do no harm)."""
        if keys.shape[0] >= 2**31:  # positions beyond the int32 scratch (half the bytes to scatter and gather)
            self._last = self._last.astype(np.int64)
        pos = np.arange(keys.shape[0], dtype=self._last.dtype)
        self._last[keys] = pos
        return keys[self._last[keys] == pos]

    def mark(self, sh: SharedStep) -> None:
        self.by_key[sh.marked] = self.NOT_READ_HERE
        self.by_key[sh.recv_gkey] = np.arange(sh.recv_gkey.shape[0], dtype=np.int64)

    def reset(self, sh: SharedStep) -> None:
        self.by_key[sh.marked] = self.NOT_SHARED


def classify(
    plan: Plan, local: LocalInput, ms: MoveStep, marks: SharedMarks, st: RowStore
) -> tuple[np.ndarray, np.ndarray]:
    """Check every local id against the plan (rank-local checks). Returns, per table, the hits (distinct keys read
    here that this rank owns after the moves and that did not move this step: no transfer at all, whether the key
    is exclusive or this rank is the owner reading a shared key) and the distinct keys read here."""
    T, rank = st.num_tables, st.rank
    gk = local.gkeys
    fast = host_kernels.classify(
        gk, marks.by_key, st.owner_all, ms.gkey_sorted, ms.dst_sorted, st.key_base, rank, marks.seen
    )
    if fast is not None:  # the same counts, compiled; a batch the plan does not allow goes on below, to raise
        return fast
    not_reader = marks.by_key[gk] == SharedMarks.NOT_READ_HERE
    if not_reader.any():
        g = int(gk[np.argmax(not_reader)])
        t = int(st.tables_of(np.asarray([g]))[0])
        raise ValueError(
            f"plan {plan.step} does not match the batch: rank {rank} reads shared row {g - st.key_base[t]} of "
            f"table {_table_name(st, t)!r} but is not among its readers"
        )
    u = marks.distinct(gk)
    tab = st.tables_of(u)
    own = owners_after_moves(st, ms, u)
    foreign = (marks.by_key[u] == SharedMarks.NOT_SHARED) & (own != rank)
    if foreign.any():
        i = int(np.argmax(foreign))
        raise ValueError(
            f"plan {plan.step} does not match the batch: rank {rank} reads row {u[i] - st.key_base[tab[i]]} of "
            f"table {_table_name(st, tab[i])!r}, owned by rank {int(own[i])} after the moves and not in plan.shared"
        )
    hit = (own == rank) & ~moved(ms, u)
    return np.bincount(tab[hit], minlength=T).astype(np.int64), np.bincount(tab, minlength=T).astype(np.int64)
