"""`HeraldTrainPipeline`: TorchRec's `TrainPipelineSparseDist` with Herald's input-permutation stage in front.

`pipeline.schedule(stream)` turns this rank's slices of the global batch stream (`Samples`) into the batches the
stock machinery trains (input_dist / forward / backward / optimizer): it runs the scheduler L batches ahead on
every rank (`ScheduledInput`), exchanges samples so this rank holds exactly the B the plan assigns it, and queues
the plan on every Herald-managed sharded module. Plans are consumed one per forward, in order, so the pipeline's
look-ahead of a batch or two keeps them aligned.

Evaluation batches (model in eval mode) are plain TorchRec batches: the sharded module serves them with read-only
static plans of its own, which move no rows and so leave the scheduler's directory in sync.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from herald_torchrec.data.samples import Samples
from herald_torchrec.distributed.embeddingbag import ShardedHeraldEmbeddingBagCollection
from herald_torchrec.distributed.scheduled_input import ScheduledInput
from herald_torchrec.schedule.plan import Plan


def herald_modules(model: torch.nn.Module) -> list[ShardedHeraldEmbeddingBagCollection]:
    """Every Herald-managed sharded module in a (DMP-wrapped) model, including the Herald part of a mixed EBC."""
    return [m for m in model.modules() if isinstance(m, ShardedHeraldEmbeddingBagCollection)]


class HeraldTrainPipeline(TrainPipelineSparseDist):
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        scheduled_input: ScheduledInput,
        to_batch: Callable[[Samples], Batch],
        modules: Optional[list[ShardedHeraldEmbeddingBagCollection]] = None,
        on_plan: Optional[Callable[[Plan], None]] = None,
        **kwargs,
    ) -> None:
        super().__init__(model, optimizer, device, execute_all_batches=True, **kwargs)
        modules = herald_modules(model) if modules is None else modules
        if not modules:
            raise ValueError("HeraldTrainPipeline: the model has no Herald-managed sharded module")
        self._scheduled_input = scheduled_input
        self._herald_modules = modules
        self._to_batch = to_batch
        self._on_plan = on_plan
        self.trained_counters: dict[str, int] = {}  # this rank's rows by kind over training steps (not eval)

    def schedule(self, stream: Iterator[Samples]) -> Iterator[Batch]:
        """This rank's slices of the training stream -> its assigned batches, each with its plan queued.

        Create it once per training stream and feed it to `progress` (in slices, if you like: `islice` of it
        between evaluations keeps the scheduler's lookahead across the slices). Plans are queued as batches are
        drawn, and the pipeline draws them in order, so queue and forwards stay aligned."""
        for samples, plan in self._scheduled_input(stream):
            for m in self._herald_modules:
                m.set_plan(plan)
            if self._on_plan is not None:
                self._on_plan(plan)
            yield self._to_batch(samples)

    def progress(self, dataloader_iter: Iterator[Samples]):
        out = super().progress(dataloader_iter)
        if self._model.training:
            for m in self._herald_modules:
                for k, v in m.step_counters.items():
                    self.trained_counters[k] = self.trained_counters.get(k, 0) + int(v)
        return out
