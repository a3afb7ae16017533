"""App wiring of the baseline schedulers `p2res`, `fae` and `het` (conf/scheduler/{p2res,fae,het}.yaml).

They run in Herald's engine (HeraldTrainPipeline + the Herald sharder) with their own policy; what differs is
- their settings (`policy_options`: hot_budget, profile_fraction, window, staleness; herald's replicate,
  plan_budget_ms, first_pass and refine), validated by the policy;
- `fae` / `p2res` choose the replicated rows from a profiled prefix of the training stream: the first
  ceil(profile_fraction x steps) global batches of the first epoch (`profile_batches`). Every rank reads the same
  global batches (the data are deterministic), so every rank profiles alike without communicating; the same
  batches go to the pipeline's policy (`HeraldTrainPipeline(profile=...)`);
- `fae` reorders the stream (`FaeReorder`): within each window of `window` global batches, the samples whose ids
  are all hot first, then the rest, cut again into global batches of the same size. It is a step of the global
  stream, applied before each rank takes its slice (trainer.local_samples), so every rank reorders alike and the
  scheduler sees the reordered batches, as FAE's input pipeline does.
numpy / app code only (the control plane stays torch.distributed-free; the data plane decides nothing).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

import numpy as np
from omegaconf import DictConfig

from herald_torchrec.data.samples import Samples
from herald_torchrec.data.source import DataSource
from herald_torchrec.options import HeraldOptions
from herald_torchrec.schedule.baselines.replicated import ReplicaPolicyBase
from herald_torchrec.schedule.global_batch import GlobalBatch

# scheduler config keys each policy takes as its own options (the rest of conf/scheduler/*.yaml is common to every
# Herald policy)
OPTIONS = {
    "p2res": ("hot_budget", "profile_fraction"),
    "fae": ("hot_budget", "profile_fraction", "window"),
    "het": ("staleness",),
    "herald": ("replicate", "plan_budget_ms", "first_pass", "refine"),
    "herald_hier": ("ranks_per_host", "plan_budget_ms", "planner_wire", "first_pass", "refine"),
}
REPLICA_POLICIES = ("p2res", "fae")


def policy_options(sc: DictConfig) -> dict[str, Any]:
    """The policy's own settings from `scheduler.*` (None values left to the policy's defaults), for
    `HeraldOptions.policy_options`."""
    keys = OPTIONS.get(sc.policy, ())
    return {k: sc.get(k) for k in keys if sc.get(k) is not None}


def total_steps(cfg: DictConfig, source: DataSource, world_size: int) -> int:
    """Global batches the run trains (trainer.steps, or epochs x the batches of one epoch)."""
    if cfg.trainer.steps is not None:
        return int(cfg.trainer.steps)
    per_epoch = sum(1 for _ in source.train_batches(world_size * cfg.trainer.batch_size))
    return int(cfg.trainer.epochs) * per_epoch


def profile_batches(
    cfg: DictConfig, options: HeraldOptions, source: DataSource, world_size: int, tables, convert: Callable
) -> list[GlobalBatch]:
    """The profiled prefix of the training stream, as the scheduler sees global batches (`options`: the run's Herald
    settings, whose policy options give `profile_fraction`; `tables`: the managed tables, input_layout.ManagedTables;
    `convert`: Samples -> torchrec Batch)."""
    from herald_torchrec.distributed.train_pipeline.input_layout import one_process_global_batch

    fraction = float(options.policy_options.get("profile_fraction") or 0.05)
    n = ReplicaPolicyBase.profile_steps(total_steps(cfg, source, world_size), fraction)
    g = world_size * cfg.trainer.batch_size
    return [
        one_process_global_batch(convert(s), tables, i)
        for i, s in enumerate(itertools.islice(source.train_batches(g), n))
    ]


class FaeReorder:
    """FAE's input reordering of a stream of global batches (see the module docstring). `hot(samples)` gives the
    bool [N] of samples all of whose ids are hot. Counts the hot samples and batches it produced."""

    def __init__(self, window: int, hot: Callable[[Samples], np.ndarray]) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(
                f"scheduler.window must be an integer >= 1 (global batches reordered together), got {window!r}"
            )
        self.window, self.hot = window, hot
        self.hot_samples = 0
        self.samples = 0

    def __call__(self, batches: Iterator[Samples]) -> Iterator[Samples]:
        it = iter(batches)
        while True:
            win = list(itertools.islice(it, self.window))
            if not win:
                return
            n = len(win[0])
            if any(len(b) != n for b in win):
                yield from win  # a short batch (end of an epoch): left as it is
                continue
            hot = np.concatenate([self.hot(b) for b in win])
            self.hot_samples += int(hot.sum())
            self.samples += int(hot.shape[0])
            order = np.concatenate([np.flatnonzero(hot), np.flatnonzero(~hot)])
            big = Samples.concat(win).take(order)
            for i in range(len(win)):
                yield big.take(slice(i * n, (i + 1) * n))


def fae_reorder(policy, tables, convert: Callable, window: int) -> FaeReorder:
    """The reordering for a profiled FaePolicy (its hot set decides which samples are hot)."""
    from herald_torchrec.distributed.train_pipeline.input_layout import one_process_global_batch

    return FaeReorder(int(window), lambda s: policy.sample_hot(one_process_global_batch(convert(s), tables)))
