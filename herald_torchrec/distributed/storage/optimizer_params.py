"""The fused embedding optimizer's settings for Herald-managed tables, resolved exactly as TorchRec resolves them.

Why a module of its own: TorchRec takes the embedding optimizer from two places — the sharder's `fused_params` and
`apply_optimizer_in_backward(...)` set on the unsharded EBC's parameters (`param._optimizer_classes` /
`param._optimizer_kwargs`) — and merges them per table (torchrec.distributed.embeddingbag.
create_sharding_infos_by_sharding_device_group): the in-backward class becomes `"optimizer"` through
`optimizer_type_to_emb_opt_type`, its kwargs override the sharder's (`merge_fused_params`, which also renames
`lr` to `learning_rate`), the plan's per-table settings override both (`add_params_from_parameter_sharding`) and
TorchRec data types become FBGEMM's (`convert_to_fbgemm_types`). The result is passed to FBGEMM's TBE as keyword
arguments. `resolve_table_settings` calls those same TorchRec functions, in that order, so a Herald table gets the
settings a stock ROW_WISE table would get.

Optimizer state layout (`StateLayout`): a supported optimizer keeps no state (EXACT_SGD), one float per row
(EXACT_ROWWISE_ADAGRAD's `momentum1`, [rows]) or one float per element (EXACT_ADAGRAD's `momentum1`, [rows, dim]).
A moved row carries its whole state row either way; checkpoints present it in the shape stock TorchRec gives.

What Herald then checks, and why (`check_settings`): Herald updates an *exclusive* row in the TBE's own fused backward
and a *shared* row once per step through a backward of the same TBE over one-row bags carrying the row's summed
gradient (apply_summed_gradients_packed in summed_update.py). A setting is exact under Herald when FBGEMM applies it
per row, as a function of (row, its optimizer state, its summed gradient) only: then it acts identically wherever the
row lives. That holds for SGD, row-wise and element-wise (exact) Adagrad and their eps, and for row-wise Adagrad's L2
or decoupled weight decay / max_norm. Gradient clipping is per *bag*, not per row: FBGEMM clamps each pooled bag's
gradient (the TBE's grad_output, CPU and CUDA alike) before summing it per row; Herald's readers clamp the bag
gradients of shared values the same way and the owner applies their sum unclipped (RowStore.clip_pooled_gradient), so
it is exact too. Settings that read the TBE's step counter (counter-based or global weight decay; Adam-like optimizers
— Herald's extra update pass advances that counter) are refused, as is anything Herald cannot honour (unknown keys,
other optimizers, a torch optimizer argument FBGEMM's kernel ignores, such as SGD momentum).

Row precision: a table's rows are kept in its `data_type` (FP32 or FP16, FBGEMM's `weights_precision`), as stock
TorchRec's TBE keeps them; FBGEMM computes the update in float32 and rounds the row to it, wherever the row lives, so
one summed update is as exact for FP16 rows as for FP32 ones (up to the float32 sum order of shared gradients, which
may flip an FP16 rounding by one ulp). CUDA's stochastic rounding of FP16 rows is refused (`check_precision`).
Nothing is silently dropped: each refusal is a ValueError naming the setting and why.
"""

from __future__ import annotations

import enum
import inspect
import math
from typing import Any, Collection, Mapping

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, CacheAlgorithm
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # 1.6 .. 1.9 (tbe.config only from 1.7)
    SplitTableBatchedEmbeddingBagsCodegen,
    WeightDecayMode,
)
from torchrec.distributed.types import ParameterSharding
from torchrec.distributed.utils import (
    add_params_from_parameter_sharding,
    convert_to_fbgemm_types,
    merge_fused_params,
    optimizer_type_to_emb_opt_type,
)
from torchrec.modules.embedding_configs import DataType, data_type_to_sparse_type
from torchrec.modules.embedding_modules import EmbeddingBagCollection


class StateLayout(enum.Enum):
    """How a fused optimizer's state sits beside a table's rows: what a moved row carries along, and the shape the
    checkpoint gives it (TorchRec's `<table>.momentum1`). Width = floats of state per row of `dim` floats."""

    NONE = "none"  # EXACT_SGD: no state
    PER_ROW = "per_row"  # EXACT_ROWWISE_ADAGRAD: one float per row, [rows]
    PER_ELEMENT = "per_element"  # EXACT_ADAGRAD: one float per element, [rows, dim]

    def width(self, dim: int) -> int:
        """Floats of state per row."""
        return {StateLayout.NONE: 0, StateLayout.PER_ROW: 1, StateLayout.PER_ELEMENT: dim}[self]

    def shape(self, rows: int, dim: int) -> tuple[int, ...]:
        """The state tensor's shape for `rows` rows of `dim` floats (TorchRec's and FBGEMM's): () for NONE."""
        return {StateLayout.NONE: (), StateLayout.PER_ROW: (rows,), StateLayout.PER_ELEMENT: (rows, dim)}[self]


