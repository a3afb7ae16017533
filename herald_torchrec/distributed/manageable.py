"""Which tables of an EmbeddingBagCollection Herald manages: one predicate for the sharded module and the sharder.

Why one place: the sharded module refuses a table it cannot train as stock TorchRec trains it (a one-line
ValueError naming the setting), and the sharder must leave exactly those tables to TorchRec's own sharding, so
that one `HeraldEmbeddingBagCollectionSharder` serves any model (DMP keeps one sharder per module type). Both ask
`table_refusal`; the sharder asks `split_tables` for a whole EBC.

A refusal is either *Herald's* (a data type other than FP32 / FP16, pooling or an in-backward optimizer setting
Herald cannot honour exactly, a precision or optimizer unlike the EBC's other Herald tables', which share one TBE):
TorchRec trains the table as asked, so the sharder hands it to TorchRec and warns; or one that *no*
sharding honours (a weighted EBC that does not pool by SUM, a setting FBGEMM's CPU kernels ignore): handing the
table to TorchRec would train something the user did not ask for, so it stays an error (`Refusal.stock_trains_it`).

FP16 tables are Herald's: their rows stay float16 in Herald's TBE as in stock's (the precision is one of the
table's resolved settings, `weights_precision`, so an EBC mixing precisions splits as one mixing optimizers does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping

import torch
from torchrec.distributed.types import ParameterSharding
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from herald_torchrec.distributed.storage.optimizer_params import (
    IgnoredEverywhere,
    agreeing_settings,
    resolve_each_table,
)


@dataclass(frozen=True)
class Refusal:
    """Why Herald does not manage a table: `reason` names the setting in one line; `stock_trains_it` is False when
    TorchRec's own sharding would not train it as asked either (then it is an error wherever the table goes)."""

    reason: str
    stock_trains_it: bool = True

    def error(self, table: str) -> ValueError:
        """The module's one-line error for this refusal."""
        return ValueError(f"table {table!r}: {self.reason}")


def config_refusal(config: EmbeddingBagConfig, weighted: bool) -> Refusal | None:
    """The table's own configuration (pooling, data type) against what Herald's rows and pooling do."""
    if weighted and config.pooling != PoolingType.SUM:  # TorchRec's own EBC refuses it in its forward
        return Refusal(
            "a weighted EmbeddingBagCollection pools by SUM only (as TorchRec's own, whose torch.nn.EmbeddingBag "
            f"takes per-sample weights with mode='sum' only), got {config.pooling.name}",
            stock_trains_it=False,
        )
    if config.pooling not in (PoolingType.SUM, PoolingType.MEAN):
        return Refusal(f"SUM or MEAN pooling is supported, got {config.pooling}")
    if config.data_type not in (DataType.FP32, DataType.FP16):  # stock keeps rows in their precision: so does Herald
        return Refusal(
            f"data_type={config.data_type.name}: Herald-managed rows are FP32 or FP16; make the table one of those or "
            "leave it to TorchRec's sharding"
        )
    return None


def settings_refusal(config: EmbeddingBagConfig, settings: Mapping[str, Any]) -> Refusal | None:
    """The table's resolved fused-optimizer settings against its configuration."""
    if config.pooling == PoolingType.MEAN and settings.get("gradient_clipping", False):
        return Refusal(
            "gradient clipping with MEAN pooling is not supported by Herald-managed tables (the clipped bag gradient "
            "would be that of the sum); use SUM pooling or no clipping for this table"
        )
    return None


def table_refusal(config: EmbeddingBagConfig, weighted: bool, settings: Mapping[str, Any] | Refusal) -> Refusal | None:
    """Why Herald cannot manage this table (None: it can). `settings` are the table's resolved fused-optimizer
    settings (optimizer_params.resolve_each_table), or the refusal their resolution gave."""
    return config_refusal(config, weighted) or (
        settings if isinstance(settings, Refusal) else settings_refusal(config, settings)
    )


@dataclass(frozen=True)
class TableSplit:
    """An EBC's tables as the sharder shards them: `managed` by Herald (EBC order), `left` to TorchRec (EBC order:
    the user's `unscheduled_tables` and the tables Herald refuses), `refused` the latter with their reasons."""

    managed: tuple[str, ...]
    left: tuple[str, ...]
    refused: dict[str, Refusal]


def split_tables(
    module: EmbeddingBagCollection,
    fused_params: Mapping[str, Any] | None,
    unscheduled: Collection[str] = (),
    parameter_sharding: Mapping[str, ParameterSharding] | None = None,
    device: torch.device | None = None,
) -> TableSplit:
    """Herald's tables and TorchRec's of `module`. A table Herald refuses goes to TorchRec; where the candidates
    resolve to different fused-optimizer settings (Herald keeps one optimizer per EBC), those of the most tables
    (ties: the first such table's) stay Herald's and the others go to TorchRec. A refusal no sharding honours
    raises its one-line ValueError."""
    configs = module.embedding_bag_configs()
    weighted = bool(module.is_weighted())
    candidates = [c for c in configs if c.name not in set(unscheduled)]
    settings = resolve_each_table(module, fused_params, parameter_sharding, device, [c.name for c in candidates])
    refused: dict[str, Refusal] = {}
    usable: dict[str, dict[str, Any]] = {}
    for c in candidates:
        s = settings[c.name]
        if isinstance(s, ValueError):  # the setting's own message; one that FBGEMM ignores everywhere is an error
            s = Refusal(str(s), stock_trains_it=not isinstance(s, IgnoredEverywhere))
        why = table_refusal(c, weighted, s)
        if why is None:
            usable[c.name] = s
        elif not why.stock_trains_it:
            raise why.error(c.name)
        else:
            refused[c.name] = why
    for name, reason in agreeing_settings(usable).items():
        refused[name] = Refusal(reason)
    managed = tuple(c.name for c in candidates if c.name not in refused)
    left = tuple(c.name for c in configs if c.name not in managed)
    return TableSplit(managed, left, {c.name: refused[c.name] for c in configs if c.name in refused})


__all__ = ["Refusal", "TableSplit", "config_refusal", "settings_refusal", "split_tables", "table_refusal"]
