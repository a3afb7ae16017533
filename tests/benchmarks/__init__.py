"""Tests of benchmarks/: the trace simulator's CLI and the network emulation of the end-to-end benchmark."""
