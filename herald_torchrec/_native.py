"""Compiled kernels, built on first use and loaded with ctypes: the one switch and build cache they share.

Herald's host work per step is many small numpy passes (docs/performance.md); where one matters, a C++ kernel does the
same arithmetic in one pass: `schedule/native.py` (the planner) and `distributed/host_kernels.py` (the data plane's host
work; some of its kernels take host torch tensors' data pointers). Each is a C ABI on raw buffers (no torch, no
Python headers), compiled with the system C++ compiler into a cache directory (`$HERALD_NATIVE_DIR`, default
`~/.cache/herald_torchrec`) under a hash of its source and flags, written atomically (ranks building at once do not
collide). `make setup` builds them once.

One switch for all of them: `HERALD_NATIVE=0` (app: `scheduler.native=off`) runs numpy only; `=1` (`on`) makes a
failed build an error; otherwise (`auto`) a kernel set that cannot be built warns once and its numpy code runs.
Results are the same either way (tests compare both paths).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

ENV, DIR_ENV = "HERALD_NATIVE", "HERALD_NATIVE_DIR"
# no FMA contraction, no fast-math: the kernels must round exactly as numpy does
FLAGS = ["-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math"]
_OFF, _ON = ("0", "off", "false", "no"), ("1", "on", "true", "yes")

_forced: bool | None = None  # set_mode(); None: HERALD_NATIVE decides


def contiguous(a: np.ndarray, dtype) -> np.ndarray:
    """`a` as a C-contiguous array of the kernel's dtype (a copy only where it is not one already)."""
    return np.ascontiguousarray(a, dtype=dtype)


def address(a: np.ndarray) -> int:
    """The address of a C-contiguous array's first element, as kernels take arrays (ctypes' ndpointer checks cost
    ~2.5 us per argument); the caller keeps the array alive during the call. Through the buffer protocol (~0.3 us;
    `a.ctypes.data` builds a helper object, ~0.8 us, and a step passes ~100 arrays), except for read-only or empty
    arrays, which it refuses. A strided array is an error: a kernel reading it as contiguous would read other data."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):
        if not a.flags.c_contiguous:
            raise ValueError("a kernel takes C-contiguous arrays; this one is strided") from None
        return a.ctypes.data


def addresses(arrays) -> ctypes.Array:
    """A C array of `address`es (`void**`), for kernels that take a list of arrays; the caller keeps them alive."""
    return (ctypes.c_void_p * len(arrays))(*(address(a) for a in arrays))


_addressof, _from_buffer = ctypes.addressof, ctypes.c_char.from_buffer


def address_array(arrays) -> np.ndarray:
    """The `address`es of many arrays as np.uint64, 0 for an empty one, for kernels that never read an empty array
    (asking an empty array for its address costs an exception): one buffer-protocol call per array where none is
    read-only (a planner's phase passes ~650 at R=256, where a call of `address` each cost more than the kernel)."""
    try:
        return np.array([_addressof(_from_buffer(a)) if len(a) else 0 for a in arrays], dtype=np.uint64)
    except (TypeError, ValueError):  # a read-only array
        return np.array([address(a) if len(a) else 0 for a in arrays], dtype=np.uint64)


def _cache_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or Path.home() / ".cache" / "herald_torchrec")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _env_mode() -> str:
    m = os.environ.get(ENV, "auto").strip().lower()
    return "off" if m in _OFF else "on" if m in _ON else "auto"


def mode() -> str:
    """ "on", "off" or "auto" for this process (set_mode, else HERALD_NATIVE)."""
    return _env_mode() if _forced is None else ("on" if _forced else "off")


class Kernels:
    """One kernel library: a C++ source, the ctypes signatures of its functions, and the version it must report
    (`<prefix>_version()`). `get()` is the loaded library, or None when the switch is off or it cannot be built
    (warned once; an error when the switch is on)."""

    _all: list["Kernels"] = []

    def __init__(self, source: Path, signatures: dict, version: int, what: str, prefix: str) -> None:
        self.source, self.signatures, self.version, self.what, self.prefix = source, signatures, version, what, prefix
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        Kernels._all.append(self)

    def library_path(self) -> Path:
        """Where the built library lives for this source, these flags and this platform."""
        h = hashlib.sha1(self.source.read_bytes() + " ".join(FLAGS).encode() + sys.platform.encode()).hexdigest()[:16]
        return _cache_dir() / f"{self.prefix}_{h}.so"

    def build(self, force: bool = False) -> Path:
        """Compile (if not already built) and return the library's path; RuntimeError if it cannot."""
        out = self.library_path()
        if out.exists() and not force:
            return out
        cxx = _compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp", dir=out.parent)
        os.close(fd)
        try:
            p = subprocess.run([cxx, *FLAGS, str(self.source), "-o", tmp], capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"{cxx} failed (exit {p.returncode}): {p.stderr.strip()[-2000:]}")
            os.replace(tmp, out)  # atomic: a rank loading it never sees half a file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return out

    def load(self) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(self.build()))
        for name, (args, res) in self.signatures.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, res
        got = getattr(lib, f"{self.prefix}_version")()
        if got != self.version:
            raise RuntimeError(f"{self.source.name} reports version {got}, expected {self.version}")
        return lib

    def get(self) -> ctypes.CDLL | None:
        if self._tried:
            return self._lib
        self._tried = True
        m = mode()
        if m == "off":
            return None
        try:
            self._lib = self.load()
        except (OSError, RuntimeError) as e:
            if m == "on":
                raise RuntimeError(f"herald: {ENV}=on but {self.what} compiled kernels are unavailable: {e}") from e
            warnings.warn(
                f"herald: {self.what} compiled kernels are unavailable ({e}); using numpy (same results, "
                f"more CPU per step). Set {ENV}=0 to silence this.",
                stacklevel=3,
            )
        return self._lib

    def _reset(self) -> None:
        self._lib, self._tried = None, False


def set_mode(on: bool | None) -> None:
    """True: every kernel set loads now (RuntimeError if one cannot); False: numpy only; None: back to HERALD_NATIVE
    (resolved again at the next use). For this process."""
    global _forced
    _forced = on
    for k in Kernels._all:
        k._reset()
    if on:
        for k in Kernels._all:
            k.get()
