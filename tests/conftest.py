"""Fixtures and report hooks of the whole suite (the harnesses the tests import are in tests/helpers/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.ranks import REPO_ROOT

SHARED_DATA = REPO_ROOT.parent / "shared" / "data"  # real-format samples, ../shared beside the repo


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real-format samples not found at {SHARED_DATA} (../shared beside the repo)")
    return SHARED_DATA


_deselected_cuda: list[str] = []


def pytest_deselected(items) -> None:
    """Remember `cuda`-marked tests that `-m` deselected, so the run says so instead of dropping them silently."""
    _deselected_cuda.extend(i.nodeid for i in items if i.get_closest_marker("cuda") is not None)


def pytest_terminal_summary(terminalreporter) -> None:
    if _deselected_cuda:
        terminalreporter.write_line(
            f"{len(_deselected_cuda)} cuda-marked tests deselected: they need a CUDA GPU (run `make test-gpu` there)"
        )
