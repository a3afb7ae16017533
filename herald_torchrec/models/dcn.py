"""DCN (Wang et al. 2017): a cross network and a deep MLP side by side over [dense projection, embeddings]."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.crossnet import CrossNet, LowRankCrossNet
from torchrec.modules.mlp import MLP

from herald_torchrec.models.base import CTRModel, FeatureSpec, make_ebc, stacked


class DCN(CTRModel):
    def __init__(
        self,
        features: FeatureSpec,
        embedding_dim: int = 16,
        cross_layers: int = 3,
        low_rank: int = 0,
        deep_layers: tuple[int, ...] = (256, 128),
        device: str = "cpu",
    ) -> None:
        super().__init__()
        self.features = features
        self.ebc = make_ebc(features, embedding_dim, device)
        self.dense_proj = MLP(features.num_dense, [embedding_dim], device=device) if features.num_dense else None
        width = embedding_dim * (len(features.names) + (1 if features.num_dense else 0))
        self.cross = LowRankCrossNet(width, cross_layers, low_rank) if low_rank > 0 else CrossNet(width, cross_layers)
        self.deep = MLP(width, list(deep_layers), device=device)
        self.head = nn.Linear(width + deep_layers[-1], 1, device=device)

    def logits(self, dense: torch.Tensor, emb) -> torch.Tensor:
        # the embeddings by feature name: a sharded EBC's KeyedTensor lists its keys in the sharding's order (TorchRec
        # TABLE_WISE groups them by rank), so its values() would feed the cross and deep layers permuted features
        parts = [stacked(emb, self.features.names).flatten(1)]
        if self.dense_proj is not None:
            parts.insert(0, self.dense_proj(dense))
        x0 = torch.cat(parts, dim=1)
        return self.head(torch.cat([self.cross(x0), self.deep(x0)], dim=1)).squeeze(1)
