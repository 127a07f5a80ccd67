"""Pipeline-parallel state: which decoder layers this rank's stage holds, and its neighbours.

`setup_pipeline_parallel` (called by `hfaccel.patch(model, pipeline_parallel_size=P)`) splits the
decoder layers into P contiguous stages over P ranks (groups of P consecutive ranks when the world is
larger): the embedding runs on the first stage, the final norm and LM head on the last. The layers of
the other stages stay on the model object (the model is left whole, so `unpatch` gives it back as it
was) but are never called here, and this rank's paged KV cache holds only its own layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hfaccel.distributed.layout import parallel_layout, record_layout
from hfaccel.distributed.world import init_world, split_groups


@dataclass
class PPState:
    size: int
    stage: int
    layer_start: int  # global index of this stage's first decoder layer
    layer_end: int  # one past its last
    ranks: list[int]  # the global ranks of the pipeline, stage order
    group: Any

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.size - 1

    @property
    def prev_rank(self) -> int:
        return self.ranks[self.stage - 1]

    @property
    def next_rank(self) -> int:
        return self.ranks[self.stage + 1]


def stage_layers(num_layers: int, size: int, stage: int) -> tuple[int, int]:
    """The ``[start, end)`` decoder layers of `stage`: contiguous, sizes differing by at most one (the
    first stages take the extra layers)."""
    base, extra = divmod(num_layers, size)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


def check_pipeline_size(size: Any, num_layers: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive integer, got {size!r}")
    if size > num_layers:
        raise ValueError(f"pipeline_parallel_size={size} is larger than the {num_layers} decoder layers")


def setup_pipeline_parallel(model: Any, size: int | None) -> PPState | None:
    """What `hfaccel.patch` does about pipeline parallelism; the model's `PPState` (or None). The model's
    forward was checked first (`patches/layer_loop.py`)."""
    existing = parallel_layout(model).pp
    if size is None:
        return existing
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    check_pipeline_size(size, num_layers)
    if size == 1:
        return existing
    if existing is not None:
        if existing.size != size:
            raise ValueError(f"the model is already split into {existing.size} stages")
        return existing
    if parallel_layout(model).tp is not None:
        raise ValueError("pipeline parallelism combined with tensor parallelism is not supported yet")
    init_world(size, "pipeline_parallel_size", next(model.parameters()).device)
    ranks, group = split_groups(size)
    stage = ranks.index(dist.get_rank())
    start, end = stage_layers(num_layers, size, stage)
    state = PPState(size=size, stage=stage, layer_start=start, layer_end=end, ranks=ranks, group=group)
    record_layout(model, pp=state)
    return state
