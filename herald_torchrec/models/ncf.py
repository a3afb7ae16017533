"""NCF / NeuMF (He et al. 2017): GMF (element-wise product) and an MLP over user and item embeddings.

Each id's row holds its GMF half and its MLP half, so one EBC with two tables serves both towers. Dense features
are not used (implicit-feedback recommendation); any data source works once a user and an item feature are named.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.mlp import MLP

from herald_torchrec.models.base import CTRModel, FeatureSpec, make_ebc


class NeuMF(CTRModel):
    def __init__(
        self,
        features: FeatureSpec,
        embedding_dim: int = 16,
        mlp_layers: tuple[int, ...] = (64, 32, 16),
        device: str = "cpu",
    ) -> None:
        super().__init__()
        if len(features.names) != 2:
            raise ValueError(f"NCF needs exactly a user and an item feature, got {list(features.names)}")
        self.features = features
        self.dim = embedding_dim
        self.ebc = make_ebc(features, 2 * embedding_dim, device)
        self.mlp = MLP(2 * embedding_dim, list(mlp_layers), device=device)
        self.head = nn.Linear(embedding_dim + mlp_layers[-1], 1, device=device)

    def logits(self, dense: torch.Tensor, emb) -> torch.Tensor:
        d = emb.to_dict()
        u, i = d[self.features.names[0]], d[self.features.names[1]]
        gmf = u[:, : self.dim] * i[:, : self.dim]
        mlp = self.mlp(torch.cat([u[:, self.dim :], i[:, self.dim :]], dim=1))
        return self.head(torch.cat([gmf, mlp], dim=1)).squeeze(1)
