"""Text-generation pipelines over many inputs run as one continuous batch, whatever their `batch_size`.

A pipeline called on a list (or a dataset or generator) builds an iterator: a DataLoader that
preprocesses (and, for ``batch_size > 1``, pads and collates) the inputs, a `PipelineIterator` that
calls ``self.forward`` on each loader item, and one that postprocesses. Out of the box each forward
waits for the previous one, so with the default ``batch_size=1`` the engine only ever sees one prompt.

For a patched model, the forward stage is made concurrent (unless the calls share a streamer or the
user's own processors or criteria, which transformers calls item after item: `shares_callbacks`): the
loader items are still produced in the calling thread (preprocessing and tokenization stay sequential
there; tokenizers are not thread-safe), each one's ``self.forward`` (so its ``model.generate``) runs in a
worker thread, and the results come back in input order to the unchanged unbatching and postprocessing.
Sampled items stay reproducible under ``torch.manual_seed``: one base seed is drawn in the calling thread
when the iteration starts, and item k samples from ``base + k * 2**20`` (`seeded_calls`), whichever
worker runs first. Every ``generate`` call joins the model's one engine loop, so all of them share its
steps. At most a window of loader items is in flight (twice what fits in one step), which bounds memory
on datasets and generators.

`TextGenerationPipeline.get_iterator` is wrapped once, class-wide; it delegates to the original for
models that are not patched.
"""

from __future__ import annotations

import inspect
import math
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import torch

from hfaccel.config import DEFAULT_MAX_NUM_SEQS
from hfaccel.patches.patch_state import seeded_calls

_ROWS_PER_ITEM = 2**20  # seeds apart between items: more than any item's rows (batch x return sequences)

_MAX_WORKERS = 128
_installed = False


def install_pipeline_batching() -> None:
    """Wrap `TextGenerationPipeline.get_iterator` (once per process)."""
    global _installed
    if _installed:
        return
    from transformers import TextGenerationPipeline

    original = TextGenerationPipeline.get_iterator

    def get_iterator(
        self: Any,
        inputs: Any,
        num_workers: int,
        batch_size: int,
        preprocess_params: dict[str, Any],
        forward_params: dict[str, Any],
        postprocess_params: dict[str, Any],
    ) -> Any:
        final = original(
            self, inputs, num_workers, batch_size, preprocess_params, forward_params, postprocess_params
        )
        state = getattr(self.model, "__dict__", {}).get("_hfaccel")
        model_iterator = getattr(final, "loader", None)
        if (
            state is None
            or state.temporary
            or getattr(model_iterator, "infer", None) != self.forward
            or shares_callbacks(forward_params)
        ):
            # not patched (a temporary patch, serving another thread's hfaccel call, leaves this model's
            # generate to transformers), a pipeline layout this wrapper does not know, or calls that must
            # come one after another: leave it alone
            return final
        engine = state.engine
        max_num_seqs = (
            engine.config if engine is not None else state.config
        ).max_num_seqs or DEFAULT_MAX_NUM_SEQS
        window = min(_MAX_WORKERS, max(2, math.ceil(2 * max_num_seqs / max(1, batch_size))))
        device = next(self.model.parameters()).device.type
        model_iterator.loader = _ConcurrentForward(
            model_iterator.loader, self.forward, model_iterator.params, window, device
        )
        model_iterator.infer = _result
        model_iterator.params = {}
        return final

    get_iterator.__wrapped__ = original  # type: ignore[attr-defined]
    get_iterator.__doc__ = original.__doc__
    TextGenerationPipeline.get_iterator = get_iterator
    _installed = True


def shares_callbacks(forward_params: dict[str, Any]) -> bool:
    """Whether every item's ``generate`` gets one object that transformers calls item after item: a
    streamer (its text would interleave, its ``end`` come while other items still stream), or the user's
    own logits processor or stopping criterion (which may keep state from call to call). Such items run
    one after another, as in transformers; transformers' own processors are per-row computations."""
    if forward_params.get("streamer") is not None:
        return True
    for name in ("logits_processor", "stopping_criteria"):
        for item in forward_params.get(name) or ():
            kind = item if inspect.isfunction(item) else type(item)
            if not str(kind.__module__).startswith("transformers."):
                return True
    return False


def _result(future: Future, **_: Any) -> Any:
    return future.result()


class _ConcurrentForward:
    """Iterates `loader` in the calling thread and yields, in order, futures of ``forward(item)`` run
    in worker threads, with at most `window` in flight."""

    def __init__(self, loader: Any, forward: Any, params: dict[str, Any], window: int, device: str) -> None:
        self.loader = loader
        self.device = device
        self.forward = forward
        self.params = params
        self.window = window

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Future]:
        pool = ThreadPoolExecutor(max_workers=self.window, thread_name_prefix="hfaccel-pipeline")
        in_flight: deque[Future] = deque()
        # The caller's autocast, which is thread-local, holds in the workers too (HF's pipeline runs the
        # forward in the caller's thread, under it; the call then goes to transformers).
        device = self.device
        self._autocast = (
            [(device, torch.get_autocast_dtype(device))] if torch.is_autocast_enabled(device) else []
        )
        base = int(torch.randint(0, 2**62, ()).item())  # here, in the calling thread, in order
        try:
            for index, item in enumerate(self.loader):
                seed = (base + index * _ROWS_PER_ITEM) % 2**63
                in_flight.append(pool.submit(self._forward, item, seed))
                if len(in_flight) >= self.window:
                    yield in_flight.popleft()
            while in_flight:
                yield in_flight.popleft()
        finally:
            # Stopped early (an error, or a lazily consumed dataset abandoned): drop what has not started;
            # calls already generating finish in the background and their results are discarded.
            pool.shutdown(wait=False, cancel_futures=True)

    def _forward(self, item: Any, seed: int) -> Any:
        with ExitStack() as stack:
            for device, dtype in self._autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            stack.enter_context(seeded_calls(seed))
            return self.forward(item, **self.params)
