"""One planner for both front-ends: a `generate` call becomes engine requests here, or is sent to
transformers' own `generate` with the reason why.

A call is `model.generate(...)`'s arguments, or one prompt of `hfaccel.generate` & co. with its own
config. `GenerateCall` holds it and prepares, on first use, what the gates ask about (HF's prepared
config, the attention mask, the stopping and sampling parameters). `GATES` is the one ordered table of
everything the engine does not serve: the first gate that gives a reason decides. A call that passes
every gate becomes requests through `make_requests` (or `beam_requests`), the same way for both
front-ends.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch
from transformers import GenerationConfig

from hfaccel.distributed.layout import parallel_layout
from hfaccel.engine.beam_search import BeamParams
from hfaccel.engine.prompt_inputs import prompt_inputs_reason
from hfaccel.engine.request import Request, SamplingParams, StoppingParams
from hfaccel.patches import assisted, cache_in, criteria, lora
from hfaccel.patches import embeds as embeds_in
from hfaccel.patches import model_kwargs as extra_inputs
from hfaccel.patches.arguments import CACHE_NAME, given, unserved_argument
from hfaccel.patches.beam import beam_limits_reason, beam_unsupported_reason, is_beam_search
from hfaccel.patches.layer_support import (
    attention_needs,
    attention_shape,
    has_recurrent_layers,
    narrowest_local_span,
)
from hfaccel.patches.model_state import draws_dropout
from hfaccel.patches.models import all_modules, long_rope_reason, max_model_len, weights_and_mode_reason
from hfaccel.patches.params import (
    bind_batch_row,
    bind_prefix_constraint,
    has_default_lengths,
    prepare_config,
    prepare_special_tokens,
    request_params,
    unsupported_reason,
    uses_batch_prompts,
)
from hfaccel.patches.patch_state import PatchState

# generate's own per-call objects, served on the engine by both front-ends (run per row / per prompt);
# the text names them in fallback reasons.
PER_ROW_ARGUMENTS = {
    "stopping_criteria": "custom stopping_criteria",
    "assistant_model": "assistant_model (assisted decoding)",
    "logits_processor": "custom logits_processor",
    "prefix_allowed_tokens_fn": "prefix_allowed_tokens_fn (constrained decoding)",
}
# Arguments the planner takes out of the call before HF prepares its config: never model kwargs.
_OWN = ("input_ids", "streamer", "tokenizer", "trust_remote_code", "adapter_names", *PER_ROW_ARGUMENTS)
# output_attentions / output_hidden_states: judged with the config's (`_states_gate`)
_STATE_FLAGS = ("output_attentions", "output_hidden_states")
_SERVED_MODEL_KWARGS = {
    "input_ids",
    "attention_mask",
    "inputs_embeds",
    CACHE_NAME,
    *extra_inputs.SERVED,
    *_STATE_FLAGS,
}


@dataclasses.dataclass(eq=False)
class GenerateCall:
    """One `generate` call as the gates see it. `kwargs` are the call's arguments as given (the fallback
    passes them on unchanged); `input_ids` its prompt rows (``inputs`` or ``input_ids``)."""

    model: torch.nn.Module
    state: PatchState
    generation_config: GenerationConfig | None
    kwargs: dict[str, Any]
    input_ids: torch.Tensor | None
    tokenizer: Any = None
    # Both `inputs` and `input_ids` given (model.generate): HF decides which wins, so HF serves it.
    both_inputs: bool = False
    # hfaccel.generate gives each prompt as one unpadded row: a mask of ones, never inferred from ids.
    given_mask: torch.Tensor | None = None
    output_logprobs: bool = False
    top_logprobs: int | None = None
    # hfaccel.generate checks each adapter once per call: `adapter_names` are then its prompt's, and
    # `adapter_reason` the check's answer.
    adapter_names: list[str | None] | None = None
    adapters_checked: bool = False
    adapter_reason: str | None = None
    beams_allowed: bool = True  # False in streams: a beam search's hypotheses are known at its end
    states_allowed: bool = True  # False in hfaccel.generate: its results carry no hidden states
    first_row: int = 0  # the call's first row in the caller's batch (a prompt list's later prompts)
    imported: Any = None  # the DynamicCache given, as planned on the engine (`cache_in.plan`)

    def __post_init__(self) -> None:
        if self.adapter_names is None:
            self.adapter_names = self.kwargs.get("adapter_names")

    @property
    def embeds(self) -> torch.Tensor | None:
        return self.kwargs.get("inputs_embeds")

    @property
    def cache(self) -> Any:
        return self.kwargs.get(CACHE_NAME)

    @property
    def streamer(self) -> Any:
        return self.kwargs.get("streamer")

    @cached_property
    def custom(self) -> dict[str, Any]:
        """generate's own objects (processors, criteria, assistant): served per row, never model kwargs."""
        return {name: self.kwargs.get(name) for name in PER_ROW_ARGUMENTS}

    @cached_property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(visible, engine) ids: HF's input_ids (the output's start, what the processors see; ``[B, 0]``
        for embeddings without ids) and the engine's prompt rows (placeholders there)."""
        if self.embeds is None:
            ids = self.input_ids if self.input_ids is not None else self._start_rows()
            return ids, ids
        return embeds_in.visible_and_engine_ids(self.embeds, self.input_ids)

    def _start_rows(self) -> torch.Tensor | None:
        """HF's prompt rows for a call with no inputs: the BOS token, one row per batch row of the model
        kwargs (None without a BOS token: HF raises, so the call goes to HF)."""
        bos = self.config.bos_token_id
        if bos is None or self.given_mask is not None or self.kwargs.get("attention_mask") is not None:
            return None  # HF takes any mask beside its BOS rows, unchecked: it serves those
        model_kwargs = self._prepared[1]
        return self.model._maybe_initialize_input_ids_for_generation(None, torch.tensor(bos), model_kwargs)

    @property
    def ids(self) -> torch.Tensor:
        """The engine's prompt rows ``[B, L]`` (checked by the ids gate before any later gate reads them)."""
        return self.rows[1]

    @cached_property
    def _prepared(self) -> tuple[GenerationConfig, dict[str, Any], bool, bool]:
        call_kwargs = {k: v for k, v in self.kwargs.items() if k not in _OWN}
        has_default_max, has_default_min = has_default_lengths(
            self.model, self.generation_config, call_kwargs
        )
        config, model_kwargs = prepare_config(self.model, self.generation_config, call_kwargs)
        return config, model_kwargs, has_default_max, has_default_min

    @property
    def config(self) -> GenerationConfig:
        """HF's prepared generation config for this call."""
        return self._prepared[0]

    @property
    def copies(self) -> int:
        return self.config.num_return_sequences or 1

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @cached_property
    def beam(self) -> bool:
        """Whether the call is beam search (greedy or sampled): one request per prompt, its hypotheses."""
        return (self.config.num_beams or 1) > 1 and is_beam_search(self.config)

    @cached_property
    def extra(self) -> list[str]:
        """Model kwargs the engine does not serve."""
        model_kwargs = self._prepared[1]
        return sorted(
            k
            for k, v in model_kwargs.items()
            if v is not None and v is not False and k not in _SERVED_MODEL_KWARGS
        )

    @cached_property
    def mask(self) -> torch.Tensor:
        """The attention mask, as HF prepares it (the config's special tokens set on the way)."""
        model_kwargs = self._prepared[1]
        mask = self.given_mask if self.given_mask is not None else model_kwargs.get("attention_mask")
        ids = self.ids
        prepare_special_tokens(self.model, self.config, mask is not None, ids.device, ids.shape[0])
        if mask is None:  # HF infers padding from ids, never from embeddings
            source = ids if self.embeds is None or self.input_ids is not None else self.embeds
            return self.model._prepare_attention_mask_for_generation(source, self.config, model_kwargs)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}")
        return mask

    @cached_property
    def params(self) -> tuple[StoppingParams, SamplingParams]:
        """The stopping and (unpadded row's) sampling parameters, from HF's own processors."""
        return self.row_params(None)

    def row_params(self, attention_mask: torch.Tensor | None) -> tuple[StoppingParams, SamplingParams]:
        """`request_params` for this call; `attention_mask` a row's own, for the processors HF hands it."""
        _, _, has_default_max, has_default_min = self._prepared
        lengths = {} if self.embeds is None else {"inputs_embeds": self.embeds}
        return request_params(
            self.model,
            self.config,
            self.rows[0],
            has_default_max,
            has_default_min,
            self.tokenizer,
            output_logprobs=self.output_logprobs,
            top_logprobs=self.top_logprobs,
            attention_mask=attention_mask,
            logits_processor=self.custom["logits_processor"],
            stopping_criteria=self.custom["stopping_criteria"],
            prefix_allowed_tokens_fn=self.custom["prefix_allowed_tokens_fn"],
            **lengths,
        )

    @property
    def stopping(self) -> StoppingParams:
        return self.params[0]

    def first_reason(self) -> str | None:
        """The reason of the first gate the call does not pass (None: the engine serves it). Gates may
        raise ValueError for input HF would refuse too."""
        return next((reason for _, gate in GATES if (reason := gate(self)) is not None), None)


