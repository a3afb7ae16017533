"""The train pipeline and its input stage: each rank's `Batch` slice in, the samples the plan assigns it and the plan
out (input_stage, one round of it in input_round, the host-side layout in input_layout, run ahead of training by
input_thread), then TorchRec's sparse-dist pipeline over them (pipeline)."""

from herald_torchrec.distributed.train_pipeline.pipeline import HeraldTrainPipeline

__all__ = ["HeraldTrainPipeline"]
