"""Tests of herald_torchrec.distributed, the data plane: the sharded module, its step, row storage, the pipeline."""