def _arguments_gate(call: GenerateCall) -> str | None:
    reason = unserved_argument(call.kwargs, call.config)
    return reason or ("both inputs and input_ids" if call.both_inputs else None)


def _embeds_gate(call: GenerateCall) -> str | None:
    return (
        None if call.embeds is None else embeds_in.unsupported_reason(call.model, call.embeds, call.input_ids)
    )


def _ids_gate(call: GenerateCall) -> str | None:
    ids = call.rows[1]
    if ids is None or ids.dim() != 2 or ids.dtype != torch.long:
        return "inputs other than a 2-D tensor of token ids"
    if 0 in ids.shape:  # HF fails on these too, deep inside
        name, shown = ("input_ids", ids) if call.embeds is None else ("inputs_embeds", call.embeds)
        raise ValueError(
            f"{name} has shape {tuple(shown.shape)}: generate needs at least one prompt of at least one token"
        )
    return None


def _cache_gate(call: GenerateCall) -> str | None:
    """A cache given (of a type the engine imports) or returned (`return_dict_in_generate`), on a model
    whose transformers cache holds what the engine's does: not multi-head latent attention's, which
    holds compressed latents where the engine keeps expanded K and padded V."""
    config = call.config  # HF returns one for embeddings whatever use_cache says (as `generate.keep_kv`)
    returned = config.return_dict_in_generate and (config.use_cache is not False or call.embeds is not None)
    if call.cache is None and not returned:
        return None
    if has_recurrent_layers(call.model):
        return "a cache given or returned, with recurrent layers (the engine keeps their state its own way)"
    shape = attention_shape(call.model)
    if shape is not None and shape.value_head_dim != shape.head_dim:
        return "a cache given or returned, with multi-head latent attention (its cache holds latents)"
    implementation = call.config.cache_implementation
    if call.cache is not None and implementation is not None:  # HF raises: the call goes to it
        return f"a cache given with cache_implementation={implementation!r} (transformers refuses it)"
    if call.cache is None and implementation not in (None, "dynamic", "offloaded", "static"):
        # the engine builds a DynamicCache, or HF's StaticCache (`outputs.static_cache`)
        return f"a cache returned, with cache_implementation={implementation!r} (HF returns its own class)"
    return None if call.cache is None else cache_in.type_reason(call.cache)


