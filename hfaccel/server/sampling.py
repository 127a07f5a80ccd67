"""An OpenAI request's sampling fields as `hfaccel.generate` keyword arguments (transformers' own
`generate` arguments), each mistake a 400 naming its field."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hfaccel.api.detokenize import decodes_locally
from hfaccel.api.results import output_rows
from hfaccel.server.penalties import OutputTokenPenalties
from hfaccel.server.prompt_rows import prefix_clash
from hfaccel.server.protocol import APIError, SamplingFields
from hfaccel.server.structured import GrammarProcessor, compile_format, xgrammar_missing


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (each a 400, or 413 for the prompt, beyond it)."""

    max_tokens: int = 4096  # the most new tokens a request may ask for
    max_n: int = 16  # the most choices a request may ask for
    max_prompt_tokens: int | None = None  # None: the model's context
    max_body_bytes: int = 4 * 1024 * 1024
    max_pending: int = 256  # requests admitted and not yet finished; beyond: 429


# Temperatures below this are greedy, as in vLLM: the scores divided by 1e-45 overflow float32, and the
# draw would read infinities and NaNs.
GREEDY_BELOW = 1e-5


def generate_kwargs(
    request: SamplingFields,
    max_tokens: int | None,
    prompt_tokens: int,
    max_model_len: int,
    limits: Limits,
    vocab_size: int,
) -> dict[str, Any]:
    """The `generate` arguments of a request whose prompt has `prompt_tokens` tokens (`vocab_size`: the
    tokenizer's, for `logit_bias`). Omitted fields keep the model's generation config, as transformers'
    `generate` does; ``temperature=0`` is greedy, and so is any below `GREEDY_BELOW`."""
    longest = min(max_model_len, limits.max_prompt_tokens or max_model_len)
    if prompt_tokens >= longest:
        raise APIError(
            413,
            f"the prompt has {prompt_tokens} tokens; this server takes prompts of fewer than {longest} "
            f"(the model's context is {max_model_len} tokens)",
            "messages" if hasattr(request, "messages") else "prompt",
        )
    room = max_model_len - prompt_tokens
    name = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
    given = max_tokens is not None
    if max_tokens is None:
        max_tokens = min(room, limits.max_tokens)
    elif max_tokens > limits.max_tokens:
        raise APIError(400, f"{name}={max_tokens} is above this server's limit of {limits.max_tokens}", name)
    elif max_tokens > room:
        raise APIError(
            400,
            f"the prompt's {prompt_tokens} tokens plus {name}={max_tokens} pass the model's context of "
            f"{max_model_len} tokens",
            name,
        )
    if request.min_tokens and request.min_tokens > max_tokens:  # vLLM's 400 too (it was cut to max_tokens)
        most = f"{name}={max_tokens}" if given else f"the {max_tokens} tokens this prompt may have"
        raise APIError(400, f"min_tokens={request.min_tokens} is above {most}", "min_tokens")
    if request.n > limits.max_n:
        raise APIError(400, f"n={request.n} is above this server's limit of {limits.max_n}", "n")
    kwargs: dict[str, Any] = {"max_new_tokens": max_tokens}
    if request.temperature is not None:
        if request.temperature < GREEDY_BELOW:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=request.temperature)
    for field in ("top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(request, field)
        if value is not None:
            kwargs[field] = value
    if request.top_k is not None and request.top_k < 1:
        kwargs["top_k"] = 0  # vLLM's -1 / 0: no top-k (not the generation config's, as leaving it out would)
    if request.min_tokens:
        kwargs["min_new_tokens"] = min(request.min_tokens, max_tokens)
    if request.ignore_eos:
        kwargs["min_new_tokens"] = max_tokens  # EOS is suppressed until max_tokens
    stops = stop_strings(request)
    if stops:
        kwargs["stop_strings"] = stops
    if request.logit_bias:
        kwargs["sequence_bias"] = _sequence_bias(request.logit_bias, vocab_size)
    return kwargs


def penalties_processor(request: SamplingFields, prompts: list[list[int]]) -> OutputTokenPenalties | None:
    """The processor of a request's ``presence_penalty`` / ``frequency_penalty`` (None when both are 0 or
    unset). A completions batch one of whose prompts begins with another is refused: its rows could not
    be told apart (`penalties.py`)."""
    presence, frequency = request.presence_penalty or 0.0, request.frequency_penalty or 0.0
    if not presence and not frequency:
        return None
    clash = prefix_clash(prompts)
    if clash is not None:
        field = "presence_penalty" if presence else "frequency_penalty"
        raise APIError(
            400,
            f"{field} with a list of prompts where prompt {clash[0]} begins with prompt {clash[1]} is not "
            "served: send them as separate requests",
            field,
        )
    return OutputTokenPenalties(prompts, presence, frequency)


def grammar_job(
    served: Any, request: Any, prompts: list[list[int]], kwargs: dict[str, Any]
) -> Callable[[], GrammarProcessor] | None:
    """What makes the processor of a chat request's ``response_format`` (None for text): a function to
    run off the event loop (xgrammar's compile), each mistake a 400 naming the field: xgrammar missing,
    EOS held off (``min_tokens``, ``ignore_eos``), which a completed answer needs, here; a schema
    xgrammar refuses, when the function runs. `kwargs` (the call's `generate` arguments) get the
    tokenizer's EOS when the model's generation config has none."""
    response_format = getattr(request, "response_format", None)
    if response_format is None or response_format.type == "text":
        return None
    missing = xgrammar_missing()
    if missing is not None:
        raise APIError(400, missing, "response_format")
    if request.ignore_eos or request.min_tokens:
        field = "ignore_eos" if request.ignore_eos else "min_tokens"
        raise APIError(
            400, f"{field} with response_format is not served: a complete answer ends at EOS", field
        )
    model, tokenizer = served.model, served.tokenizer
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer.eos_token_id is not None:
        # A model that declares no EOS would decode past the grammar's end: the answer ends at the
        # tokenizer's EOS, the one token the completed grammar leaves open.
        eos = kwargs["eos_token_id"] = tokenizer.eos_token_id
    stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not stop_ids:
        raise APIError(
            400,
            "response_format needs an EOS token to end the answer; this model has none",
            "response_format",
        )
    vocab = output_rows(model)

    def compiled() -> GrammarProcessor:
        try:
            grammar = compile_format(response_format, tokenizer, vocab, stop_ids)
        except ValueError as error:
            raise APIError(400, str(error), "response_format.json_schema.schema") from error
        return GrammarProcessor(grammar, prompts)

    return compiled


def _sequence_bias(logit_bias: dict[str, float], vocab_size: int) -> dict[tuple[int, ...], float]:
    """OpenAI's ``logit_bias`` (token ids as JSON keys, each bias added to that token's logit before
    sampling, in [-100, 100]) as transformers' `sequence_bias` of one-token sequences, which does so."""
    bias = {}
    for key, value in logit_bias.items():
        token = int(key) if key.isascii() and key.strip().lstrip("-").isdigit() else None
        if token is None or not 0 <= token < vocab_size:
            raise APIError(400, f"logit_bias key {key!r} is not a token id of this model", "logit_bias")
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias {key!r}: {value} is outside [-100, 100]", "logit_bias")
        bias[(token,)] = float(value)
    return bias


def stop_strings(request: SamplingFields) -> list[str]:
    stop = request.stop
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop strings must not be empty", "stop")
    return stops


def cut_at_stop(
    text: str, stops: list[str], cleaned: list[str] | tuple[str, ...] = (), after: int = 0
) -> str:
    """`text` up to the first stop string in it (OpenAI's output leaves the stop string out) that ends
    past its first `after` characters (the text of the tokens ``min_tokens`` held: no stop string ended
    the answer there). `cleaned`: the stop strings as a tokenizer that cleans up spaces shows them (" ." as
    "."), for a text that holds no stop string as the engine's check read it; the answer ended at such a
    string, so it is cut at the last one."""
    cuts = [i for i in (text.find(s, max(0, after - len(s) + 1)) for s in stops) if i >= 0]
    if cuts:
        return text[: min(cuts)]
    last = max((text.rfind(s) for s in cleaned), default=-1)
    return text[:last] if last >= 0 else text


def cleaned_stops(tokenizer: Any, stops: list[str]) -> list[str] | None:
    """The stop strings as `tokenizer`'s decode shows them after its clean-up of spaces, or None when it
    does not clean up (its text is its tokens' strings, which the engine's stop check reads)."""
    clean = getattr(tokenizer, "clean_up_tokenization", None)
    if not stops or clean is None or decodes_locally(tokenizer):
        return None
    return [c for s in stops if (c := clean(s)) != s and c]
