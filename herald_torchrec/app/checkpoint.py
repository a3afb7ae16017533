"""Checkpoints that verify themselves, and storage failures told in one line.

The format stays torch.distributed.checkpoint (DCP); beside DCP's files each checkpoint directory holds
`manifest.json`: every file's name, size and sha256, the step and the run's identity. It is written after DCP's save
and before the checkpoint is swapped into place, so a checkpoint in place always has a complete manifest; before
anything is loaded, every file is checked against it. A flipped or zeroed byte, a missing or truncated file (a copy
that stopped, a disk that lied) is then one line naming the file, on every rank, instead of a NaN model or a 200-line
traceback. A checkpoint without a manifest (written before this version, or its manifest lost) is refused too: it
cannot be told apart from a partial copy. `python -m herald_torchrec.app.checkpoint adopt DIR` writes the manifest of
a checkpoint the user vouches for; `... verify DIR` checks one.

A full disk, a permission or a read-only file system met while writing or reading a checkpoint is one line too
(`CheckpointError`), whether it surfaces as an OSError, torch's writer's "enforce fail at inline_container.cc" or
DCP's CheckpointException that wraps either.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import torch.distributed as dist

if TYPE_CHECKING:
    from herald_torchrec.app.runtime import DistContext

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
HASH_CHUNK = 1 << 20  # files are hashed in 1 MiB reads: checkpoints can be larger than memory
LOW_SPACE = 64 << 20  # a short write with less free than this on the device is reported as a full device
ADOPT_HINT = "python -m herald_torchrec.app.checkpoint adopt"
RESTORE_HINT = "restore it from a good copy, or start again without trainer.resume (trainer.overwrite=true)"
log = logging.getLogger(__name__)
T = TypeVar("T")

# storage failures that are the user's to fix (free space, permissions, a read-only mount), by errno
STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
}
# what torch's zip writer says when a write came up short (a full device, most often)
TORCH_SHORT_WRITE = ("inline_container.cc", "PytorchStreamWriter failed", "file write failed")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or trusted; the message is one line naming the file and what is wrong.
    A ValueError, so train.py prints it as `error: ...` and exits 2."""


@dataclass(frozen=True)
class CheckpointDirs:
    """A run's checkpoint directory, the one being written (`.tmp`) and the one being replaced (`.old`, during the
    swap only; a resume reads it when the swap was interrupted)."""

    final: Path
    tmp: Path
    old: Path

    @staticmethod
    def of(run_dir: Path, name: str) -> CheckpointDirs:
        return CheckpointDirs(run_dir / name, run_dir / f"{name}.tmp", run_dir / f"{name}.old")


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint as written: its path inside the checkpoint directory ('/'-separated), bytes, sha256."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint directory held when it was complete: its files, and the step and run identity of the run
    that wrote it (the identity the trainer compares on resume, kept here so a directory says what it is)."""

    step: int
    identity: dict[str, Any]
    files: tuple[FileRecord, ...]

    def to_json(self) -> str:
        body = {"format": MANIFEST_FORMAT, "step": self.step, "identity": self.identity}
        return json.dumps(body | {"files": [asdict(f) for f in self.files]}, indent=1, sort_keys=True) + "\n"

    @staticmethod
    def read(directory: Path) -> Manifest:
        """The manifest of `directory`; CheckpointError (one line) when it is missing or not a manifest."""
        path = directory / MANIFEST
        if not path.is_file():
            raise CheckpointError(
                f"checkpoint {directory} has no {MANIFEST} (written before checkpoints carried one, or it was lost "
                f"with a partial copy), so it cannot be verified; if you trust it, run `{ADOPT_HINT} {directory}` "
                "and resume again"
            )
        try:
            with storage_errors("read", directory):
                raw = json.loads(path.read_text())
            files = tuple(FileRecord(str(f["name"]), int(f["size"]), str(f["sha256"])) for f in raw["files"])
            if raw.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, this version reads {MANIFEST_FORMAT}")
            return Manifest(int(raw["step"]), dict(raw["identity"] or {}), files)
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"checkpoint {directory} is damaged: {MANIFEST} is not a valid manifest ({e}); {RESTORE_HINT}"
            ) from e


def sha256_of(path: Path) -> str:
    """The file's sha256, read in HASH_CHUNK pieces (never the whole file in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_files(directory: Path) -> list[str]:
    """Every regular file under `directory` but the manifest (and its temporary), sorted, '/'-separated."""
    names = []
    for root, _, files in os.walk(directory):
        for name in files:
            rel = (Path(root) / name).relative_to(directory).as_posix()
            if rel not in (MANIFEST, f".{MANIFEST}.tmp"):
                names.append(rel)
    return sorted(names)


