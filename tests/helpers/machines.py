"""Ranks on emulated machines inside one host. Herald keys a rank's machine by its host name (plus torchrun's
GROUP_RANK), so a spawned rank that reports another host name sits on another "machine": host relays, one planner
per machine, replicas that matter only across machines."""

from __future__ import annotations

import contextlib
import socket
from typing import Iterator


@contextlib.contextmanager
def on_machine(name: str | None) -> Iterator[None]:
    """This process reports host name `name` inside the block (None: the real one)."""
    real = socket.gethostname
    if name is not None:
        socket.gethostname = lambda: name
    try:
        yield
    finally:
        socket.gethostname = real
