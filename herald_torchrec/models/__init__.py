"""CTR models in TorchRec idiom. `build_model(name, features, **kwargs)` is what the app calls."""

from __future__ import annotations

from herald_torchrec.models.base import CTRModel, FeatureSpec, TrainModel, table_name
from herald_torchrec.models.dcn import DCN
from herald_torchrec.models.deepfm import DeepFM
from herald_torchrec.models.ncf import NeuMF
from herald_torchrec.models.wdl import WideAndDeep

MODELS = {"dcn": DCN, "deepfm": DeepFM, "wdl": WideAndDeep, "ncf": NeuMF}


def build_model(name: str, features: FeatureSpec, **kwargs) -> CTRModel:
    if name not in MODELS:
        raise ValueError(f"unknown model '{name}'; choose one of {sorted(MODELS)}")
    return MODELS[name](features, **kwargs)


__all__ = [
    "CTRModel",
    "FeatureSpec",
    "TrainModel",
    "table_name",
    "build_model",
    "MODELS",
    "DCN",
    "DeepFM",
    "NeuMF",
    "WideAndDeep",
]