def damage(directory: Path, record: FileRecord) -> str | None:
    """What is wrong with one file of a checkpoint against its manifest record, in words (None: it is intact)."""
    path = directory / record.name
    if not path.is_file():
        return f"{record.name} is missing (the manifest lists {record.size} bytes)"
    size = path.stat().st_size
    if size != record.size:
        how = "truncated" if size < record.size else "grown"
        return f"{record.name} is {how}: {size} bytes, the manifest says {record.size}"
    digest = sha256_of(path)
    if digest != record.sha256:
        return (
            f"{record.name} does not match its checksum (sha256 {digest[:16]}..., the manifest says "
            f"{record.sha256[:16]}...): its bytes changed after it was written"
        )
    return None


def write_manifest(directory: Path, step: int, identity: dict[str, Any], ctx: DistContext | None = None) -> Manifest:
    """Hash every file of a complete DCP directory and write its manifest (rank 0). Collective: the files are split
    between the ranks for hashing (a big checkpoint hashes in parallel); every rank returns the manifest or raises
    the same one-line CheckpointError."""
    rank, world = _rank_world(ctx)
    names = checkpoint_files(directory)

    def hash_mine() -> list[FileRecord]:
        return [FileRecord(n, (directory / n).stat().st_size, sha256_of(directory / n)) for n in names[rank::world]]

    mine, problem = _attempt(hash_mine, "write", directory)
    parts = _all_gather((mine, problem), ctx)
    problem = next((p for _, p in parts if p), None)
    if problem is not None:
        raise CheckpointError(problem)
    records = sorted((r for part, _ in parts for r in part or []), key=lambda r: r.name)
    manifest = Manifest(step, identity, tuple(records))

    def write() -> None:
        tmp = directory / f".{MANIFEST}.tmp"
        with open(tmp, "w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST)
        fsync_dir(directory)

    on_rank0(write, "write", directory, ctx)
    return manifest


def verify_checkpoint(directory: Path, ctx: DistContext | None = None) -> Manifest:
    """Check a checkpoint directory against its manifest before anything is loaded from it: the manifest present and
    valid, every file it lists present with its size and sha256. Collective (the files are split between the ranks);
    every rank raises the same one-line CheckpointError, naming the first damaged file, or returns the manifest."""
    rank, world = _rank_world(ctx)
    manifest: Manifest | None = None
    problem: tuple[int, str] | None = None
    try:
        manifest = Manifest.read(directory)
    except CheckpointError as e:
        problem = (-1, str(e))
    if manifest is not None:
        for i in range(rank, len(manifest.files), world):
            what, failed = _attempt(lambda record=manifest.files[i]: damage(directory, record), "read", directory)
            if failed or what:
                problem = (i, failed or f"checkpoint {directory} is damaged: {what}; {RESTORE_HINT}")
                break
    found = [p for p in _all_gather(problem, ctx) if p is not None]
    if found:
        raise CheckpointError(min(found)[1])  # the first damaged file in the manifest's order, on every rank
    assert manifest is not None
    return manifest


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (a crash right after it never brings the old name back)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def storage_problem(e: BaseException, where: Path) -> str | None:
    """What a storage failure was, in words ("no space left on device (0.0 MiB free where it is written)"), or None
    when `e` is not one. Looks through DCP's CheckpointException (each rank's failure) and exception chains."""
    for exc in _causes(e):
        if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
            what = STORAGE_ERRNOS[exc.errno]
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return what + _free_note(where)
            return what + (f" on {exc.filename}" if exc.filename else "")
        if isinstance(exc, RuntimeError) and any(s in str(exc) for s in TORCH_SHORT_WRITE):
            free = _free_bytes(where)
            if free is not None and free < LOW_SPACE:
                return "no space left on device" + _free_note(where)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"a write stopped short (torch: {first[:160]}){_free_note(where)}"
    return None


@contextmanager
def storage_errors(action: str, path: Path, what: str = "checkpoint") -> Iterator[None]:
    """Turn a storage failure inside the block into `CheckpointError("cannot {action} {what} {path}: no space
    left on device ...")` (`what`: "checkpoint", or another output such as "final state"); anything else propagates
    unchanged. The original stays chained (`from`) and in the debug
    log, never printed: train.py shows only the line."""
    try:
        yield
    except CheckpointError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        problem = storage_problem(e, path)
        if problem is None:
            raise
        log.debug("storage failure while trying to %s %s %s", action, what, path, exc_info=e)
        raise CheckpointError(f"cannot {action} {what} {path}: {problem}") from e


def failure_line(e: BaseException) -> str:
    """One line for an error DCP raised: DCP's CheckpointException prints every rank's traceback, this names the
    first rank's exception only ("FileNotFoundError: ... (rank 0)")."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0]
        return f"{_first_line(inner)} (rank {rank})"
    return _first_line(e)


def on_rank0(fn: Callable[[], None], action: str, path: Path, ctx: DistContext | None) -> None:
    """Run `fn` on rank 0 only; if it fails, every rank raises one CheckpointError with rank 0's line (the other
    ranks would otherwise wait at the next collective until the timeout). Collective."""
    rank, world = _rank_world(ctx)
    problem = _attempt(fn, action, path)[1] if rank == 0 else None
    if world > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem is not None:
        raise CheckpointError(problem)


def save_verified(
    state: dict[str, Any], dirs: CheckpointDirs, step: int, identity: dict[str, Any], ctx: DistContext | None
) -> Manifest:
    """DCP's save of `state` into `dirs.tmp`, its manifest, then the swap into `dirs.final` (rank 0): the previous
    checkpoint stays until the new one is complete, manifest included (`dirs.old` during the swap). Collective.
    A storage failure is one CheckpointError on every rank; the partial directory is removed (its space freed)."""
    import torch.distributed.checkpoint as dcp

    rank, _ = _rank_world(ctx)
    try:
        with storage_errors("write", dirs.final):
            dcp.save(state, checkpoint_id=str(dirs.tmp))
        _barrier(ctx)  # every rank's files are in tmp
        manifest = write_manifest(dirs.tmp, step, identity, ctx)
    except CheckpointError as e:
        if rank == 0:
            shutil.rmtree(dirs.tmp, ignore_errors=True)
        kept = "the previous checkpoint is kept" if dirs.final.exists() else "no checkpoint was written"
        raise CheckpointError(f"{e}; {kept}") from e.__cause__

    def swap() -> None:
        if dirs.final.exists():
            shutil.rmtree(dirs.old, ignore_errors=True)
            os.replace(dirs.final, dirs.old)
        os.replace(dirs.tmp, dirs.final)
        fsync_dir(dirs.final.parent)
        shutil.rmtree(dirs.old, ignore_errors=True)

    on_rank0(swap, "write", dirs.final, ctx)
    _barrier(ctx)
    return manifest


def _attempt(fn: Callable[[], T], action: str, path: Path) -> tuple[T | None, str | None]:
    """(fn(), None), or (None, one line saying why it failed): a step of a collective must not leave the other ranks
    waiting, so any error becomes a line every rank can raise (the original goes to the debug log)."""
    try:
        with storage_errors(action, path):
            return fn(), None
    except CheckpointError as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - told to every rank as one line
        log.debug("failed to %s checkpoint %s", action, path, exc_info=e)
        return None, f"cannot {action} checkpoint {path}: {_first_line(e)}"


def _barrier(ctx: DistContext | None) -> None:
    if ctx is not None and ctx.world_size > 1:
        dist.barrier()


def _rank_world(ctx: DistContext | None) -> tuple[int, int]:
    return (0, 1) if ctx is None else (ctx.rank, ctx.world_size)


def _all_gather(obj: T, ctx: DistContext | None) -> list[T]:
    if ctx is None or ctx.world_size == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def _causes(e: BaseException) -> Iterator[BaseException]:
    """e, the exceptions DCP wrapped in it (one per failed rank), and their causes and contexts, each once."""
    seen, todo = set(), [e]
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f[0] for _, f in sorted(failures.items()))
        todo.extend([exc.__cause__, exc.__context__])


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _free_bytes(where: Path) -> int | None:
    probe = Path(where)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def _free_note(where: Path) -> str:
    free = _free_bytes(where)
    return "" if free is None else f" ({free / 2**20:.1f} MiB free where it is written)"


def read_meta(directory: Path) -> dict[str, Any]:
    """The trainer's meta record (step, identity) of a DCP checkpoint, read in this one process."""
    import torch.distributed.checkpoint as dcp

    head = {"meta": ""}
    try:
        with storage_errors("read", directory):
            dcp.load(head, checkpoint_id=str(directory))
        return json.loads(head["meta"])
    except CheckpointError:
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"cannot read checkpoint {directory}: {failure_line(e)}") from e


def main(argv: list[str]) -> int:
    """`adopt DIR`: write the manifest of a checkpoint written without one (its files as they are now: only for a
    checkpoint you trust). `verify DIR`: check one. Exit 0, or 2 with one `error:` line."""
    if len(argv) != 2 or argv[0] not in ("adopt", "verify"):
        print("usage: python -m herald_torchrec.app.checkpoint adopt|verify CHECKPOINT_DIR", file=sys.stderr)
        return 2
    command, directory = argv[0], Path(argv[1])
    try:
        if not directory.is_dir():
            raise CheckpointError(f"{directory} is not a checkpoint directory")
        if command == "verify":
            m = verify_checkpoint(directory)
            print(f"{directory}: step {m.step}, {len(m.files)} files, all match {MANIFEST}")
            return 0
        if (directory / MANIFEST).exists():
            raise CheckpointError(f"{directory} already has a {MANIFEST}; check it with `verify`")
        meta = read_meta(directory)
        m = write_manifest(directory, int(meta["step"]), dict(meta.get("identity") or {}))
        print(f"{directory}: wrote {MANIFEST} for step {m.step} ({len(m.files)} files, as they are now)")
        return 0
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