def _adapters_gate(call: GenerateCall) -> str | None:
    if call.adapters_checked:
        return call.adapter_reason
    if (names := call.adapter_names) is None:  # a PeftModel over the patched base may hand its own in
        if not hasattr(call.model, "peft_config"):
            return None
        return (
            lora.ROW_HOOKS_REASON if lora.peft_row_hooks(call.model) else lora.row_offsets_reason(call.model)
        )
    lora.check_call_adapter_names(call.model, names, call.ids.shape[0])
    return lora.unsupported_reason(call.model, names)


def _mode_gate(call: GenerateCall) -> str | None:
    """The generation mode and options, as judged for beam search or for the engine's other modes."""
    if not call.beam:
        reason = unsupported_reason(call.config, True, call.device)
        return reason or (f"model kwargs {call.extra}" if call.extra else None)
    if not call.beams_allowed:
        return "beam search in a stream"
    if has_recurrent_layers(call.model):
        return "beam search with recurrent layers (a beam's state would have to be forked)"
    if any(draws_dropout(module) for module in all_modules(call.model)):  # HF's beams draw apart
        return "beam search on a model drawing dropout (train mode): the engine's beams share the prompt's KV"
    names = call.adapter_names
    reason = beam_unsupported_reason(call.model, call.config, call.extra, call.streamer, names, call.device)
    if reason is None and call.cache is not None:
        reason = "beam search with past_key_values"
    custom_given = [name for name, value in call.custom.items() if given(value)]
    return reason or (f"beam search with {custom_given[0]}" if custom_given else None)


