"""Quality metrics, run summaries and logging sinks (TensorBoard, metrics.json written atomically)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics.functional.classification import binary_auroc


def auc_logloss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """ROC AUC and log loss of a set of predictions (all ranks' predictions, gathered by the caller)."""
    logits, labels = logits.double().flatten(), labels.double().flatten()
    if labels.numel() == 0:
        return float("nan"), float("nan")
    auc = float(binary_auroc(logits.sigmoid(), labels.long())) if 0 < labels.sum() < labels.numel() else float("nan")
    logloss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    return auc, logloss


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write-then-rename, so an interrupted run never leaves a truncated file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(strict_json(obj), indent=2, sort_keys=True, allow_nan=False)  # before the file: no half writes
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.write("\n")
    os.replace(tmp, path)


def save_torch_atomic(path: str | os.PathLike, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def strict_json(x: Any) -> Any:
    """`x` with every value JSON can hold strictly: NaN and infinities (an AUC of a one-class split, a diverged
    loss) become null, tensors and numpy scalars their Python values, anything else its str. Python's json module
    would otherwise write bare `NaN`, which strict parsers (jq, JavaScript, most non-Python readers) refuse."""
    if isinstance(x, dict):
        return {str(k): strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    if hasattr(x, "item") and getattr(x, "ndim", 0) == 0:  # a 0-d tensor or a numpy scalar
        x = x.item()
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


class Logger:
    """TensorBoard scalars on rank 0; a no-op elsewhere.

    `purge_step`: TensorBoard hides every event of an earlier writer in this directory at this step or later. A run
    that starts after step N (a resume from a checkpoint of step N) passes N + 1, so the steps an interrupted run
    logged after its checkpoint, which this run logs again, never show twice; a fresh run passes 1."""

    def __init__(self, run_dir: str | os.PathLike | None, enabled: bool, purge_step: int | None = None) -> None:
        self.writer = None
        if enabled and run_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tb"), purge_step=purge_step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        for k, v in values.items():
            if v is not None and not (isinstance(v, float) and math.isnan(v)):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None


@dataclass
class LossWindow:
    """The training loss of one logging window as the mean over every rank's samples of every step in it (not rank
    0's share): each rank adds its steps' mean losses, `global_mean` sums (loss x samples, samples) over the ranks
    with one all-reduce of two numbers per window. Only the logged value changes; the model never sees it."""

    samples_per_step: int  # this rank's batch
    loss_x_samples: float = 0.0
    samples: int = 0

    def add(self, step_loss: float) -> None:
        self.loss_x_samples += step_loss * self.samples_per_step
        self.samples += self.samples_per_step

    @property
    def empty(self) -> bool:
        return self.samples == 0

    def global_mean(self) -> float:
        """The window's mean loss over all ranks' samples, then a new window. Collective where torch.distributed
        runs more than one rank: every rank calls it at the same step."""
        totals = torch.tensor([self.loss_x_samples, float(self.samples)], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals)  # CPU tensor: gloo, or the gloo side of "cpu:gloo,cuda:nccl"
        self.loss_x_samples, self.samples = 0.0, 0
        total, n = (float(x) for x in totals)
        return total / n if n else float("nan")


@dataclass
class RunHistory:
    """metrics.json's step-by-step record: the global training loss of each logging window (`loss_history`, at the
    window's last step) and each evaluation (`eval_history`). A resumed run starts from the part of the previous
    metrics.json up to its checkpoint's step (`read_earlier`), so the file keeps the whole run's history."""

    losses: list[dict[str, Any]] = field(default_factory=list)  # {"step", "loss"}
    evals: list[dict[str, Any]] = field(default_factory=list)  # {"step", "auc", "logloss"}

    def add_loss(self, step: int, loss: float) -> None:
        self.losses.append({"step": step, "loss": loss})

    def add_eval(self, step: int, auc: float, logloss: float) -> None:
        self.evals.append({"step": step, "auc": auc, "logloss": logloss})

    def as_metrics(self) -> dict[str, Any]:
        """metrics.json's history fields: both lists, and the first and last logged loss of the whole run."""
        return {
            "first_loss": self.losses[0]["loss"] if self.losses else None,
            "last_loss": self.losses[-1]["loss"] if self.losses else None,
            "loss_history": list(self.losses),
            "eval_history": list(self.evals),
        }

    @classmethod
    def read_earlier(cls, path: str | os.PathLike, up_to_step: int) -> tuple["RunHistory", str | None]:
        """The history of the metrics.json at `path` up to `up_to_step` (a resumed checkpoint's step; what the
        interrupted run recorded after it is trained again), and None; or an empty history and a one-line note
        saying why nothing was kept (no file, unreadable), for the run to print."""
        path = Path(path)
        try:
            earlier = json.loads(path.read_text())
            losses = [dict(h) for h in earlier.get("loss_history", []) if int(h["step"]) <= up_to_step]
            evals = [dict(h) for h in earlier.get("eval_history", []) if int(h["step"]) <= up_to_step]
        except FileNotFoundError:
            return cls(), f"no {path} to take the history before step {up_to_step} from; metrics.json starts there"
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            return cls(), f"cannot read the history before step {up_to_step} from {path} ({e}); it starts there"
        return cls(losses, evals), None


def hbm_cache_stats(model: torch.nn.Module) -> dict[str, Any]:
    """FBGEMM's HBM-cache counters of the model's cached TBEs (those built with gather_uvm_cache_stats), summed over
    every rank: the hit rate over unique ids per lookup (1 - unique misses / unique ids) and the cache lines of all
    ranks together. Ranks may split the rows unevenly (stock's planner places whole tables), so only all-rank totals
    compare across schedulers. Collective where torch.distributed runs more than one rank: call it on every rank."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    # TorchRec's sharded EBC keeps its lookups (and their TBEs) in a plain list, outside `modules()`
    found = {id(m): m for m in model.modules()}
    for owner in list(found.values()):
        for lookup in getattr(owner, "_lookups", None) or []:
            found.update((id(m), m) for m in lookup.modules())
    every = [m for m in found.values() if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen)]
    cached = [m for m in every if m.lxu_cache_weights.numel()]
    tbes = [m for m in cached if getattr(m, "gather_uvm_cache_stats", False)]
    totals = torch.zeros(5, dtype=torch.float64)  # ranks with a cache, ranks with counters, lines, unique, misses
    if cached:
        totals[0] = 1.0
        totals[2] = float(sum(m.lxu_cache_state.numel() for m in (tbes or cached)))
    if tbes:
        st = sum(m.uvm_cache_stats.double().cpu() for m in tbes)
        totals[1], totals[3], totals[4] = 1.0, float(st[2]), float(st[3])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)  # CPU tensor: gloo, or the gloo side of "cpu:gloo,cuda:nccl"
    return cache_summary(totals)


def cache_summary(totals: torch.Tensor) -> dict[str, Any]:
    """metrics.json's `hbm_cache_*` from all-rank totals [ranks with a cache, ranks with counters, lines, unique ids,
    unique misses]: nothing without a cache; lines and no hit rate where a cache has no counters (say so rather than
    report nothing)."""
    has_cache, has_counters, lines, uniq, misses = (float(x) for x in totals)
    if not has_cache:
        return {}
    if has_counters < has_cache:
        return {"hbm_cache_lines": int(lines), "hbm_cache_hit_rate": None}
    return {
        "hbm_cache_hit_rate": 1.0 - misses / max(uniq, 1.0),
        "hbm_cache_lines": int(lines),
        "hbm_cache_unique_ids": int(uniq),
        "hbm_cache_unique_misses": int(misses),
    }
