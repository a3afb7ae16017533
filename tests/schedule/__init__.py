"""Tests of herald_torchrec.schedule, the control plane: numpy only, one process, fast."""
