"""hfaccel: paged-KV continuous batching for Hugging Face transformers, in one line.

import hfaccel
model = hfaccel.patch(model)      # model.generate(...) and pipelines now run on the engine
hfaccel.generate(model, prompts, tokenizer=tok, max_new_tokens=64)   # many prompts at once
"""

from hfaccel.api import Completion, RequestError, StreamEvent, generate, patch, stream, unpatch
from hfaccel.config import EngineConfig

__all__ = [
    "Completion",
    "EngineConfig",
    "RequestError",
    "StreamEvent",
    "generate",
    "patch",
    "stream",
    "unpatch",
]
__version__ = "0.1.0"
