"""`model.generate(..., num_beams=n)` on the engine: HF's beam search, each prompt a group of beams in the
continuous batch (engine/beam_search.py).

Served: ``num_beams``, ``length_penalty``, ``early_stopping`` (True, False, "never"),
``num_return_sequences <= num_beams``, ``max_new_tokens`` / ``max_length`` / ``min_new_tokens`` /
``min_length``, EOS, and every logits processor HF builds for beam search (they run on each beam's
padded row, after the log-softmax, as in HF). The output is HF's: for each prompt its
``num_return_sequences`` best hypotheses, best first, each the prompt as given followed by its tokens,
right-padded with HF's fill value. What falls back to the original `generate` (one warning naming the
reason): beam sampling (``do_sample=True``), diverse/group and constrained beam search (other generation
modes), ``return_dict_in_generate`` (HF's per-step ``scores`` and the reordered cache describe beams
the engine drops once a prompt is done), stop strings, streamers, ``adapter_names``, a prompt plus
``max_new_tokens`` past the model's context, and parallel (TP/PP/EP/DP) patches.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from hfaccel.distributed.layout import parallel_layout
from hfaccel.engine.request import StoppingParams
from hfaccel.patches.params import unsupported_reason


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
    if config.return_dict_in_generate:
        return "return_dict_in_generate with beam search"
    if streamer is not None:
        return "a streamer with beam search"
    if names is not None:
        return "adapter_names with beam search"
    if config.stop_strings:
        return "stop_strings with beam search"
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


def beam_output(
    config: GenerationConfig, prompts: torch.Tensor, results: list[list[tuple[list[int], float]]]
) -> torch.Tensor:
    """HF's `sequences` for beam search: per prompt its hypotheses (best first), each the prompt row as
    given then its tokens, cut to the longest returned one and filled past each one's end with HF's
    fill value (the pad id if it is non-zero, else the first EOS id; -1 without EOS)."""
    pad, eos = config._pad_token_tensor, config._eos_token_tensor
    fill = pad or eos[0] if eos is not None else -1  # HF's own expression, zero pad id included
    fill = int(fill)
    width = max((len(tokens) for hyps in results for tokens, _ in hyps), default=0)
    count = sum(len(hyps) for hyps in results)
    out = torch.full((count, prompts.shape[1] + width), fill, dtype=torch.long)
    row = 0
    for prompt, hyps in zip(prompts.cpu(), results):
        for tokens, _ in hyps:
            out[row, : prompts.shape[1]] = prompt
            out[row, prompts.shape[1] : prompts.shape[1] + len(tokens)] = torch.tensor(
                tokens, dtype=torch.long
            )
            row += 1
    return out.to(prompts.device)
