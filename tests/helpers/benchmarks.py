"""A script of benchmarks/ imported as a module (they are scripts, not a package), for the tests of their CLIs."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from tests.helpers.ranks import REPO_ROOT


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py, executed as the module `name`."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
