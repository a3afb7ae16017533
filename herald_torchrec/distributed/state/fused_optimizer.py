"""`HeraldFusedOptimizer`: a Herald-managed EBC's entry in DMP's fused optimizer (TorchRec keeps its fused
optimizers beside their kernels, not in the sharded module, and so does this package).

FBGEMM's fused optimizer updates the rows; a shared row's update needs its readers' gradients, so `step()` finishes
the step (the module's `finish_step`): the gradient all-to-all, then the TBE backward that updates exclusive and
shared rows together (deferred from `loss.backward()`; with mixed dims or gradient clipping, exclusive rows are
updated in backward and shared rows here by a separate pass).
"""

from __future__ import annotations

from typing import Any

from torchrec.optim.fused import FusedOptimizer

from herald_torchrec.distributed.state.checkpoint import CheckpointedModule, HeraldCheckpoint, state_key, weight_key


def optimizer_layout(module: CheckpointedModule, ck: HeraldCheckpoint) -> tuple[dict, dict, list[dict]]:
    """(params, state, param_groups) of the fused optimizer, as TorchRec's EmbeddingFusedOptimizer has them:
    params keyed `embedding_bags.<t>.weight` (the weight ShardedTensors), state `{param: {"<t>.momentum1": ST}}`
    (an empty dict per table without optimizer state), one param group with the learning rate."""
    params = {weight_key(n): w for n, w in zip(module.table_names, ck.weights)}
    state: dict = {}
    for t, (n, w) in enumerate(zip(module.table_names, ck.weights)):
        state[w] = {state_key(n): ck.states[t]} if ck.has_state else {}
    return params, state, [{"params": list(params.values()), "lr": module.learning_rate}]


class HeraldFusedOptimizer(FusedOptimizer):
    """The module's entry in DMP's fused optimizer: `step()` finishes the step (gradient all-to-all of the shared
    rows + one fused update per row at its owner, see the module docstring).

    Params, state and param_groups are TorchRec's (checkpoint.py): `state_dict()` / `load_state_dict()` carry the
    row-wise optimizer state under TorchRec's keys (both collective). `state` (what `KeyedOptimizer.state_dict()`
    and `CombinedOptimizer` read; the latter never calls this optimizer's `state_dict()`, hence a property) is
    refreshed from the module's rows before it is read; `post_load_state_dict` writes loaded state home."""

    def __init__(self, module: CheckpointedModule, ck: HeraldCheckpoint) -> None:
        super().__init__(*optimizer_layout(module, ck))
        self._rows, self._checkpoint = module, ck
        self._checkpoint_ready = True

    @property
    def state(self) -> dict:  # type: ignore[override]
        if self.__dict__.get("_checkpoint_ready"):
            self._checkpoint.refresh()
        return self.__dict__["_herald_state"]

    @state.setter
    def state(self, value: dict) -> None:
        self.__dict__["_herald_state"] = value

    def post_load_state_dict(self) -> None:
        ck = self._checkpoint
        if ck.has_state:
            ck.load(states=dict(enumerate(ck.home_s)))
        lr = float(next(iter(self.param_groups))["lr"])
        if lr != self._rows.learning_rate:
            self._rows.set_learning_rate(lr)

    def _follow_lr(self) -> None:
        # LR schedulers edit param_groups; like TorchRec's fused optimizers, the TBE takes the new rate at step() /
        # zero_grad(), i.e. from the next backward on. Never between a backward and its shared-row update, so
        # every row of a step is updated with the same rate.
        lr = float(next(iter(self.param_groups))["lr"])
        if lr != self._rows.learning_rate and not self._rows.step_pending:
            self._rows.set_learning_rate(lr)

    def step(self, closure: Any = None) -> None:
        self._rows.finish_step()
        self._follow_lr()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._follow_lr()
