"""The parallel layout a model was set up with: one typed record on the model, holding the runtime
state of each kind of parallelism `hfaccel.patch` set up (tensor, pipeline, expert, data). The executor
is chosen from it, the front-ends ask it, and the setup functions in this package fill it in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_ATTRIBUTE = "_hfaccel_parallel"


@dataclass
class ParallelLayout:
    """Each kind's runtime state (`TPState`, `PPState`, `EPState`, `DPState`), None where not parallel."""

    tp: Any = None
    pp: Any = None
    ep: Any = None
    dp: Any = None

    @property
    def model_parallel(self) -> bool:
        """Whether one replica of the model spans several processes (tensor, pipeline or expert)."""
        return self.tp is not None or self.pp is not None or self.ep is not None

    @property
    def replica_size(self) -> int:
        """Processes per replica: the product of the tensor, pipeline and expert sizes."""
        size = 1
        for state in (self.tp, self.pp, self.ep):
            if state is not None:
                size *= state.size
        return size

    @property
    def parallel(self) -> bool:
        return self.model_parallel or self.dp is not None


def parallel_layout(model: Any) -> ParallelLayout:
    """The model's layout (an empty one, not kept on the model, where none was set up)."""
    layout = getattr(model, "__dict__", {}).get(_ATTRIBUTE)
    return layout if layout is not None else ParallelLayout()


def record_layout(model: Any, **states: Any) -> None:
    """Keep `states` (tp=, pp=, ep=, dp=) in the model's layout record."""
    layout = model.__dict__.get(_ATTRIBUTE)
    if layout is None:
        layout = model.__dict__[_ATTRIBUTE] = ParallelLayout()
    for name, state in states.items():
        setattr(layout, name, state)
