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
naming the reason (or an error with ``patch(model, strict=True)``): the gates, in order, are one table
in `patches/planner.py`, which both front-ends use. The full list, with why each served option gives
HF's result: docs/generate.md.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from contextlib import closing
from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging as transformers_logging

from hfaccel.engine.loop import EngineLoop
from hfaccel.engine.prompt_inputs import isolate
from hfaccel.engine.request import Request
from hfaccel.patches import embeds as embeds_in
from hfaccel.patches.arguments import (
    CACHE_NAME,
    check_generate_kwargs,
    normalize_cache_argument,
    output_cache,
)
from hfaccel.patches.outputs import beam_dict_output, beam_output, dynamic_cache, static_cache
from hfaccel.patches.patch_state import PatchState, call_seed, fall_back
from hfaccel.patches.planner import GenerateCall, beam_requests, is_left_padding, make_requests
from hfaccel.patches.state_outputs import request_rows, state_fields

logger = logging.getLogger("hfaccel")
# The user's own processors and criteria already warned about, by module and qualified name (once per
# process; names, not types, so a class made per call is not kept alive).
_WARNED_ROW_CALLBACKS: set[tuple[str, str]] = set()


def warn_row_callbacks(call: GenerateCall) -> None:
    """Warn (once per type) that a user's own logits processor or stopping criterion, on a batch of more
    than one row, is called once per row with that row's ``[1, L]`` ids, where HF calls it once per step
    with the whole ``[B, L]`` batch: one that indexes rows, returns one value for the whole batch, or
    keeps state per step gives other tokens than HF's (docs/generate.md). Transformers' own types are
    per-row computations and are not warned about."""
    if call.ids.shape[0] * call.copies < 2:
        return
    for name in ("logits_processor", "stopping_criteria"):
        for item in call.custom[name] or ():
            named = item if inspect.isfunction(item) else type(item)  # a plain function is its own kind
            key = (str(named.__module__), named.__qualname__)
            if key[0].startswith("transformers.") or key in _WARNED_ROW_CALLBACKS:
                continue
            _WARNED_ROW_CALLBACKS.add(key)
            logger.warning(
                "hfaccel: %s %s runs once per row on the engine, with that row's [1, L] input_ids (HF calls "
                "it once per step with the whole [B, L] batch): if it indexes batch rows, returns one value "
                "for the whole batch or keeps per-step state, its tokens differ from HF's; run such a call "
                "with hfaccel.unpatch(model) or type(model).generate(model, ...) (docs/generate.md)",
                name,
                named.__qualname__,
            )


def warn_right_padding(call: GenerateCall) -> None:
    """Transformers' warning for a right-padded batch of ids, in its words and through its logger, as its
    generate gives it (the engine serves the call with HF's tokens; the user keeps the hint that the
    tokenizer pads on the wrong side): a mask given with a masked last column, or without a mask, a last
    id that is the pad id."""
    ids, pad = call.input_ids, call.config._pad_token_tensor
    if ids is None or ids.dim() != 2 or ids.shape[0] < 2 or pad is None:
        return
    mask = call.given_mask if call.given_mask is not None else call.kwargs.get("attention_mask")
    if mask is not None and mask.shape == ids.shape:
        right = bool((mask[:, -1] == 0).any())
    else:
        right = bool((ids[:, -1] == pad.to(ids.device)).any())
    if right:
        transformers_logging.get_logger("transformers.generation.utils").warning(
            "A decoder-only architecture is being used, but right-padding was detected! For correct "
            "generation results, please set `padding_side='left'` when initializing the tokenizer."
        )


@functools.cache
def _positional_names(cls: type) -> tuple[str, ...]:
    """The parameters a class's `generate` takes by position after ``inputs`` and ``generation_config``
    (transformers': ``logits_processor``, ``stopping_criteria``, ``prefix_allowed_tokens_fn``, ...); a
    wrapper's that passes ``*args`` on (PEFT's) takes transformers'."""
    parameters = inspect.signature(cls.generate).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        parameters = inspect.signature(GenerationMixin.generate).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in parameters if p.kind in kinds]
    return tuple(names[3:])  # after self, inputs, generation_config


