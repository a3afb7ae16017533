"""Entry point: `torchrun --standalone --nproc_per_node N train.py model=dcn data=synthetic trainer.steps=600`."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
import warnings
from typing import NoReturn

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


def record_for_launcher(line: str) -> None:
    """Hand the error line to torchrun's agent (the reply file it names in TORCHELASTIC_ERROR_FILE): torchrun's
    failure report then shows it as the root cause, and scripts/launch.py prints it last and exits 2."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the line is on stderr anyway


def leave(code: int) -> NoReturn:
    """End the process with `code`, everything written. With peers (several ranks, or under torchrun): the exit
    hooks run (the pipeline's close, profiling output), the streams are flushed, then os._exit skips the interpreter's
    teardown. There gloo's worker threads, still owned by objects that hold a process group after
    destroy_process_group, can release tensors while the interpreter is half gone, which aborts the process (SIGABRT)
    and makes torchrun report a finished run as failed. Alone (one process, or many runs in one process as the tests
    run them) a plain sys.exit."""
    under_launcher = int(os.environ.get("WORLD_SIZE", "1")) > 1 or "TORCHELASTIC_RESTART_COUNT" in os.environ
    if not under_launcher:
        sys.exit(code)
    run_exit_hooks = getattr(atexit, "_run_exitfuncs", None)  # what a normal exit runs before the teardown
    if run_exit_hooks is not None:
        run_exit_hooks()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    quiet_known_noise()
    from herald_torchrec.app.trainer import ConfigError, TrainingDiverged, summary_line, train

    try:
        metrics = train(cfg)  # the process group is left (destroyed) on success
    except (ConfigError, ValueError, FileNotFoundError, TrainingDiverged) as e:
        line = f"error: {e}"
        print(line, file=sys.stderr, flush=True)
        record_for_launcher(line)
        leave(2)
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary_line(metrics), flush=True)
    leave(0)


if __name__ == "__main__":
    main()
