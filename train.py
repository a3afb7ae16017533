"""Entry point: `torchrun --standalone --nproc_per_node N train.py model=dcn data=synthetic trainer.steps=600`."""

from __future__ import annotations

import os
import sys
import warnings

import hydra
from omegaconf import DictConfig


def quiet_known_noise() -> None:
    """Silence library warnings that say nothing about this run (deprecations inside torchrec / torch)."""
    import logging

    for msg in (
        "`broadcast_buffers` is deprecated",
        "an autograd kernel was not registered",
        "TypedStorage is deprecated",
        "HeuristicalStorageReservation",
        "reduce_scatter_tensor` is deprecated",
        "all_gather_into_tensor` is deprecated",
        "we are deprecating ShardedTensor",
    ):
        warnings.filterwarnings("ignore", message=f".*{msg}.*")
    for name in (
        "torchrec.distributed.planner",
        "torchrec.distributed.utils",
        "torchrec.distributed.train_pipeline",
        "torch.fx._symbolic_trace",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    quiet_known_noise()
    from herald_torchrec.app.trainer import ConfigError, TrainingDiverged, summary_line, train

    try:
        metrics = train(cfg)
    except (ConfigError, ValueError, FileNotFoundError, TrainingDiverged) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary_line(metrics))


if __name__ == "__main__":
    main()
