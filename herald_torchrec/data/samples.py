"""Host-side sample block shared by every data source, the scheduler and the trainer (numpy, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Samples:
    """N samples: dense features, one id per table (single-hot, int64 — ids never pass through float), labels."""

    dense: np.ndarray  # float32 [N, num_dense]
    ids: np.ndarray  # int64 [N, num_tables]
    labels: np.ndarray  # float32 [N]

    def __post_init__(self) -> None:
        if self.ids.dtype != np.int64:
            raise TypeError(f"Samples.ids must be int64, got {self.ids.dtype}")
        n = self.ids.shape[0]
        if self.dense.shape[0] != n or self.labels.shape[0] != n:
            raise ValueError(
                f"Samples: row counts differ (dense {self.dense.shape[0]}, ids {n}, labels {self.labels.shape[0]})"
            )

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def take(self, index: np.ndarray | slice) -> "Samples":
        return Samples(self.dense[index], self.ids[index], self.labels[index])

    @staticmethod
    def concat(parts: list["Samples"]) -> "Samples":
        return Samples(
            np.concatenate([p.dense for p in parts]),
            np.concatenate([p.ids for p in parts]),
            np.concatenate([p.labels for p in parts]),
        )
