"""The rows of the coverage table: every option of transformers' `generate` (GenerationConfig fields and
generate's own arguments), each with a representative value (`python -m hfaccel bench coverage`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DROP = object()  # an option's kwargs value that removes the base argument

# GenerationConfig fields that do not change what generate computes (or only parameterise another field),
# with why they are not rows of their own.
BOOKKEEPING = {
    "pad_token_id": "special token: the id used to pad finished rows",
    "bos_token_id": "special token: starts a prompt given as no ids",
    "decoder_start_token_id": "encoder-decoder models only",
    "is_assistant": "set by generate on an assistant model",
    "assistant_lookbehind": "a knob of assisted decoding with two tokenizers, see assistant_tokenizer",
    "target_lookbehind": "a knob of assisted decoding with two tokenizers, see assistant_tokenizer",
    "cache_config": "arguments of the cache_implementation's class",
    "max_cache_len": "the size of a static cache, see cache_implementation",
    "compile_config": "how HF's own loop compiles its forward (where HF would, the call falls back)",
    "disable_compile": "whether HF's own loop compiles its forward: the tokens do not change",
    "continuous_batching_config": "HF's own continuous batching, generate_batch, not generate",
    "low_memory": "a removed beam-search option that HF ignores",
    "_from_model_config": "bookkeeping",
    "transformers_version": "bookkeeping",
}


@dataclass(frozen=True)
class Option:
    """One row: an option (a GenerationConfig field or an argument of generate) and a representative value."""

    group: str
    name: str
    value: str  # the value set, as shown in the table
    kwargs: Callable[[Any], dict[str, Any]]  # the call's arguments beside the base ones, from the context
    argument: bool = False  # an argument of generate (not a GenerationConfig field)


def _sampling(**extra: Any) -> Callable[[Any], dict[str, Any]]:
    return lambda c: {"do_sample": True, **extra}


def _fixed(**extra: Any) -> Callable[[Any], dict[str, Any]]:
    return lambda c: dict(extra)


OPTIONS: tuple[Option, ...] = (
    # Length and stopping
    Option("length & stopping", "max_new_tokens", "6", _fixed(max_new_tokens=6)),
    Option(
        "length & stopping",
        "max_length",
        "width + 5",
        lambda c: {"max_new_tokens": DROP, "max_length": c.width + 5},
    ),
    Option("length & stopping", "min_new_tokens", "3", _fixed(min_new_tokens=3)),
    Option("length & stopping", "min_length", "width + 3", lambda c: {"min_length": c.width + 3}),
    Option("length & stopping", "eos_token_id", "[2, 5]", _fixed(eos_token_id=[2, 5])),
    Option(
        "length & stopping",
        "stop_strings",
        '"a" (tokenizer=)',
        lambda c: {"stop_strings": "a", "tokenizer": c.tokenizer},
    ),
    Option("length & stopping", "max_time", "30.0", _fixed(max_time=30.0)),
    Option(
        "length & stopping",
        "stopping_criteria",
        "a custom criterion",
        lambda c: {"stopping_criteria": c.criteria()},
        True,
    ),
    # Sampling
    Option("sampling", "do_sample", "True", _sampling()),
    Option("sampling", "temperature", "0.7", _sampling(temperature=0.7)),
    Option("sampling", "top_k", "5", _sampling(top_k=5)),
    Option("sampling", "top_p", "0.9", _sampling(top_p=0.9)),
    Option("sampling", "min_p", "0.1", _sampling(min_p=0.1)),
    Option("sampling", "top_h", "0.5", _sampling(top_h=0.5)),
    Option("sampling", "typical_p", "0.9", _sampling(typical_p=0.9)),
    Option("sampling", "epsilon_cutoff", "3e-4", _sampling(epsilon_cutoff=3e-4)),
    Option("sampling", "eta_cutoff", "1e-3", _sampling(eta_cutoff=1e-3)),
    Option("sampling", "num_return_sequences", "2", _sampling(num_return_sequences=2)),
    # Logits processors
    Option("logits processors", "repetition_penalty", "1.3", _fixed(repetition_penalty=1.3)),
    Option("logits processors", "encoder_repetition_penalty", "1.3", _fixed(encoder_repetition_penalty=1.3)),
    Option("logits processors", "no_repeat_ngram_size", "2", _fixed(no_repeat_ngram_size=2)),
    Option("logits processors", "encoder_no_repeat_ngram_size", "2", _fixed(encoder_no_repeat_ngram_size=2)),
    Option("logits processors", "bad_words_ids", "[[5], [6, 7]]", _fixed(bad_words_ids=[[5], [6, 7]])),
    Option("logits processors", "sequence_bias", "{(5,): -2.0}", _fixed(sequence_bias={(5,): -2.0})),
    Option("logits processors", "suppress_tokens", "[5, 6]", _fixed(suppress_tokens=[5, 6])),
    Option("logits processors", "begin_suppress_tokens", "[5]", _fixed(begin_suppress_tokens=[5])),
    Option("logits processors", "forced_bos_token_id", "5", _fixed(forced_bos_token_id=5)),
    Option("logits processors", "forced_eos_token_id", "2", _fixed(forced_eos_token_id=2)),
    Option(
        "logits processors",
        "exponential_decay_length_penalty",
        "(2, 1.2)",
        _fixed(exponential_decay_length_penalty=(2, 1.2)),
    ),
    Option("logits processors", "renormalize_logits", "True", _fixed(renormalize_logits=True)),
    Option("logits processors", "remove_invalid_values", "True", _fixed(remove_invalid_values=True)),
    Option("logits processors", "guidance_scale", "1.5", _fixed(guidance_scale=1.5)),
    Option(
        "logits processors",
        "watermarking_config",
        "bias 2.0",
        lambda c: {"watermarking_config": c.watermark()},
    ),
    Option(
        "logits processors",
        "token_healing",
        "True (tokenizer=)",
        lambda c: {"token_healing": True, "tokenizer": c.tokenizer},
    ),
    Option(
        "logits processors",
        "logits_processor",
        "a custom processor",
        lambda c: {"logits_processor": c.processors()},
        True,
    ),
    Option(
        "logits processors",
        "prefix_allowed_tokens_fn",
        "every id allowed",
        lambda c: {"prefix_allowed_tokens_fn": c.allowed},
        True,
    ),
    Option(
        "logits processors",
        "negative_prompt_ids",
        "ids (guidance 1.5)",
        lambda c: {"negative_prompt_ids": c.ids, "guidance_scale": 1.5},
        True,
    ),
    Option(
        "logits processors",
        "negative_prompt_attention_mask",
        "mask (guidance 1.5)",
        lambda c: {
            "negative_prompt_ids": c.ids,
            "negative_prompt_attention_mask": c.mask,
            "guidance_scale": 1.5,
        },
        True,
    ),
    # Outputs
    Option("outputs", "return_dict_in_generate", "True", _fixed(return_dict_in_generate=True)),
    Option("outputs", "output_scores", "True", _fixed(return_dict_in_generate=True, output_scores=True)),
    Option("outputs", "output_logits", "True", _fixed(return_dict_in_generate=True, output_logits=True)),
    Option(
        "outputs", "output_attentions", "True", _fixed(return_dict_in_generate=True, output_attentions=True)
    ),
    Option(
        "outputs",
        "output_hidden_states",
        "True",
        _fixed(return_dict_in_generate=True, output_hidden_states=True),
    ),
    Option(
        "outputs", "streamer", "a streamer (1 row)", lambda c: {**c.one_row(), "streamer": c.streamer()}, True
    ),
    # Inputs and cache
    Option("inputs & cache", "use_cache", "False", _fixed(use_cache=False)),
    Option("inputs & cache", "cache_implementation", '"static"', _fixed(cache_implementation="static")),
    Option("inputs & cache", "prefill_chunk_size", "4", _fixed(prefill_chunk_size=4)),
    Option(
        "inputs & cache",
        "inputs_embeds",
        "embeddings, no ids",
        lambda c: {"input_ids": DROP, "inputs_embeds": c.embeds()},
        True,
    ),
    Option(
        "inputs & cache", "inputs_embeds + input_ids", "both", lambda c: {"inputs_embeds": c.embeds()}, True
    ),
    Option("inputs & cache", "past_key_values", "DynamicCache of a prefix", lambda c: c.continuation(), True),
    Option(
        "inputs & cache", "position_ids", "from the mask", lambda c: {"position_ids": c.positions()}, True
    ),
    # Decoding modes
    Option("decoding modes", "num_beams", "2", _fixed(num_beams=2)),
    Option("decoding modes", "length_penalty", "0.5 (num_beams 2)", _fixed(num_beams=2, length_penalty=0.5)),
    Option(
        "decoding modes", "early_stopping", "True (num_beams 2)", _fixed(num_beams=2, early_stopping=True)
    ),
    Option(
        "decoding modes",
        "num_beam_groups",
        "2 (diversity 0.5, 2 beams)",
        _fixed(num_beams=2, num_beam_groups=2, diversity_penalty=0.5),
    ),
    Option(
        "decoding modes",
        "diversity_penalty",
        "0.5 (2 groups, 2 beams)",
        _fixed(num_beams=2, num_beam_groups=2, diversity_penalty=0.5),
    ),
    Option(
        "decoding modes",
        "constraints",
        "a Constraint (num_beams 2)",
        lambda c: {"num_beams": 2, "constraints": [c.constraint()]},
    ),
    Option(
        "decoding modes", "force_words_ids", "[[5]] (num_beams 2)", _fixed(num_beams=2, force_words_ids=[[5]])
    ),
    Option("decoding modes", "penalty_alpha", "0.6 (top_k 4)", _fixed(penalty_alpha=0.6, top_k=4)),
    Option("decoding modes", "dola_layers", '"low"', _fixed(dola_layers="low")),
    # Assisted decoding
    Option(
        "assisted decoding",
        "assistant_model",
        "a tiny Llama",
        lambda c: {"assistant_model": c.assistant},
        True,
    ),
    Option(
        "assisted decoding",
        "num_assistant_tokens",
        "3 (assistant)",
        lambda c: {"assistant_model": c.assistant, "num_assistant_tokens": 3},
    ),
    Option(
        "assisted decoding",
        "num_assistant_tokens_schedule",
        '"constant" (assistant)',
        lambda c: {"assistant_model": c.assistant, "num_assistant_tokens_schedule": "constant"},
    ),
    Option(
        "assisted decoding",
        "assistant_confidence_threshold",
        "0.2 (assistant)",
        lambda c: {"assistant_model": c.assistant, "assistant_confidence_threshold": 0.2},
    ),
    Option(
        "assisted decoding",
        "assistant_ensemble_weight",
        "0.5 (assistant)",
        lambda c: {"assistant_model": c.assistant, "assistant_ensemble_weight": 0.5},
    ),
    Option(
        "assisted decoding",
        "speculation_type",
        '"dflash" (assistant)',
        lambda c: {"assistant_model": c.assistant, "speculation_type": "dflash"},
    ),
    Option(
        "assisted decoding",
        "assistant_tokenizer",
        "another tokenizer",
        lambda c: {
            "assistant_model": c.assistant,
            "tokenizer": c.tokenizer,
            "assistant_tokenizer": c.tokenizer,
        },
        True,
    ),
    Option("assisted decoding", "prompt_lookup_num_tokens", "3", _fixed(prompt_lookup_num_tokens=3)),
    Option(
        "assisted decoding",
        "max_matching_ngram_size",
        "3 (prompt lookup 3)",
        _fixed(prompt_lookup_num_tokens=3, max_matching_ngram_size=3),
    ),
    Option("assisted decoding", "assistant_early_exit", "1", _fixed(assistant_early_exit=1)),
    Option("assisted decoding", "use_mtp", "True", _fixed(use_mtp=True)),
    # Other arguments of generate
    Option("other", "custom_generate", "a function", lambda c: {"custom_generate": c.custom_generate}, True),
    Option("other", "synced_gpus", "True", _fixed(synced_gpus=True), True),
)