# Optimizers whose update is a pure function of (row, its state, the row's summed gradient), with the layout of that
# state: the only ones for which "one update with the summed gradient, wherever the row lives" is exact. Adam-like
# optimizers also read the TBE's step counter, which the extra update pass per step would advance twice.
OPTIMIZER_STATE_LAYOUT: dict[EmbOptimType, StateLayout] = {
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: StateLayout.PER_ROW,
    EmbOptimType.EXACT_ADAGRAD: StateLayout.PER_ELEMENT,
    EmbOptimType.EXACT_SGD: StateLayout.NONE,
}
SUPPORTED_OPTIMIZERS = tuple(OPTIMIZER_STATE_LAYOUT)


def state_layout(opt: EmbOptimType | str) -> StateLayout:
    """The state layout of a supported optimizer (a ValueError for any other, as `parse_optimizer`)."""
    return OPTIMIZER_STATE_LAYOUT[parse_optimizer(opt)]


def _tbe_defaults() -> dict[str, Any]:
    """FBGEMM's own defaults for the optimizer and learning rate, read off the TBE's signature: what a stock
    TorchRec table trains with when neither the sharder's fused_params nor an in-backward optimizer names them."""
    params = inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters
    return {"optimizer": params["optimizer"].default, "learning_rate": params["learning_rate"].default}


# The lowest precedence (below the sharder's fused_params and any in-backward optimizer), as in stock TorchRec: a
# table nobody names an optimizer for trains with FBGEMM's default (EXACT_SGD, learning rate 0.01), never another.
DEFAULT_FUSED_PARAMS: dict[str, Any] = _tbe_defaults()

# torch-optimizer arguments (as `apply_optimizer_in_backward` records them) that FBGEMM's kernels do not implement:
# accepted only at the value that means "not used" (then dropped; the TBE does not take most of them).
NEUTRAL_SETTINGS: dict[str, Any] = {
    "momentum": 0.0,
    "dampening": 0.0,
    "nesterov": False,
    "maximize": False,
    "lr_decay": 0.0,
    "initial_accumulator_value": 0.0,
    "foreach": None,
    "differentiable": False,
    "fused": None,
}

# Settings of rows that FBGEMM's CPU kernels ignore (checked in tests/distributed/storage/test_optimizer_params.py):
# with them a CPU run would silently train without them (stock TorchRec's CPU TBEs ignore them too), so Herald refuses
# them there.
CPU_IGNORED_SETTINGS: dict[str, Any] = {"weight_decay": 0.0, "max_norm": 0.0}

_ANY_OPTIMIZER = {
    "optimizer",
    "learning_rate",
    "gradient_clipping",
    "max_gradient",
    "stochastic_rounding",
    "eps",
    "cache_load_factor",
    "cache_algorithm",
    "cache_reserved_memory",
    "enforce_hbm",
    "bounds_check_mode",
    "weights_precision",
    "cache_precision",
    "output_dtype",
    "prefetch_pipeline",
    "gather_uvm_cache_stats",
}
_ROWWISE_ADAGRAD_ONLY = {"weight_decay", "weight_decay_mode", "max_norm"}
_EXACT_WEIGHT_DECAY_MODES = (WeightDecayMode.NONE, WeightDecayMode.L2, WeightDecayMode.DECOUPLE)


def parse_optimizer(opt: EmbOptimType | str) -> EmbOptimType:
    """EmbOptimType or its name/value ("exact_rowwise_adagrad", "rowwise_adagrad", "exact_adagrad", "adagrad",
    "exact_sgd", "sgd"); a ValueError for unknown or unsupported optimizers."""
    if isinstance(opt, EmbOptimType):
        parsed = opt
    else:
        aliases = {
            "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "adagrad": EmbOptimType.EXACT_ADAGRAD,
            "sgd": EmbOptimType.EXACT_SGD,
        }
        key = str(opt).strip().lower()
        parsed = aliases.get(key)
        if parsed is None:
            for o in EmbOptimType:
                if key in (o.value.lower(), o.name.lower()):
                    parsed = o
                    break
        if parsed is None:
            raise ValueError(f"optimizer: unknown embedding optimizer {opt!r}")
    if parsed not in SUPPORTED_OPTIMIZERS:
        raise ValueError(
            f"optimizer: Herald-managed tables support {[o.name for o in SUPPORTED_OPTIMIZERS]}, got {parsed.name} "
            "(its update is not a function of the row and its summed gradient alone)"
        )
    return parsed


