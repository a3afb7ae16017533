"""Tests of herald_torchrec.models: every model's forward and backward on a TorchRec batch."""
