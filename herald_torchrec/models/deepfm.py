"""DeepFM (Guo et al. 2017): first-order weights + FM pairwise interactions + a deep MLP over shared embeddings.

TorchRec's FactorizationMachine computes the second-order term; the first-order weight of an id is the last
column of its embedding row (see base.py).
"""

from __future__ import annotations

import torch
from torchrec.modules.deepfm import FactorizationMachine

from herald_torchrec.models.base import FeatureSpec, LinearPlusDeep


class DeepFM(LinearPlusDeep):
    def __init__(
        self,
        features: FeatureSpec,
        embedding_dim: int = 16,
        deep_layers: tuple[int, ...] = (256, 128),
        device: str = "cpu",
    ) -> None:
        super().__init__(features, embedding_dim, tuple(deep_layers), device)
        self.fm = FactorizationMachine()

    def logits(self, dense: torch.Tensor, emb) -> torch.Tensor:
        v, first, deep = self.parts(dense, emb)
        return first + self.fm([v]).squeeze(1) + deep
