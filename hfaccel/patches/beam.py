"""`model.generate(..., num_beams=n)` on the engine: HF's beam search, each prompt a group of beams in the
continuous batch (engine/beam_search.py).

Served: ``num_beams``, ``length_penalty``, ``early_stopping`` (True, False, "never"),
``num_return_sequences <= num_beams``, ``max_new_tokens`` / ``max_length`` / ``min_new_tokens`` /
``min_length``, EOS, and every logits processor HF builds for beam search (they run on each beam's
padded row, after the log-softmax, as in HF), beam sampling, and ``return_dict_in_generate`` with
``output_scores`` / ``output_logits`` and the returned cache. The output is HF's
(`patches/outputs.py`): for each prompt its ``num_return_sequences`` best hypotheses, best first, each
the prompt as given followed by its tokens, right-padded with HF's fill value; with
``return_dict_in_generate``, ``sequences_scores``, ``beam_indices``, the per-step rows of every running
beam and the cache of the final running beams. HF goes on stepping a prompt whose search has ended until
every prompt's has; the engine stops it, so in a batch whose prompts end at different steps those
prompts' later rows differ (a warning says so). What falls back to the original `generate` (one warning
naming the reason): diverse/group and constrained beam search (other generation modes),
``output_attentions`` / ``output_hidden_states``, stop strings, streamers, ``adapter_names``, a prompt
plus ``max_new_tokens`` past the model's context, and parallel (TP/PP/EP/DP) patches.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from hfaccel.distributed.layout import parallel_layout
from hfaccel.engine.request import StoppingParams
from hfaccel.patches.params import unsupported_reason, uses_batch_prompts


def is_beam_search(config: GenerationConfig) -> bool:
    """Whether a prepared generation config asks for beam search, plain or sampled."""
    return config.get_generation_mode() in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE)


def beam_unsupported_reason(
    model: torch.nn.Module,
    config: GenerationConfig,
    extra: list[str],
    streamer: Any,
    names: Any,
    device: torch.device | None = None,
) -> str | None:
    """Why the engine cannot serve this beam search call, or None. `device` is the model's (see
    `unsupported_reason`)."""
    if parallel_layout(model).parallel:
        return "beam search with tensor/pipeline/expert/data parallelism"
    if streamer is not None:
        return "a streamer with beam search"
    if names is not None:
        return "adapter_names with beam search"
    if config.stop_strings:
        return "stop_strings with beam search"
    if config.max_time is not None:
        return "max_time with beam search"
    if uses_batch_prompts(config):
        return "encoder_repetition_penalty or encoder_no_repeat_ngram_size with beam search"
    if getattr(config, "low_memory", None):
        return "low_memory beam search"
    if extra:
        return f"model kwargs {extra}"
    greedy = copy.copy(config)  # every other option, as the engine's other modes judge it
    greedy.num_beams, greedy.num_return_sequences, greedy.do_sample = 1, 1, False
    return unsupported_reason(greedy, device=device)


def beam_limits_reason(
    engine: Any, num_beams: int, longest_prompt: int, stopping: StoppingParams
) -> str | None:
    """Why the engine cannot run this beam search (its context, or its batch limits), or None."""
    if longest_prompt + stopping.max_new_tokens > engine.max_model_len:
        return "beam search past the model's context"
    if num_beams > min(engine.config.max_num_seqs, engine.config.max_num_batched_tokens):
        return "num_beams above the engine's max_num_seqs (or max_num_batched_tokens)"
    return None
