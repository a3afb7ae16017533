"""A Herald module's state as TorchRec presents it: `state_dict` / DCP checkpoints in TorchRec's ROW_WISE layout
(checkpoint) and the module's entry in DMP's fused optimizer (fused_optimizer)."""
