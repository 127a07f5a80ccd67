"""Everything that touches transformers internals: attention registration, the drop-in generate, the
HF model adapter (registered with the engine on import)."""

import hfaccel.patches.executors  # noqa: F401  (registers the HF executor factory with the engine)
