"""A minimal TorchRec-pipelineable batch and model wrapper for the data-plane tests that drive
`TrainPipelineSparseDist` with the small model of tests/scenarios/test_module_parity.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.streamable import Pipelineable


@dataclass
class Batch(Pipelineable):
    dense: torch.Tensor
    kjt: object
    labels: torch.Tensor

    def to(self, device, non_blocking=False):
        return Batch(self.dense.to(device), self.kjt.to(device), self.labels.to(device))

    def record_stream(self, stream) -> None:
        pass

    def pin_memory(self):
        return self


class Wrap(torch.nn.Module):
    """forward(batch) -> (loss, logits): the pipeline's (loss, output) convention."""

    def __init__(self, net) -> None:
        super().__init__()
        self.net = net

    def forward(self, b):
        logits = self.net(b.dense, b.kjt)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels), logits.detach()


def drain(pipeline, items: list) -> int:
    """Run a TorchRec train pipeline over `items` until it runs out; returns the number of steps."""
    it, steps = iter(items), 0
    while True:
        try:
            pipeline.progress(it)
            steps += 1
        except StopIteration:
            return steps
