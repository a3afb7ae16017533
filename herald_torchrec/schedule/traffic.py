"""Where a plan's rows travel when ranks share hosts: rows that cross hosts and rows that stay inside one.

Ranks r .. r+H-1 share a host (H = `ranks_per_host`; the last host may hold fewer). On real clusters the links
between hosts are what embedding traffic costs, so the simulator reports a plan's rows split by host. Two ways of
delivering the same plan are counted (the names of the fields say "today" and "host-aggregated"):

* **direct** ("today": the data plane with `host_relay=False`, and the comparison systems' own collectives): each
  shared row's value goes to every reading rank, each reader's gradient
  comes back on its own; every row move, pull and push is one rank-to-rank transfer; an all-reduce is a flat ring
  over the ranks in order (each of its R links carries 2 (R-1) / R rows per reduced row; the links from one host to
  the next cross).
* **host-aggregated**: a value sent from one rank to several ranks of another host (a shared value, a cache pull, a
  replica refresh) crosses once, to one of them, who hands it to the others inside the host; gradients sent from
  several ranks of one host to one rank (shared gradients, cache pushes) are summed inside the host and one sum
  crosses; an all-reduce is hierarchical (inside each host, then a ring over the hosts: 2 (hosts-1) crossing rows per
  reduced row). Row moves stay point to point. The rows on the wire in all are the same; only where they go changes.
  The data plane delivers Herald's shared rows so by default where ranks share hosts (one relay per row and host,
  distributed/step/host_relay.py); HET's cache pulls and pushes and the replicas' flat all-reduce are not relayed.

A transfer inside one rank (a parameter-server model pulling a row its own rank holds) counts as intra-host, so that
`cross + intra` of every kind equals the plan's counter for it. numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from herald_torchrec.schedule.plan import MOVE_KIND_NAMES, Plan

FAN_OUT, FAN_IN, POINT = "out", "in", "point"
_FANS = (FAN_OUT, FAN_IN, POINT)


def _i64(n: int = 0) -> np.ndarray:
    return np.zeros(n, dtype=np.int64)


@dataclass
class KindTransfers:
    """The rows of one kind that one step sends: row `key[i]` goes rank `src[i]` -> rank `dst[i]`.

    `fan` says how a host-aware data plane could merge them: FAN_OUT (one rank sends the same value of a row to
    several ranks: merged per (key, src, destination host)), FAN_IN (several ranks send gradients of one row to one
    rank: summed per (key, dst, source host)), POINT (a row and its state change place: never merged). `key` only
    has to be equal for the same row within the step; `table` (optional) attributes the rows to tables."""

    key: np.ndarray = field(default_factory=_i64)
    src: np.ndarray = field(default_factory=_i64)
    dst: np.ndarray = field(default_factory=_i64)
    fan: str = POINT
    table: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.fan not in _FANS:
            raise ValueError(f"KindTransfers: fan must be one of {_FANS}, got {self.fan!r}")
        n = self.key.shape[0]
        if self.src.shape[0] != n or self.dst.shape[0] != n or (self.table is not None and self.table.shape[0] != n):
            raise ValueError("KindTransfers: key, src, dst (and table) must have one entry per transfer")

    def __len__(self) -> int:
        return int(self.key.shape[0])


@dataclass
class HostTraffic:
    """One step's transmitted rows by kind, split into rows that cross hosts and rows that stay inside a host, as the
    data plane delivers them today and with host aggregation (module docstring). Counts are rows (all-reduce rows are
    ring shares, hence floats). `rank_rows`: rows each rank sends plus receives today (transfers between ranks only),
    whose busiest / mean is the step's balance. `unattributed`: counted kinds the plan gives no endpoints for (left
    out of every other figure). `cross_by_table*`: crossing rows per (kind, table), where the kind names tables."""

    num_ranks: int
    ranks_per_host: int
    cross: dict[str, float] = field(default_factory=dict)
    intra: dict[str, float] = field(default_factory=dict)
    cross_aggregated: dict[str, float] = field(default_factory=dict)
    intra_aggregated: dict[str, float] = field(default_factory=dict)
    rank_rows: np.ndarray = field(default_factory=lambda: np.zeros(0))
    unattributed: dict[str, int] = field(default_factory=dict)
    cross_by_table: dict[tuple[str, int], float] = field(default_factory=dict)  # (kind, table) -> crossing rows
    cross_by_table_aggregated: dict[tuple[str, int], float] = field(default_factory=dict)

    @property
    def num_hosts(self) -> int:
        return -(-self.num_ranks // self.ranks_per_host)

    @property
    def cross_rows(self) -> float:
        return float(sum(self.cross.values()))

    @property
    def intra_rows(self) -> float:
        return float(sum(self.intra.values()))

    @property
    def cross_rows_aggregated(self) -> float:
        return float(sum(self.cross_aggregated.values()))

    @property
    def intra_rows_aggregated(self) -> float:
        return float(sum(self.intra_aggregated.values()))

    def balance(self) -> float:
        """The busiest rank's rows (sent + received) over the mean rank's; 1.0 for a step that sends nothing."""
        mean = float(self.rank_rows.mean()) if self.rank_rows.shape[0] else 0.0
        return float(self.rank_rows.max()) / mean if mean > 0 else 1.0


def host_of(rank: np.ndarray, ranks_per_host: int) -> np.ndarray:
    """Host index of ranks (ranks r .. r+H-1 share a host)."""
    return np.asarray(rank, dtype=np.int64) // ranks_per_host


def check_ranks_per_host(ranks_per_host: int) -> int:
    if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, (int, np.integer)) or ranks_per_host < 1:
        raise ValueError(f"ranks_per_host must be an integer >= 1, got {ranks_per_host!r}")
    return int(ranks_per_host)


def plan_transfers(plan: Plan) -> dict[str, KindTransfers]:
    """The transfers a plan locates itself, by kind: its row moves (POINT) and, where its counters count them, the
    shared rows' values (FAN_OUT from the owner to every other reader) and gradients (FAN_IN back)."""
    out: dict[str, KindTransfers] = {}
    mv = plan.moves
    for code, name in MOVE_KIND_NAMES.items():
        m = mv.kind == code
        if name in plan.counters or m.any():
            out[name] = KindTransfers(mv.row[m].astype(np.int64), mv.src[m], mv.dst[m], POINT, mv.table[m])
    sh = plan.shared
    if "shared_value" in plan.counters or "shared_grad" in plan.counters:
        counts = np.diff(sh.reader_offsets)
        idx = np.repeat(np.arange(len(sh), dtype=np.int64), counts)
        owner = sh.owner[idx]
        remote = sh.readers != owner
        key, own, rdr, tab = idx[remote], owner[remote], sh.readers[remote], sh.table[idx][remote]
        out["shared_value"] = KindTransfers(key, own, rdr, FAN_OUT, tab)
        out["shared_grad"] = KindTransfers(key, rdr, own, FAN_IN, tab)
    return out