def _states_gate(call: GenerateCall) -> str | None:
    """``output_hidden_states`` / ``output_attentions``: what HF returns per step is recorded token by
    token (`engine/recorded_states.py`) and laid out as HF lays it (`state_outputs.py`), where the
    engine computes every token HF's output shows it computing: no window or chunk binding (HF's
    sliding caches trim the keys its attentions show), no cache given (HF does not recompute it), one
    process. Drafts are served: HF splits a verification's states into one step per token, and a
    rejected draft's record is overwritten by the token that replaces it when that one is fed."""
    config, model_kwargs = call.config, call._prepared[1]
    wanted = [name for name in _STATE_FLAGS if getattr(config, name, False) or model_kwargs.get(name)]
    if not wanted:
        return None
    what = f"{wanted[0]}=True"
    if not config.return_dict_in_generate and call.states_allowed:
        return None  # HF returns the sequences alone: nothing to record
    if not isinstance(config.output_hidden_states, bool):
        return "output_hidden_states selecting layers"
    if call.cache is not None:
        return f"{what} with a cache given"
    if has_recurrent_layers(call.model) or parallel_layout(call.model).parallel:
        return f"{what} with recurrent layers or parallelism"
    attention = getattr(call.model.config, "_attn_implementation", None) or "eager"
    if config.output_attentions and attention != "eager":  # HF's other implementations return none
        return (
            f"{what} with attn_implementation={attention!r} (transformers returns no attention probabilities)"
        )
    implementation = config.cache_implementation
    if config.output_attentions and implementation not in (None, "dynamic", "offloaded"):
        return f"{what} with cache_implementation={implementation!r} (HF's attentions span its whole cache)"
    needs = attention_needs(call.model)
    if "sliding_window" in needs or "chunked_attention" in needs:
        span = narrowest_local_span(call.model)
        width = call.mask.shape[1]  # (the mask first: it sets the special tokens the lengths read)
        if span is None or width + call.stopping.max_new_tokens > span:
            return f"{what} past a sliding window or chunk (HF's cache trims what its attentions show)"
    return None if call.states_allowed else f"{what} (hfaccel.generate's results carry no hidden states)"


def _streamer_gate(call: GenerateCall) -> str | None:
    if call.streamer is not None and call.ids.shape[0] * call.copies != 1:
        return "a streamer with more than one sequence"
    return None


