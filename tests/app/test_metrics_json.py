"""metrics.json is strict JSON whatever the run produced: NaN and infinities (an AUC of a one-class split, a diverged
loss) are written as null, never as the bare `NaN` that strict parsers refuse."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from herald_torchrec.app.metrics import RunHistory, write_json_atomic


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


def test_earlier_history_is_kept_up_to_the_resumed_step(tmp_path: Path) -> None:
    """A resumed run keeps what the earlier metrics.json recorded up to its checkpoint's step (what came after is
    trained again); without a readable file it starts empty and says why in one line."""
    path = tmp_path / "metrics.json"
    write_json_atomic(
        path,
        {
            "status": "running",
            "loss_history": [{"step": s, "loss": 1.0 / s} for s in (5, 10, 15)],
            "eval_history": [{"step": 10, "auc": 0.7, "logloss": 0.5}, {"step": 15, "auc": math.nan, "logloss": 0.4}],
        },
    )
    history, note = RunHistory.read_earlier(path, 10)
    assert note is None
    assert history.as_metrics() == {
        "first_loss": 0.2,
        "last_loss": 0.1,
        "loss_history": [{"step": 5, "loss": 0.2}, {"step": 10, "loss": 0.1}],
        "eval_history": [{"step": 10, "auc": 0.7, "logloss": 0.5}],
    }
    missing, note = RunHistory.read_earlier(tmp_path / "none.json", 10)
    assert missing.as_metrics()["loss_history"] == [] and "no " in note and "before step 10" in note
    path.write_text('{"loss_history": [{"loss": 1.0}]}')  # an entry without a step
    broken, note = RunHistory.read_earlier(path, 10)
    assert broken.losses == [] and note.startswith("cannot read the history before step 10")
