"""Binding each local rank to its own cores (herald_torchrec/app/runtime.py, `cpu_affinity`): the blocks are disjoint
and cover the machine, and binding reaches every thread of the process (those started before it too), which is what
the kernel reports per thread id. The binding runs in a child process so that the test process keeps its CPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from herald_torchrec.app.runtime import bind_local_rank, cpu_blocks


def test_cpu_blocks_are_disjoint_contiguous_and_cover_the_cpus() -> None:
    assert cpu_blocks([5, 1, 7, 0, 2, 3, 6, 4], 3) == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert cpu_blocks([0, 1], 2) == [[0], [1]]
    assert cpu_blocks([3], 1) == [[3]]
    for n in range(1, 9):
        for L in range(1, n + 1):
            blocks = cpu_blocks(list(range(n)), L)
            assert sorted(c for b in blocks for c in b) == list(range(n)) and all(blocks), (n, L, blocks)
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_more_local_ranks_than_cpus_share_cores_evenly() -> None:
    assert cpu_blocks([0, 1], 4) == [[0], [0], [1], [1]]
    assert cpu_blocks([4, 2, 3], 5) == [[2], [2], [3], [3], [4]]
    with pytest.raises(ValueError):
        cpu_blocks([], 2)


def test_off_and_single_rank_leave_the_process_alone() -> None:
    before = os.sched_getaffinity(0)
    assert bind_local_rank("off", 1, 2) is None
    assert bind_local_rank(False, 1, 2) is None  # YAML reads `off` as False
    assert bind_local_rank("auto", 0, 1) is None
    assert os.sched_getaffinity(0) == before


def test_a_bad_mode_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cpu_affinity must be one of"):
        bind_local_rank("yes", 0, 2)


_CHILD = """
import json, os, threading
from herald_torchrec.app.runtime import bind_local_rank, cpu_blocks
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()  # a thread that exists before the binding
cpus = sorted(os.sched_getaffinity(0))
got = bind_local_rank("auto", 1, 2)
seen = {}
after = threading.Thread(target=lambda: seen.update(after=sorted(os.sched_getaffinity(0)))); after.start(); after.join()
out = {"cpus": cpus, "got": got, "expected": cpu_blocks(cpus, 2),
       "main": sorted(os.sched_getaffinity(0)), "before": sorted(os.sched_getaffinity(before.native_id)), **seen}
stop.set(); before.join()
print(json.dumps(out))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding two local ranks needs two CPUs")
def test_binding_reaches_every_thread_of_the_process() -> None:
    p = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    block = r["expected"][1]
    assert r["got"] == block and block and set(block) < set(r["cpus"])
    assert r["main"] == block and r["before"] == block and r["after"] == block
