"""What every CTR model here shares: one EmbeddingBagCollection over all its sparse features, a dense input, a
logit per sample, and a train wrapper in TorchRec's (loss, output) convention for the train pipelines.

Why one EBC per model: the sharder (stock or Herald) then sees every table at once, and a row that moves between
ranks carries everything the model keeps for that id — the wide / first-order weight of an id rides in the last
column of its embedding row instead of in a second EBC (row widths stay multiples of 4, as FBGEMM requires).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass(frozen=True)
class FeatureSpec:
    """The inputs a model is built for: sparse feature names with their table sizes, and the dense width."""

    names: tuple[str, ...]
    rows: tuple[int, ...]
    num_dense: int

    def __post_init__(self) -> None:
        if len(self.names) != len(self.rows) or not self.names:
            raise ValueError(
                f"FeatureSpec: need one table size per feature, got {len(self.names)} names, {len(self.rows)} sizes"
            )

    def subset(self, names: list[str]) -> "FeatureSpec":
        missing = [n for n in names if n not in self.names]
        if missing:
            raise ValueError(f"features {missing} are not in the data (it has {list(self.names)})")
        idx = [self.names.index(n) for n in names]
        return FeatureSpec(tuple(names), tuple(self.rows[i] for i in idx), self.num_dense)


def table_name(feature: str) -> str:
    """The EBC table that serves a sparse feature (one table per feature)."""
    return f"t_{feature}"


def make_ebc(spec: FeatureSpec, dim: int, device: torch.device | str = "cpu") -> EmbeddingBagCollection:
    """One table per feature (t_<name>), sum pooling."""
    if dim < 4 or dim % 4:
        raise ValueError(f"embedding_dim must be a positive multiple of 4 (FBGEMM's TBE kernels need it), got {dim}")
    tables = [
        EmbeddingBagConfig(
            name=table_name(n), embedding_dim=dim, num_embeddings=r, feature_names=[n], pooling=PoolingType.SUM
        )
        for n, r in zip(spec.names, spec.rows)
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device(device))


def stacked(ebc_out, names: tuple[str, ...]) -> torch.Tensor:
    """KeyedTensor -> [B, T, D] in feature order."""
    d = ebc_out.to_dict()
    return torch.stack([d[n] for n in names], dim=1)


class CTRModel(nn.Module):
    """Base: subclasses set `features` (the sparse features they read) and `ebc`, and implement `logits`."""

    features: FeatureSpec
    ebc: EmbeddingBagCollection

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.logits(dense, self.ebc(sparse))

    def logits(self, dense: torch.Tensor, emb) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class LinearPlusDeep(CTRModel):
    """Shared body of W&D and DeepFM: a linear term (the last embedding column of each id + a dense linear layer)
    and a deep MLP over the other columns and the dense features. Subclasses add their own terms in `logits`."""

    def __init__(self, features: FeatureSpec, embedding_dim: int, deep_layers: tuple[int, ...], device: str) -> None:
        super().__init__()
        self.features = features
        self.dim = embedding_dim - 1  # the last column of each row is the per-id linear weight
        self.ebc = make_ebc(features, embedding_dim, device)
        width = self.dim * len(features.names) + features.num_dense
        self.deep = nn.Sequential(
            MLP(width, list(deep_layers), device=device), nn.Linear(deep_layers[-1], 1, device=device)
        )
        self.dense_linear = nn.Linear(features.num_dense, 1, device=device) if features.num_dense else None

    def parts(self, dense: torch.Tensor, emb) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(embeddings [B, T, D-1], linear term [B], deep term [B])."""
        e = stacked(emb, self.features.names)
        v = e[:, :, : self.dim]
        linear = e[:, :, self.dim].sum(dim=1)
        deep_in = v.flatten(1)
        if self.dense_linear is not None:
            linear = linear + self.dense_linear(dense).squeeze(1)
            deep_in = torch.cat([deep_in, dense], dim=1)
        return v, linear, self.deep(deep_in).squeeze(1)


class TrainModel(nn.Module):
    """TorchRec pipeline convention: forward(batch) -> (loss, (loss, logits, labels)), all detached but the loss."""

    def __init__(self, model: CTRModel) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch):
        logits = self.model(batch.dense_features, batch.sparse_features)
        loss = self.loss_fn(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())
