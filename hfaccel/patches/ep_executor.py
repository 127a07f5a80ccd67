"""`EPExecutor`: the HF executor of an expert-parallel model (experts sharded, everything else
replicated): the ranks of the group run the same steps in lock step (`StepSync`, as under tensor
parallelism); the experts' all-to-all happens inside the model (`hfaccel.distributed.ep`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from hfaccel.distributed.ep import EPState
from hfaccel.distributed.sync import StepSync
from hfaccel.patches.executor import HFExecutor


class EPExecutor(HFExecutor):
    def __init__(self, model: Any, ep: EPState) -> None:
        super().__init__(model)
        self.ep = ep
        self.step_sync = StepSync(ep.group, ep.src, ep.size)

    def compile(self, dynamic: bool) -> Callable[..., torch.Tensor]:
        return self._model_forward  # eager: data-dependent all-to-all sizes

    def state_token(self) -> Hashable:
        return self.step_sync.agree_token(super().state_token())
