"""Stop strings as the engine checks them: on the decoded text of a row's newest tokens, where
transformers' `StopStringCriteria` matches token strings (`stop_string_check`), and OpenAI's ``stop`` for
`hfaccel serve` (`openai_stops`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any
from weakref import WeakKeyDictionary

# None: transformers' stop strings; an int: OpenAI's ``stop``, held for that many tokens (`openai_stops`).
_openai_stops: ContextVar[int | None] = ContextVar("hfaccel_openai_stops", default=None)


def after(
    count: int, check: Callable[[list[int], list[int]], bool]
) -> Callable[[list[int], list[int]], bool]:
    """`check`, asked only once `count` tokens were generated (earlier ones end no row)."""
    return lambda prompt, generated: len(generated) >= count and check(prompt, generated)


def openai_min_tokens() -> int | None:
    """The tokens OpenAI's ``stop`` holds back within an `openai_stops` block; None outside one."""
    return _openai_stops.get()


@contextmanager
def openai_stops(min_tokens: int = 0) -> Iterator[None]:
    """Within this block (this thread or asyncio task), stop strings work as OpenAI's ``stop`` (`hfaccel
    serve`): they match the generated text only (transformers' ``stop_strings`` also match a string that
    begins in the prompt), and none ends a row before `min_tokens` tokens, as vLLM's ``min_tokens``
    holds them (transformers' ``min_new_tokens`` holds EOS only)."""
    token = _openai_stops.set(min_tokens)
    try:
        yield
    finally:
        _openai_stops.reset(token)


def stop_string_check(
    tokenizer: Any, stop_strings: list[str], in_prompt: bool | None = None
) -> Callable[[list[int], list[int]], bool]:
    """A check of (prompt ids, generated ids) that fires when a stop string ends inside the newest token
    (overhang allowed), wherever it starts: in the prompt too, as HF's StopStringCriteria matches over
    the whole row, unless `in_prompt` is False (None: as `openai_stops` says).

    The newest token's text is where the decoded tail stops agreeing with the tail decoded without it:
    a token may end inside a character (byte-level tokenizers split an emoji or a CJK character over
    several tokens, each alone decoding to U+FFFD), so the shorter text is not always a prefix of the
    longer one. A newest token that adds no text ends no stop string. The tail starts a few tokens
    longer than the longest stop string and doubles while the text before the newest token, less the
    U+FFFD of a tail that starts inside a character, is shorter than that string (tokens that decode to
    nothing, characters of several tokens). An id above the tokenizer's vocabulary (a model whose
    embedding table is larger) ends every match that spans it, as it matches nothing in HF's criteria
    (not under `openai_stops`: OpenAI's stop matches the answer's text)."""
    if not stop_strings or any(not isinstance(s, str) or not s for s in stop_strings):
        raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
    longest = max(map(len, stop_strings))
    openai = _openai_stops.get() is not None
    in_prompt = not openai if in_prompt is None else in_prompt
    # OpenAI's stop matches the text the answer shows, whatever ids spelled it; HF's, token strings.
    highest = None if openai else highest_token_id(tokenizer)

    def check(prompt: list[int], generated: list[int]) -> bool:
        available = len(generated) + (len(prompt) if in_prompt else 0)
        size = longest + 2
        while True:
            tail = generated[-size:]
            if len(tail) < size and prompt and in_prompt:
                tail = prompt[len(tail) - size :] + tail
            unknown = highest is not None and max(tail) > highest
            if unknown:  # only the tokens after the last unknown one can end in a match
                tail = tail[max(i for i, t in enumerate(tail) if t > highest) + 1 :]
                if not tail:
                    return False
            # As HF's StopStringCriteria reads tokens: their own strings, without the clean-up of spaces
            # before punctuation a tokenizer may apply when it decodes ("a ." -> "a.").
            text = tokenizer.decode(tail, clean_up_tokenization_spaces=False)
            previous = (
                tokenizer.decode(tail[:-1], clean_up_tokenization_spaces=False) if len(tail) > 1 else ""
            )
            if previous == text:  # the newest token adds no text: no stop string ends in it
                return False
            before = len(os.path.commonprefix([previous, text]))
            # A window that starts inside a character starts with U+FFFD: not text to match against.
            broken = len(text) - len(text.lstrip("\ufffd"))
            if before - broken >= longest - 1 or len(tail) >= available or unknown:
                break
            size *= 2
        if openai:  # a character still being decoded ends in U+FFFD, which the answer will not hold
            text = text.rstrip("\ufffd")  # (as vLLM holds it back; transformers' strings match it)
        return any((pos := text.rfind(s)) != -1 and pos + len(s) > before for s in stop_strings)

    return check


_highest: WeakKeyDictionary[Any, tuple[int, int | None]] = WeakKeyDictionary()


def highest_token_id(tokenizer: Any) -> int | None:
    """The highest id of `tokenizer`'s vocabulary (None: it does not say): ids above it are a larger
    embedding table's rows. Kept per tokenizer while its length holds (a vocabulary of 49,152 takes
    about 20 ms to list)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        size = len(tokenizer)
        kept = _highest.get(tokenizer)
        if kept is not None and kept[0] == size:
            return kept[1]
        highest = max(get_vocab().values(), default=None)
        _highest[tokenizer] = (size, highest)
    except TypeError:  # not weakly referenced, or no length: listed every time
        highest = max(get_vocab().values(), default=None)
    return highest
