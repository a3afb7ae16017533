"""DeepFM (Guo et al. 2017): first-order weights + FM pairwise interactions + a deep MLP over shared embeddings.

TorchRec's FactorizationMachine computes the second-order term; the first-order weight of an id is the last
column of its embedding row (see base.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.deepfm import FactorizationMachine
from torchrec.modules.mlp import MLP

from herald_torchrec.models.base import CTRModel, FeatureSpec, make_ebc, stacked


class DeepFM(CTRModel):
    def __init__(
        self, features: FeatureSpec, embedding_dim: int = 16, deep_layers: tuple[int, ...] = (256, 128),
        device: str = "cpu",
    ) -> None:
        super().__init__()
        self.features = features
        self.dim = embedding_dim - 1  # the last column of each row is the per-id linear weight
        self.ebc = make_ebc(features, embedding_dim, device)
        self.fm = FactorizationMachine()
        width = self.dim * len(features.names) + features.num_dense
        self.deep = nn.Sequential(MLP(width, list(deep_layers), device=device), nn.Linear(deep_layers[-1], 1, device=device))
        self.first_dense = nn.Linear(features.num_dense, 1, device=device) if features.num_dense else None

    def logits(self, dense: torch.Tensor, emb) -> torch.Tensor:
        e = stacked(emb, self.features.names)
        v = e[:, :, : self.dim]
        first = e[:, :, self.dim].sum(dim=1)
        if self.first_dense is not None:
            first = first + self.first_dense(dense).squeeze(1)
        deep_in = v.flatten(1) if self.first_dense is None else torch.cat([v.flatten(1), dense], dim=1)
        return first + self.fm([v]).squeeze(1) + self.deep(deep_in).squeeze(1)