def _count_kind(tr: KindTransfers, R: int, H: int) -> tuple[float, float, float, float, np.ndarray, np.ndarray]:
    """(cross, intra, cross aggregated, intra aggregated, cross per transfer today (bool), cross kept aggregated
    per transfer (float weights)) of one kind's transfers."""
    hs, hd = host_of(tr.src, H), host_of(tr.dst, H)
    crosses = hs != hd
    n, n_cross = len(tr), int(crosses.sum())
    nh = -(-R // H)
    weight = crosses.astype(np.float64)  # crossing rows per transfer, aggregated (groups share one crossing)
    if tr.fan == POINT or n_cross == 0:
        groups = n_cross
    else:
        c = np.flatnonzero(crosses)
        if tr.fan == FAN_OUT:  # one crossing per (row, sender, receiving host)
            a, b, h = tr.key[c], tr.src[c], hd[c]
        else:  # one summed gradient per (row, receiver, sending host)
            a, b, h = tr.key[c], tr.dst[c], hs[c]
        code = (a * R + b) * nh + h if int(a.max()) + 1 <= (2**62) // max(R * nh, 1) else None
        if code is not None:
            _, inv, cnt = np.unique(code, return_inverse=True, return_counts=True)
        else:
            _, inv, cnt = np.unique(np.stack([a, b, h], axis=1), axis=0, return_inverse=True, return_counts=True)
        inv = inv.reshape(-1)
        groups = int(cnt.shape[0])
        weight[c] = 1.0 / cnt[inv]
    return float(n_cross), float(n - n_cross), float(groups), float(n - groups), crosses, weight


def _ring_allreduce(rows: int, R: int, H: int) -> tuple[float, float, float, float, float]:
    """(cross, intra, cross aggregated, intra aggregated, rows per rank sent + received) of all-reducing `rows`
    rows over R ranks: a flat ring today, hierarchical (inside hosts, then a ring over hosts) aggregated."""
    if R <= 1 or rows == 0:
        return 0.0, 0.0, 0.0, 0.0, 0.0
    nh = -(-R // H)
    total = 2.0 * (R - 1) * rows
    cross_links = nh if nh > 1 else 0  # the ring's links from each host's last rank to the next host's first
    cross = total * cross_links / R
    cross_agg = 2.0 * (nh - 1) * rows
    return cross, total - cross, cross_agg, total - cross_agg, 2.0 * total / R


def host_traffic(
    plan: Plan,
    ranks_per_host: int,
    transfers: dict[str, KindTransfers] | None = None,
) -> HostTraffic:
    """Split a plan's transmitted rows by host (module docstring). `transfers`: what the policy sent that the plan
    does not locate (the cache and replica policies' `last_transfers`), merged over the plan's own."""
    H = check_ranks_per_host(ranks_per_host)
    R = plan.num_ranks
    kinds = plan_transfers(plan)
    kinds.update(transfers or {})
    out = HostTraffic(num_ranks=R, ranks_per_host=H, rank_rows=np.zeros(R, dtype=np.float64))
    by_table: dict[tuple[str, int], float] = {}
    by_table_agg: dict[tuple[str, int], float] = {}
    for name, tr in kinds.items():
        cr, ir, cra, ira, crosses, weight = _count_kind(tr, R, H)
        out.cross[name], out.intra[name] = cr, ir
        out.cross_aggregated[name], out.intra_aggregated[name] = cra, ira
        between = tr.src != tr.dst
        out.rank_rows += np.bincount(tr.src[between], minlength=R) + np.bincount(tr.dst[between], minlength=R)
        if tr.table is not None and tr.table.shape[0]:
            nt = int(tr.table.max()) + 1
            for acc, w in ((by_table, crosses.astype(np.float64)), (by_table_agg, weight)):
                for t, v in enumerate(np.bincount(tr.table, weights=w, minlength=nt)):
                    if v:
                        acc[(name, t)] = float(v)
    if plan.replicas is not None and "allreduce" in plan.counters:
        rows = int(plan.replicas.allreduce_row.shape[0])
        cr, ir, cra, ira, per_rank = _ring_allreduce(rows, R, H)
        out.cross["allreduce"], out.intra["allreduce"] = cr, ir
        out.cross_aggregated["allreduce"], out.intra_aggregated["allreduce"] = cra, ira
        out.rank_rows += per_rank
    for name, v in plan.counters.items():
        if name != "hit" and name not in out.cross and v:
            out.unattributed[name] = int(v)
    out.cross_by_table, out.cross_by_table_aggregated = by_table, by_table_agg
    return out
