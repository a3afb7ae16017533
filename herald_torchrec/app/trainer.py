"""The training recipe: data -> model -> DistributedModelParallel -> train pipeline -> metrics.

Kept as one direct function (nanoGPT style) over small helpers; `train.py` only turns the Hydra config into a call.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from herald_torchrec.app.checkpoint import (
    CheckpointDirs,
    CheckpointError,
    failure_line,
    save_verified,
    storage_errors,
    verify_checkpoint,
)
from herald_torchrec.app.metrics import (
    Logger,
    LossWindow,
    RunHistory,
    auc_logloss,
    save_torch_atomic,
    write_json_atomic,
)
from herald_torchrec.app.model_setup import ShardedSetup, shard_model
from herald_torchrec.app.model_state import full_state
from herald_torchrec.app.runtime import DIST_TIMEOUT_S, DistContext, affinity_mode, init_distributed, shutdown
from herald_torchrec.data import build_source
from herald_torchrec.data.samples import Samples
from herald_torchrec.data.source import DataSource
from herald_torchrec.distributed.comm import CommCounter
from herald_torchrec.distributed.traffic import count_collectives
from herald_torchrec.models import FeatureSpec, TrainModel, build_model

CHECKPOINT = "checkpoint"  # a torch.distributed.checkpoint directory under run_dir
# what a checkpoint must agree on to be resumed (the rest — scheduler, cache ratio, logging, the number of ranks and
# each rank's batch, so the global batch — may change). The data split is fixed per sample, and a checkpoint records
# the training samples it consumed (DataPosition), so a resumed run continues at the next sample at any global batch.
RESUME_KEYS = (
    "model",
    "data",
    "seed",
    "trainer.embedding_optimizer",
    "trainer.dense_optimizer",
)
RECORDED_KEYS = ("trainer.batch_size", "world_size", "global_batch")  # in the identity, free to change on resume


class ConfigError(ValueError):
    """A configuration value that cannot work; the message says which key and why."""


class TrainingDiverged(RuntimeError):
    """The loss (or a parameter about to be checkpointed) became NaN or infinite. Raised on every rank at the same
    step, before anything non-finite reaches a checkpoint, so the last checkpoint written is the last good one."""


@dataclass
class DivergenceWatch:
    """The first step at which this rank's loss was NaN or infinite. The check is local and free (the loss is read
    each step anyway); `first_bad` agrees the ranks on it with one small all-reduce, done only where every rank is
    at the same step anyway: at a progress line, before a checkpoint or an evaluation, and at the end."""

    nan_step: float = math.inf
    inf_step: float = math.inf

    def see(self, step: int, loss: float) -> None:
        if math.isnan(loss):
            self.nan_step = min(self.nan_step, step)
        elif math.isinf(loss):
            self.inf_step = min(self.inf_step, step)

    def first_bad(self, ctx: DistContext) -> tuple[int, str] | None:
        """(step, "nan" or "inf") of the first non-finite loss on any rank, or None. Collective."""
        both = torch.tensor([self.nan_step, self.inf_step], dtype=torch.float64)
        if ctx.world_size > 1:
            dist.all_reduce(both, op=dist.ReduceOp.MIN)
        nan_step, inf_step = (float(x) for x in both)
        if math.isinf(min(nan_step, inf_step)):
            return None
        return (int(nan_step), "nan") if nan_step <= inf_step else (int(inf_step), "inf")


def divergence_message(step: int, what: str, cfg: DictConfig, run_dir: Path) -> str:
    t = cfg.trainer
    ckpt = run_dir / CHECKPOINT
    kept = f"the last good checkpoint is kept in {ckpt}" if ckpt.exists() else "no checkpoint was written"
    return (
        f"training diverged: {what} at step {step}; stopped ({kept}). Try a lower trainer.dense_lr (now "
        f"{t.dense_lr}) or trainer.embedding_lr (now {t.embedding_lr})"
    )


def model_features(cfg: DictConfig, source: DataSource) -> FeatureSpec:
    spec = FeatureSpec(tuple(source.feature_names), tuple(source.table_rows), source.num_dense)
    if cfg.model.name != "ncf":
        return spec
    names = list(source.feature_names)
    # without user / item features, the two largest tables play those roles (synthetic: c2 and c3)
    largest = sorted(range(len(names)), key=lambda i: -source.table_rows[i])[:2]
    user = cfg.model.get("user_feature") or ("user" if "user" in names else names[min(largest)])
    item = cfg.model.get("item_feature") or ("item" if "item" in names else names[max(largest)])
    if user == item:
        raise ConfigError(f"NCF needs two different features for user and item, got '{user}' twice")
    return spec.subset([user, item])


def model_kwargs(cfg: DictConfig) -> dict[str, Any]:
    kw = OmegaConf.to_container(cfg.model, resolve=True)
    for k in ("name", "user_feature", "item_feature"):
        kw.pop(k, None)
    return {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}


@dataclass(frozen=True)
class DataPosition:
    """Where a training stream stands, in samples rather than steps: every epoch before `epoch` and the first `sample`
    training samples of `epoch` are trained (`samples_trained` in all). It does not depend on the global batch, so a
    run resumed at another one continues at exactly the next training sample. `reordered`: the stream's global batches
    were reordered (fae), so `sample` counts whole reordered global batches, not a prefix of the epoch."""

    epoch: int = 0
    sample: int = 0
    samples_trained: int = 0
    reordered: bool = False

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> "DataPosition":
        return cls(int(meta["epoch"]), int(meta["sample"]), int(meta["samples_trained"]), bool(meta["reordered"]))


class TrainStream:
    """This rank's slices of the training global batches from `start` on: each epoch's training samples cut into
    consecutive global batches from its first untrained sample. A global batch never spans two epochs (an epoch's
    incomplete tail is dropped), so every epoch is the same samples whatever the global batch, and "the samples after
    the checkpoint" is the rest of its epoch, then the next epochs. `reorder` (the scheduler's, e.g. fae's) transforms
    each epoch's global batches before the slicing. The stream notes where each epoch began in its own batch count, so
    `position_after(n)` is known when a checkpoint is written, however far the pipeline has read ahead."""

    def __init__(
        self,
        source: DataSource,
        batch: int,
        ctx: DistContext,
        epochs: int | None,
        start: DataPosition = DataPosition(),
        reorder: Callable[[Iterator[Samples]], Iterator[Samples]] | None = None,
    ) -> None:
        self.source, self.batch, self.ctx, self.epochs, self.start, self.reorder = (
            source,
            batch,
            ctx,
            epochs,
            start,
            reorder,
        )
        self.global_batch = batch * ctx.world_size
        self._epoch_at: list[int] = []  # batches this stream yielded before each epoch it began
        self._epoch_first: list[tuple[int, int]] = []  # (epoch, its first sample in this stream)

    def __iter__(self) -> Iterator[Samples]:
        g, b, r = self.global_batch, self.batch, self.ctx.rank
        lo, hi = r * b, (r + 1) * b
        passes = itertools.count(self.start.epoch) if self.epochs is None else range(self.start.epoch, self.epochs)
        n = 0
        for epoch in passes:
            first = self.start.sample if epoch == self.start.epoch else 0
            self._epoch_first.append((epoch, first))
            self._epoch_at.append(n)
            if self.reorder is None:  # the source cuts this rank's slice (the synthetic log makes only that)
                slices = self.source.train_slices(g, lo, hi, first)
            else:  # a reorder needs whole global batches; `first` counts whole reordered batches (resume checks it)
                whole = self.reorder(self.source.train_batches(g))
                slices = (s.take(slice(lo, hi)) for s in itertools.islice(whole, first // g, None))
            produced = False
            for s in slices:
                produced = True
                n += 1
                yield s
            if not produced and first == 0:
                raise ConfigError(
                    f"the training split has no complete global batch of {g} samples ({self.ctx.world_size} ranks x "
                    f"trainer.batch_size={b}); use a smaller batch or more data"
                )

    def position_after(self, n: int) -> DataPosition:
        """Where the stream stands once its first n global batches are trained: just after the n-th batch, in the
        epoch that batch belongs to (the last epoch begun before it)."""
        if n <= 0:
            return self.start
        i = bisect.bisect_left(self._epoch_at, n) - 1  # the last epoch that began before batch n
        epoch, first = self._epoch_first[i]
        return DataPosition(
            epoch,
            first + (n - self._epoch_at[i]) * self.global_batch,
            self.start.samples_trained + n * self.global_batch,
            self.reorder is not None or self.start.reordered,
        )


def local_samples(
    source: DataSource,
    batch: int,
    ctx: DistContext,
    train: bool,
    epochs: int | None,
    reorder: Callable[[Iterator[Samples]], Iterator[Samples]] | None = None,
) -> Iterator[Samples]:
    """This rank's slice of each global batch: the training stream from its start (`TrainStream`, looping over
    `epochs`, None = forever), or one pass over the held-out split."""
    if train:
        yield from TrainStream(source, batch, ctx, epochs, reorder=reorder)
        return
    g = batch * ctx.world_size
    lo, hi = ctx.rank * batch, (ctx.rank + 1) * batch
    slices = (
        source.val_slices(g, lo, hi)
        if reorder is None
        else (s.take(slice(lo, hi)) for s in reorder(source.val_batches(g)))
    )
    produced = False
    for s in slices:
        produced = True
        yield s
    if not produced:
        raise ConfigError(
            f"the validation split has no complete global batch of {g} samples ({ctx.world_size} ranks x "
            f"trainer.batch_size={batch}); use a smaller batch or more data"
        )


CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # train.py's Hydra config groups
# keys the app reads that no option file of conf/ holds (set with `+key=value`)
_LOADER_KEYS = ("split_seed", "chunk_bytes", "hash_mode", "time_features", "fmt", "positive_threshold", "num_negatives")
OPTIONAL_KEYS = frozenset(
    {"sharding.compute_kernel", "sharding.cache_load_factor", "data.neg_seed"} | {f"data.{k}" for k in _LOADER_KEYS}
)  # the file loaders' further keyword arguments (herald_torchrec/data) are data.*


def config_schema(conf_dir: Path = CONF_DIR) -> frozenset[str] | None:
    """Every key the app knows: the top-level keys of conf/config.yaml, each group's name, `group.key` for the keys
    of every option file of that group (all options, so one override list serves every scheduler or model, as the
    benchmarks pass it), and OPTIONAL_KEYS. None where conf/ is not beside the package (an installed copy)."""
    if not (conf_dir / "config.yaml").is_file():
        return None
    keys = {k for k in OmegaConf.load(conf_dir / "config.yaml") if k not in ("defaults", "hydra")}
    for group in sorted(p for p in conf_dir.iterdir() if p.is_dir()):
        keys.add(group.name)
        for option in group.glob("*.yaml"):
            keys.update(f"{group.name}.{k}" for k in OmegaConf.load(option) or {})
    return frozenset(keys | OPTIONAL_KEYS)


def unknown_keys(cfg: DictConfig, schema: frozenset[str]) -> list[str]:
    """The keys of `cfg` (two levels: top and group) that the schema does not know, e.g. a `+trainer.stepz=10`."""
    out = []
    for k, v in cfg.items():
        if k not in schema:
            out.append(str(k))
        elif isinstance(v, DictConfig):
            out.extend(f"{k}.{sub}" for sub in v if f"{k}.{sub}" not in schema)
    return out


def _integer(t: DictConfig, key: str, low: int, meaning: str = "", optional: bool = False) -> None:
    v = t.get(key)
    if optional and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(f"trainer.{key} must be an integer >= {low}{meaning}, got {v!r}")


def validate(cfg: DictConfig) -> None:
    """Every check that needs no data and no process group: run before anything starts, so a mistake costs nothing."""
    schema = config_schema()
    unknown = [] if schema is None else unknown_keys(cfg, schema)
    if unknown:
        raise ConfigError(
            f"unknown configuration key {', '.join(unknown)} (not in any file of {CONF_DIR}); check the spelling"
        )
    try:
        affinity_mode(cfg.get("cpu_affinity", "off"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t = cfg.trainer
    _integer(t, "batch_size", 1)
    if (t.steps is None) == (t.epochs is None):
        raise ConfigError("set exactly one of trainer.steps and trainer.epochs (the other to null)")
    _integer(t, "steps", 1, optional=True)
    _integer(t, "epochs", 1, optional=True)
    _integer(t, "eval_interval", 0, " (steps between evaluations; 0 = only at the end)")
    _integer(t, "log_interval", 1, " (steps between progress lines)")
    _integer(t, "checkpoint_interval", 0, " (steps between checkpoints; 0 = off)", optional=True)
    if t.embedding_optimizer not in ("rowwise_adagrad", "adagrad", "sgd"):
        raise ConfigError(
            f"trainer.embedding_optimizer must be rowwise_adagrad, adagrad or sgd, got '{t.embedding_optimizer}'"
        )
    if t.dense_optimizer not in ("adam", "adagrad", "sgd"):
        raise ConfigError(f"trainer.dense_optimizer must be adam, adagrad or sgd, got '{t.dense_optimizer}'")
    for key in ("embedding_lr", "dense_lr"):
        v = t.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v):
            raise ConfigError(f"trainer.{key} must be a number > 0, got {v!r}")
    path = cfg.data.get("path")
    if path and Path(str(path)).is_dir():
        raise ConfigError(f"data.path must be a file, got the directory {path}")
    run_dir = Path(str(cfg.run_dir))
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir {run_dir} is a file; run_dir must be a directory (it is created if missing)")


def check_splits(source: DataSource, cfg: DictConfig, ctx: DistContext) -> None:
    """Both splits hold at least one complete global batch: found before the first step (each takes one batch), not
    when the first evaluation comes after hours of training."""
    for train in (True, False):
        next(local_samples(source, cfg.trainer.batch_size, ctx, train=train, epochs=1))


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: the global step, the training samples consumed (None: a checkpoint of an
    earlier version, which recorded only the step; it continues at its own global batch by skipping `step` batches),
    and the shape of the run that wrote the checkpoint."""

    step: int
    position: DataPosition | None
    world_size: int
    batch_size: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size


