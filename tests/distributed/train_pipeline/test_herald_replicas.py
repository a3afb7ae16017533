"""Herald's replicated rows, trained end to end (policy_options={"replicate": True}; distributed/step/replicas.py).

Four gloo ranks on two "machines" (each rank reports the host name of its pair, as the host-relay test does): Herald
replicates only where hosts matter. In the stream, rank r's samples read t1 row 10 + r - 1 (r > 0) in steps 0-2 and
every sample reads rows 10-13 in steps 3-6 (rows join the set in steps 0, 2 and 4, one from the guest slot Herald
had moved it to); in steps 3-6 one sample per rank reads one of rows 20-23, which Herald moves to that rank, and
from step 7 every sample reads rows 20-23 instead of 10-13: the set is re-declared with them, mostly from guest
slots, and rows 10-13 leave it (then read, moved and updated like any row). With `replica_interval=2` the set is
chosen every other step. The trained model equals the one-process model on the global batches (SGD, <= 1e-5); the
replicas really ran (all-reduced rows, joins, joins from guest slots), every copy equals its owner's row at the end,
and the host relays carry the rows that stay shared."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.distributed.train_pipeline.test_pipeline_edges import B, build, one_process_reference
from tests.helpers.machines import on_machine
from tests.helpers.ranks import rank_result, run_ranks

STEPS = 14
WORLD = 4
# t1 rows every sample reads (4000 + row is their global key: t0 has 4000 rows)
HOT_BEFORE, HOT_AFTER, SWITCH = torch.arange(10, 14), torch.arange(20, 24), 7


def replica_batches(rank: int, n: int):
    """n batches of this rank's slice (module docstring): f0, f2 single-hot and random; f1 multi-hot, the hot rows
    of the step and 0-1 random ids."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for i in range(n):
        f0 = torch.randint(0, 30, (B,), generator=g)
        f2 = torch.randint(0, 20, (B,), generator=g)
        hot = HOT_BEFORE if i < SWITCH else HOT_AFTER
        bags = []
        for s in range(B):
            if i < 3:  # rank r's samples read hot row r - 1 (r > 0): it moves to their rank before it joins the set
                own = hot[rank - 1 : rank] if rank > 0 else hot[:0]
            else:
                own = hot
            if i >= SWITCH and s == 0:  # a row that left the set, read through Herald's path again
                own = torch.cat([own, HOT_BEFORE[rank : rank + 1]])
            if 3 <= i < SWITCH and s == 0 and rank > 0:  # one reader for a later hot row: it moves to a guest slot
                own = torch.cat([own, HOT_AFTER[rank - 1 : rank]])
            extra = torch.randint(30, 50, (int(torch.randint(0, 2, (1,), generator=g)),), generator=g)
            bags.append(torch.cat([own, extra]))
        lens = torch.cat(
            [
                torch.ones(B, dtype=torch.int32),
                torch.tensor([b.numel() for b in bags], dtype=torch.int32),
                torch.ones(B, dtype=torch.int32),
            ]
        )
        kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.cat([f0, *bags, f2]), lengths=lens)
        out.append(Batch(torch.randn(B, 3, generator=g), kjt, torch.randint(0, 2, (B,), generator=g).float()))
    return out


def replica_drift(module) -> tuple[list[int], float]:
    """The rows of the module's replica region (global keys) and the largest difference, value and optimizer state,
    between this rank's copies and their owners' rows (collective: an all-reduce of the owners' rows)."""
    import numpy as np
    import torch.distributed as dist

    (region,) = [e.region for e in module._extensions if e.plan_part == "replicas"]
    if region.copies is None:
        return [], 0.0
    st = module.store
    gk = np.flatnonzero(region.slot_of >= 0)
    tables = st.tables_of(gk)
    width = st.packed_widths(tables)
    start = np.concatenate([[0], np.cumsum(width)[:-1]]).astype(np.int64)
    owners = torch.zeros(int(width.sum()))
    slot = st.slot_of_all[gk].astype(np.int64)
    for k in np.flatnonzero(slot >= 0):  # this rank's own rows
        owners[start[k] : start[k] + width[k]] = st.read_packed(tables[k : k + 1], slot[k : k + 1])
    dist.all_reduce(owners)
    copies = region.copies.read_packed(tables, region.slot_of[gk])
    return gk.tolist(), float((owners - copies).abs().max())


def replicas_worker(rank: int, world: int, out_dir: str) -> None:
    """STEPS steps of Herald with replication on two "machines" of two ranks; a DCP checkpoint, this rank's rows
    by kind and (on rank 0, which plans) the policy's description."""

    import torch.distributed.checkpoint as dcp

    from herald_torchrec import HeraldOptions
    from herald_torchrec.distributed.train_pipeline.pipeline import herald_modules

    with on_machine(f"machine-{rank // 2}"):
        options = HeraldOptions(
            cache_ratio=0.05, lookahead=2, policy_options={"replicate": True, "replica_interval": 2}
        )
        dmp, pipeline = build("herald", options=options)
        it = iter(replica_batches(rank, STEPS))
        for _ in range(STEPS):
            pipeline.progress(it)
        drift = {name: replica_drift(m) for name, m in zip(("ebc_a", "ebc_b"), herald_modules(dmp))}
        dcp.save({"model": dmp.state_dict()}, checkpoint_id=str(Path(out_dir) / "ckpt"))
        policy = pipeline.policy.describe() if pipeline.policy is not None else None
        pipeline.close()
    torch.save(
        {"counters": dict(pipeline.trained_counters), "policy": policy, "drift": drift}, rank_result(out_dir, rank)
    )


def test_herald_replicas_train_the_one_process_model(tmp_path: Path) -> None:
    from tests.scenarios.test_dropin import full_checkpoint

    run_ranks("tests.distributed.train_pipeline.test_herald_replicas:replicas_worker", tmp_path, world_size=WORLD)
    ref = one_process_reference(WORLD, STEPS, data=replica_batches)
    got = full_checkpoint(tmp_path / "ckpt")
    assert sum(".embedding_bags." in k for k in got) == 3 and all(k in ref for k in got)
    worst = max(float((ref[k] - got[k]).abs().max()) for k in got)
    assert worst < 1e-5, worst
    res = [torch.load(rank_result(tmp_path, q)) for q in range(WORLD)]
    total = {k: sum(r["counters"].get(k, 0) for r in res) for k in ("allreduce", "replica_join", "replica_join_guest")}
    # the replicas ran: rows read through replicas in steps 0-5 (1, 1, 2, 2, 4, 4) and 8-13 (4 each), on every rank
    assert total["allreduce"] == WORLD * 38, total
    # sets declared at steps 0, 2, 4 and 8 brought 1 + 1 + 2 + 4 rows; rows that Herald had moved to their one reader
    # joined from that guest slot (the second set's, at least three of them)
    assert total["replica_join"] == 8 and total["replica_join_guest"] >= 3, total
    assert res[0]["policy"]["replica_joins"] == 8 and res[0]["policy"]["replicated_rows"] == 4, res[0]["policy"]
    # every copy equals its owner's row, value and optimizer state (the last set: the four rows hot since step 7)
    for r in res:
        assert r["drift"]["ebc_a"] == ([4000 + int(k) for k in HOT_AFTER], 0.0), r["drift"]
    # the rows that stay shared cross machines through the host relays
    assert sum(r["counters"].get("cross_host", 0) for r in res) > 0
