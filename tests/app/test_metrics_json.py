"""metrics.json is strict JSON whatever the run produced: NaN and infinities (an AUC of a one-class split, a diverged
loss) are written as null, never as the bare `NaN` that strict parsers refuse."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from herald_torchrec.app.metrics import write_json_atomic


def strict_load(text: str) -> object:
    def refuse(name: str) -> None:
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_values_are_written_as_null(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    write_json_atomic(
        path,
        {
            "auc": math.nan,
            "logloss": math.inf,
            "loss": -math.inf,
            "steps": np.int64(7),
            "rate": torch.tensor(0.5),
            "history": [{"auc": float("nan"), "step": 3}, (1.5, np.float32("nan"))],
        },
    )
    got = strict_load(path.read_text())
    assert got == {
        "auc": None,
        "logloss": None,
        "loss": None,
        "steps": 7,
        "rate": 0.5,
        "history": [{"auc": None, "step": 3}, [1.5, None]],
    }
    assert not list(tmp_path.glob(".m.json.*")), "a temporary file was left behind"
