"""The public entry points: `patch`, `unpatch`, offline `generate` and `stream`, their asyncio forms
`agenerate` and `astream`, and cache control. Every call is served by the model's one engine loop, from
any thread.

One module a concept: `patching` (the patch lifecycle), `prompts` (what a prompt may be), `planning`
(prompts -> engine requests), `offline` (generate), `streaming` (stream), `results` (what comes back)
and `check` (what of a model the engine serves, before it runs).
"""

from hfaccel.api.check import ModelCheck, check
from hfaccel.api.offline import agenerate, generate
from hfaccel.api.patching import is_patched, patch, release, reset_prefix_cache, unpatch
from hfaccel.api.results import Completion, RequestError, StreamEvent, group_by_prompt, prompt_logprobs_of
from hfaccel.api.streaming import astream, stream

__all__ = [
    "Completion",
    "ModelCheck",
    "RequestError",
    "StreamEvent",
    "agenerate",
    "astream",
    "check",
    "generate",
    "group_by_prompt",
    "is_patched",
    "patch",
    "prompt_logprobs_of",
    "release",
    "reset_prefix_cache",
    "stream",
    "unpatch",
]
