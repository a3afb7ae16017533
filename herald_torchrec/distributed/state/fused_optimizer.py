"""`HeraldFusedOptimizer`: a Herald-managed EBC's entry in DMP's fused optimizer (TorchRec keeps its fused
optimizers beside their kernels, not in the sharded module, and so does this package).

FBGEMM's fused optimizer updates the rows; a shared row's update needs its readers' gradients, so `step()` finishes
the step (`ShardedHeraldEmbeddingBagCollection.finish_step`): the gradient all-to-all, then the TBE backward that
updates exclusive and shared rows together (deferred from `loss.backward()`; with mixed dims or gradient clipping,
exclusive rows are updated in backward and shared rows here by a separate pass).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchrec.optim.fused import FusedOptimizer

from herald_torchrec.distributed.state.checkpoint import CheckpointedOptimizerMixin, optimizer_layout

if TYPE_CHECKING:
    from herald_torchrec.distributed.embeddingbag import ShardedHeraldEmbeddingBagCollection


class HeraldFusedOptimizer(CheckpointedOptimizerMixin, FusedOptimizer):
    """The module's entry in DMP's fused optimizer: `step()` finishes the step (gradient all-to-all of the shared
    rows + one fused update per row at its owner, see the module docstring).
    Params, state and param_groups are TorchRec's (checkpoint.py): `state_dict()` / `load_state_dict()` carry the
    row-wise optimizer state under TorchRec's keys (both collective)."""

    def __init__(self, module: "ShardedHeraldEmbeddingBagCollection") -> None:
        super().__init__(*optimizer_layout(module._checkpoint))
        self._module_ref = [module]  # a list, so that the module is not registered as an optimizer attribute
        self._checkpoint_ready = True

    def _follow_lr(self) -> None:
        # LR schedulers edit param_groups; like TorchRec's fused optimizers, the TBE takes the new rate at step() /
        # zero_grad(), i.e. from the next backward on. Never between a backward and its shared-row update, so
        # every row of a step is updated with the same rate.
        module = self._module_ref[0]
        lr = float(next(iter(self.param_groups))["lr"])
        if lr != module.learning_rate and not module.step_pending:
            module.set_learning_rate(lr)

    def step(self, closure: Any = None) -> None:
        self._module_ref[0].finish_step()
        self._follow_lr()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._follow_lr()
