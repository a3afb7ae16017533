"""Where rows sit, in numpy: TorchRec's ROW_WISE home blocks, guest capacity, and index arithmetic over ragged rows.

These are pure functions of sizes and arrays. The store lays its slots out by them (row_store.py), and the step
preparation (step/prepare.py), the input stage (input_layout.py), checkpoints and the baselines' caches compute with
the same ones, so that every side agrees on where a row lives and where its floats sit in a flat buffer. None of
them needs torch or the TBE.
"""

from __future__ import annotations

import math

import numpy as np

from herald_torchrec.options import check_cache_ratio  # one check of the setting, with HeraldOptions


def home_block(rows: int, world_size: int) -> int:
    """Rows per home block: ceil(rows / R), as TorchRec's ROW_WISE sharding (the last blocks may be short or empty)."""
    return -(-rows // world_size)


def home_range(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    block = home_block(rows, world_size)
    lo = min(rows, rank * block)
    return lo, min(rows, lo + block)


def home_rank(rows: int, world_size: int, keys: np.ndarray) -> np.ndarray:
    return np.asarray(keys, dtype=np.int64) // home_block(rows, world_size)


def exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    """[0, x0, x0 + x1, ...] (int64, same length as x): start offsets of consecutive blocks of sizes x."""
    out = np.zeros(x.shape[0], dtype=np.int64)
    if x.shape[0] > 1:
        np.cumsum(x[:-1], out=out[1:])
    return out


def ragged_arange(starts: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[i], starts[i] + widths[i]) over i (int64), in one numpy pass: the element
    indices of variable-width rows in a flat buffer."""
    widths = np.asarray(widths, dtype=np.int64)
    return np.repeat(np.asarray(starts, dtype=np.int64) - exclusive_cumsum(widths), widths) + np.arange(
        int(widths.sum()), dtype=np.int64
    )


def rank_within_group(groups: np.ndarray, num_groups: int) -> np.ndarray:
    """For each item, how many earlier items share its group (items keep their order within a group)."""
    order = np.argsort(groups, kind="stable")
    counts = np.bincount(groups, minlength=num_groups)
    k = np.empty(groups.shape[0], dtype=np.int64)
    k[order] = np.arange(groups.shape[0], dtype=np.int64) - np.repeat(exclusive_cumsum(counts), counts)
    return k


def guest_capacity(rows: int, cache_ratio: float) -> int:
    """Guest slots per rank for a table: ceil(cache_ratio * rows), rounded to 9 decimals first (so 0.1 * 30 is 3, not
    4) exactly as the scheduler's directory counts them: the two sides must agree, or plans that respect the
    scheduler's capacity get rejected here."""
    return math.ceil(round(check_cache_ratio(cache_ratio) * rows, 9))
