"""Errors raised by the real-log loaders (criteo.py, avazu.py, movielens.py)."""

from __future__ import annotations

from pathlib import Path


class DataFormatError(ValueError):
    """The file is not in the format the loader expects (wrong header, empty, every leading row malformed, ...).

    Individual malformed rows inside an otherwise well-formed file are *not* errors: they are counted in the
    loader's `stats` and skipped. The message always names the file and, where one applies, the 1-based line.
    """

    def __init__(self, path: str | Path, line: int | None, message: str, expected: str | None = None) -> None:
        self.path = str(path)
        self.line = line
        self.reason = message
        self.expected = expected
        where = f"{self.path}:{line}" if line is not None else self.path
        text = f"{where}: {message}"
        if expected:
            text += f" (expected {expected})"
        super().__init__(text)
