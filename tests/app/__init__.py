"""Tests of herald_torchrec.app pieces that run without a training job (the app's runs are in scenarios/)."""