def _options_gate(call: GenerateCall) -> str | None:
    """Custom stopping criteria, assisted decoding and extra model inputs (`position_ids`,
    `logits_to_keep`): each feature's module is asked only when the call uses the feature."""
    config, custom, ids, mask = call.config, call.custom, call.ids, call.mask
    stopping_criteria = custom["stopping_criteria"]
    stops = bool(config.stop_strings) or given(stopping_criteria) or config.max_time is not None
    rows = ids.shape[0] * call.copies
    if stops and (reason := criteria.unsupported_reason(call.model, config, stopping_criteria, rows)):
        return reason
    assistant = custom["assistant_model"]
    if assistant is not None or config.prompt_lookup_num_tokens is not None:
        if has_recurrent_layers(call.model):
            return "assisted decoding with recurrent layers (their state cannot be rolled back over rejected drafts)"
        speculative = call.state.config.speculative
        reason = assisted.unsupported_reason(call.model, config, assistant, speculative, ids.shape[0], stops)
        if reason is not None:
            return reason
        if reason := assisted.inputs_reason(call.embeds is not None, call.cache is not None, config):
            return reason
    model_kwargs = call._prepared[1]
    if any(model_kwargs.get(name) is not None for name in ("position_ids", "logits_to_keep")):
        return extra_inputs.unsupported_reason(model_kwargs, ids, mask)
    return None


def _padding_gate(call: GenerateCall) -> str | None:
    """Masked prompt tokens are dropped from the engine's rows. HF keeps them in place, but attends to
    none of them and numbers positions by the mask's running count, so a row gives the same tokens
    either way: left padding, or holes anywhere before the last token (transformers' own random masks,
    some collators). The processors see the row as HF shows it (`make_requests`). A masked last token
    (right padding) is fed once for its logits, as HF does (`Request.masked_last`). A returned cache
    holds the kept tokens in their columns (`outputs.dynamic_cache`). A mask of other values (segment
    ids 1, 1, 2, 2) is HF's alone: it numbers positions by the mask's running sum."""
    if not bool(((call.mask == 0) | (call.mask == 1)).all()):
        return "an attention mask with values other than 0 and 1 (transformers numbers positions by its sum)"
    mask = call.mask.bool()
    masked_last = not bool(mask[:, -1].all())
    if not masked_last and is_left_padding(mask):
        return None
    what = "an attention mask with holes"
    if masked_last:
        what = "an attention mask whose last column is masked (right padding)"
    if call.cache is not None:
        return f"{what}, with a cache given"
    # transformers' recurrent layers scan over the masked positions, and its windows count them
    if has_recurrent_layers(call.model):
        return f"{what}, with recurrent layers (they step over the masked tokens)"
    needs = attention_needs(call.model)
    if "sliding_window" in needs or "chunked_attention" in needs:
        span = narrowest_local_span(call.model)  # within it, every key is seen: nothing to count
        if span is None or call.ids.shape[1] + call.stopping.max_new_tokens > span:
            return f"{what}, with sliding windows or chunks (they count the masked tokens)"
    if call.kwargs.get("position_ids") is not None:
        return f"{what}, with position_ids"
    if masked_last:
        return _masked_last_reason(call, mask)
    return None


def _masked_last_reason(call: GenerateCall, mask: torch.Tensor) -> str | None:
    """HF gives a masked last token position 0 and the tokens after it 1, 2, ...: only where the model
    takes `position_ids` (else it numbers by cache position)."""
    if not bool(mask.any(dim=1).all()):
        return "an attention mask with a row of zeros only"
    if "position_ids" not in inspect.signature(call.model.forward).parameters:
        return "right padding, with a model that takes no position_ids (it numbers by cache position)"
    drafter = call.state.config.speculative  # an assistant_model drafts only as the engine's (`assisted`)
    if not (drafter is None or isinstance(drafter, str)):
        return "right padding, with a draft model (its own cache is not shifted)"
    return None


def _prompt_inputs_gate(call: GenerateCall) -> str | None:
    if call.embeds is None and call.cache is None:
        return None
    engine = call.state.get_engine(call.model)
    reason = prompt_inputs_reason(engine)
    if reason is None and call.cache is not None:
        dtype = next(call.model.parameters()).dtype
        call.imported, reason = cache_in.plan(
            engine, call.cache, call.mask, call.copies, call.config, call.embeds is not None, dtype
        )
    return reason


def _limits_gate(call: GenerateCall) -> str | None:
    kept = int(call.mask.sum(dim=1).max())  # the longest prompt, without its padding
    context = max_model_len(call.model, call.state.config.max_model_len)
    if call.given_mask is None and kept >= context:  # model.generate: HF generates past the context
        return f"a prompt of {kept} tokens, at or over the engine's max_model_len ({context})"
    reason, stopping = long_rope_reason(call.model, kept + call.stopping.max_new_tokens), call.stopping
    engine = call.state.get_engine(call.model) if call.beam and reason is None else None
    return reason if engine is None else beam_limits_reason(engine, call.config.num_beams, kept, stopping)


