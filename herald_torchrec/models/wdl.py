"""Wide & Deep (Cheng et al. 2016): a linear model over sparse ids and dense features plus a deep MLP.

The wide weight of an id is the last column of its embedding row (see base.py), so one EBC serves both parts.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.mlp import MLP

from herald_torchrec.models.base import CTRModel, FeatureSpec, make_ebc, stacked


class WideAndDeep(CTRModel):
    def __init__(
        self, features: FeatureSpec, embedding_dim: int = 16, deep_layers: tuple[int, ...] = (256, 128),
        device: str = "cpu",
    ) -> None:
        super().__init__()
        self.features = features
        self.dim = embedding_dim - 1  # the last column of each row is the per-id linear weight
        self.ebc = make_ebc(features, embedding_dim, device)
        width = self.dim * len(features.names) + features.num_dense
        self.deep = nn.Sequential(MLP(width, list(deep_layers), device=device), nn.Linear(deep_layers[-1], 1, device=device))
        self.wide_dense = nn.Linear(features.num_dense, 1, device=device) if features.num_dense else None

    def logits(self, dense: torch.Tensor, emb) -> torch.Tensor:
        e = stacked(emb, self.features.names)  # [B, T, D+1]
        deep_in = e[:, :, : self.dim].flatten(1)
        if self.wide_dense is not None:
            deep_in = torch.cat([deep_in, dense], dim=1)
        wide = e[:, :, self.dim].sum(dim=1)
        if self.wide_dense is not None:
            wide = wide + self.wide_dense(dense).squeeze(1)
        return wide + self.deep(deep_in).squeeze(1)
