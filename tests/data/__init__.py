"""Tests of herald_torchrec.data: the synthetic log and the real-format loaders (beside criteo_search_sample.tsv)."""
