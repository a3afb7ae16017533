"""`HeraldTrainPipeline`: TorchRec's `TrainPipelineSparseDist` with Herald's input-permutation stage in front.

The pipeline consumes this rank's slices of the global batch stream (`Samples`), and for training streams:
runs the scheduler L batches ahead on every rank (`ScheduledInput`), exchanges samples so this rank holds exactly
the B the plan assigns it, queues the plan on every Herald-managed sharded module, and only then hands the TorchRec
`Batch` to the stock pipeline machinery (input_dist / forward / backward / optimizer). Plans are queued in batch
order and consumed one per forward, so the pipeline's look-ahead of a batch or two keeps them aligned.

Evaluation streams (model in eval mode) are not scheduled: the sharded module serves them with read-only static
plans of its own, which move no rows and so leave the scheduler's directory in sync.
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


class HeraldTrainPipeline(TrainPipelineSparseDist):
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        scheduled_input: ScheduledInput,
        modules: list[ShardedHeraldEmbeddingBagCollection],
        to_batch: Callable[[Samples], Batch],
        on_plan: Optional[Callable[[Plan], None]] = None,
        **kwargs,
    ) -> None:
        super().__init__(model, optimizer, device, execute_all_batches=True, **kwargs)
        if not modules:
            raise ValueError("HeraldTrainPipeline: the model has no Herald-managed sharded module")
        self._scheduled_input = scheduled_input
        self._herald_modules = modules
        self._to_batch = to_batch
        self._on_plan = on_plan
        self._raw_iter: Optional[Iterator[Samples]] = None
        self._batch_iter: Optional[Iterator[Batch]] = None

    def _schedule(self, stream: Iterator[Samples]) -> Iterator[Batch]:
        for samples, plan in self._scheduled_input(stream):
            for m in self._herald_modules:
                m.set_plan(plan)
            if self._on_plan is not None:
                self._on_plan(plan)
            yield self._to_batch(samples)

    def _next_batch(self, dataloader_iter: Iterator[Samples]) -> Optional[Batch]:
        if dataloader_iter is not self._raw_iter:  # a new stream: schedule it if we are training
            self._raw_iter = dataloader_iter
            if self._model.training:
                self._batch_iter = self._schedule(dataloader_iter)
            else:
                self._batch_iter = (self._to_batch(s) for s in dataloader_iter)
        return super()._next_batch(self._batch_iter)
