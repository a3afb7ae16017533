"""Training a Herald-sharded model without HeraldTrainPipeline (`model(batch)`, `loss.backward()`) trains the right
model but with the static plan, no scheduling: the modules say so once (UNSCHEDULED_WARNING), never for eval
forwards and never when the pipeline (or the user, `set_plan`) queues the plans."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import torch

from herald_torchrec.distributed.embeddingbag import UNSCHEDULED_WARNING
from tests.distributed.test_embeddingbag import empty_plan, kjt, make_module
from tests.helpers.ranks import rank_result, run_ranks


def _unscheduled(caught: list[warnings.WarningMessage]) -> int:
    return sum(str(w.message) == UNSCHEDULED_WARNING for w in caught)


def test_one_rank_module_warns_once_when_trained_without_plans() -> None:
    ids0, ids1 = [1, 19, 1], [0, 32, 5]
    m = make_module()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count every call, not Python's once-per-location registry
        m.eval()
        with torch.no_grad():
            m(kjt(ids0, ids1)).wait()
        assert _unscheduled(caught) == 0  # eval forwards never warn
        m.train()
        for _ in range(4):
            m(kjt(ids0, ids1)).wait().values().sum().backward()
        assert _unscheduled(caught) == 1
        assert "HeraldTrainPipeline" in UNSCHEDULED_WARNING and "unscheduled" in UNSCHEDULED_WARNING
    queued = make_module()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            queued.set_plan(empty_plan(1, 3, step=step))
            queued(kjt(ids0, ids1)).wait().values().sum().backward()
        queued.eval()
        with torch.no_grad():
            queued(kjt(ids0, ids1)).wait()
    assert _unscheduled(caught) == 0 and queued.queued_plans == 0


def warning_worker(rank: int, world: int, out_dir: str) -> None:
    """TorchRec's DLRM on two ranks: once driven by HeraldTrainPipeline (with an eval pause), once by the user's own
    `dmp(batch)` / `backward()` / `step()` loop; counts the warnings each way."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from herald_torchrec import HeraldEmbeddingBagCollectionSharder, HeraldTrainPipeline
    from tests.scenarios.test_dropin import data, make_model

    def sharded():
        model = make_model()
        apply_optimizer_in_backward(
            torch.optim.SGD, model.model.sparse_arch.embedding_bag_collection.parameters(), {"lr": 0.1}
        )
        sharder = HeraldEmbeddingBagCollectionSharder(cache_ratio=0.2, lookahead=2)
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder])
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda p: torch.optim.SGD(p, lr=0.05)
        )
        return dmp, dense

    counts = {}
    dmp, dense = sharded()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipeline = HeraldTrainPipeline(dmp, dense, torch.device("cpu"))
        batches = iter(data(rank))
        for _ in range(6):
            pipeline.progress(batches)
        model = pipeline.detach()
        model.eval()
        with torch.no_grad():
            for batch in itertools.islice(data(rank + 10), 2):
                model(batch)
        model.train()
        for _ in range(4):
            pipeline.progress(batches)
        pipeline.close()
    counts["pipeline"] = _unscheduled(caught)
    dmp, dense = sharded()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in itertools.islice(data(rank), 5):  # RandomRecDataset is endless
            loss, _ = dmp(batch)
            loss.backward()
            dense.step()
            dense.zero_grad()
        dmp.eval()
        with torch.no_grad():
            dmp(next(iter(data(rank + 10))))
    counts["own_loop"] = _unscheduled(caught)
    torch.save(counts, rank_result(out_dir, rank))


def test_two_ranks_warn_once_without_the_pipeline_and_never_with_it(tmp_path: Path) -> None:
    for f in run_ranks("tests.scenarios.test_unscheduled_warning:warning_worker", tmp_path, world_size=2, timeout=240):
        assert torch.load(f) == {"pipeline": 0, "own_loop": 1}
