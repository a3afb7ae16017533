"""The training recipe: data -> model -> DistributedModelParallel -> train pipeline -> metrics.

Kept as one direct function (nanoGPT style) over small helpers; `train.py` only turns the Hydra config into a call.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from herald_torchrec.app.metrics import Logger, auc_logloss, save_torch_atomic, write_json_atomic
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
# what a checkpoint must agree on to be resumed (the rest — scheduler, cache ratio, logging — may change)
RESUME_KEYS = ("model", "data", "seed", "trainer.batch_size", "trainer.embedding_optimizer", "world_size")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message says which key and why."""


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


def local_samples(
    source: DataSource,
    batch: int,
    ctx: DistContext,
    train: bool,
    epochs: int | None,
    reorder: Callable[[Iterator[Samples]], Iterator[Samples]] | None = None,
) -> Iterator[Samples]:
    """This rank's slice of each global batch; the training stream loops over epochs (None = forever). `reorder`
    (the scheduler's, e.g. fae's) transforms each epoch's global batches before the slicing."""
    g = batch * ctx.world_size
    lo, hi = ctx.rank * batch, (ctx.rank + 1) * batch
    passes = itertools.count() if (train and epochs is None) else range(epochs if train else 1)
    for _ in passes:
        produced = False
        if reorder is None:  # the source cuts this rank's slice (the synthetic log makes only that)
            slices = source.train_slices(g, lo, hi) if train else source.val_slices(g, lo, hi)
        else:  # a reorder needs whole global batches
            slices = (
                s.take(slice(lo, hi)) for s in reorder(source.train_batches(g) if train else source.val_batches(g))
            )
        for s in slices:
            produced = True
            yield s
        if not produced:
            raise ConfigError(
                f"the {'training' if train else 'validation'} split has no complete global batch of {g} samples "
                f"({ctx.world_size} ranks x trainer.batch_size={batch}); use a smaller batch or more data"
            )