# Every reason a call goes to transformers' generate, in the order they are asked: the first wins.
def _reentry_gate(call: GenerateCall) -> str | None:
    """A call from inside the model's own engine step (a processor or criterion that generates), or one
    that would close a cycle of models waiting on each other, runs on transformers: it completes."""
    reentered = call.state.loop is not None and call.state.loop.reentry_reason() is not None
    if reentered:
        return "a generate call from inside an engine step (a processor or criterion)"
    # Inside a fallback it holds the fallback lock: waiting on the engine could close a cycle with an
    # engine step whose processor falls back, waiting on that lock.
    return "a generate call from inside transformers' generate" if call.state.inside_fallback() else None


GATES: tuple[tuple[str, Callable[[GenerateCall], str | None]], ...] = (
    ("a call from inside an engine step", _reentry_gate),
    ("the model's config as it is now", lambda call: call.state.config_reason(call.model)),
    ("arguments the engine does not take", _arguments_gate),
    ("prompts as embeddings", _embeds_gate),
    ("prompt ids", _ids_gate),
    ("a cache to continue from", _cache_gate),
    ("the model's weights and mode", lambda call: weights_and_mode_reason(call.model)),
    ("adapters", _adapters_gate),
    ("generation mode and options", _mode_gate),
    ("hidden states and attentions", _states_gate),
    ("streamer", _streamer_gate),
    ("criteria, assistants, extra inputs", _options_gate),
    ("padding", _padding_gate),
    ("imported embeddings or K/V", _prompt_inputs_gate),
    ("lengths: a longrope model's original context, beam search limits", _limits_gate),
)


