"""Tests of herald_torchrec.distributed.storage: the row store and the optimizer settings it takes."""
