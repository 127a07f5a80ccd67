"""Structured output: OpenAI's ``response_format`` (``json_object``, ``json_schema``) through xgrammar.

xgrammar compiles the JSON grammar (or the schema's) against the tokenizer and, for each row, masks
every token that cannot continue a valid answer. transformers has no such processor and xgrammar's own
HF one keeps one matcher per batch position, while the engine runs a call's processors row by row
(``[1, L]`` each, rows of any request in any order). So `GrammarProcessor` keys each row's matcher by
the tokens it generated: a row's next call finds the matcher of its tokens but the last one and
advances a fork of it by that token; a matcher no longer kept is rebuilt from the row's tokens
(`GrammarProcessor`).

A completed answer leaves only the stop tokens (the generation config's EOS ids) open, so the answer
ends there; ``max_tokens`` can still cut it (finish_reason ``"length"``), as with OpenAI.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from transformers import LogitsProcessor

from hfaccel.server.prompt_rows import PromptRows
from hfaccel.server.schema_checks import check_schema

# Whitespace between JSON tokens is free, but a run of it is capped: a small model left free to write
# spaces can write them until max_tokens (vLLM's "any whitespace" issue).
MAX_WHITESPACE = 20


# Compiled grammars kept for schemas asked again (xgrammar's own cache, unbounded by default: every
# schema a client ever sent would stay).
COMPILER_CACHE_BYTES = 64 * 2**20


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
            made[key] = xgrammar.GrammarCompiler(info, cache_limit_bytes=COMPILER_CACHE_BYTES)
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
        check_schema(schema, strict)  # what the grammar would not enforce, and OpenAI's size limits
    try:
        grammar = compiler.compile_json_schema(
            schema, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE, strict_mode=strict
        )
    except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's refusals of a schema
        reason = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(error)).strip()  # its C++ log prefix
        raise ValueError(f"the JSON schema cannot be used: {reason}") from error
    if not _opens(grammar, vocab_size, stop_ids):
        # A schema no value satisfies (``{"$ref": "#"}`` compiles to ``root ::= root``): the processor
        # would leave an answer that can never start unmasked.
        raise ValueError("the JSON schema cannot be used: no JSON value satisfies it")
    return grammar


def _opens(grammar: Any, vocab_size: int, stop_ids: Sequence[int]) -> bool:
    """Whether some token besides the stop tokens can begin an answer in `grammar` (``{"anyOf": []}``
    compiles to a grammar that takes the empty answer only)."""
    import xgrammar

    mask = xgrammar.allocate_token_bitmask(1, vocab_size)
    xgrammar.GrammarMatcher(grammar).fill_next_token_bitmask(mask, 0)
    scores = torch.zeros(1, vocab_size)
    xgrammar.apply_token_bitmask_inplace(scores, mask)  # -inf where the grammar refuses the token
    scores[0, [t for t in stop_ids if 0 <= t < vocab_size]] = -float("inf")
    return bool(scores.isfinite().any())


class GrammarProcessor(LogitsProcessor):
    """Masks each row's scores to the tokens that keep its generated text in `grammar` (compiled by
    `compile_format`); `prompts` are the call's, to find where each row's generated tokens begin.

    Matchers are kept by the tokens they accepted, at most `MAX_MATCHERS` of them (the least recently
    used go; one is rebuilt from its row's tokens when asked again): speculative verification asks for
    rows with draft tokens appended, and the drafts it rejects are never extended. A row whose tokens
    leave the grammar (a draft the mask would have refused) is left unmasked: verification discards it.
    """

    MAX_MATCHERS = 64

    def __init__(self, grammar: Any, prompts: Sequence[Sequence[int]]) -> None:
        import xgrammar

        self._xgrammar = xgrammar
        self._grammar = grammar
        self.rows = PromptRows(prompts)
        # Keyed by the tokens' int32 bytes (4 a token); None: tokens that left the grammar.
        self._matchers: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()  # one call's rows may be processed from more than one thread

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """`scores` with each row's tokens outside its grammar at -inf. The bitmask (a bit a token) is
        filled on the host and applied where the scores are: on a GPU only it crosses the bus, not the
        scores (600 KB a row for a vocabulary of 150k)."""
        xgrammar = self._xgrammar
        with self._lock:
            mask = xgrammar.allocate_token_bitmask(input_ids.shape[0], scores.shape[-1])
            masked = []
            for i, row in enumerate(input_ids):
                matcher = self._matcher(self.rows.generated(row))
                if matcher is not None:
                    matcher.fill_next_token_bitmask(mask, i)
                    if not mask[i].any():  # a dead end: a sub-schema no value satisfies (a recursive $ref)
                        raise ValueError(
                            "the JSON schema cannot be used: the answer reached a point no token can continue "
                            "(a part of the schema that no JSON value satisfies)"
                        )
                    masked.append(i)
        out = scores.to(dtype=torch.float32, copy=True)
        if masked:
            xgrammar.apply_token_bitmask_inplace(out, mask.to(out.device), indices=masked)
        return out.to(scores.dtype)

    def _matcher(self, generated: torch.Tensor) -> Any:
        """The matcher of a row that generated `generated` (None: they leave the grammar): kept, its
        predecessor's fork advanced by the last token, or one rebuilt from all of them."""
        key = generated.to(device="cpu", dtype=torch.int32).numpy().tobytes()
        if key in self._matchers:
            self._matchers.move_to_end(key)
            return self._matchers[key]
        before = self._matchers.get(key[:-4], False) if key else False
        if before is None:  # its tokens left the grammar already
            matcher = None
        elif before is not False:
            matcher = before.fork()  # the predecessor stays: rows with the same tokens fork it alike
            matcher = matcher if matcher.accept_token(int(generated[-1])) else None
        else:
            matcher = self._xgrammar.GrammarMatcher(self._grammar)
            matcher = matcher if all(matcher.accept_token(t) for t in generated.tolist()) else None
        self._matchers[key] = matcher
        if len(self._matchers) > self.MAX_MATCHERS:
            self._matchers.popitem(last=False)
        return matcher
