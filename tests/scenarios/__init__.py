"""What a user does, end to end: the drop-in loop, exactness against stock TorchRec (module, app, CUDA), the app's
runs, resume, DCP checkpoints, closing the pipeline. Mostly multi-rank and slower than the unit tests."""