def validate(cfg: DictConfig) -> None:
    try:
        affinity_mode(cfg.get("cpu_affinity", "off"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t = cfg.trainer
    if t.batch_size < 1:
        raise ConfigError(f"trainer.batch_size must be >= 1, got {t.batch_size}")
    if (t.steps is None) == (t.epochs is None):
        raise ConfigError("set exactly one of trainer.steps and trainer.epochs (the other to null)")
    if t.steps is not None and t.steps < 1:
        raise ConfigError(f"trainer.steps must be >= 1, got {t.steps}")
    if t.epochs is not None and t.epochs < 1:
        raise ConfigError(f"trainer.epochs must be >= 1, got {t.epochs}")
    if t.embedding_optimizer not in ("rowwise_adagrad", "sgd"):
        raise ConfigError(f"trainer.embedding_optimizer must be rowwise_adagrad or sgd, got '{t.embedding_optimizer}'")
    if t.dense_optimizer not in ("adam", "adagrad", "sgd"):
        raise ConfigError(f"trainer.dense_optimizer must be adam, adagrad or sgd, got '{t.dense_optimizer}'")
    for key in ("embedding_lr", "dense_lr"):
        if not t[key] > 0:
            raise ConfigError(f"trainer.{key} must be > 0, got {t[key]}")
    if t.get("checkpoint_interval", 0) < 0:
        raise ConfigError(f"trainer.checkpoint_interval must be >= 0 (0 = off), got {t.checkpoint_interval}")


def _identity(cfg: DictConfig, world_size: int) -> dict[str, Any]:
    full = OmegaConf.to_container(cfg, resolve=True) | {"world_size": world_size}
    out = {}
    for key in RESUME_KEYS:
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


def save_checkpoint(setup: ShardedSetup, run_dir: Path, step: int, cfg: DictConfig, ctx: DistContext) -> None:
    """`<run_dir>/checkpoint/`: a torch.distributed.checkpoint of the model, both optimizers and the step (data are
    deterministic by step). Collective. Written into `checkpoint.tmp/`, then renamed by rank 0; the previous
    checkpoint stays until the new one is complete (`checkpoint.old/` during the swap, also read by `resume`)."""
    import torch.distributed.checkpoint as dcp

    final, tmp, old = run_dir / CHECKPOINT, run_dir / f"{CHECKPOINT}.tmp", run_dir / f"{CHECKPOINT}.old"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
    _barrier(ctx)
    meta = json.dumps({"step": step, "identity": _identity(cfg, ctx.world_size)})
    dcp.save(_checkpoint_state(setup, meta), checkpoint_id=str(tmp))
    _barrier(ctx)  # every rank's files are in tmp
    if ctx.is_main:
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(ctx)


def _barrier(ctx: DistContext) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def resume(setup: ShardedSetup, run_dir: Path, cfg: DictConfig, ctx: DistContext) -> int:
    """Load `<run_dir>/checkpoint/` into a fresh setup (TorchRec's idiom: the setup's own state dicts, filled in place
    by DCP, then loaded; Herald tables come back at their home placement); returns the step to continue from.
    Refuses (ConfigError) a checkpoint of another model, data, batch size, optimizer or world size."""
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
        return 0
    try:
        head = {"meta": ""}
        dcp.load(head, checkpoint_id=str(path))
        meta = json.loads(head["meta"])
    except Exception as e:  # not written by this version (or damaged): say which directory it was
        raise ConfigError(f"cannot read checkpoint {path}: {e}") from e
    want = _identity(cfg, ctx.world_size)
    diff = {k: (meta["identity"].get(k), v) for k, v in want.items() if meta["identity"].get(k) != v}
    if diff:
        raise ConfigError(
            f"{path} is from a different run (checkpoint vs now: {diff}); use another run_dir or trainer.resume=false"
        )
    setup.dense_optimizer.init_state()  # creates the state entries that DCP fills
    state = _checkpoint_state(setup, "")
    dcp.load(state, checkpoint_id=str(path))
    setup.model.load_state_dict(state["model"])
    optim = state.get("optim", {})
    if "fused" in optim:
        setup.model.fused_optimizer.load_state_dict(optim["fused"])
    if "dense" in optim:
        setup.dense_optimizer.load_state_dict(optim["dense"])
    return int(meta["step"])


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
        return _train(cfg, ctx)
    ctx = init_distributed(cfg.dist_backend, cfg.get("cpu_affinity", "off"), cfg.get("dist_timeout_s", DIST_TIMEOUT_S))
    # no barrier on failure: the other ranks may be inside a collective; exiting non-zero lets torchrun stop them
    metrics = _train(cfg, ctx)
    shutdown()
    return metrics


def _train(cfg: DictConfig, ctx: DistContext) -> dict[str, Any]:
    say = print if ctx.is_main else (lambda *a, **k: None)
    run_dir = Path(cfg.run_dir)
    source = build_source(cfg.data)
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
    start = resume(setup, run_dir, cfg, ctx) if cfg.trainer.get("resume") else 0
    if start:
        say(f"[herald] resumed from {run_dir / CHECKPOINT} at step {start}")
    logger = Logger(run_dir, ctx.is_main)
    steps_cap = cfg.trainer.steps
    stream = local_samples(
        source, cfg.trainer.batch_size, ctx, train=True, epochs=cfg.trainer.epochs, reorder=setup.reorder
    )
    stream = itertools.islice(stream, start, steps_cap)  # the data are deterministic: skip what was trained
    ckpt_every = cfg.trainer.get("checkpoint_interval", 0) or 0
    train_iter = setup.train_batches(stream)  # once: a scheduler's lookahead spans evaluation pauses
    eval_every = cfg.trainer.eval_interval or 0
    global_batch = cfg.trainer.batch_size * ctx.world_size
    step, loss_sum, loss_n, t0, t_log, train_time = start, 0.0, 0, time.time(), time.time(), 0.0
    history, first_loss, last_loss = [], None, None
    traffic = CommCounter()  # bytes handed to torch.distributed during training steps, the same for every scheduler
    sent_at_log = 0
    done = False
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
            loss_sum += float(loss)
            loss_n += 1
            if step % cfg.trainer.log_interval == 0:
                now = time.time()
                avg = loss_sum / loss_n
                sps = cfg.trainer.log_interval * global_batch / max(now - t_log, 1e-9)
                first_loss = avg if first_loss is None else first_loss
                last_loss = avg
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
                loss_sum, loss_n, t_log = 0.0, 0, now
            if ckpt_every and step % ckpt_every == 0:
                save_checkpoint(setup, run_dir, step, cfg, ctx)
        train_time += time.time() - seg_start
        if seg_steps == 0:
            break
        if eval_every:
            auc, ll = evaluate(setup, source, cfg, ctx)
            say(f"eval @ step {step}: auc {auc:.4f}  logloss {ll:.4f}")
            logger.scalars(step, {"eval/auc": auc, "eval/logloss": ll})
            history.append({"step": step, "auc": auc, "logloss": ll})
    if loss_n:
        last_loss = loss_sum / loss_n
        first_loss = last_loss if first_loss is None else first_loss
    if not eval_every or not history or history[-1]["step"] != step:
        auc, ll = evaluate(setup, source, cfg, ctx)
        logger.scalars(step, {"eval/auc": auc, "eval/logloss": ll})
        history.append({"step": step, "auc": auc, "logloss": ll})
    auc, ll = history[-1]["auc"], history[-1]["logloss"]
    samples_per_s = (step - start) * global_batch / max(train_time, 1e-9)
    sent = torch.tensor([float(traffic.total_bytes() + setup.host_bytes())], dtype=torch.float64)
    if ctx.world_size > 1:
        dist.all_reduce(sent)
    metrics = {
        "auc": auc,
        "logloss": ll,
        "steps": step,
        "samples_per_s": samples_per_s,
        "first_loss": first_loss,
        "last_loss": last_loss,
        "world_size": ctx.world_size,
        "global_batch": global_batch,
        "comm_bytes_per_step": float(sent) / max(step - start, 1),  # all ranks together, embeddings + sample exchange
        "wall_s": time.time() - t0,
        "resumed_from_step": start,
        "eval_history": history,
        **setup.final_stats(step - start),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    if cfg.trainer.save_final:
        state = full_state(setup.model, ctx)
        if ctx.is_main:
            save_torch_atomic(run_dir / "final_state.pt", state)
    if ctx.is_main:
        write_json_atomic(run_dir / "metrics.json", metrics)
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
