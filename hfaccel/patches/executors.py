"""Which executor runs a model: the parallel layout `patch` set up (`distributed/layout.py`) picks it
(expert, pipeline or tensor parallel), else the plain `HFExecutor`. Registered with the engine when the
HF adapter is imported, so ``Engine(model, config)`` takes a plain transformers model."""

from __future__ import annotations

from typing import Any

from hfaccel.distributed.layout import parallel_layout
from hfaccel.engine.executor import register_executor_factory
from hfaccel.patches.ep_executor import EPExecutor
from hfaccel.patches.executor import HFExecutor
from hfaccel.patches.pp_executor import PPExecutor
from hfaccel.patches.tp_executor import TPExecutor


def make_hf_executor(model: Any) -> HFExecutor:
    """The executor of an HF model: expert-, pipeline- or tensor-parallel when `patch` (or transformers,
    for a model it sharded at load) made it so, else an `HFExecutor`."""
    layout = parallel_layout(model)
    if layout.ep is not None:
        return EPExecutor(model, layout.ep)
    if layout.pp is not None:
        return PPExecutor(model, layout.pp)
    if layout.tp is not None:
        return TPExecutor(model, layout.tp)
    return HFExecutor(model)


register_executor_factory(make_hf_executor)
