"""Tests of herald_torchrec.distributed.train_pipeline: the input stage's layout and thread, the pipeline's edges."""