def _keywords_of(cls: type, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with `args` (given by position after ``generation_config``) under their names in the
    class's `generate`, as Python binds them; its TypeErrors where Python raises them."""
    names = _positional_names(cls)
    if len(args) > len(names):
        raise TypeError(
            f"generate() takes {len(names) + 2} positional arguments but {len(args) + 2} were given"
        )
    kwargs = dict(kwargs)
    for name, value in zip(names, args):
        if name in kwargs:
            raise TypeError(f"generate() got multiple values for argument {name!r}")
        kwargs[name] = value
    return kwargs


def patched_generate(
    self: torch.nn.Module,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """Drop-in replacement for `model.generate`, bound on a patched instance. Arguments after
    ``generation_config`` may come by position, as transformers' `generate` takes them."""
    if args:
        kwargs = _keywords_of(type(self), args, kwargs)
    state: PatchState | None = self.__dict__.get("_hfaccel")
    if state is None or state.temporary:
        # Unpatched since this bound method was taken (kept, or looked up by another thread), or patched
        # now only for another thread's hfaccel call, which leaves generate to transformers: the model's
        # own generate (an instance's, put back by unpatch), or its class's.
        own = self.__dict__.get("generate")
        if own is not None and getattr(own, "__func__", None) is not patched_generate:
            return own(inputs, generation_config, **kwargs)
        return type(self).generate(self, inputs, generation_config, **kwargs)
    kwargs = normalize_cache_argument(kwargs, "model.generate")
    # adapter_names is PEFT's (its generate pops it); checked against the model's LoRA layers (a gate).
    checked = {k: v for k, v in kwargs.items() if k != "adapter_names"}
    check_generate_kwargs(self, checked, "model.generate", [generation_config])
    call = GenerateCall(
        self,
        state,
        generation_config,
        kwargs,
        inputs if inputs is not None else kwargs.get("input_ids"),
        tokenizer=kwargs.get("tokenizer"),
        both_inputs=inputs is not None and kwargs.get("input_ids") is not None,
    )
    reason = call.first_reason()
    if reason is not None:
        fall_back(state, reason)
        return state.run_original(inputs=inputs, generation_config=generation_config, **kwargs)
    warn_row_callbacks(call)
    warn_right_padding(call)
    config, visible_ids = call.config, call.rows[0]
    loop = state.get_loop(self)
    # HF returns the cache with return_dict_in_generate and use_cache (which it sets for inputs_embeds).
    embeds = call.embeds
    keep_kv = bool(config.return_dict_in_generate and (config.use_cache is not False or embeds is not None))
    columns = (
        _kept_columns(call) if config.return_dict_in_generate and not is_left_padding(call.mask) else None
    )
    width = call.ids.shape[1]
    if call.beam:
        requests = beam_requests(call, loop.engine, seed=call_seed() if call.config.do_sample else None)
        for request in requests:
            request.keep_kv = keep_kv
            if request.sampling.output_hidden_states or request.sampling.output_attentions:
                isolate(request)  # every prompt token computed: each one's states recorded
        if embeds is not None:  # a beam's slots fork after the prompt: the request alone takes them
            embeds_in.attach(
                loop.engine, requests, embeds, call.mask.bool().cpu(), 1, call.input_ids is not None
            )
        loop.run(requests, progress=state.progress)
        if not config.return_dict_in_generate:
            return beam_output(config, visible_ids, [r.beam_group.results for r in requests])
        output = beam_dict_output(config, visible_ids, requests, self, columns, width, _recomputes(call))
        return _as_static(self, call, output, width)
    prompts = visible_ids.repeat_interleave(call.copies, dim=0)
    if call.stopping.max_new_tokens <= 0:
        return generate_output(config, prompts, [])
    base_seed = call_seed()
    requests = make_requests(call, loop.engine, seed=base_seed)
    for request in requests:
        request.keep_kv = keep_kv
        if request.sampling.output_hidden_states or request.sampling.output_attentions:
            isolate(request)  # every prompt token computed: each one's states recorded
    if embeds is not None:  # after the draft source: embedded prompts never speculate
        keep = call.mask.bool().cpu().repeat_interleave(call.copies, dim=0)
        embeds_in.attach(loop.engine, requests, embeds, keep, call.copies, call.input_ids is not None)
    imported = call.imported
    if imported is not None:  # after the embeddings: both isolate the request from the prefix cache
        imported.attach(loop.engine, requests, call.copies)
    warn_past_context(requests, loop.engine.max_model_len)
    if call.streamer is not None:
        assisted = (
            call.config.prompt_lookup_num_tokens is not None or call.custom["assistant_model"] is not None
        )
        _stream_one(loop, requests[0], visible_ids, call.streamer, assisted)
    else:
        loop.run(requests, progress=state.progress)
    if columns is not None:
        columns = [c for c in columns for _ in range(call.copies)]
    output = generate_output(config, prompts, requests, self, width, columns, _recomputes(call))
    output = _as_static(self, call, output, width)
    if imported is None:
        return output
    built = output_cache(output) if config.return_dict_in_generate else None
    if built is None:
        longest = max(len(r.output_token_ids) for r in requests)
        built = dynamic_cache(self, requests, width, longest, call.ids.device)
    return imported.finish(output, built)


def _recomputes(call: GenerateCall) -> bool:
    """Whether HF's generate runs this call without a cache, recomputing every token at every step (it
    keeps one for a prompt of embeddings whatever ``use_cache`` says)."""
    return call.config.use_cache is False and call.embeds is None


def _kept_columns(call: GenerateCall) -> list[torch.Tensor]:
    """Each prompt row's kept columns (its mask's non-zero places): where the returned cache holds them."""
    return [row.nonzero().flatten() for row in call.mask.bool().cpu()]


def _as_static(model: Any, call: GenerateCall, output: Any, width: int) -> Any:
    """`output`, its cache made the `StaticCache` HF returns when the call asks for a static cache."""
    if call.config.cache_implementation != "static" or output_cache(output) is None:
        return output
    visible = call.rows[0].shape[1]  # HF's max_length counts the ids (none for embeddings only)
    extra = width if call.input_ids is None and call.embeds is not None else 0
    limit = getattr(call.config, "max_cache_len", None)
    length = visible + call.stopping.max_new_tokens
    built = static_cache(model, length, limit, output_cache(output), width, extra)
    setattr(output, CACHE_NAME, built)
    return output


def warn_past_context(requests: list[Request], max_model_len: int, names: list[str] | None = None) -> None:
    """Warn, once per call, when a prompt plus its max_new_tokens runs past the model's context: the
    engine stops there; HF's generate would go on past it (where the model was never trained), with
    a logger message only."""
    short = [
        i
        for i, r in enumerate(requests)
        if len(r.prompt_token_ids) - r.masked_last + r.stopping.max_new_tokens > max_model_len
    ]
    if not short:
        return
    i = short[0]
    length = len(requests[i].prompt_token_ids) - requests[i].masked_last  # a masked last token is not kept
    max_new_tokens = requests[i].stopping.max_new_tokens
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


def _stream_one(
    loop: EngineLoop, request: Request, input_ids: torch.Tensor, streamer: Any, assisted: bool = False
) -> None:
    """HF's streamer protocol for one sequence: the prompt, each new token (``[1]``), then `end()`; under
    assisted decoding a step's tokens together (``[1, n]``), as HF's assisted loop puts them. If the
    streamer raises (or the wait is interrupted), the request is cancelled."""
    streamer.put(input_ids.cpu())
    try:
        with closing(loop.submit([request], stream=True).updates()) as updates:  # closing cancels
            for update in updates:
                if assisted and update.token_ids:
                    streamer.put(torch.tensor([update.token_ids]))
                    continue
                for token in update.token_ids:
                    streamer.put(torch.tensor([token]))
    finally:
        streamer.end()


def generate_output(
    config: GenerationConfig,
    prompts: torch.Tensor,
    requests: list[Request],
    model: Any = None,
    kv_width: int | None = None,
    columns: list[torch.Tensor] | None = None,
    recompute: bool = False,
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """HF's layout: each prompt as given, its new tokens, right-padded with the pad id; and, for
    ``return_dict_in_generate``, per-step ``scores``/``logits`` of shape ``[B, V]`` (a row that had
    already finished holds -inf there: it was not computed) and ``past_key_values`` (its prompt part
    `kv_width` wide: the prompts' width, or the embeddings' for a prompt given as embeddings only; each
    row's kept prompt tokens at its `columns`, or right-aligned); hidden states and attentions per step
    (`state_outputs`; `recompute`: HF ran without a cache, recomputing every token at every step)."""
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
        layered = config.cache_implementation != "static"  # a static one is built from it (`static_cache`)
        cache = dynamic_cache(model, requests, kv_width, width, prompts.device, columns, layered)
    prompt_width = kv_width or prompts.shape[1]
    rows = functools.partial(request_rows, requests, prompt_width, columns)
    states = state_fields(requests[0].sampling, rows, prompt_width, width, recompute) if requests else {}
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=_per_step(requests, "scores", width) if config.output_scores else None,
        logits=_per_step(requests, "logits", width) if config.output_logits else None,
        **states,
        **{CACHE_NAME: cache},
    )


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
