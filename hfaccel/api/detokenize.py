"""A stream's text, token by token, without decoding the whole token list at every token.

Decoding all of a stream's tokens for each new one costs O(n) per token, O(n^2) per stream: about 2 ms a
token at 4,000 tokens with a fast tokenizer, in the thread that serves every client. The text a token
adds is read off a short window instead (vLLM's prefix and read offsets): the window from the last token
that produced text, decoded with and without the new tokens, so a decoder's treatment of the window's
first token (a stripped leading space) is the same on both sides and cancels. A tokenizer seen to rewrite
spaces across tokens (`clean_up_tokenization_spaces` where transformers applies it, or a decoder's own
cleanup: probed once) keeps the whole-list decode. The deltas join to ``tokenizer.decode(tokens,
skip_special_tokens=True)`` for the tokenizers tested (byte-level BPE, SentencePiece-style BPE with byte
fallback, WordPiece with cleanup: `tests/api/test_detokenize.py`); a decoder that rewrote earlier text
for a later token in some other way would not join, as the whole-list decode's deltas did not either.
"""

from __future__ import annotations

import contextlib
import functools
import re
import weakref
from typing import Any

_CLEANUP_REACH = 4  # characters at the end of a whole-list decode that a later token's cleanup can change
_INCOMPLETE = "\ufffd"  # a character whose UTF-8 bytes span tokens, until its last byte's token comes


class Detokenizer:
    """The text each new token of one sequence adds (`add`), held back while it could still change: a
    partial character, a run of byte tokens not yet ended, and (cleanup tokenizers) the last 4
    characters; the deltas join to the whole list's decode (`skip_special_tokens` as given: a reply parser
    reads the special tokens that mark a tool call or the end of a turn)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.skip_special_tokens = skip_special_tokens
        self.windowed = decodes_locally(tokenizer)
        self._bytes = byte_tokens(tokenizer)
        self._skipped = special_tokens(tokenizer) if self._bytes and skip_special_tokens else frozenset()
        self._in_run = False
        self._prefix = 0  # the window starts here: the token after the last one whose text was read...
        self._read = 0  # ...and its text up to here was sent
        self._text = ""  # whole-list mode: the text sent so far

    def add(self, token: int, done: bool = False) -> str:
        """Append `token` and return the text it completes ("" while a character is incomplete, unless
        `done`: the sequence's last token sends whatever is left)."""
        self.tokens.append(token)
        if token in self._bytes:
            self._in_run = True
        elif token not in self._skipped:  # a skipped special token leaves the run open on both sides
            self._in_run = False
        if self._in_run and not done:
            # A byte-fallback decoder reads a run of byte tokens as one: a complete character in a run
            # that a stray byte ends decodes to U+FFFD. Nothing of a run is final until it ends.
            return ""
        if not self.windowed:
            text = self._decode(self.tokens)
            if done:
                delta, self._text = text[len(self._text) :], text
                return delta
            # Cleanup rewrites a space up to 4 characters back (" n't" -> "n't", " ' " -> "'"): hold
            # those back until later tokens (or the end) settle them.
            safe = len(text) - _CLEANUP_REACH
            if text.endswith(_INCOMPLETE) or safe <= len(self._text):
                return ""
            delta, self._text = text[len(self._text) : safe], text[:safe]
            return delta
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        if len(after) > len(before) and (done or not after.endswith(_INCOMPLETE)):
            self._prefix, self._read = self._read, len(self.tokens)
            return after[len(before) :]
        return after[len(before) :] if done else ""

    def flush(self) -> str:
        """The text held back so far: the sequence ended with no new token."""
        if not self.windowed:
            text = self._decode(self.tokens)
            delta, self._text = text[len(self._text) :], text
            return delta
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        self._prefix, self._read = self._read, len(self.tokens)
        return after[len(before) :]

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens) if tokens else ""


def decodes_locally(tokenizer: Any) -> bool:
    """Whether this tokenizer's decode of a token list is its pieces' decodes joined, up to the window's
    first-token handling: false where transformers applies `clean_up_tokenization_spaces` (it joins
    " ." to "." across tokens). Probed once per tokenizer object and value of its flag."""
    flag = getattr(tokenizer, "clean_up_tokenization_spaces", None)  # a change of it is probed again
    try:
        probed_flag, local = _PROBED[tokenizer]
        if probed_flag == flag:
            return local
    except (KeyError, TypeError):  # not probed yet, or not weakly referenceable
        pass
    # Probed rather than read off `clean_up_tokenization_spaces`: transformers 5 ignores that flag for
    # BPE tokenizers, and a decoder can clean up by itself (WordPiece's `cleanup`).
    try:
        ids = tokenizer.encode("a . b , c 's", add_special_tokens=False)
        local = tokenizer.decode(ids, skip_special_tokens=True).endswith("a . b , c 's")
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say keeps the whole-list decode
        local = False
    with contextlib.suppress(TypeError):
        _PROBED[tokenizer] = (flag, local)
    return local


