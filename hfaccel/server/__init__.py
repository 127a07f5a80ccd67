"""`hfaccel serve`: an OpenAI-compatible HTTP server over the engine, for a model on disk
(``python -m hfaccel serve``) or the live model object in a notebook or training loop
(`hfaccel.serve(model, tokenizer)`; this package is `hfaccel.server`). Needs the ``serve`` extra:
``pip install 'hfaccel[serve]'``."""

from hfaccel.server.sampling import Limits
from hfaccel.server.server import ServerHandle, serve

__all__ = ["Limits", "ServerHandle", "serve"]
