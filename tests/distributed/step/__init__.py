"""Tests of herald_torchrec.distributed.step: a step's preparation and lookup layout, two ranks in one process."""
