"""Data sources: the synthetic default and streaming loaders for the real click / rating / conversion logs."""

from __future__ import annotations

from typing import Any, Mapping

from herald_torchrec.data.samples import Samples
from herald_torchrec.data.source import DataSource, SyntheticSource
from herald_torchrec.data.synthetic import SyntheticCTR, SyntheticSpec

SYNTHETIC_KEYS = (
    "scale",
    "num_tables",
    "table_rows",
    "zipf",
    "tail",
    "locality",
    "trend_life",
    "num_dense",
    "seed",
    "val_every",
    "val_block",
)


def synthetic_spec(cfg: Mapping[str, Any]) -> SyntheticSpec:
    kw = {k: cfg[k] for k in SYNTHETIC_KEYS if k in cfg and cfg[k] is not None}
    if "table_rows" in kw:
        kw["table_rows"] = tuple(kw["table_rows"])
    return SyntheticSpec(**kw)


def build_source(cfg: Mapping[str, Any]) -> DataSource:
    """A DataSource from a data config (the `data/` Hydra group): name + that loader's options."""
    cfg = dict(cfg)
    name = cfg.pop("name")
    if name == "synthetic":
        return SyntheticSource(synthetic_spec(cfg), cfg.get("epoch_batches", 1000), cfg.get("val_batches", 20))
    loaders = {
        "criteo": "CriteoSource",
        "avazu": "AvazuSource",
        "movielens": "MovieLensSource",
        "criteo_search": "CriteoSearchSource",
    }
    if name not in loaders:
        raise ValueError(f"data.name must be one of synthetic, {', '.join(loaders)}; got '{name}'")
    if not cfg.get("path"):
        raise ValueError(f"data={name} needs a file: add data.path=/path/to/file")
    import importlib

    module = importlib.import_module(f"herald_torchrec.data.{name}")
    return getattr(module, loaders[name])(**cfg)


__all__ = [
    "DataSource",
    "Samples",
    "SyntheticCTR",
    "SyntheticSource",
    "SyntheticSpec",
    "build_source",
    "synthetic_spec",
]
