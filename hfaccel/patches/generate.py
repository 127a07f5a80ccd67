"""The drop-in `generate`: HF's arguments and output layout, the hfaccel engine underneath.

Served: greedy and sampling with every logits processor HF builds for them, plus custom
``logits_processor`` lists (merged by HF's own `_get_logits_processor`, run per row on the padded row);
EOS / length / stop-string stopping, plus custom ``stopping_criteria`` (run per row after each token,
`patches/criteria.py`); `num_return_sequences`; `return_dict_in_generate` with `scores` / `logits` /
`past_key_values`; a streamer for one sequence; ``cache_implementation`` values with the default
numerics (static, offloaded on CUDA, the deprecated static aliases) and ``compile_config`` (the engine's
paged cache and compile settings serve them); ``position_ids`` equal to HF's own and an int
``logits_to_keep`` (`patches/model_kwargs.py`); assisted decoding by prompt lookup
(``prompt_lookup_num_tokens``) or by the engine's own draft model (``assistant_model``) on the
speculative path (`patches/assisted.py`); beam search (`patches/beam.py`); prompts as
``inputs_embeds`` (`patches/embeds.py`); a `DynamicCache` to continue from in ``past_key_values``
(`patches/cache_in.py`); and PEFT's mixed-adapter batches (``adapter_names``: LoRA applied per request,
see `patches/lora.py`). What the engine does not serve goes to the original `generate`, with one warning
naming the reason (or an error with ``patch(model, strict=True)``). The full list, with why each served
option gives HF's result: docs/generate.md.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hfaccel.config import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.loop import EngineLoop, LoopClosed
from hfaccel.engine.prompt_inputs import prompt_inputs_reason
from hfaccel.engine.request import Request, SamplingParams
from hfaccel.patches import assisted, cache_in, criteria, lora
from hfaccel.patches import embeds as embeds_in
from hfaccel.patches import model_kwargs as extra_inputs
from hfaccel.patches.arguments import check_generate_kwargs
from hfaccel.patches.beam import beam_unsupported_reason, generate_beams, is_beam_search
from hfaccel.patches.cache_names import CACHE_NAME, normalize_cache_argument, output_cache
from hfaccel.patches.models import window_reason
from hfaccel.patches.params import (
    has_default_lengths,
    prepare_config,
    prepare_special_tokens,
    request_params,
    unsupported_reason,
)

# Arguments of HF generate that the engine does not serve, with the reason shown to the user.
UNSUPPORTED_ARGUMENTS = {
    "prefix_allowed_tokens_fn": "prefix_allowed_tokens_fn (constrained decoding)",
    "negative_prompt_ids": "negative_prompt_ids (classifier-free guidance)",
    "negative_prompt_attention_mask": "negative_prompt_attention_mask",
    "custom_generate": "custom_generate",
    "synced_gpus": "synced_gpus",
    "assistant_tokenizer": "assistant_tokenizer",
}
# generate's own per-call objects, served on the engine by both front-ends (run per row / per prompt);
# the text names them in fallback reasons.
PER_ROW_ARGUMENTS = {
    "stopping_criteria": "custom stopping_criteria",
    "assistant_model": "assistant_model (assisted decoding)",
    "logits_processor": "custom logits_processor",
}
# A seed for the sampled rows of the `generate` calls made in this context (row i gets seed + i), set by
# callers that run generate in worker threads and must not let the threads race for torch's global
# generator (a pipeline over a list: `patches/pipeline.py`); None: each row draws its own seed.
_call_seed: ContextVar[int | None] = ContextVar("hfaccel_call_seed", default=None)


@contextmanager
def seeded_calls(seed: int | None) -> Iterator[None]:
    """Within this block (in this thread), patched ``generate`` seeds its sampled rows from `seed`."""
    token = _call_seed.set(seed)
    try:
        yield
    finally:
        _call_seed.reset(token)


_SERVED_MODEL_KWARGS = {"input_ids", "attention_mask", *extra_inputs.SERVED}


@dataclass
class PatchState:
    """What `hfaccel.patch` keeps on a model: the engine config, the engine and the loop that steps it
    for every caller, and what to restore."""

    config: EngineConfig
    original_generate: Callable[..., Any]
    instance_generate: Any  # `generate` from the instance __dict__ before patching, or None
    strict: bool = False  # unsupported options raise instead of falling back
    progress: bool = False  # progress bar inside model.generate
    engine: Engine | None = None
    loop: EngineLoop | None = None
    warned: set[str] = field(default_factory=set)
    temporary: bool = False  # patched by hfaccel.generate/stream for their own duration only
    temporary_users: int = 0  # such calls still running (the last one unpatches)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    # Re-entrant: a fallback may call the same model's generate again in its own thread (HF's assisted
    # decoding with the model as its own assistant, a processor or criterion that generates).
    fallback_lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def get_engine(self, model: torch.nn.Module) -> Engine:
        """The model's engine, (re)built if absent or if the model moved to another device or dtype.

        The engine watches the model's weights and adapters (`HFExecutor.state_token`) and forgets its
        prefix cache when they change. A rebuild closes the old engine's loop: requests still running
        there fail with `LoopClosed` (their callers get it raised) rather than wait on a cache the model
        no longer matches.
        """
        param = next(model.parameters())
        with self.lock:
            engine = self.engine
            if engine is None or engine.device != param.device or engine.model_dtype != param.dtype:
                if engine is not None:
                    self.release(f"the model moved to {param.device} / {param.dtype}: its engine was rebuilt")
                self.engine = Engine(model, self.config)
            return self.engine

    def get_loop(self, model: torch.nn.Module) -> EngineLoop:
        """The loop that steps the model's (current) engine for every caller."""
        with self.lock:
            engine = self.get_engine(model)
            if self.loop is None or self.loop.engine is not engine:
                self.loop = EngineLoop(engine)
            return self.loop

    def run_original(self, *args: Any, **kwargs: Any) -> Any:
        """The original `generate`, one call at a time: HF's generate is not documented as thread-safe
        (a static cache, for one, lives on the model), and concurrent callers of a patched model —
        pipeline workers included — may all fall back at once."""
        with self.fallback_lock:
            return self.original_generate(*args, **kwargs)

    def release(self, reason: str) -> None:
        """Drop the engine (and its KV cache); requests in flight on its loop fail with `reason`."""
        with self.lock:
            loop, self.loop, self.engine = self.loop, None, None
        if loop is not None:
            loop.close(LoopClosed(reason))

    def __repr__(self) -> str:
        engine = repr(self.engine) if self.engine is not None else "not built yet (built on first generate)"
        return f"hfaccel patch (strict={self.strict}): {self.config}\n  engine: {engine}"