def _identity(cfg: DictConfig, world_size: int) -> dict[str, Any]:
    full = OmegaConf.to_container(cfg, resolve=True) | {
        "world_size": world_size,
        "global_batch": world_size * cfg.trainer.batch_size,
    }
    out = {}
    for key in (*RESUME_KEYS, *RECORDED_KEYS):
        v: Any = full
        for part in key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        out[key] = v
    return out


def _checkpoint_state(setup: ShardedSetup, meta: str) -> dict[str, Any]:
    """The DCP state of a run, in TorchRec's layout: the model's state dict (sharded tables as ShardedTensors — Herald's
    in TorchRec's ROW_WISE layout — and the dense parameters), the fused and the dense optimizer's state, and the run's
    meta data (one JSON string). Building it is collective (a Herald module gathers rows that live away from home)."""
    model = setup.model
    optim = {"fused": model.fused_optimizer.state_dict(), "dense": setup.dense_optimizer.state_dict()}
    # optimizers without state (SGD) have nothing to save: DCP cannot hold empty containers
    optim = {k: v for k, v in optim.items() if any(v.get("state", {}).values())}
    state = {"model": model.state_dict(), "meta": meta}
    return state | ({"optim": optim} if optim else {})


def _local_tensors(x: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, this rank's tensor) of every tensor in a nested state dict (a ShardedTensor's local shards, a
    DTensor's local part)."""
    if isinstance(x, dict):
        for k, v in x.items():
            for sub, t in _local_tensors(v):
                yield (f"{k}.{sub}" if sub else str(k)), t
    elif hasattr(x, "local_shards"):
        for shard in x.local_shards():
            yield "", shard.tensor
    elif hasattr(x, "to_local"):
        yield "", x.to_local()
    elif isinstance(x, torch.Tensor):
        yield "", x


def first_nonfinite(state: dict[str, Any], ctx: DistContext) -> str | None:
    """The key of a NaN / infinite floating-point entry of the state about to be checkpointed, on any rank (None: all
    finite). Collective: every rank learns whether some rank found one."""
    bad = next(
        (k for k, t in _local_tensors(state) if t.is_floating_point() and not bool(torch.isfinite(t).all())), None
    )
    flag = torch.tensor([0.0 if bad is None else 1.0 + ctx.rank], dtype=torch.float64)
    if ctx.world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if float(flag) == 0.0:
        return None
    return bad or f"a tensor of rank {int(float(flag)) - 1}"


def save_checkpoint(
    setup: ShardedSetup, run_dir: Path, step: int, cfg: DictConfig, ctx: DistContext, position: DataPosition
) -> None:
    """`<run_dir>/checkpoint/`: a torch.distributed.checkpoint of the model, both optimizers, the step and the training
    samples consumed (`position`: the data are deterministic per sample), with its manifest (app/checkpoint.py: every
    file's size and sha256). Collective. Written into `checkpoint.tmp/`, then renamed by rank 0 once the manifest is
    complete; the previous checkpoint stays until the new one is complete (`checkpoint.old/` during the swap, also read
    by `resume`)."""
    dirs = CheckpointDirs.of(run_dir, CHECKPOINT)
    if ctx.is_main:
        shutil.rmtree(dirs.tmp, ignore_errors=True)  # left by an interrupted save
    _barrier(ctx)
    identity = _identity(cfg, ctx.world_size)
    meta = {"step": step, "identity": identity, "data_position": asdict(position)}
    state = _checkpoint_state(setup, json.dumps(meta))
    bad = first_nonfinite(state, ctx)
    if bad is not None:  # never replace a good checkpoint with a diverged one
        raise TrainingDiverged(divergence_message(step, f"{bad} is not finite", cfg, run_dir))
    save_verified(state, dirs, step, identity, ctx)


def _barrier(ctx: DistContext) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def resume(setup: ShardedSetup, run_dir: Path, cfg: DictConfig, ctx: DistContext) -> ResumePoint | None:
    """Load `<run_dir>/checkpoint/` into a fresh setup (TorchRec's idiom: the setup's own state dicts, filled in place
    by DCP, then loaded; Herald tables come back at their home placement); returns where to continue (None: no
    checkpoint, start from step 0). The number of ranks and the batch size may differ from the checkpoint's (DCP
    reshards the tables and optimizer state): the checkpoint records the training samples it consumed, and the run
    continues at the next one. Refuses (ConfigError) a checkpoint of another model, data or optimizer, and another
    global batch where the stream is counted in global batches (`check_data_position`)."""
    import torch.distributed.checkpoint as dcp

    path = run_dir / CHECKPOINT
    if not path.exists() and (run_dir / f"{CHECKPOINT}.old").exists():
        path = run_dir / f"{CHECKPOINT}.old"  # interrupted while swapping in a newer one: the previous is complete
    if not path.exists():
        if (run_dir / "checkpoint.pt").exists():  # the unsharded format of earlier versions: never restart silently
            raise ConfigError(
                f"{run_dir / 'checkpoint.pt'} is an old-format checkpoint (this version reads "
                f"{path}/, a torch.distributed.checkpoint); use another run_dir or trainer.resume=false"
            )
        return None
    verify_checkpoint(path, ctx)  # every file as written (one-line CheckpointError on every rank), before any load
    try:
        head = {"meta": ""}
        with storage_errors("read", path):
            dcp.load(head, checkpoint_id=str(path))
        meta = json.loads(head["meta"])
    except CheckpointError:
        raise
    except Exception as e:  # not written by this version: say which directory it was
        raise ConfigError(f"cannot read checkpoint {path}: {e}") from e
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException (each rank's traceback): its first line
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ConfigError(f"cannot read checkpoint {path}: {failure_line(e)}") from e
    have, want = dict(meta["identity"]), _identity(cfg, ctx.world_size)
    if "global_batch" not in have:  # written before the global batch was recorded
        have["global_batch"] = have["trainer.batch_size"] * have["world_size"]
    position = DataPosition.from_meta(meta["data_position"]) if "data_position" in meta else None
    check_data_position(path, have, want, position, setup.reorder is not None)
    # keys the checkpoint does not record (written by an earlier version) are not compared
    diff = {k: (have[k], want[k]) for k in RESUME_KEYS if k in have and have[k] != want[k]}
    if diff:
        raise ConfigError(
            f"{path} is from a different run (checkpoint vs now: {diff}); use another run_dir or trainer.resume=false"
        )
    setup.dense_optimizer.init_state()  # creates the state entries that DCP fills
    state = _checkpoint_state(setup, "")
    with storage_errors("read", path):
        dcp.load(state, checkpoint_id=str(path))
    setup.model.load_state_dict(state["model"])
    optim = state.get("optim", {})
    if "fused" in optim:
        setup.model.fused_optimizer.load_state_dict(optim["fused"])
    if "dense" in optim:
        setup.dense_optimizer.load_state_dict(optim["dense"])
    return ResumePoint(int(meta["step"]), position, int(have["world_size"]), int(have["trainer.batch_size"]))


def check_data_position(
    path: Path, have: dict[str, Any], want: dict[str, Any], position: DataPosition | None, reorders: bool
) -> None:
    """Refuse (ConfigError) a resume that could not continue after exactly the samples the checkpoint trained:
    - a checkpoint of an earlier version records only its step, so only its own global batch continues its stream;
      on the synthetic log, whose split then held out every val_every-th global batch, also only with data.val_block
      equal to that global batch (`have["data"]` gets the block it used, so the data compare equal);
    - a stream whose global batches are reordered (fae) counts its position in whole reordered global batches: a
      checkpoint written or resumed under a reordering scheduler continues mid-epoch only at the same global batch
      and under a reordering scheduler again."""
    g_have, g_want = have["global_batch"], want["global_batch"]
    shape = f"{have['world_size']} rank(s) x trainer.batch_size={have['trainer.batch_size']}"
    if position is None:
        if g_have != g_want:
            raise ConfigError(
                f"{path} was trained with global batches of {g_have} samples ({shape}), this run makes {g_want}: "
                "the checkpoint was written by an earlier version, which records steps and not samples, so only the "
                f"same global batch continues the same samples; use ranks x trainer.batch_size = {g_have}"
            )
        data = have.get("data")
        if isinstance(data, dict) and data.get("name") == "synthetic" and "val_block" not in data:
            block = (want.get("data") or {}).get("val_block", g_have)
            if block != g_have:
                raise ConfigError(
                    f"{path} was written by an earlier version, whose synthetic split held out every val_every-th "
                    f"global batch of {g_have} samples; resume it with data.val_block={g_have} (now {block})"
                )
            have["data"] = {**data, "val_block": block}
        return
    if not (reorders or position.reordered) or position.sample == 0:
        return
    if g_have != g_want:
        raise ConfigError(
            f"{path} stands at sample {position.sample} of epoch {position.epoch} of a stream whose global batches "
            f"{'are' if reorders else 'were'} reordered (scheduler fae reorders each epoch's global batches, so its "
            f"place is counted in global batches of {g_have} samples, {shape}); this run makes {g_want}: use ranks x "
            f"trainer.batch_size = {g_have}"
        )
    if reorders != position.reordered:
        raise ConfigError(
            f"{path} stands mid-epoch (sample {position.sample} of epoch {position.epoch}) in a stream "
            + (
                "in log order, which a reordering scheduler (fae) would not continue sample for sample"
                if reorders
                else "reordered by scheduler fae, which only fae continues sample for sample"
            )
            + "; resume under the checkpoint's scheduler (at the end of this epoch any scheduler continues)"
        )


LOCK_FILE = ".lock"  # in run_dir: held (flock) by rank 0 of the job writing there
# a run's outputs in run_dir; trainer.overwrite=true removes them before a new run starts
CHECKPOINT_NAMES = (CHECKPOINT, f"{CHECKPOINT}.old", f"{CHECKPOINT}.tmp", "checkpoint.pt")
RUN_OUTPUTS = (*CHECKPOINT_NAMES, "tb", "metrics.json", "final_state.pt")


class RunDirLock:
    """An exclusive `flock` on `<run_dir>/.lock`, held by rank 0 for the whole run: a second job on the same run_dir
    is refused while the first runs (the kernel releases the lock when the holder exits, even on kill -9, so a crashed
    job never leaves it held). The file keeps the holder's host and pid for the refusal message."""

    def __init__(self, run_dir: Path) -> None:
        import fcntl

        self.path = run_dir / LOCK_FILE
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip() or "another job"
            os.close(self._fd)
            self._fd = None
            raise ConfigError(
                f"run_dir {run_dir} is in use by a running job ({holder} holds {self.path}); wait for it to end or "
                "use another run_dir"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None


def _claim_on_rank0(run_dir: Path, cfg: DictConfig) -> RunDirLock:
    """Rank 0's part of `claim_run_dir`: create run_dir, take its lock, refuse (ConfigError) a run_dir holding a
    checkpoint unless told to resume it or to overwrite it; with overwrite, remove the earlier run's outputs."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(run_dir)
    try:
        held = [n for n in CHECKPOINT_NAMES if (run_dir / n).exists()]
        t = cfg.trainer
        if held and not t.get("resume") and not t.get("overwrite"):
            raise ConfigError(
                f"run_dir {run_dir} already holds a checkpoint ({held[0]}); continue it with trainer.resume=true, "
                "replace it with trainer.overwrite=true, or use another run_dir"
            )
        if t.get("overwrite") and not t.get("resume"):
            for name in RUN_OUTPUTS:
                target = run_dir / name
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
    except BaseException:
        lock.release()
        raise
    return lock


def claim_run_dir(run_dir: Path, cfg: DictConfig, ctx: DistContext) -> RunDirLock | None:
    """Make run_dir this job's before anything is written there (`_claim_on_rank0`); every rank raises the same
    one-line ConfigError when rank 0 refuses. Collective. Returns rank 0's lock (None on other ranks)."""
    lock, refusal = None, None
    if ctx.is_main:
        try:
            lock = _claim_on_rank0(run_dir, cfg)
        except (ConfigError, OSError) as e:
            refusal = str(e) if isinstance(e, ConfigError) else f"cannot use run_dir {run_dir}: {e}"
    if ctx.world_size > 1:
        box = [refusal]
        dist.broadcast_object_list(box, src=0)
        refusal = box[0]
    if refusal is not None:
        raise ConfigError(refusal)
    return lock


def resharded_note(point: ResumePoint, cfg: DictConfig, world_size: int) -> str:
    """The line a run resumed at another shape prints. Nothing else needs to change: a global batch's update does not
    depend on how it is split between ranks (DDP averages the dense gradients; TorchRec's gradient division scales the
    embedding gradients alike, and Herald's equal stock's), and another global batch continues at the next sample."""
    g = world_size * cfg.trainer.batch_size
    same = point.global_batch == g
    return (
        f"[herald] resharded: checkpoint of {point.world_size} rank(s) x batch {point.batch_size}, now {world_size} x "
        f"{cfg.trainer.batch_size} "
        + (
            "(the same global batch: the same samples and updates)"
            if same
            else f"(global batch {point.global_batch} -> {g}: the next samples, cut into the new global batches)"
        )
    )


def evaluate(setup: ShardedSetup, source: DataSource, cfg: DictConfig, ctx: DistContext) -> tuple[float, float]:
    """AUC and log loss over the whole held-out split (all ranks' predictions gathered).

    Plain eval-mode forwards of the sharded model, for every scheduler: the train pipeline is detached meanwhile (its
    in-flight batches are kept; the next `progress` re-attaches it), and Herald's modules never consume a training
    plan in eval mode."""
    model = setup.pipeline.detach()
    model.eval()
    logits, labels = [], []
    with torch.no_grad():
        for batch in setup.eval_batches(local_samples(source, cfg.trainer.batch_size, ctx, train=False, epochs=None)):
            _, (_, lg, lb) = model(batch.to(ctx.device))
            logits.append(lg.float().cpu())
            labels.append(lb.float().cpu())
    model.train()
    lg, lb = torch.cat(logits), torch.cat(labels)
    if ctx.world_size > 1:
        both = torch.stack([lg, lb]).to(ctx.device)
        out = [torch.empty_like(both) for _ in range(ctx.world_size)]
        dist.all_gather(out, both)
        lg, lb = torch.cat([o[0] for o in out]).cpu(), torch.cat([o[1] for o in out]).cpu()
    return auc_logloss(lg, lb)


def train(cfg: DictConfig, ctx: DistContext | None = None) -> dict[str, Any]:
    """One run of the app (train.py's job). Without `ctx` it joins torchrun's process group and leaves it at the end;
    with `ctx` (an initialised group, e.g. several runs in one process) the group is the caller's to close."""
    validate(cfg)
    if ctx is not None:
        return _train_in_own_run_dir(cfg, ctx)
    ctx = init_distributed(cfg.dist_backend, cfg.get("cpu_affinity", "off"), cfg.get("dist_timeout_s", DIST_TIMEOUT_S))
    # no barrier on failure: the other ranks may be inside a collective; exiting non-zero lets torchrun stop them
    metrics = _train_in_own_run_dir(cfg, ctx)
    shutdown()
    return metrics


def _train_in_own_run_dir(cfg: DictConfig, ctx: DistContext) -> dict[str, Any]:
    """The data checked, then run_dir claimed (locked, refused if it holds another run's checkpoint), then the run."""
    source = build_source(cfg.data)
    check_splits(source, cfg, ctx)
    lock = claim_run_dir(Path(cfg.run_dir), cfg, ctx)
    try:
        return _train(cfg, ctx, source)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg: DictConfig, ctx: DistContext, source: DataSource) -> dict[str, Any]:
    say = print if ctx.is_main else (lambda *a, **k: None)
    run_dir = Path(cfg.run_dir)
    features = model_features(cfg, source)
    torch.manual_seed(cfg.seed)  # same dense init on every rank
    model = TrainModel(build_model(cfg.model.name, features, device="cpu", **model_kwargs(cfg)))
    setup = shard_model(model, features, source, cfg, ctx)
    say(
        f"[herald] {cfg.model.name} on {cfg.data.name} ({source.describe()}), {ctx.world_size} rank(s) x "
        f"batch {cfg.trainer.batch_size}, backend {ctx.backend}"
        + ("" if ctx.cpus is None else f" (rank 0 bound to cores {list(ctx.cpus)})")
        + f", scheduler {setup.name}, run_dir {run_dir}"
    )
    point = resume(setup, run_dir, cfg, ctx) if cfg.trainer.get("resume") else None
    start = 0 if point is None else point.step
    if point is not None:
        at = (
            ""
            if point.position is None
            else (
                f", training sample {point.position.sample} of epoch {point.position.epoch} "
                f"({point.position.samples_trained} samples trained)"
            )
        )
        say(f"[herald] resumed from {run_dir / CHECKPOINT} at step {start}{at}")
        if (point.world_size, point.batch_size) != (ctx.world_size, cfg.trainer.batch_size):
            say(resharded_note(point, cfg, ctx.world_size))
    # TensorBoard: whatever an earlier run logged in run_dir after this run's first step is hidden (Logger)
    logger = Logger(run_dir, ctx.is_main, purge_step=start + 1)
    history = RunHistory()  # metrics.json's record, on rank 0; a resumed run's starts with the earlier part
    if point is not None and ctx.is_main:
        history, note = RunHistory.read_earlier(run_dir / "metrics.json", start)
        if note is not None:
            say(f"[herald] note: {note}")
    steps_cap = cfg.trainer.steps
    if point is None or point.position is None:  # from the start; an earlier version's checkpoint: skip its batches
        train_stream = TrainStream(source, cfg.trainer.batch_size, ctx, cfg.trainer.epochs, reorder=setup.reorder)
        stream_base = 0  # the global step of the stream's first batch
        stream = itertools.islice(train_stream, start, steps_cap)
    else:  # the samples after the checkpoint's, at this run's global batch
        train_stream = TrainStream(
            source, cfg.trainer.batch_size, ctx, cfg.trainer.epochs, point.position, reorder=setup.reorder
        )
        stream_base = start
        stream = itertools.islice(train_stream, None if steps_cap is None else max(steps_cap - start, 0))
    ckpt_every = cfg.trainer.get("checkpoint_interval") or 0
    train_iter = setup.train_batches(stream)  # once: a scheduler's lookahead spans evaluation pauses
    eval_every = cfg.trainer.eval_interval or 0
    global_batch = cfg.trainer.batch_size * ctx.world_size
    step, t0, t_log, train_time = start, time.time(), time.time(), 0.0
    window = LossWindow(cfg.trainer.batch_size)  # the logged loss: every rank's samples of the window
    traffic = CommCounter()  # bytes handed to torch.distributed during training steps, the same for every scheduler
    sent_at_log = 0
    watch = DivergenceWatch()
    config = OmegaConf.to_container(cfg, resolve=True)

    def write_metrics(status: str, **fields: Any) -> None:
        """metrics.json (rank 0): the run's status and history so far, and `fields`."""
        if ctx.is_main:
            record = {"status": status, "steps": step, "resumed_from_step": start, **history.as_metrics()}
            with storage_errors("write", run_dir / "metrics.json", "metrics"):
                write_json_atomic(run_dir / "metrics.json", {**record, **fields, "config": config})

    def stop_if_diverged() -> None:
        """Collective, at a step every rank is at: raise TrainingDiverged on every rank (metrics.json says so)."""
        bad = watch.first_bad(ctx)
        if bad is None:
            return
        msg = divergence_message(bad[0], f"loss is {bad[1]}", cfg, run_dir)
        write_metrics("diverged", error=msg, diverged_at_step=bad[0])
        logger.close()
        close = getattr(setup.pipeline, "close", None)  # Herald's input stage: stopped on every rank, at one step
        if close is not None:
            close()
        raise TrainingDiverged(msg)

    done, evaluated_at = False, None
    while not done:
        seg_start, seg_steps = time.time(), 0
        while not eval_every or seg_steps < eval_every:  # the same iterator throughout: pipelines keep their lookahead
            try:
                with count_collectives(traffic, "train"):
                    loss, _, _ = setup.pipeline.progress(train_iter)
            except StopIteration:
                done = True
                break
            step += 1
            seg_steps += 1
            loss_value = float(loss)
            watch.see(step, loss_value)
            window.add(loss_value)
            if step % cfg.trainer.log_interval == 0:
                stop_if_diverged()
                avg = window.global_mean()  # collective, every rank at this step
                history.add_loss(step, avg)
                now = time.time()
                sps = cfg.trainer.log_interval * global_batch / max(now - t_log, 1e-9)
                extra = setup.step_stats()
                sent = traffic.total_bytes() + setup.host_bytes()
                extra["rank0_bytes_per_step"] = (sent - sent_at_log) / cfg.trainer.log_interval  # rank 0's own sends
                sent_at_log = sent
                say(
                    f"step {step:6d}  loss {avg:.4f}  {sps:9.0f} samples/s"
                    + "".join(f"  {k} {v:.3g}" for k, v in extra.items())
                )
                logger.scalars(
                    step, {"train/loss": avg, "train/samples_per_s": sps, **{f"sched/{k}": v for k, v in extra.items()}}
                )
                t_log = now
            if ckpt_every and step % ckpt_every == 0:
                stop_if_diverged()
                write_metrics("running")  # the history up to this checkpoint, for a resume after an interruption
                save_checkpoint(setup, run_dir, step, cfg, ctx, train_stream.position_after(step - stream_base))
        train_time += time.time() - seg_start
        stop_if_diverged()  # before an evaluation and at the end of training
        if seg_steps == 0:
            break
        if eval_every:
            auc, ll = evaluate(setup, source, cfg, ctx)
            say(f"eval @ step {step}: auc {auc:.4f}  logloss {ll:.4f}")
            logger.scalars(step, {"eval/auc": auc, "eval/logloss": ll})
            history.add_eval(step, auc, ll)
            evaluated_at = step
    if not window.empty:  # the steps after the last progress line (every rank has the same number)
        history.add_loss(step, window.global_mean())
    if evaluated_at != step:
        auc, ll = evaluate(setup, source, cfg, ctx)
        logger.scalars(step, {"eval/auc": auc, "eval/logloss": ll})
        history.add_eval(step, auc, ll)
    else:
        auc, ll = history.evals[-1]["auc"], history.evals[-1]["logloss"]
    samples_per_s = (step - start) * global_batch / max(train_time, 1e-9)
    sent = torch.tensor([float(traffic.total_bytes() + setup.host_bytes())], dtype=torch.float64)
    if ctx.world_size > 1:
        dist.all_reduce(sent)
    close = getattr(setup.pipeline, "close", None)  # Herald's input stage (ended with the stream): joined here
    if close is not None:
        close()
    fields = {
        "auc": auc,
        "logloss": ll,
        "samples_per_s": samples_per_s,
        "world_size": ctx.world_size,
        "global_batch": global_batch,
        "comm_bytes_per_step": float(sent) / max(step - start, 1),  # all ranks together, embeddings + sample exchange
        "data_position": asdict(train_stream.position_after(step - stream_base)),  # the training samples consumed
        "wall_s": time.time() - t0,
        **setup.final_stats(step - start),
    }
    if cfg.trainer.save_final:
        state = full_state(setup.model, ctx)
        if ctx.is_main:
            with storage_errors("write", run_dir / "final_state.pt", "final state"):
                save_torch_atomic(run_dir / "final_state.pt", state)
    write_metrics("finished", **fields)
    metrics = {"status": "finished", "steps": step, "resumed_from_step": start, **history.as_metrics(), **fields}
    metrics["config"] = config
    logger.scalars(step, {"eval/final_auc": auc})
    logger.close()
    say(
        f"[herald] done: {step} steps, auc {auc:.4f}, logloss {ll:.4f}, {samples_per_s:.0f} samples/s "
        f"-> {run_dir / 'metrics.json'}"
    )
    return metrics


def summary_line(metrics: dict[str, Any]) -> str:
    keep = {k: metrics[k] for k in ("auc", "logloss", "steps", "samples_per_s") if k in metrics}
    return json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in keep.items()})
