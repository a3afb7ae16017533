"""A checkpoint's manifest and the one-line storage errors, on hand-made directories and exceptions (one process, no
DCP): the manifest lists every file with its size and sha256; every kind of damage is named with its file; a full
disk, a permission or a read-only file system reads as one line, also inside DCP's CheckpointException."""

from __future__ import annotations

import errno
import hashlib
import json
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from herald_torchrec.app import checkpoint as ck
from herald_torchrec.app.checkpoint import MANIFEST, CheckpointError, storage_errors, verify_checkpoint, write_manifest


def _directory(root: Path) -> Path:
    """A DCP-like directory: its metadata, two data files (one larger than a hash chunk), a subfolder's file."""
    d = root / "checkpoint"
    (d / "sub").mkdir(parents=True)
    (d / ".metadata").write_bytes(b"meta" * 100)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * (ck.HASH_CHUNK // 256 * 3 + 7))
    (d / "__1_0.distcp").write_bytes(b"\x01" * 5000)
    (d / "sub" / "extra.bin").write_bytes(b"x")
    return d


def test_the_manifest_lists_every_file_with_size_and_sha256(tmp_path: Path) -> None:
    d = _directory(tmp_path)
    m = write_manifest(d, 40, {"seed": 3})
    raw = json.loads((d / MANIFEST).read_text())
    assert raw["step"] == 40 and raw["identity"] == {"seed": 3} and raw["format"] == ck.MANIFEST_FORMAT
    names = [".metadata", "__0_0.distcp", "__1_0.distcp", "sub/extra.bin"]
    assert [f["name"] for f in raw["files"]] == names == [f.name for f in m.files]
    for f in raw["files"]:
        data = (d / f["name"]).read_bytes()
        assert f["size"] == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest()
    assert verify_checkpoint(d) == m
    assert not (d / f".{MANIFEST}.tmp").exists()


def _flip(path: Path, at: int, n: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


DAMAGE = {  # what is done to the directory -> the words the one line must hold
    "flipped": (lambda d: _flip(d / "__0_0.distcp", 1 << 20, 4096), "__0_0.distcp does not match its checksum"),
    "zeroed": (lambda d: (d / "__1_0.distcp").write_bytes(bytes(5000)), "__1_0.distcp does not match its checksum"),
    "missing": (lambda d: (d / "__1_0.distcp").unlink(), "__1_0.distcp is missing (the manifest lists 5000 bytes)"),
    "truncated": (
        lambda d: (d / "__1_0.distcp").write_bytes(b"\x01" * 100),
        "__1_0.distcp is truncated: 100 bytes, the manifest says 5000",
    ),
    "grown": (lambda d: (d / ".metadata").write_bytes(b"meta" * 101), ".metadata is grown: 404 bytes"),
    "manifest_missing": (lambda d: (d / MANIFEST).unlink(), f"has no {MANIFEST}"),
    "manifest_garbled": (lambda d: (d / MANIFEST).write_text("{"), f"{MANIFEST} is not a valid manifest"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_every_damage_is_one_line_naming_the_file(tmp_path: Path, case: str) -> None:
    d = _directory(tmp_path)
    write_manifest(d, 40, {})
    harm, words = DAMAGE[case]
    harm(d)
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(d)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and str(d) in msg, msg
    if case == "manifest_missing":  # the way to use a trusted checkpoint of an earlier version is in the line
        assert f"python -m herald_torchrec.app.checkpoint adopt {d}" in msg
    elif case != "manifest_garbled":
        assert msg.startswith(f"checkpoint {d} is damaged: ") and "trainer.overwrite=true" in msg


def test_the_first_damaged_file_is_named(tmp_path: Path) -> None:
    d = _directory(tmp_path)
    write_manifest(d, 1, {})
    (d / "__1_0.distcp").unlink()
    _flip(d / ".metadata", 0, 4)
    with pytest.raises(CheckpointError, match=r"damaged: \.metadata does not match"):
        verify_checkpoint(d)


def test_adopt_writes_the_manifest_of_a_trusted_checkpoint_only_once(tmp_path: Path, monkeypatch) -> None:
    d = _directory(tmp_path)
    monkeypatch.setattr(ck, "read_meta", lambda directory: {"step": 12, "identity": {"seed": 1}})
    assert ck.main(["adopt", str(d)]) == 0
    assert verify_checkpoint(d).step == 12 and ck.main(["verify", str(d)]) == 0
    assert ck.main(["adopt", str(d)]) == 2  # never over an existing manifest
    (d / "__1_0.distcp").write_bytes(b"")
    assert ck.main(["verify", str(d)]) == 2


SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
STORAGE = {  # the exception -> the words of its one line
    "full": (OSError(errno.ENOSPC, "No space left on device"), "no space left on device ("),
    "quota": (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded"),
    "denied": (PermissionError(errno.EACCES, "Permission denied", "/r/checkpoint.tmp/__0_0.distcp"), "permission"),
    "read_only": (OSError(errno.EROFS, "Read-only file system", "/r/checkpoint.tmp"), "read-only file system on /r/"),
    "torch_short_write": (RuntimeError(SHORT_WRITE), "a write stopped short (torch: [enforce fail at inline_cont"),
}


@pytest.mark.parametrize("case", list(STORAGE))
@pytest.mark.parametrize("wrapped", [False, True])
def test_storage_failures_are_one_line(tmp_path: Path, case: str, wrapped: bool) -> None:
    """Raised as they are, or as DCP raises them: a CheckpointException holding each rank's (exception, trace)."""
    exc, words = STORAGE[case]
    raised = CheckpointException("write", {1: (exc, None)}) if wrapped else exc
    with pytest.raises(CheckpointError) as e:
        with storage_errors("write", tmp_path / "checkpoint"):
            raise raised
    msg = str(e.value)
    assert msg.startswith(f"cannot write checkpoint {tmp_path / 'checkpoint'}: ") and words in msg, msg
    assert "\n" not in msg and "Traceback" not in msg and e.value.__cause__ is raised


def test_other_outputs_name_themselves(tmp_path: Path) -> None:
    """final_state.pt and metrics.json go through the same wrapper: the line names what could not be written."""
    with pytest.raises(CheckpointError) as e:
        with storage_errors("write", tmp_path / "final_state.pt", "final state"):
            raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "final_state.pt.tmp"))
    assert str(e.value).startswith(f"cannot write final state {tmp_path / 'final_state.pt'}: read-only file system")


def test_a_short_write_on_a_full_device_says_so(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ck, "_free_bytes", lambda where: 4096)
    with pytest.raises(CheckpointError, match=r"^cannot read checkpoint .*: no space left on device \(0\.0 MiB free"):
        with storage_errors("read", tmp_path):
            raise RuntimeError(SHORT_WRITE)


def test_other_errors_pass_through(tmp_path: Path) -> None:
    for exc in (OSError(errno.EIO, "I/O error"), RuntimeError("size mismatch"), KeyError("model")):
        with pytest.raises(type(exc)):
            with storage_errors("read", tmp_path):
                raise exc
    inner = FileNotFoundError(errno.ENOENT, "No such file", "x/__0_0.distcp")
    line = ck.failure_line(CheckpointException("read", {0: (inner, None)}))
    assert line == "FileNotFoundError: [Errno 2] No such file: 'x/__0_0.distcp' (rank 0)"