def make_requests(
    call: GenerateCall, engine: Any, seed: int | None = None, targets: dict[str, Any] | None = None
) -> list[Request]:
    """The engine requests of a call that passed every gate: `copies` per row, each row unpadded (its
    mask's kept tokens), row i seeded with ``seed + i`` (None: its own seed), the processors seeing
    the padded row as in HF."""
    copies, rows = call.copies, call.ids
    stopping, sampling = call.params
    assistant, speculative = call.custom["assistant_model"], call.state.config.speculative
    if assistant is not None and assisted.foreign_assistant(call.config, assistant, speculative):
        assisted.warn_foreign(call.state.warned)  # (asked only then: assisted.py stays off plain calls)
    keep = call.mask.bool().cpu().repeat_interleave(copies, dim=0)
    rows = rows.repeat_interleave(copies, dim=0).cpu()
    samplings = [sampling] * len(rows)
    if sampling.processors and not bool(keep.all()):
        samplings = _per_padding(call, call.mask.repeat_interleave(copies, dim=0), sampling)
    if (allowed := call.custom["prefix_allowed_tokens_fn"]) is not None:  # asked as HF asks row i
        samplings = [bind_prefix_constraint(s, allowed, call.first_row + i) for i, s in enumerate(samplings)]
    if uses_batch_prompts(call.config):  # the encoder_* processors, built from the batch's prompts
        samplings = [bind_batch_row(s, i, len(rows)) for i, s in enumerate(samplings)]
    names = call.adapter_names
    adapters = [None] * len(rows) if names is None else [names[i // copies] for i in range(len(rows))]
    masked_last = ~keep[:, -1]
    requests = [
        engine.make_request(
            _engine_tokens(rows[i], keep[i]),
            stopping,
            samplings[i],
            seed=None if seed is None else seed + i,
            adapter=adapters[i],
            masked_last=bool(masked_last[i]),  # HF feeds it for the first token's logits
            **(targets or {}),
        )
        for i in range(len(rows))
    ]
    if (sampling.processors or stopping.criteria is not None) and call.input_ids is not None:
        for request, row, kept in zip(requests, rows, keep):
            if is_left_padding(kept[None]):
                request.processor_prefix = row[~kept].tolist()  # the padded row, as in HF
            else:  # holes: the whole row as given, the prompt's kept tokens in place within it
                request.processor_prefix, request.processor_sees_prompt = row.tolist(), False
    attach_prompt_lookup(requests, call.config)
    return requests


def _engine_tokens(row: torch.Tensor, kept: torch.Tensor) -> list[int]:
    """A row's kept tokens, and its last token where that one is masked (`Request.masked_last`)."""
    tokens = row[kept].tolist()
    return tokens if bool(kept[-1]) else [*tokens, int(row[-1])]


def beam_requests(
    call: GenerateCall, engine: Any, targets: dict[str, Any] | None = None, seed: int | None = None
) -> list[Request]:
    """One request per prompt row for a beam search that passed every gate (its beams are the engine's
    `BeamGroup`), the processors seeing the padded row with its own mask (one per beam), as in HF.
    Beam sampling: row i draws from ``seed + i`` (None: a seed of its own)."""
    config, (_, sampling) = call.config, call.params
    beam = BeamParams(
        num_beams=config.num_beams,
        length_penalty=config.length_penalty,
        early_stopping=config.early_stopping,
        num_return_sequences=call.copies,
        do_sample=bool(config.do_sample),
    )
    keep, rows = call.mask.bool().cpu(), call.ids.cpu()
    by_padding = {(True,) * keep.shape[1]: dataclasses.replace(sampling, beam=beam)}
    requests = []
    for i in range(len(rows)):
        padding = tuple(keep[i].tolist())  # the row's padding (or holes)
        if padding not in by_padding:
            padded = call.row_params(call.mask[i : i + 1].expand(config.num_beams, -1))[1]
            by_padding[padding] = dataclasses.replace(padded, beam=beam)
        request = engine.make_request(
            _engine_tokens(rows[i], keep[i]),
            call.stopping,
            by_padding[padding],
            seed=None if seed is None else seed + i,
            masked_last=not bool(keep[i, -1]),  # HF feeds it for the first token's logits
            **(targets or {}),
        )
        if is_left_padding(keep[i : i + 1]):
            request.processor_prefix = rows[i][~keep[i]].tolist()  # the padded row, as in HF
        else:  # holes: the whole row as given, the prompt's kept tokens in place within it
            request.processor_prefix, request.processor_sees_prompt = rows[i].tolist(), False
        requests.append(request)
    return requests


def _per_padding(call: GenerateCall, masks: torch.Tensor, unpadded: SamplingParams) -> list[SamplingParams]:
    """One `SamplingParams` per row, built as HF builds its processors for the padded batch: those HF
    gives the attention mask (the repetition penalty, which skips a row's masked tokens) get the row's
    own mask. Rows with the same mask share one object (and so one warper call)."""
    by_mask: dict[tuple[int, ...], SamplingParams] = {(1,) * masks.shape[1]: unpadded}
    samplings = []
    for mask in masks:
        key = tuple(mask.ne(0).int().tolist())  # the row's padding (or holes)
        if key not in by_mask:
            by_mask[key] = call.row_params(mask[None])[1]
        samplings.append(by_mask[key])
    return samplings


def attach_prompt_lookup(requests: list[Request], config: GenerationConfig) -> None:
    """Prompt lookup (``prompt_lookup_num_tokens``): the call's own draft source and length on each of its
    requests (the engine's speculative path verifies them); nothing for other calls."""
    if config.prompt_lookup_num_tokens is None:
        return
    proposer, num_spec_tokens = assisted.request_speculation(config)
    for request in requests:
        request.speculation.proposer, request.speculation.num_drafts = proposer, num_spec_tokens


def is_left_padding(attention_mask: torch.Tensor) -> bool:
    """Whether every row of a 2-D mask is zeros then ones (left padding), with at least one token."""
    mask = attention_mask.bool()
    return bool((mask[:, 1:] >= mask[:, :-1]).all()) and bool(mask[:, -1].all())
