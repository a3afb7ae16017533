"""Harnesses the tests share: gloo ranks as subprocesses (ranks.py), train.py runs in one process or one set of
ranks (app_runs.py, app_cli.py, app_ranks.py), and a TorchRec-pipelineable batch (pipeline.py)."""
