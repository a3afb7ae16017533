"""Process-group set-up under torchrun (herald_torchrec/app/runtime.py): what the agent's environment says about
restarts and its shared rendezvous store, when a run must warn, and that every group the app makes has the timeout
the user chose (the pipeline's host group included), not torch's half hour. The groups are made in a child process
so that the test process stays without one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from herald_torchrec.app.runtime import SHARE_STORE_VAR, ElasticLaunch, init_distributed
from tests.helpers.ranks import REPO_ROOT


def _env(restart: int, max_restarts: int, agent_store: bool, machines: int = 1) -> dict[str, str]:
    return {  # what torch's LocalElasticAgent puts in each worker's environment
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
        "GROUP_WORLD_SIZE": str(machines),
    }


def test_launch_is_read_from_the_agents_environment() -> None:
    assert ElasticLaunch.from_env({}) is None  # not under torchrun
    launch = ElasticLaunch.from_env(_env(1, 2, True, machines=3))
    assert launch == ElasticLaunch(restart_count=1, max_restarts=2, agent_store=True, machines=3)


def test_one_machine_isolates_attempts_and_needs_no_warning() -> None:
    launch = ElasticLaunch.from_env(_env(1, 2, True))
    assert launch.isolates_attempts and launch.restart_hazard() is None


def test_shared_store_across_machines_warns_in_one_line_naming_the_fix() -> None:
    for restart in (0, 2):
        line = ElasticLaunch.from_env(_env(restart, 2, True, machines=2)).restart_hazard()
        assert line is not None and "\n" not in line and f"{SHARE_STORE_VAR}=1" in line, line
        assert f"attempt {restart + 1} of at most 3" in line
    assert ElasticLaunch.from_env(_env(0, 0, True, machines=2)).restart_hazard() is None  # no restarts asked for
    assert ElasticLaunch.from_env(_env(1, 2, False, machines=2)).restart_hazard() is None  # the variable was set
    assert not ElasticLaunch.from_env(_env(1, 2, False)).isolates_attempts  # its own store per attempt already


@pytest.mark.parametrize("bad", [0, -5, "abc", float("inf"), True, None])
def test_a_bad_timeout_is_a_one_line_error(bad: object) -> None:
    with pytest.raises(ValueError, match="dist_timeout_s must be a positive number of seconds"):
        init_distributed("gloo", "off", bad)  # checked before any group is made


_GROUPS = r"""
import json, sys
import torch
from herald_torchrec.app.runtime import init_distributed, shutdown
from herald_torchrec.distributed.train_pipeline.pipeline import default_group_timeout, host_process_group
import torch.distributed as dist
init_distributed("gloo", "off", 77)
def seconds(group):
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
host = host_process_group()
out = {"default": seconds(dist.distributed_c10d._get_default_group()), "host": seconds(host),
       "inherited": default_group_timeout().total_seconds()}
shutdown()
print(json.dumps(out))
"""


def test_every_group_has_the_chosen_timeout() -> None:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "-c", _GROUPS], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"default": 77.0, "host": 77.0, "inherited": 77.0}
