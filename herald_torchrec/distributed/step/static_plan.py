"""The *static* plan, built on the data plane: owners never move, every read by a non-owner is shared.

Eval batches and runs without a scheduler have no queued plan; the sharded module then makes this one itself:
every rank packs its distinct keys (`static_plan_keys`), the keys are all-gathered (`HeraldLookup.static_plan` in
embedding_lookup.py), and every rank builds the same `Plan` from them (`static_plan`). It has no moves, so the
scheduler's directory stays in step with the data plane. Numpy only, like step/prepare.py, which executes a plan: this
module makes one.
"""

from __future__ import annotations

import numpy as np

from herald_torchrec.distributed.step.prepare import LocalInput
from herald_torchrec.distributed.storage.row_store import RowStore
from herald_torchrec.schedule.plan import Plan, SharedRows


def static_plan_keys(local: LocalInput, st: RowStore) -> np.ndarray:
    """This rank's distinct (row, table) keys, packed as row * T + table, for the all-gather of the static plan."""
    T = st.num_tables
    u = np.unique(local.gkeys)  # by table, then row
    t_u = st.tables_of(u)
    return (u - st.key_base[t_u]) * T + t_u  # ids are < rows, so no overflow for realistic sizes


def static_plan(gathered: list[np.ndarray], st: RowStore, batch_size: int) -> Plan:
    """The plan of the `static` policy from every rank's `static_plan_keys` (gathered[q] from rank q): owners stay,
    every non-owner read is shared, sample_order is the identity. Used when no plan is queued (eval batches, runs
    without a scheduler)."""
    R, T = st.world_size, st.num_tables
    k_all = np.concatenate(gathered)
    rk_all = np.concatenate([np.full(g.shape[0], q, dtype=np.int64) for q, g in enumerate(gathered)])
    order = np.lexsort((rk_all, k_all))
    k_all, rk_all = k_all[order], rk_all[order]
    uk, start, cnt = np.unique(k_all, return_index=True, return_counts=True)
    tab, row = uk % T, uk // T
    owner = st.owner_all[st.gkeys(tab, row)].astype(np.int64)
    excl = (cnt == 1) & (rk_all[start] == owner)
    hit = int((rk_all == np.repeat(owner, cnt)).sum())  # (key, reader) pairs read by the owner
    sel = np.flatnonzero(~excl)
    readers = rk_all[np.repeat(~excl, cnt)]
    ro = np.concatenate([[0], np.cumsum(cnt[sel])]).astype(np.int64)
    shared = SharedRows(table=tab[sel], row=row[sel], owner=owner[sel], reader_offsets=ro, readers=readers)
    remote = shared.remote_reads()
    return Plan(
        step=-1,
        num_ranks=R,
        batch_per_rank=batch_size,
        sample_order=np.arange(R * batch_size, dtype=np.int64),
        shared=shared,
        counters={
            "hit": hit,
            "migrate": 0,
            "evict_home": 0,
            "forward": 0,
            "shared_value": remote,
            "shared_grad": remote,
        },
    )
