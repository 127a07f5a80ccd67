"""A stream's text, token by token, without decoding the whole token list at every token.

Decoding all of a stream's tokens for each new one costs O(n) per token, O(n^2) per stream: about 2 ms a
token at 4,000 tokens with a fast tokenizer, in the thread that serves every client. The text a token
adds is read off a short window instead (vLLM's prefix and read offsets): the window from the last token
that produced text, decoded with and without the new tokens, so a decoder's treatment of the window's
first token (a stripped leading space) is the same on both sides and cancels. A tokenizer that rewrites
text across token boundaries (`clean_up_tokenization_spaces` where transformers applies it) keeps the
whole-list decode, so the deltas always join to ``tokenizer.decode(tokens, skip_special_tokens=True)``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

_INCOMPLETE = "\ufffd"  # a character whose UTF-8 bytes span tokens, until its last byte's token comes


class Detokenizer:
    """The text each new token of one sequence adds (`add`), held back while it ends in a partial
    character; the deltas join to the whole list's decode."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.windowed = decodes_locally(tokenizer)
        self._prefix = 0  # the window starts here: the token after the last one whose text was read...
        self._read = 0  # ...and its text up to here was sent
        self._text = ""  # whole-list mode: the text sent so far

    def add(self, token: int, done: bool = False) -> str:
        """Append `token` and return the text it completes ("" while a character is incomplete, unless
        `done`: the sequence's last token sends whatever is left)."""
        self.tokens.append(token)
        if not self.windowed:
            text = self._decode(self.tokens)
            if text.endswith(_INCOMPLETE) and not done:
                return ""
            delta, self._text = text[len(self._text) :], text
            return delta
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        if len(after) > len(before) and (done or not after.endswith(_INCOMPLETE)):
            self._prefix, self._read = self._read, len(self.tokens)
            return after[len(before) :]
        return after[len(before) :] if done else ""

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if tokens else ""


def decodes_locally(tokenizer: Any) -> bool:
    """Whether this tokenizer's decode of a token list is its pieces' decodes joined, up to the window's
    first-token handling: false where transformers applies `clean_up_tokenization_spaces` (it joins
    " ." to "." across tokens). Probed once per tokenizer object."""
    try:
        return _PROBED[tokenizer]
    except (KeyError, TypeError):  # not probed yet, or not weakly referenceable
        pass
    local = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    if not local:  # transformers 5 ignores the flag for BPE tokenizers: see whether it is applied
        try:
            ids = tokenizer.encode("a . b , c 's", add_special_tokens=False)
            local = tokenizer.decode(ids, skip_special_tokens=True).endswith("a . b , c 's")
        except Exception:  # noqa: BLE001 - a tokenizer that cannot say keeps the exact whole-list decode
            local = False
    with contextlib.suppress(TypeError):
        _PROBED[tokenizer] = local
    return local


_PROBED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
