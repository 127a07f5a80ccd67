"""Structured output: OpenAI's ``response_format`` (``json_object``, ``json_schema``) through xgrammar.

xgrammar compiles the JSON grammar (or the schema's) against the tokenizer and, for each row, masks
every token that cannot continue a valid answer. transformers has no such processor and xgrammar's own
HF one keeps one matcher per batch position, while the engine runs a call's processors row by row
(``[1, L]`` each, rows of any request in any order). So `GrammarProcessor` keys each row's matcher by
the tokens it generated: a row's next call finds the matcher of its tokens but the last one and
advances it by that token; a matcher not found (two rows with the same tokens so far) is rebuilt from
the row's tokens. Each matcher is held by the row that made it, so the matchers a call holds stay one
per row.

A completed answer leaves only the stop tokens (the generation config's EOS ids) open, so the answer
ends there; ``max_tokens`` can still cut it (finish_reason ``"length"``), as with OpenAI.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from transformers import LogitsProcessor

from hfaccel.server.prompt_rows import PromptRows

# Whitespace between JSON tokens is free, but a run of it is capped: a small model left free to write
# spaces can write them until max_tokens (vLLM's "any whitespace" issue).
MAX_WHITESPACE = 20


def xgrammar_missing() -> str | None:
    """Why structured output is not served here, or None."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return "response_format needs xgrammar: pip install 'hfaccel[serve]'"
    return None


_compilers: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def _compiler(tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> Any:
    """xgrammar's compiler for this tokenizer (made once; it caches the grammars it compiled)."""
    import xgrammar

    with _compilers_lock:
        made = _compilers.setdefault(tokenizer, {})
        key = (vocab_size, stop_ids)
        if key not in made:
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
            )
            made[key] = xgrammar.GrammarCompiler(info)
        return made[key]


def compile_format(
    response_format: Any, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]
) -> Any | None:
    """The compiled grammar of a request's `response_format` (`protocol.ResponseFormat`), or None for
    plain text. A schema xgrammar cannot compile raises ValueError with its reason."""
    if response_format is None or response_format.type == "text":
        return None
    compiler = _compiler(tokenizer, vocab_size, tuple(sorted(set(stop_ids))))
    if response_format.type == "json_object":
        schema: Any = {"type": "object"}  # OpenAI's JSON mode: any JSON object
        strict = False
    else:
        spec = response_format.json_schema
        schema, strict = spec.json_schema, bool(spec.strict)
    try:
        return compiler.compile_json_schema(
            schema, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE, strict_mode=strict
        )
    except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's refusals of a schema
        reason = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(error)).strip()  # its C++ log prefix
        raise ValueError(f"the JSON schema cannot be used: {reason}") from error


class GrammarProcessor(LogitsProcessor):
    """Masks each row's scores to the tokens that keep its generated text in `grammar` (compiled by
    `compile_format`); `prompts` are the call's, to find where each row's generated tokens begin."""

    def __init__(self, grammar: Any, prompts: Sequence[Sequence[int]]) -> None:
        import xgrammar

        self._xgrammar = xgrammar
        self._grammar = grammar
        self.rows = PromptRows(prompts)
        self._matchers: dict[tuple[int, ...], Any] = {}
        self._lock = threading.Lock()  # one call's rows may be processed from more than one thread
        self._mask: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        xgrammar = self._xgrammar
        with self._lock:
            if self._mask is None:
                self._mask = xgrammar.allocate_token_bitmask(1, scores.shape[-1])
            out = scores.to(device="cpu", dtype=torch.float32, copy=True)
            for i, row in enumerate(input_ids):
                matcher = self._matcher(tuple(self.rows.generated(row).tolist()))
                matcher.fill_next_token_bitmask(self._mask, 0)
                xgrammar.apply_token_bitmask_inplace(out[i : i + 1], self._mask)
        return out.to(device=scores.device, dtype=scores.dtype)

    def _matcher(self, generated: tuple[int, ...]) -> Any:
        """The matcher of a row that generated `generated`: its predecessor advanced by the last token,
        or one rebuilt from all of them."""
        matcher = self._matchers.pop(generated[:-1], None) if generated else None
        if matcher is None or not matcher.accept_token(generated[-1]):
            matcher = self._xgrammar.GrammarMatcher(self._grammar)
            for token in generated:
                if not matcher.accept_token(token):
                    raise ValueError(f"token {token} does not continue the answer's JSON")
        self._matchers[generated] = matcher
        return matcher
