"""Wide & Deep (Cheng et al. 2016): a linear model over sparse ids and dense features plus a deep MLP.

The wide weight of an id is the last column of its embedding row (see base.py), so one EBC serves both parts.
"""

from __future__ import annotations

import torch

from herald_torchrec.models.base import FeatureSpec, LinearPlusDeep


class WideAndDeep(LinearPlusDeep):
    def __init__(
        self,
        features: FeatureSpec,
        embedding_dim: int = 16,
        deep_layers: tuple[int, ...] = (256, 128),
        device: str = "cpu",
    ) -> None:
        super().__init__(features, embedding_dim, tuple(deep_layers), device)

    def logits(self, dense: torch.Tensor, emb) -> torch.Tensor:
        _, wide, deep = self.parts(dense, emb)
        return wide + deep
