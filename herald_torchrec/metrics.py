"""Quality metrics, run summaries and logging sinks (TensorBoard, metrics.json written atomically)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=_jsonable)
        f.write("\n")
    os.replace(tmp, path)


def save_torch_atomic(path: str | os.PathLike, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    if hasattr(x, "item"):
        return x.item()
    return str(x)


class Logger:
    """TensorBoard scalars on rank 0; a no-op elsewhere."""

    def __init__(self, run_dir: str | os.PathLike | None, enabled: bool) -> None:
        self.writer = None
        if enabled and run_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tb"))

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
