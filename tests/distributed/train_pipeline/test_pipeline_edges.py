"""HeraldTrainPipeline at the edges a TorchRec user's loop reaches (2 gloo ranks; each fails on the pre-Batch main):

- a model with two Herald-managed EBCs, with eval-mode forwards (plain and through TorchRec's EvalPipelineSparseDist)
  between training steps, trains the same model as stock TorchRec (eval consumes no training plan; the plan is split
  per module);
- the input stage runs on a gloo group of its own (host tensors: works beside an NCCL default group);
- ids of 2^31 or more are an error on every rank, never wrapped to int32;
- one rank running out of data first stops every rank with a warning that counts the dropped samples;
- a short last batch is dropped with a warning (drop_last);
- batch norm in the model is a warning;
- the lowest rank of each machine plans for its ranks and sends them the plans (plan_on="host", the default; one
  machine here, and two when rank 1 reports another host name), or rank 0 for all (plan_on="rank0"): every rank
  executes the plans every rank would have computed itself (plan_on="every_rank", here with the input stage in the
  training thread: prefetch=0; rank0 2 batches ahead, the default; host 16), and trains the same model; a failing
  planner stops every rank.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers.machines import on_machine
from tests.helpers.ranks import rank_result, run_ranks, run_ranks_sequence

B = 8
ROWS = {"t0": 4000, "t1": 5000, "t2": 4500}  # the default planner picks TABLE_WISE (not DATA_PARALLEL) for these
HASH = [30, 50, 20]


class TwoEBCModel(torch.nn.Module):
    """Two EmbeddingBagCollections (t0 + t1 reading f0, f1; t2 reading f2) and a small dense head; TorchRec's
    (loss, output) convention. `table_options`: EmbeddingBagConfig keywords per table (e.g. a pooling, a data type:
    the pooled values are read as float32 whatever the table's precision)."""

    def __init__(
        self, batch_norm: bool = False, weighted: bool = False, table_options: dict[str, dict] | None = None
    ) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()
        torch.manual_seed(0)
        options = table_options or {}

        def cfg(t: str, f: str) -> EmbeddingBagConfig:
            return EmbeddingBagConfig(
                name=t, embedding_dim=4, num_embeddings=ROWS[t], feature_names=[f], **options.get(t, {})
            )

        self.ebc_a = EmbeddingBagCollection(tables=[cfg("t0", "f0"), cfg("t1", "f1")], is_weighted=weighted)
        self.ebc_b = EmbeddingBagCollection(tables=[cfg("t2", "f2")], is_weighted=weighted)
        self.norm = torch.nn.BatchNorm1d(3) if batch_norm else torch.nn.Identity()
        self.head = torch.nn.Linear(3 + 12, 1)

    def forward(self, batch):
        a = self.ebc_a(batch.sparse_features).values().float()
        b = self.ebc_b(batch.sparse_features).values().float()
        logit = self.head(torch.cat([self.norm(batch.dense_features), a, b], dim=1)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, batch.labels.float())
        return loss, (loss.detach(), logit.detach(), batch.labels)


def batches(rank: int, n: int, big_id_at: int | None = None, short_last: int | None = None, weighted: bool = False):
    """n batches of this rank's slice (multi-hot f1 with empty bags), deterministic by rank; `weighted`: with a
    weight in [0.2, 2) per id (id-score lists; drawn apart, so the ids are those of the unweighted batches)."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(10 + rank)
    wg = torch.Generator().manual_seed(1000 + rank)
    out = []
    for i in range(n):
        m = short_last if (short_last is not None and i == n - 1) else B
        lens = torch.cat(
            [
                torch.ones(m, dtype=torch.int32),
                torch.randint(0, 3, (m,), generator=g, dtype=torch.int32),
                torch.ones(m, dtype=torch.int32),
            ]
        )
        vals = torch.cat(
            [torch.randint(0, h, (int(lens[k * m : (k + 1) * m].sum()),), generator=g) for k, h in enumerate(HASH)]
        )
        if big_id_at is not None and i == big_id_at:
            vals[0] = 2**31 + 3  # wraps to 3 in int32
        wts = torch.rand(vals.shape[0], generator=wg) * 1.8 + 0.2 if weighted else None
        kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=vals, lengths=lens, weights=wts)
        out.append(Batch(torch.randn(m, 3, generator=g), kjt, torch.randint(0, 2, (m,), generator=g).float()))
    return out


def build(kind: str, batch_norm: bool = False, weighted: bool = False, options=None, **pipeline_kwargs):
    """The two-EBC model (SGD in backward, lr 0.2; dense SGD, lr 0.1) sharded by Herald (cache 5 %, lookahead 2, or
    the sharder and pipeline both given `options`, a HeraldOptions) or by stock TorchRec, and its train pipeline."""
    from torchrec.distributed import TrainPipelineSparseDist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from herald_torchrec import HeraldEmbeddingBagCollectionSharder, HeraldTrainPipeline

    model = TwoEBCModel(batch_norm, weighted)
    init = {n: b.weight.detach().clone() for e in (model.ebc_a, model.ebc_b) for n, b in e.embedding_bags.items()}
    for ebc in (model.ebc_a, model.ebc_b):
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.2})
    herald = kind == "herald"
    if not herald:
        sharder = EmbeddingBagCollectionSharder()
    elif options is None:
        sharder = HeraldEmbeddingBagCollectionSharder(cache_ratio=0.05, lookahead=2)
    else:
        sharder = HeraldEmbeddingBagCollectionSharder(options=options)
        pipeline_kwargs["options"] = options
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder])
    if not herald:  # stock shards draw their own values: start from the unsharded model's, as Herald does
        from tests.scenarios.test_dropin import set_tables

        set_tables(dmp, init)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda p: torch.optim.SGD(p, lr=0.1)
    )
    return dmp, (HeraldTrainPipeline if herald else TrainPipelineSparseDist)(
        dmp, dense, torch.device("cpu"), **pipeline_kwargs
    )


def train_worker(rank: int, world: int, out_dir: str, kind: str, do_eval: bool = True) -> None:
    import torch.distributed.checkpoint as dcp

    dmp, pipeline = build(kind)
    data = batches(rank, 14)
    it = iter(data)
    for _ in range(6):
        pipeline.progress(it)
    model = (
        pipeline.detach() if do_eval else None
    )  # an eval forward between training steps, TorchRec's way (in-flight batches are kept)
    eval_loss = 0.0
    if do_eval:
        from torchrec.distributed.train_pipeline import EvalPipelineSparseDist

        model.eval()
        with torch.no_grad():
            eval_loss = float(model(data[0])[0])
            evaluator, eval_it = EvalPipelineSparseDist(model, None, torch.device("cpu")), iter(data[:3])
            eval_losses = [float(evaluator.progress(eval_it)[0]) for _ in range(3)]  # TorchRec's eval pipeline too
            evaluator.detach()
        assert abs(eval_losses[0] - eval_loss) < 1e-6
        model.train()
    for _ in range(6):
        pipeline.progress(it)
    dcp.save({"model": dmp.state_dict()}, checkpoint_id=str(Path(out_dir) / "ckpt"))
    extra = {}
    if kind == "herald":
        import torch.distributed as dist

        extra["host_backend"] = str(dist.get_backend(pipeline.input_stage.comm.group))
        extra["host_is_default"] = pipeline.input_stage.comm.group is dist.GroupMember.WORLD
        extra["counters"] = dict(pipeline.trained_counters)
    torch.save({"eval_loss": eval_loss, **extra}, rank_result(out_dir, rank))


@pytest.fixture(scope="module")
def against_stock(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runs compared with stock's pipeline, one after another in one pair of ranks (each trains in about a
    second; the ranks' start-up is paid once): out/eval, out/reload (Herald's run first: stock's loads its
    checkpoint) and out/weighted, each with a stock and a herald run."""
    out = tmp_path_factory.mktemp("against_stock")
    runs = {}
    for test, worker, kinds in (
        ("eval", "train_worker", ("stock", "herald")),
        ("reload", "reload_worker", ("herald", "stock")),
        ("weighted", "weighted_worker", ("stock", "herald")),
    ):
        for kind in kinds:
            runs[f"{test}/{kind}"] = (f"tests.distributed.train_pipeline.test_pipeline_edges:{worker}", {"kind": kind})
    run_ranks_sequence(runs, out, world_size=2)
    return out


def test_two_ebcs_with_eval_in_between_equal_stock(against_stock: Path) -> None:
    from tests.scenarios.test_dropin import full_checkpoint

    tmp_path = against_stock / "eval"
    got = {kind: full_checkpoint(tmp_path / kind / "ckpt") for kind in ("stock", "herald")}
    stock, herald = got["stock"], got["herald"]
    assert sorted(stock) == sorted(herald)
    assert sum(".embedding_bags." in k for k in stock) == 3
    worst = max(float((stock[k] - herald[k]).abs().max()) for k in stock)
    assert worst < 1e-5, worst
    r0 = torch.load(rank_result(tmp_path / "herald", 0))
    assert r0["host_backend"] == "gloo" and not r0["host_is_default"]
    assert r0["counters"]["shared_value"] + r0["counters"]["migrate"] > 0
    s0 = torch.load(rank_result(tmp_path / "stock", 0))
    assert abs(r0["eval_loss"] - s0["eval_loss"]) < 1e-5  # the eval forward saw the same model


def edges_worker(rank: int, world: int, out_dir: str, case: str) -> None:
    dmp, pipeline = build("herald")
    result: dict = {"steps": 0, "error": None}
    if case == "big_id":
        data = batches(rank, 5, big_id_at=2 if rank == 1 else None)
    elif case == "uneven":
        data = batches(rank, 4 if rank == 0 else 6)
    elif case == "empty":  # rank 0 has no data at all
        data = batches(rank, 0 if rank == 0 else 3)
    else:  # short: rank 0's last batch has 5 samples
        data = batches(rank, 5, short_last=5 if rank == 0 else None)
    it = iter(data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            while True:
                pipeline.progress(it)
                result["steps"] += 1
        except StopIteration:
            pass
        except ValueError as e:
            result["error"] = str(e)
    result["warnings"] = [str(w.message) for w in caught if "herald input" in str(w.message)]
    result["dropped"] = pipeline.input_stage.dropped_samples
    torch.save(result, rank_result(out_dir, rank))


EDGE_CASES = ["big_id", "uneven", "short", "empty"]


@pytest.fixture(scope="module")
def edge_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every edge case's run (out/case), one after another in one pair of ranks."""
    out = tmp_path_factory.mktemp("edges")
    worker = "tests.distributed.train_pipeline.test_pipeline_edges:edges_worker"
    run_ranks_sequence({case: (worker, {"case": case}) for case in EDGE_CASES}, out, world_size=2)
    return out


@pytest.mark.parametrize("case", EDGE_CASES)
def test_edge_input(edge_runs: Path, case: str) -> None:
    r = [torch.load(rank_result(edge_runs / case, q)) for q in range(2)]
    if (
        case == "big_id"
    ):  # rank 1's third batch holds id 2^31 + 3 (3 after an int32 wrap): both ranks stop with an error
        assert "out of range [2147483651]" in r[1]["error"], r[1]
        assert "rank 1 rejected its input" in r[0]["error"], r[0]
        assert r[0]["steps"] == r[1]["steps"] == 0  # the pipeline draws 2 batches ahead: batch 2 is seen at step 0
    elif case == "uneven":  # rank 0 has 4 batches, rank 1 has 6: 4 steps; rank 1 drops its 5th (in the round that
        # found the end) and its 6th (drawn a round ahead, its header words already sent), warned
        assert r[0]["steps"] == r[1]["steps"] == 4 and r[0]["error"] is None and r[1]["error"] is None
        assert r[1]["dropped"] == 2 * B and any(f"drops {2 * B} samples" in w for w in r[1]["warnings"]), r[1]
        assert r[0]["dropped"] == 0 and r[0]["warnings"], r[0]  # every rank hears why the run stopped
    elif case == "empty":  # every rank stops before the first step; the rank with data hears why
        assert r[0]["steps"] == r[1]["steps"] == 0 and r[0]["error"] is None and r[1]["error"] is None
        assert any("no data at all" in w for w in r[1]["warnings"]), r[1]
    else:  # rank 0's 5th batch is short: 4 steps on both ranks, the incomplete global batch dropped with a warning
        assert r[0]["steps"] == r[1]["steps"] == 4 and r[0]["error"] is None
        assert r[0]["dropped"] == 5 and r[1]["dropped"] == B
        assert all("short last batch" in w for q in range(2) for w in r[q]["warnings"]) and r[1]["warnings"]


def bn_worker(rank: int, world: int, out_dir: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build("herald", batch_norm=True)
    torch.save([str(w.message) for w in caught if "batch-norm" in str(w.message)], rank_result(out_dir, rank))


def test_batch_norm_is_a_warning(tmp_path: Path) -> None:
    run_ranks("tests.distributed.train_pipeline.test_pipeline_edges:bn_worker", tmp_path, world_size=1)
    msgs = torch.load(rank_result(tmp_path, 0))
    assert msgs and "norm" in msgs[0]


def reload_worker(rank: int, world: int, out_dir: str, kind: str) -> None:
    """Herald: train 5 steps, checkpoint (DCP), train 3 more (rows move), load the checkpoint back into the same
    model mid-stream and train 5 more on the same pipeline: the scheduler must restart from the home placement that
    the load restored. Stock: load that checkpoint into a fresh model and train the same 5 batches."""
    import torch.distributed.checkpoint as dcp

    ckpt = str(Path(out_dir).parent / "ckpt_a")
    dmp, pipeline = build(kind)
    data = batches(rank, 16)
    if kind == "herald":
        it = iter(data)
        for _ in range(5):
            pipeline.progress(it)
        dcp.save({"model": dmp.state_dict()}, checkpoint_id=ckpt)
        for _ in range(3):
            pipeline.progress(it)
        moved_before_load = sum(pipeline.trained_counters.get(k, 0) for k in ("migrate", "forward"))
        sd = {"model": dmp.state_dict()}
        dcp.load(sd, checkpoint_id=ckpt)
        dmp.load_state_dict(sd["model"])
        for _ in range(5):  # batches 8..12
            pipeline.progress(it)
        extra = {"moved_before_load": moved_before_load, "generation": pipeline.input_stage.generation}
    else:
        sd = {"model": dmp.state_dict()}
        dcp.load(sd, checkpoint_id=ckpt)
        dmp.load_state_dict(sd["model"])
        it = iter(data[8:13])
        for _ in range(5):
            pipeline.progress(it)
        extra = {}
    dcp.save({"model": dmp.state_dict()}, checkpoint_id=str(Path(out_dir) / "ckpt"))
    torch.save(extra, rank_result(out_dir, rank))


def test_checkpoint_load_mid_stream_restarts_the_scheduler(against_stock: Path) -> None:
    from tests.scenarios.test_dropin import full_checkpoint

    tmp_path = against_stock / "reload"
    h, s = full_checkpoint(tmp_path / "herald" / "ckpt"), full_checkpoint(tmp_path / "stock" / "ckpt")
    assert sorted(h) == sorted(s)
    worst = max(float((h[k] - s[k]).abs().max()) for k in s)
    assert worst < 1e-5, worst
    r0 = torch.load(rank_result(tmp_path / "herald", 0))
    assert r0["moved_before_load"] > 0 and r0["generation"] == 1


def _plan_on_run(rank: int, plan_on: str, host: str | None = None) -> dict:
    """12 steps of the two-EBC model with plans made as `plan_on` says (`host`: this rank's host name instead of the
    machine's): every plan (arrays with their dtypes), the trained tables and dense head, whether this rank holds a
    scheduler and the plan bytes it sent."""
    with on_machine(host):  # this process only: the ranks then sit on different "machines"
        return _plan_on_steps(rank, plan_on)


def _plan_on_steps(rank: int, plan_on: str) -> dict:
    import dataclasses

    from herald_torchrec.distributed.step.plan_part import plan_parts
    from herald_torchrec.distributed.train_pipeline.pipeline import herald_modules
    from herald_torchrec.schedule.plan import PlanPart

    plans = []
    # every_rank runs its input stage in the training thread (prefetch=0), rank0 in the background thread 2 batches
    # ahead (the default), host 16 ahead (the whole 12-batch stream is drawn ahead); the plans must not differ
    depth = {"every_rank": 0, "rank0": 2}.get(plan_on, 16)
    dmp, pipeline = build("herald", on_plan=plans.append, plan_on=plan_on, prefetch=depth)
    it = iter(batches(rank, 12))
    for _ in range(12):
        pipeline.progress(it)
    flat = []  # every array of every plan, in field order, with its dtype: this rank's part of it (a rank that
    # plans for itself only trains the whole plan: its part is cut here, with the modules' host map)
    hosts = herald_modules(dmp)[0].hosts
    for p in plans:
        if not isinstance(p, PlanPart):
            p = plan_parts(p, [rank], hosts)[rank]
        for part in (p, p.moves, p.shared):
            for f in dataclasses.fields(part):
                v = getattr(part, f.name)
                if hasattr(v, "dtype"):
                    flat.append((f.name, str(v.dtype), v.tolist()))
        flat.append(("counters", "", sorted(p.counters.items())))
    full = {}
    for m in herald_modules(dmp):  # collective, in the same order on every rank
        w, s = m.full_tables()
        full.update({f"{k}.w": v for k, v in w.items()})
        full.update({f"{k}.s": v for k, v in s.items()})
    dense = {n: p.detach().clone() for n, p in dmp.named_parameters() if "head" in n}
    sent = pipeline.input_stage.comm.counter.snapshot()
    return {
        "plans": flat,
        "n_plans": len(plans),
        "has_policy": pipeline.policy is not None,
        "host_aware": pipeline.policy is not None and bool(getattr(pipeline.policy, "host_aware", False)),
        "plan_bytes": sent.get("plan", 0),
        "id_bytes": sent.get("sample_ids", 0),
        "tables": full,
        "dense": dense,
    }


def _failing_planner_run(rank: int) -> dict:
    """A scheduler that raises at step 3 (only rank 0 plans): what each rank trained and raised."""
    from herald_torchrec.schedule.herald.planner import HeraldPolicy

    real = HeraldPolicy._plan

    def fails_at_step_3(self, batches):
        if self.step == 3:
            raise ValueError("scheduler bug at step 3")
        return real(self, batches)

    HeraldPolicy._plan = fails_at_step_3
    try:
        dmp, pipeline = build("herald")
        it = iter(batches(rank, 12))
        trained, error = 0, ""
        try:
            for _ in range(12):
                pipeline.progress(it)
                trained += 1
        except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
            error = f"{type(e).__name__}: {e}"
    finally:
        HeraldPolicy._plan = real
    return {"trained": trained, "error": error}


def plan_on_worker(rank: int, world: int, out_dir: str) -> None:
    """Every plan_on mode (host: one machine, then two), then a failing planner, in one pair of ranks."""
    out = {mode: _plan_on_run(rank, mode) for mode in ("host", "rank0", "every_rank")}
    out["two_hosts"] = _plan_on_run(rank, "host", host=f"machine-{rank}")
    out["failing"] = _failing_planner_run(rank)
    torch.save(out, rank_result(out_dir, rank))


@pytest.fixture(scope="module")
def plan_on_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("plan_on")
    run_ranks("tests.distributed.train_pipeline.test_pipeline_edges:plan_on_worker", out, world_size=2)
    return [torch.load(rank_result(out, q)) for q in (0, 1)]


def test_one_planner_sends_the_plans_every_rank_would_make(plan_on_results: list[dict]) -> None:
    r = {(m, q): plan_on_results[q][m] for m in ("host", "two_hosts", "rank0", "every_rank") for q in (0, 1)}
    base = r["every_rank", 0]
    assert base["n_plans"] == 12 and any(name == "row" and vals for name, _, vals in base["plans"])  # rows do move
    for key, res in r.items():  # the same plans (each rank's part), dtypes included, on every rank in every mode
        assert res["plans"] == r["every_rank", key[1]]["plans"], key
        for part in ("tables", "dense"):
            assert sorted(res[part]) == sorted(base[part])
            for k in base[part]:
                assert torch.equal(res[part][k], base[part][k]), (key, k)  # the same model, bit for bit
    assert not any(res["host_aware"] for res in r.values())  # one machine, or a machine per rank: rank-level LAIA
    for mode in ("host", "rank0"):  # one machine: one scheduler, whose plans travel from rank 0
        assert r[mode, 0]["has_policy"] and not r[mode, 1]["has_policy"]
        assert r[mode, 0]["plan_bytes"] > 0 and r[mode, 1]["plan_bytes"] == 0
    for mode in ("two_hosts", "every_rank"):  # a scheduler per rank: nothing travels
        assert r[mode, 0]["has_policy"] and r[mode, 1]["has_policy"]
        assert r[mode, 0]["plan_bytes"] == r[mode, 1]["plan_bytes"] == 0


def two_machines_worker(rank: int, world: int, out_dir: str) -> None:
    """Four ranks on two "machines" of two ranks (two planners, two ranks that receive their plans), and every rank
    planning for itself on the same machines."""
    out = {
        "two_machines": _plan_on_run(rank, "host", host=f"machine-{rank // 2}"),
        "every_rank": _plan_on_run(rank, "every_rank", host=f"machine-{rank // 2}"),
    }
    torch.save(out, rank_result(out_dir, rank))


def test_two_machines_of_two_ranks_train_what_every_rank_planning_trains(tmp_path: Path) -> None:
    """Each machine's lowest rank plans and receives every slice's ids; the other ranks get only their samples' ids,
    with the samples (multi-hot, so their lengths travel too). Plans and the trained model are bit for bit those of
    every rank planning, and fewer id bytes cross between ranks (to 2 planners, not to 3 peers). Every scheduler
    gets the machines of the ranks: LAIA is host-aware here (it is not on one machine, `plan_on_results`)."""
    run_ranks("tests.distributed.train_pipeline.test_pipeline_edges:two_machines_worker", tmp_path, world_size=4)
    res = [torch.load(rank_result(tmp_path, q)) for q in range(4)]
    base = res[0]["every_rank"]
    for q in range(4):
        got = res[q]["two_machines"]
        assert got["plans"] == res[q]["every_rank"]["plans"], q
        for part in ("tables", "dense"):
            for k in base[part]:
                assert torch.equal(got[part][k], base[part][k]), (q, k)
        assert got["has_policy"] == (q in (0, 2))
        assert got["host_aware"] == (q in (0, 2)) and res[q]["every_rank"]["host_aware"]
    assert [res[q]["two_machines"]["plan_bytes"] > 0 for q in range(4)] == [True, False, True, False]
    ids_now, ids_all_gather = (sum(res[q][m]["id_bytes"] for q in range(4)) for m in ("two_machines", "every_rank"))
    assert 0 < ids_now < ids_all_gather, (ids_now, ids_all_gather)


def test_a_failing_planner_stops_every_rank(plan_on_results: list[dict]) -> None:
    r0, r1 = (res["failing"] for res in plan_on_results)
    assert r0["error"] == "ValueError: scheduler bug at step 3"  # the planner raises its own error...
    assert "scheduler failed on rank(s) [0]" in r1["error"]  # ...the other rank says where to look
    assert r0["trained"] == r1["trained"] <= 3  # no rank runs ahead or hangs in a collective


def relay_worker(rank: int, world: int, out_dir: str) -> None:
    """12 steps of Herald on two "machines" of two ranks, with host relays on, then off (one DCP checkpoint each,
    and this rank's rows by link)."""

    import torch.distributed.checkpoint as dcp

    out = {}
    with on_machine(f"machine-{rank // 2}"):
        for name, relay in (("relay_on", True), ("relay_off", False)):
            dmp, pipeline = build("herald", host_relay=relay)
            it = iter(batches(rank, 12))
            for _ in range(12):
                pipeline.progress(it)
            dcp.save({"model": dmp.state_dict()}, checkpoint_id=str(Path(out_dir) / name / "ckpt"))
            out[name] = dict(pipeline.trained_counters)
    torch.save(out, rank_result(out_dir, rank))


def one_process_reference(
    world: int, steps: int, data=batches, weighted: bool = False, model=None
) -> dict[str, torch.Tensor]:
    """The model `build` trains (or `model()`, a TwoEBCModel-like class), trained in one process on the global
    batches (every rank's slice `data(rank, steps)`, in rank order) with the same optimizers: the loss is the global
    batch's mean, as DDP's averaging and TorchRec's gradient division make it."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    model = TwoEBCModel(weighted=weighted) if model is None else model()
    tables = torch.optim.SGD([*model.ebc_a.parameters(), *model.ebc_b.parameters()], lr=0.2)
    head = torch.optim.SGD(model.head.parameters(), lr=0.1)
    slices = [data(r, steps) for r in range(world)]
    for i in range(steps):
        parts = [slices[r][i] for r in range(world)]
        keys = parts[0].sparse_features.keys()
        jts = [[p.sparse_features[k] for p in parts] for k in keys]
        kjt = KeyedJaggedTensor(
            keys=keys,
            values=torch.cat([jt.values() for per_key in jts for jt in per_key]),
            lengths=torch.cat([jt.lengths() for per_key in jts for jt in per_key]),
            weights=torch.cat([jt.weights() for per_key in jts for jt in per_key]) if weighted else None,
        )
        dense = torch.cat([p.dense_features for p in parts])
        loss, _ = model(Batch(dense_features=dense, sparse_features=kjt, labels=torch.cat([p.labels for p in parts])))
        tables.zero_grad()
        head.zero_grad()
        loss.backward()
        tables.step()
        head.step()
    return {f"model.{k}": v for k, v in model.state_dict().items()}


def test_host_relays_train_the_same_model_with_fewer_rows_across_machines(tmp_path: Path) -> None:
    """Four ranks on two machines: Herald sends each shared row to a reading machine once and sums its readers'
    gradients there (host relays) and trains the model of one process on the global batches, as without relays;
    the rows on the wire are the same in all, fewer of them cross machines, the others stay inside one."""
    from tests.scenarios.test_dropin import full_checkpoint

    run_ranks("tests.distributed.train_pipeline.test_pipeline_edges:relay_worker", tmp_path, world_size=4)
    ref = one_process_reference(4, 12)
    for name in ("relay_on", "relay_off"):
        got = full_checkpoint(tmp_path / name / "ckpt")
        assert sum(".embedding_bags." in k for k in got) == 3 and all(k in ref for k in got)
        worst = max(float((ref[k] - got[k]).abs().max()) for k in got)
        assert worst < 1e-5, (name, worst)
    res = [torch.load(rank_result(tmp_path, q)) for q in range(4)]
    on, off = (
        {k: sum(r[name].get(k, 0) for r in res) for k in ("cross_host", "intra_host")}
        for name in ("relay_on", "relay_off")
    )
    assert on["cross_host"] + on["intra_host"] == off["cross_host"] + off["intra_host"]  # the same rows in all
    assert 0 < on["cross_host"] < off["cross_host"], (on, off)


def weighted_worker(rank: int, world: int, out_dir: str, kind: str) -> None:
    """12 steps of the two-EBC model with weighted features (id-score lists), Herald's pipeline or stock's."""
    import torch.distributed.checkpoint as dcp

    dmp, pipeline = build(kind, weighted=True)
    it = iter(batches(rank, 12, weighted=True))
    for _ in range(12):
        pipeline.progress(it)
    dcp.save({"model": dmp.state_dict()}, checkpoint_id=str(Path(out_dir) / "ckpt"))
    counters = dict(pipeline.trained_counters) if kind == "herald" else {}
    torch.save({"counters": counters}, rank_result(out_dir, rank))


def test_weighted_features_train_like_stock_and_one_process(against_stock: Path) -> None:
    """Weighted EBCs (multi-hot bags, empty bags, weights != 1) through HeraldTrainPipeline: the weights travel with
    their ids through the input stage (rank 0 plans, rank 1 gets its samples' ids with them) and scale each id's row
    and gradient; the model equals stock TorchRec's (its default sharding here) and one process's on the global
    batches, and differs from the unweighted model."""
    import functools

    from tests.scenarios.test_dropin import full_checkpoint

    tmp_path = against_stock / "weighted"
    got = {kind: full_checkpoint(tmp_path / kind / "ckpt") for kind in ("stock", "herald")}
    stock, herald = got["stock"], got["herald"]
    assert sorted(stock) == sorted(herald) and sum(".embedding_bags." in k for k in stock) == 3
    assert max(float((stock[k] - herald[k]).abs().max()) for k in stock) < 1e-5
    ref = one_process_reference(2, 12, functools.partial(batches, weighted=True), weighted=True)
    assert max(float((ref[k] - herald[k]).abs().max()) for k in herald) < 1e-5
    unweighted = one_process_reference(2, 12)
    assert max(float((unweighted[k] - herald[k]).abs().max()) for k in herald) > 1e-3  # the weights mattered
    r0 = torch.load(rank_result(tmp_path / "herald", 0), weights_only=False)
    assert r0["counters"]["shared_value"] + r0["counters"]["migrate"] > 0  # rows moved and were shared
