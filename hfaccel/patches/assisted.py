"""HF's assisted decoding (``assistant_model=``, ``prompt_lookup_num_tokens=``) on the engine's speculative
path.

HF's greedy assisted decoding keeps a draft token only while it is the model's own argmax, so its tokens
are plain greedy's; the engine's speculative greedy verification does the same, so the results are
equal. With sampling, both keep the model's distribution, but the samples are not the same ones: HF's
rejection rule draws differently, while the engine's tokens are its plain sampled ones (each position's
token is drawn with that position's noise, and a draft is kept only where it is that token).

- ``prompt_lookup_num_tokens=n``: the request drafts up to n tokens a step by prompt lookup
  (`NgramProposer`, matching n-grams of up to ``max_matching_ngram_size`` tokens, 2 by default, as HF's
  `PromptLookupCandidateGenerator`). Per request: nothing in the shared engine changes.
- ``assistant_model=draft``: drafts when it is the engine's own draft model
  (``hfaccel.patch(model, speculative=draft)``), ``num_speculative_tokens`` a step. A draft model needs
  its own paged KV cache in the engine, sized with the target's; building one per call would change the
  engine under every other caller, so another assistant (the model itself, in transformers' own tests)
  does not draft: the call is served with the engine's own speculation setting, which gives the same
  tokens (HF's greedy assisted result is plain greedy's; sampled, both keep the model's distribution),
  and one warning per model says so.

Whatever HF refuses for assisted decoding (a batch of more than one row, ``num_return_sequences > 1``,
``use_cache=False``, a static cache) falls back too, so HF raises its own error; as do the options that
change which tokens are accepted (``assistant_ensemble_weight``) or draft from elsewhere
(``speculation_type``, different tokenizers). Stop strings and custom stopping criteria fall back with
an assistant: HF checks them once per accepted block of tokens (not after each token), so its result
may run past a stop that plain greedy (and the engine) stops at. So do the inputs with which HF's
assisted path gives other results than its plain decoding (`inputs_reason`). HF's knobs of the draft length
(``num_assistant_tokens``, its schedule, ``assistant_confidence_threshold``) change the speed only; the
engine uses its own.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from transformers import GenerationConfig

from hfaccel.engine.speculative.proposer import NgramProposer

_STATIC = ("static", "hybrid", "sliding_window")  # the cache implementations HF's assisted path refuses


def is_assisted(config: GenerationConfig, assistant_model: Any) -> bool:
    """Whether the call asks for HF's assisted decoding by an assistant or by prompt lookup."""
    return assistant_model is not None or config.prompt_lookup_num_tokens is not None


def unsupported_reason(
    model: Any,
    config: GenerationConfig,
    assistant_model: Any,
    engine_draft: Any,
    rows: int,
    stops: bool,
) -> str | None:
    """Why the engine cannot serve this assisted call as HF would, or None (also for a call that is not
    assisted). `engine_draft`: the engine's ``speculative`` setting; `rows`: the batch's rows;
    `stops`: whether the call has stop strings or custom stopping criteria."""
    if not is_assisted(config, assistant_model):
        return None
    if assistant_model is not None and _vocab_size(assistant_model) != _vocab_size(model):
        return "assistant_model with another vocabulary (universal assisted decoding)"
    what = "prompt_lookup_num_tokens" if config.prompt_lookup_num_tokens is not None else "assistant_model"
    refused = None  # what transformers' assisted generation raises for
    if rows > 1:
        refused = f"on a batch of {rows} rows (transformers refuses it: it takes one row)"
    elif (config.num_return_sequences or 1) > 1:
        refused = "with num_return_sequences > 1 (transformers refuses it)"
    elif config.use_cache is False:
        refused = "with use_cache=False (transformers refuses it)"
    elif config.cache_implementation in _STATIC:
        refused = f"with cache_implementation={config.cache_implementation!r} (transformers refuses it)"
    if refused is not None:
        return f"assisted decoding ({what}) {refused}"
    lookup = config.prompt_lookup_num_tokens
    if lookup is not None and (isinstance(lookup, bool) or not isinstance(lookup, int) or lookup < 1):
        return f"prompt_lookup_num_tokens={lookup!r} (transformers refuses it)"
    size = config.max_matching_ngram_size
    if (
        lookup is not None
        and size is not None
        and (isinstance(size, bool) or not isinstance(size, int) or size < 1)
    ):
        return f"max_matching_ngram_size={size!r} (transformers refuses it)"
    for name in ("assistant_ensemble_weight", "speculation_type"):
        if getattr(config, name, None) is not None:
            return f"{name} (assisted decoding)"
    if stops:
        return (
            f"assisted decoding ({what}) with stop_strings, stopping_criteria or max_time (transformers checks them "
            "once per accepted block of tokens, not after each token)"
        )
    return None


def inputs_reason(embeds: bool, cache: bool, config: GenerationConfig) -> str | None:
    """Inputs with which transformers' assisted path gives other results than its plain decoding (so
    the call runs there, for its results): a prompt given as `inputs_embeds` (it re-embeds the ids, or
    raises without them), a cache passed in (it feeds the whole prompt onto it again), hidden states or
    attentions (a draft kept in the first iteration gets the prompt's first position's)."""
    what = "assisted decoding ({})".format(
        "prompt_lookup_num_tokens" if config.prompt_lookup_num_tokens is not None else "assistant_model"
    )
    if embeds:
        return f"{what} of a prompt given as inputs_embeds (transformers' assisted path differs there)"
    if cache:
        return f"{what} with a cache given (transformers' assisted path feeds the prompt onto it again)"
    if config.output_hidden_states or config.output_attentions:
        return f"{what} with output_hidden_states or output_attentions (transformers' assisted path's own)"
    return None


def foreign_assistant(config: GenerationConfig, assistant_model: Any, engine_draft: Any) -> bool:
    """Whether a served call names an assistant that is not the engine's draft model: the engine serves
    it with its own speculation setting, as HF's greedy result is plain greedy's (`warn_foreign`)."""
    return (
        config.prompt_lookup_num_tokens is None
        and assistant_model is not None
        and assistant_model is not engine_draft
    )


def warn_foreign(warned: set[str]) -> None:
    """Say once per model that an assistant was not used to draft (the tokens are HF's regardless)."""
    if "foreign assistant" in warned:
        return
    warned.add("foreign assistant")
    warnings.warn(
        "hfaccel: assistant_model is not the engine's draft model, so it does not draft here: the engine "
        "serves the call with its own speculation (the tokens are the ones HF's assisted decoding gives; "
        "hfaccel.patch(model, speculative=assistant_model) drafts from it)",
        UserWarning,
        stacklevel=5,
    )


def request_speculation(config: GenerationConfig) -> tuple[NgramProposer | None, int | None]:
    """The draft source and length a request of this (served) call carries: prompt lookup with its own n,
    or (None, None): the engine's (its draft model, for ``assistant_model``)."""
    lookup = config.prompt_lookup_num_tokens
    if lookup is None:
        return None, None
    return ngram_proposer(config.max_matching_ngram_size or 2), lookup


@functools.lru_cache(maxsize=16)
def ngram_proposer(max_n: int) -> NgramProposer:
    """One proposer per n-gram size, shared by every request that uses it (one call per step)."""
    return NgramProposer(max_n=max_n, min_n=1)


def _vocab_size(model: Any) -> Any:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None)