_PROBED: weakref.WeakKeyDictionary[Any, tuple[Any, bool]] = weakref.WeakKeyDictionary()


def byte_tokens(tokenizer: Any) -> frozenset[int]:
    """The ids of a byte-fallback vocabulary's byte tokens (``<0x00>`` ... ``<0xFF>``, SentencePiece's);
    empty for byte-level BPE, whose tokens are bytes already. Read once per tokenizer object."""
    return _per_tokenizer(_BYTES, tokenizer, _read_byte_tokens)


def _read_byte_tokens(tokenizer: Any) -> frozenset[int]:
    try:
        return frozenset(i for token, i in tokenizer.get_vocab().items() if _BYTE_TOKEN.fullmatch(token))
    except Exception:  # noqa: BLE001 - no vocabulary to read: no run to hold
        return frozenset()


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes token `token` stands for, where decoding it alone gives U+FFFD for part of a character:
    a byte-level BPE token's own bytes (GPT-2's byte alphabet, mapped back), a byte-fallback token's
    one byte (``<0xE3>``); any other token (added and special ones, whose text is stored as it is) as
    its decoded text's UTF-8."""
    if token in byte_tokens(tokenizer):
        return bytes([int(tokenizer.convert_ids_to_tokens(token)[3:5], 16)])
    if _per_tokenizer(_BYTE_LEVEL, tokenizer, _byte_level) and token not in _per_tokenizer(
        _LITERAL, tokenizer, _literal_tokens
    ):
        piece, alphabet = tokenizer.convert_ids_to_tokens(token), _byte_alphabet()
        if isinstance(piece, str) and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
    return tokenizer.decode([token]).encode()


def _byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer decodes with tokenizers' ByteLevel decoder (GPT-2-style BPE), alone or in a
    sequence of decoders (transformers 5.17 builds one for a GGUF tokenizer)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        return decoder is not None and '"type":"ByteLevel"' in decoder.__getstate__().decode()
    except Exception:  # noqa: BLE001 - a decoder that does not serialise: judge by its type
        return type(decoder).__name__ == "ByteLevel"


def _literal_tokens(tokenizer: Any) -> frozenset[int]:
    """Added and special tokens: their text is stored as it is, not in the byte alphabet."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return special_tokens(tokenizer) | frozenset(added)


def _per_tokenizer(cache: weakref.WeakKeyDictionary, tokenizer: Any, read: Any) -> Any:
    """`read(tokenizer)`, kept in `cache` per tokenizer object (read every time for one that cannot be),
    and read again once its vocabulary's size changed (``add_tokens`` in a notebook that fine-tunes)."""
    try:
        size = len(tokenizer)
    except TypeError:
        size = None
    with contextlib.suppress(KeyError, TypeError):
        held, found = cache[tokenizer]
        if held == size:
            return found
    found = read(tokenizer)
    with contextlib.suppress(TypeError):
        cache[tokenizer] = (size, found)
    return found


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, each character to the byte it stands for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {character: byte for byte, character in bytes_to_unicode().items()}


def special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts of the tokens a plain decode leaves out (`special_tokens`), read once per tokenizer."""
    return _per_tokenizer(
        _SPECIAL_TEXTS, tokenizer, lambda t: tuple({t.decode([i]) for i in special_tokens(t)} - {""})
    )


_SPECIAL_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def special_tokens(tokenizer: Any) -> frozenset[int]:
    """The ids a decode with ``skip_special_tokens`` leaves out: the special tokens transformers names
    and those its backend registered as special."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    named = getattr(tokenizer, "all_special_ids", None) or ()
    return frozenset(named) | {i for i, token in added.items() if getattr(token, "special", False)}


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_BYTES: weakref.WeakKeyDictionary[Any, tuple[int | None, frozenset[int]]] = weakref.WeakKeyDictionary()
_BYTE_LEVEL: weakref.WeakKeyDictionary[Any, tuple[int | None, bool]] = weakref.WeakKeyDictionary()
_LITERAL: weakref.WeakKeyDictionary[Any, tuple[int | None, frozenset[int]]] = weakref.WeakKeyDictionary()