def _number(key: str, value: Any, low: float, low_inclusive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
    if float(value) < low or (not low_inclusive and float(value) == low):
        raise ValueError(f"{key}: must be {'>=' if low_inclusive else '>'} {low}, got {value!r}")
    return float(value)


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected a bool, got {value!r}")
    return value


# Row precisions Herald moves and updates exactly as stock TorchRec does (FBGEMM's TBE `weights_precision`): the
# table's own `data_type` (FP32 or FP16), its HBM cache in the same precision (as TorchRec's sharding sets it)
ROW_PRECISIONS = (SparseType.FP32, SparseType.FP16)


def _sparse_type(key: str, value: Any, allowed: tuple[SparseType, ...]) -> SparseType:
    v = convert_to_fbgemm_types({key: value})[key]
    if isinstance(v, str) and v.lower() in {t.value for t in SparseType}:
        v = SparseType(v.lower())
    if v not in allowed:
        raise ValueError(
            f"{key}: Herald-managed rows are {' or '.join(t.name for t in allowed)} (moved and updated as stock "
            f"TorchRec's), got {value!r}"
        )
    return v


class IgnoredEverywhere(ValueError):
    """A setting that stock TorchRec would not apply either (a torch-optimizer argument FBGEMM's kernel does not
    implement, weight decay without a mode, or on CPU): refused wherever the table goes, never handed to TorchRec's
    sharding in Herald's place, which would train without it (distributed/manageable.py)."""


def check_settings(fused_params: Mapping[str, Any], device: torch.device | None = None) -> dict[str, Any]:
    """Validate resolved fused params for Herald's TBE; returns the TBE keyword arguments (optimizer as
    EmbOptimType, neutral torch-optimizer arguments dropped). With `device`, also refuses settings FBGEMM ignores
    there. Every refusal is a ValueError naming the setting."""
    fp = dict(fused_params)
    opt = parse_optimizer(fp.get("optimizer", DEFAULT_FUSED_PARAMS["optimizer"]))
    out: dict[str, Any] = {"optimizer": opt}
    for key, value in fp.items():
        if key == "optimizer":
            continue
        if key in NEUTRAL_SETTINGS:
            if value != NEUTRAL_SETTINGS[key]:
                raise IgnoredEverywhere(
                    f"{key}={value!r}: FBGEMM's {opt.name} kernel does not implement it (TorchRec would train without "
                    f"it); only {key}={NEUTRAL_SETTINGS[key]!r} is accepted"
                )
            continue
        if key in _ROWWISE_ADAGRAD_ONLY and opt != EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            neutral = _checked_value(key, value) == (WeightDecayMode.NONE if key == "weight_decay_mode" else 0.0)
            if not neutral:
                raise IgnoredEverywhere(f"{key}={value!r}: FBGEMM's {opt.name} kernel does not apply it")
            continue
        if key not in _ANY_OPTIMIZER | _ROWWISE_ADAGRAD_ONLY:
            raise ValueError(f"{key}: not a fused-optimizer setting Herald-managed tables support")
        out[key] = _checked_value(key, value)
    if out.get("weight_decay", 0.0) and out.get("weight_decay_mode", WeightDecayMode.NONE) == WeightDecayMode.NONE:
        raise IgnoredEverywhere(
            f"weight_decay={out['weight_decay']!r}: FBGEMM applies it only with weight_decay_mode L2 or DECOUPLE "
            "(without one, TorchRec's TBE trains without it); set weight_decay_mode"
        )
    check_precision(out, device)
    if device is not None and torch.device(device).type == "cpu":
        for key, neutral in CPU_IGNORED_SETTINGS.items():
            if key in out and out[key] != neutral:
                raise IgnoredEverywhere(
                    f"{key}={out[key]!r}: FBGEMM's CPU kernels do not apply it (stock TorchRec's CPU tables ignore it "
                    "too); Herald refuses it rather than train without it"
                )
    return out


def check_precision(settings: dict[str, Any], device: torch.device | None) -> None:
    """The rows' precision (`weights_precision`, FP32 or FP16) and that of their HBM cache, which TorchRec's sharding
    sets to the table's (a cache in another precision would round rows Herald reads behind the TBE's back). On CUDA,
    FP16 rows with FBGEMM's `stochastic_rounding` (its default) are refused: each update rounds by a random draw of
    the kernel's own, which depends on where in the TBE the row sits, so Herald could not give stock TorchRec's
    rows; with `stochastic_rounding=False` both round to nearest. FBGEMM's CPU kernels round to nearest always."""
    precision = settings.get("weights_precision", SparseType.FP32)
    cache = settings.get("cache_precision", precision)
    if cache != precision:
        raise ValueError(
            f"cache_precision={cache.name}: Herald-managed rows are cached in their own precision "
            f"(weights_precision={precision.name}), as TorchRec's sharding caches them"
        )
    if (
        precision == SparseType.FP16
        and device is not None
        and torch.device(device).type == "cuda"
        and settings.get("stochastic_rounding", True)
    ):
        raise ValueError(
            "stochastic_rounding=True (FBGEMM's default) with FP16 rows on CUDA: each update rounds by a random draw "
            "that depends on where the row sits in the TBE, so Herald cannot train stock TorchRec's rows; set "
            "fused_params stochastic_rounding=False or leave the table to TorchRec"
        )


def table_precision(data_type: DataType) -> SparseType:
    """A table's row precision as stock TorchRec's TBE keeps it (`data_type_to_sparse_type` of its data_type)."""
    return data_type_to_sparse_type(data_type)


def _no_precision_setting(fused_params: Mapping[str, Any]) -> None:
    """A table's row precision is its `EmbeddingBagConfig.data_type` (TorchRec's sharding makes the TBE with it and
    caches rows in it): a precision among the fused params would contradict some table's."""
    for key in ("weights_precision", "cache_precision"):
        if key in fused_params:
            raise ValueError(
                f"{key}={fused_params[key]!r}: a Herald-managed table's row precision is its "
                "EmbeddingBagConfig.data_type (FP32 or FP16), not a fused param"
            )


def _checked_value(key: str, value: Any) -> Any:
    if key in ("learning_rate", "weight_decay", "max_norm", "cache_reserved_memory"):
        return _number(key, value, 0.0)
    if key in ("eps", "max_gradient", "cache_load_factor"):
        return _number(key, value, 0.0, low_inclusive=False)
    if key in ("gradient_clipping", "stochastic_rounding", "enforce_hbm"):
        return _flag(key, value)  # stochastic rounding acts on reduced-precision rows only (FP16: check_precision)
    if key == "prefetch_pipeline":
        if _flag(key, value):
            raise ValueError("prefetch_pipeline=True: Herald moves rows behind the TBE's cache between steps")
        return False
    if key in ("weights_precision", "cache_precision"):
        return _sparse_type(key, value, ROW_PRECISIONS)
    if key == "output_dtype":  # pooled embeddings in float32, as TorchRec's TBEs give them for every row precision
        return _sparse_type(key, value, (SparseType.FP32,))
    if key == "weight_decay_mode":
        try:
            mode = value if isinstance(value, WeightDecayMode) else WeightDecayMode(int(value))
        except (TypeError, ValueError):
            raise ValueError(f"weight_decay_mode: unknown mode {value!r}") from None
        if mode not in _EXACT_WEIGHT_DECAY_MODES:
            raise ValueError(
                f"weight_decay_mode={mode.name}: it reads the TBE's step counter, which Herald's update of shared "
                f"rows advances; supported: {[m.name for m in _EXACT_WEIGHT_DECAY_MODES]}"
            )
        return mode
    if key == "cache_algorithm" and not isinstance(value, CacheAlgorithm):
        raise ValueError(f"cache_algorithm: expected a CacheAlgorithm, got {value!r}")
    if key == "bounds_check_mode" and not isinstance(value, BoundsCheckMode):
        raise ValueError(f"bounds_check_mode: expected a BoundsCheckMode, got {value!r}")
    return value


def sharder_fused_params(fused_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The sharder's fused params: Herald's defaults under the user's, the optimizer as an EmbOptimType (TorchRec's
    TBEs take nothing else), validated. Also what the TorchRec-sharded part of a mixed EBC is given, so both parts
    resolve from the same settings."""
    fp = {**DEFAULT_FUSED_PARAMS, **dict(fused_params or {})}
    _no_precision_setting(fp)
    check_settings(fp)
    fp["optimizer"] = parse_optimizer(fp["optimizer"])
    return fp


def in_backward_params(param: torch.Tensor) -> dict[str, Any]:
    """The fused params `apply_optimizer_in_backward` set on `param` ({} if none), as TorchRec reads them: the class
    becomes "optimizer" (unless the kwargs name one). A copy: TorchRec's merge edits the dict it is given."""
    classes = getattr(param, "_optimizer_classes", [None])
    kwargs = getattr(param, "_optimizer_kwargs", [{}])
    if len(classes) != 1 or len(kwargs) != 1:
        raise ValueError(f"apply_optimizer_in_backward: one optimizer per table, got {len(classes)} classes")
    out = dict(kwargs[0])
    if classes[0] is not None and "optimizer" not in out:
        out["optimizer"] = optimizer_type_to_emb_opt_type(classes[0])
    return out


def resolve_each_table(
    module: EmbeddingBagCollection,
    fused_params: Mapping[str, Any] | None,
    table_name_to_parameter_sharding: Mapping[str, ParameterSharding] | None = None,
    device: torch.device | None = None,
    tables: Collection[str] | None = None,
) -> dict[str, dict[str, Any] | ValueError]:
    """Per table of `module` (or of `tables`, in EBC order), TorchRec's resolution (Herald's defaults <
    `fused_params` < in-backward optimizer < the plan's per-table settings), validated for Herald's TBE: the TBE
    settings, or the ValueError naming the setting Herald refuses."""
    base = {**DEFAULT_FUSED_PARAMS, **dict(fused_params or {})}
    _no_precision_setting(base)
    params = dict(module.named_parameters())
    resolved: dict[str, dict[str, Any] | ValueError] = {}
    for c in module.embedding_bag_configs():
        if tables is not None and c.name not in tables:
            continue
        param = params.get(f"embedding_bags.{c.name}.weight")
        try:
            fp = merge_fused_params(base, in_backward_params(param) if param is not None else {})
            ps = (table_name_to_parameter_sharding or {}).get(c.name)
            if ps is not None:
                fp = add_params_from_parameter_sharding(fp, ps)
            _no_precision_setting(fp)
            fp["weights_precision"] = table_precision(c.data_type)  # rows in the table's own precision, as stock
            resolved[c.name] = check_settings(convert_to_fbgemm_types(fp), device)
        except ValueError as e:
            resolved[c.name] = e
    return resolved


def _first_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    diff = sorted((k for k in set(a) | set(b) if a.get(k) != b.get(k)), key=lambda k: (k != "optimizer", k))
    return diff[0] if diff else None


def _shared_by(key: str) -> str:
    """What the tables of one Herald TBE share that makes `key` differ between them an error."""
    return "one row precision (one TBE)" if key in ("weights_precision", "cache_precision") else "one fused optimizer"


def agreeing_settings(settings: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Tables of one Herald TBE share one fused optimizer: of `settings` (table -> resolved settings), the tables
    outside the largest group of equal settings (ties: the group of the earliest table), each with a one-line
    reason naming the first setting that differs."""
    groups: list[list[str]] = []
    for name, s in settings.items():
        for g in groups:
            if settings[g[0]] == s:
                g.append(name)
                break
        else:
            groups.append([name])
    if len(groups) <= 1:
        return {}
    kept = max(groups, key=len)  # max keeps the first of equal lengths
    ref = settings[kept[0]]
    out = {}
    for name in settings:
        key = _first_difference(ref, settings[name])
        if name not in kept and key is not None:
            out[name] = (
                f"{key}: resolves to {settings[name].get(key)!r}, the other Herald-managed tables of the EBC "
                f"({kept[0]!r}, ...) to {ref.get(key)!r}; Herald-managed tables of one EBC share {_shared_by(key)}"
            )
    return out


def resolve_table_settings(
    module: EmbeddingBagCollection,
    fused_params: Mapping[str, Any] | None,
    table_name_to_parameter_sharding: Mapping[str, ParameterSharding] | None = None,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """The validated TBE settings of `module`'s tables: per table, TorchRec's resolution (Herald's defaults <
    `fused_params` < in-backward optimizer < the plan's per-table settings); all tables must agree (Herald keeps
    them in one TBE). Raises ValueError naming the setting otherwise."""
    resolved = resolve_each_table(module, fused_params, table_name_to_parameter_sharding, device)
    for name, s in resolved.items():
        if isinstance(s, ValueError):
            raise type(s)(f"table {name!r}: {s}") from None
    names = list(resolved)
    first = resolved[names[0]]
    for n in names[1:]:
        key = _first_difference(first, resolved[n])
        if key is not None:
            raise ValueError(
                f"{key}: tables {names[0]!r} and {n!r} resolve to different settings ({first.get(key)!r} vs "
                f"{resolved[n].get(key)!r}); Herald-managed tables of one EBC share {_shared_by(key)}"
            )
    return first
