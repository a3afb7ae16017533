"""The application behind `train.py`: the training recipe (trainer) and its self-verifying checkpoints (checkpoint),
the model and pipeline it builds for the chosen scheduler (model_setup, baselines), the process group and cores
(runtime), and what it reports (metrics, model_state). The library (`schedule`, `distributed`, `data`, `models`)
never imports it."""