def fall_back(state: PatchState, reason: str) -> None:
    """Raise under strict mode; otherwise warn once per reason per model (the call then runs on HF)."""
    if state.strict:
        raise ValueError(f"hfaccel (strict=True) does not serve {reason}; patch without strict to fall back")
    if reason in state.warned:
        return
    state.warned.add(reason)
    warnings.warn(
        f"hfaccel: {reason} is not served by the engine - this call falls back to transformers' original "
        "generate (no speed-up)",
        UserWarning,
        stacklevel=4,
    )


def patched_generate(
    self: torch.nn.Module,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    **kwargs: Any,
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """Drop-in replacement for `model.generate`, bound on a patched instance."""
    state: PatchState = self._hfaccel
    kwargs = normalize_cache_argument(kwargs, "model.generate")
    # adapter_names is PEFT's (its generate pops it); checked against the model's LoRA layers below.
    checked = {k: v for k, v in kwargs.items() if k != "adapter_names"}
    check_generate_kwargs(self, checked, "model.generate", [generation_config])
    input_ids = inputs if inputs is not None else kwargs.get("input_ids")
    reason = next((text for name, text in UNSUPPORTED_ARGUMENTS.items() if given(kwargs.get(name))), None)
    if reason is None and inputs is not None and kwargs.get("input_ids") is not None:
        reason = "both inputs and input_ids"
    # inputs_embeds (patches/embeds.py): `visible_ids` are HF's input_ids (the output's start, what the
    # processors see: [B, 0] without ids), `input_ids` the engine's prompt rows (placeholders without ids).
    embeds, ids_given, visible_ids = kwargs.get("inputs_embeds"), input_ids is not None, input_ids
    if reason is None and embeds is not None:
        reason = embeds_in.unsupported_reason(self, embeds, input_ids)
        if reason is None:
            visible_ids, input_ids = embeds_in.visible_and_engine_ids(embeds, input_ids)
    if reason is None and (input_ids is None or input_ids.dim() != 2 or input_ids.dtype != torch.long):
        reason = "inputs other than a 2-D tensor of token ids"
    if reason is None and 0 in input_ids.shape:  # HF fails on these too, deep inside
        name, given_input = ("input_ids", input_ids) if embeds is None else ("inputs_embeds", embeds)
        raise ValueError(
            f"{name} has shape {tuple(given_input.shape)}: generate needs at least one prompt of at least "
            "one token"
        )
    cache = kwargs.get(CACHE_NAME)  # a DynamicCache to continue from (patches/cache_in.py)
    if reason is None and cache is not None:
        reason = cache_in.type_reason(cache)
    if reason is not None:
        fall_back(state, reason)
        return state.run_original(inputs=inputs, generation_config=generation_config, **kwargs)

    names = kwargs.get("adapter_names")  # PEFT's mixed-adapter batch: one adapter name per row
    if names is not None:
        _check_adapter_names(self, names, input_ids.shape[0])
        reason = lora.unsupported_reason(self, names)
        if reason is not None:
            fall_back(state, reason)
            return state.run_original(inputs=inputs, generation_config=generation_config, **kwargs)

    streamer = kwargs.get("streamer")
    tokenizer = kwargs.get("tokenizer")
    custom = {name: kwargs.get(name) for name in PER_ROW_ARGUMENTS}  # generate's own: never model kwargs
    popped = ("input_ids", "streamer", "tokenizer", "trust_remote_code", "adapter_names", *custom)
    call_kwargs = {k: v for k, v in kwargs.items() if k not in popped}
    has_default_max, has_default_min = has_default_lengths(self, generation_config, call_kwargs)
    config, model_kwargs = prepare_config(self, generation_config, call_kwargs)
    served = _SERVED_MODEL_KWARGS | {"inputs_embeds", CACHE_NAME}  # both checked above
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and v is not False and k not in served)
    copies = config.num_return_sequences or 1
    device = next(self.parameters()).device
    beams = (config.num_beams or 1) > 1 and is_beam_search(config)  # patches/beam.py, with its own refusals
    if beams:
        reason = beam_unsupported_reason(self, config, extra, streamer, names, device)
        custom_given = [name for name, value in custom.items() if given(value)]
        if reason is None and (embeds is not None or cache is not None):
            reason = "beam search with inputs_embeds or past_key_values"
        if reason is None and custom_given:
            reason = f"beam search with {custom_given[0]}"
    else:
        reason = unsupported_reason(config, True, device) or (f"model kwargs {extra}" if extra else None)
    if reason is None and streamer is not None and input_ids.shape[0] * copies != 1:
        reason = "a streamer with more than one sequence"
    if reason is not None:
        fall_back(state, reason)
        return state.run_original(inputs=inputs, generation_config=generation_config, **kwargs)

    attention_mask = model_kwargs.get("attention_mask")
    prepare_special_tokens(self, config, attention_mask is not None, input_ids.device)
    if attention_mask is None:  # HF infers padding from ids, never from embeddings
        source = input_ids if ids_given else embeds
        attention_mask = self._prepare_attention_mask_for_generation(source, config, model_kwargs)
    elif attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}"
        )
    reason = options_reason(self, state, config, custom, input_ids, attention_mask, model_kwargs)
    if reason is not None:
        fall_back(state, reason)
        return state.run_original(inputs=inputs, generation_config=generation_config, **kwargs)
    per_row = {name: custom[name] for name in ("logits_processor", "stopping_criteria")}
    lengths = {} if embeds is None else {"inputs_embeds": embeds}
    stopping, sampling = request_params(
        self, config, visible_ids, has_default_max, has_default_min, tokenizer, **per_row, **lengths
    )
    reason = None if is_left_padding(attention_mask) else "an attention mask that is not left padding"
    longest = int(attention_mask.sum(dim=1).max()) + stopping.max_new_tokens
    reason = reason or window_reason(self, longest)
    imported = None
    if reason is None and (embeds is not None or cache is not None):
        engine = state.get_engine(self)
        reason = prompt_inputs_reason(engine)
        if reason is None and cache is not None:
            dtype = next(self.parameters()).dtype
            imported, reason = cache_in.plan(
                engine, cache, attention_mask, copies, config, embeds is not None, dtype
            )
    if reason is not None:  # HF keeps masked positions in place; past a sliding window attention differs
        fall_back(state, reason)
        return state.run_original(inputs=inputs, generation_config=generation_config, **kwargs)
    if beams:

        def original(reason: str) -> Any:
            fall_back(state, reason)
            return state.run_original(inputs=inputs, generation_config=generation_config, **kwargs)

        arguments = (has_default_max, has_default_min, tokenizer)
        return generate_beams(
            self, state, input_ids, attention_mask, config, stopping, sampling, arguments, original
        )
    prompts = visible_ids.repeat_interleave(copies, dim=0)
    if stopping.max_new_tokens <= 0:
        return _output(config, prompts, [])
    loop = state.get_loop(self)
    keep = attention_mask.bool().cpu().repeat_interleave(copies, dim=0)
    rows = input_ids.repeat_interleave(copies, dim=0).cpu()
    samplings = [sampling] * len(rows)
    if sampling.processors and not bool(keep.all()):
        arguments = (self, config, visible_ids, has_default_max, has_default_min, tokenizer)
        masks = attention_mask.repeat_interleave(copies, dim=0)
        samplings = _per_padding(arguments, {**per_row, **lengths}, masks, sampling)
    adapters = [None] * len(rows) if names is None else [names[i // copies] for i in range(len(rows))]
    base_seed = _call_seed.get()
    requests = [
        loop.engine.make_request(
            rows[i][keep[i]].tolist(),
            stopping,
            samplings[i],
            seed=None if base_seed is None else base_seed + i,
            adapter=adapters[i],
        )
        for i in range(len(rows))
    ]
    if (sampling.processors or stopping.criteria is not None) and ids_given:  # the padded row, as in HF
        for request, row, kept in zip(requests, rows, keep):
            request.processor_prefix = row[~kept].tolist()
    attach_prompt_lookup(requests, config)
    # HF returns the cache with return_dict_in_generate and use_cache (which it sets for inputs_embeds).
    keep_kv = bool(config.return_dict_in_generate and (config.use_cache is not False or embeds is not None))
    for request in requests:
        request.keep_kv = keep_kv
    if embeds is not None:  # after the draft source: embedded prompts never speculate
        embeds_in.attach(loop.engine, requests, embeds, keep, copies, ids_given)
    if imported is not None:  # after the embeddings: both isolate the request from the prefix cache
        imported.attach(loop.engine, requests, copies)
    warn_past_context(requests, loop.engine.max_model_len)
    if streamer is not None:
        _stream_one(loop, requests[0], visible_ids, streamer)
    else:
        loop.run(requests, progress=state.progress)
    output = _output(config, prompts, requests, self, kv_width=input_ids.shape[1])
    if imported is None:
        return output
    built = output_cache(output) if config.return_dict_in_generate else None
    if built is None:
        width = max(len(r.output_token_ids) for r in requests)
        built = _dynamic_cache(self, requests, input_ids.shape[1], width, input_ids.device)
    return imported.finish(output, built)


def _per_padding(
    arguments: tuple, per_row: dict[str, Any], masks: torch.Tensor, unpadded: SamplingParams
) -> list[SamplingParams]:
    """One `SamplingParams` per row, built as HF builds its processors for the padded batch: the
    processors see the padded row (`Request.processor_prefix`), and those HF gives the attention mask
    (the repetition penalty, which skips a row's left padding) get the row's own mask. Rows with the
    same padding share one object (and so one warper call)."""
    by_padding: dict[int, SamplingParams] = {0: unpadded}
    samplings = []
    for mask in masks:
        padding = int(mask.ne(0).int().argmax())  # HF's padding length of the row
        if padding not in by_padding:
            by_padding[padding] = request_params(*arguments, attention_mask=mask[None], **per_row)[1]
        samplings.append(by_padding[padding])
    return samplings


def attach_prompt_lookup(requests: list[Request], config: GenerationConfig) -> None:
    """Prompt lookup (``prompt_lookup_num_tokens``): the call's own draft source and length on each of its
    requests (the engine's speculative path verifies them); nothing for other calls."""
    if config.prompt_lookup_num_tokens is None:
        return
    proposer, num_spec_tokens = assisted.request_speculation(config)
    for request in requests:
        request.proposer, request.num_spec_tokens = proposer, num_spec_tokens


def options_reason(
    model: torch.nn.Module,
    state: PatchState,
    config: GenerationConfig,
    custom: dict[str, Any],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    model_kwargs: dict[str, Any],
) -> str | None:
    """Why the engine cannot serve this call's custom stopping criteria, assisted decoding or extra model
    inputs (`position_ids`, `logits_to_keep`) as HF would, or None. `config` has its special tokens."""
    rows = input_ids.shape[0] * (config.num_return_sequences or 1)
    stopping_criteria = custom["stopping_criteria"]
    stops = bool(config.stop_strings) or given(stopping_criteria)
    # Each feature's module is asked only when the call uses the feature.
    if stops and (reason := criteria.unsupported_reason(model, config, stopping_criteria, rows)):
        return reason
    assistant = custom["assistant_model"]
    if assistant is not None or config.prompt_lookup_num_tokens is not None:
        reason = assisted.unsupported_reason(
            model, config, assistant, state.config.speculative, input_ids.shape[0], stops
        )
        if reason is not None:
            return reason
    if any(model_kwargs.get(name) is not None for name in ("position_ids", "logits_to_keep")):
        return extra_inputs.unsupported_reason(model_kwargs, input_ids, attention_mask)
    return None


def warn_past_context(requests: list[Request], max_model_len: int, names: list[str] | None = None) -> None:
    """Warn, once per call, when a prompt plus its max_new_tokens runs past the model's context: the
    engine stops there; HF's generate would go on past it (where the model was never trained), with
    a logger message only."""
    short = [
        i
        for i, r in enumerate(requests)
        if len(r.prompt_token_ids) + r.stopping.max_new_tokens > max_model_len
    ]
    if not short:
        return
    i = short[0]
    length, max_new_tokens = len(requests[i].prompt_token_ids), requests[i].stopping.max_new_tokens
    name = names[i] if names is not None else f"row {i}"
    more = f" (and {len(short) - 1} more)" if len(short) > 1 else ""
    warnings.warn(
        f"hfaccel: {name}{more} has {length} prompt tokens; with max_new_tokens={max_new_tokens} it would "
        f"run past the model's context (max_model_len={max_model_len}), so it stops at "
        f"{max_model_len} tokens: {max_model_len - length} new token(s), finish_reason 'length'. "
        "transformers' generate would go on past the context (where the model was not trained); "
        "shorten the prompt or lower max_new_tokens to silence this",
        UserWarning,
        stacklevel=4,
    )


def _stream_one(loop: EngineLoop, request: Request, input_ids: torch.Tensor, streamer: Any) -> None:
    """HF's streamer protocol for one sequence: the prompt, each new token, then `end()`. If the streamer
    raises (or the wait is interrupted), the request is cancelled."""
    streamer.put(input_ids.cpu())
    try:
        with closing(loop.submit([request], stream=True).updates()) as updates:  # closing cancels
            for update in updates:
                for token in update.token_ids:
                    streamer.put(torch.tensor([token]))
    finally:
        streamer.end()


def is_left_padding(attention_mask: torch.Tensor) -> bool:
    """Whether every row of a 2-D mask is zeros then ones (left padding), with at least one token."""
    mask = attention_mask.bool()
    return bool((mask[:, 1:] >= mask[:, :-1]).all()) and bool(mask[:, -1].all())


def _check_adapter_names(model: torch.nn.Module, names: Any, rows: int) -> None:
    """PEFT's own checks of ``adapter_names``, with its messages (it raises them before generating)."""
    if not isinstance(names, (list, tuple)):
        raise TypeError(f"Got adapter names of type {type(names)}, expected a list of str.")
    if len(names) != rows:
        raise ValueError(
            "Length of `adapter_names` should be the same as the number of inputs, but got "
            f"{len(names)} and {rows} respectively."
        )
    if model.training:
        raise ValueError("Cannot pass `adapter_names` when the model is in training mode.")
    lora.check_adapter_names(model, names)


def given(value: Any) -> bool:
    """Whether an argument asks for something: not None, False or an empty list (their defaults)."""
    return value is not None and value is not False and not (isinstance(value, list) and len(value) == 0)


def _output(
    config: GenerationConfig,
    prompts: torch.Tensor,
    requests: list[Request],
    model: Any = None,
    kv_width: int | None = None,
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """HF's layout: each prompt as given, its new tokens, right-padded with the pad id; and, for
    ``return_dict_in_generate``, per-step ``scores``/``logits`` of shape ``[B, V]`` (a row that had
    already finished holds -inf there: it was not computed) and ``past_key_values`` (its prompt part
    `kv_width` wide: the prompts' width, or the embeddings' for a prompt given as embeddings only)."""
    pad = config._pad_token_tensor
    pad_id = int(pad.flatten()[0]) if pad is not None else 0
    width = max((len(r.output_token_ids) for r in requests), default=0)
    out = torch.full((prompts.shape[0], prompts.shape[1] + width), pad_id, dtype=torch.long)
    out[:, : prompts.shape[1]] = prompts.cpu()
    for i, request in enumerate(requests):
        new = request.output_token_ids
        out[i, prompts.shape[1] : prompts.shape[1] + len(new)] = torch.tensor(new, dtype=torch.long)
    sequences = out.to(prompts.device)
    if not config.return_dict_in_generate:
        return sequences
    cache = None
    if requests and all(r.kv_snapshot is not None for r in requests) and model is not None:
        kv_width = prompts.shape[1] if kv_width is None else kv_width
        cache = _dynamic_cache(model, requests, kv_width, width, prompts.device)
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=_per_step(requests, "scores", width) if config.output_scores else None,
        logits=_per_step(requests, "logits", width) if config.output_logits else None,
        **{CACHE_NAME: cache},
    )


def _dynamic_cache(model: Any, requests: list[Request], prompt_width: int, width: int, device: Any) -> Any:
    """The `DynamicCache` HF's generate would return, gathered from the requests' paged KV: per layer
    ``[B, Hkv, prompt_width + width - 1, D]``, each row's prompt right-aligned (left padding, as given)
    and its generated tokens after it. Padding positions hold zeros (HF holds the pad tokens' KV there:
    masked for the left padding; for a row that finished before the longest one, HF's cache has the
    KV of the pad tokens it kept generating)."""
    from transformers import DynamicCache

    length = prompt_width + width - 1
    cache = DynamicCache(config=model.config)
    for layer in range(len(requests[0].kv_snapshot)):
        k0 = requests[0].kv_snapshot[layer][0]
        keys = torch.zeros(
            (len(requests), k0.shape[1], length, k0.shape[2]), dtype=k0.dtype, device=k0.device
        )
        values = torch.zeros_like(keys)
        for i, request in enumerate(requests):
            k, v = request.kv_snapshot[layer]
            prompt_len = len(request.prompt_token_ids)
            start = prompt_width - prompt_len
            count = min(k.shape[0], length - start)
            keys[i, :, start : start + count] = k[:count].transpose(0, 1)
            values[i, :, start : start + count] = v[:count].transpose(0, 1)
        cache.update(keys.to(device), values.to(device), layer)
    for request in requests:
        request.kv_snapshot = None
    return cache


def _per_step(requests: list[Request], name: str, steps: int) -> tuple[torch.Tensor, ...]:
    if steps == 0:
        return ()
    rows = [getattr(r, name) for r in requests]
    vocab = next(len(row[0]) for row in rows if row)
    if any(len(row) < steps for row in rows):
        # HF goes on computing a finished row from the pad tokens it feeds it; the engine stops it.
        warnings.warn(
            f"hfaccel: the {name} of a row after it finished are -inf (transformers computes them from the "
            "pad tokens it keeps feeding the row); mask them by the sequences' padding, as "
            "compute_transition_scores(normalize_logits=True) gives NaN there",
            UserWarning,
            stacklevel=4,
        )
    filler = torch.full((vocab,), -float("inf"))
    return tuple(torch.stack([row[t] if t < len(row) else filler for row in rows]) for t in range(steps))
