"""A stream's deltas (api/detokenize.py) join to the whole token list's decode for byte-level BPE
(SmolLM2's), SentencePiece-style byte-fallback BPE and a tokenizer that cleans up spaces, hold a partial
character back, and decode a short window per token however long the stream."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hfaccel.api.detokenize import Detokenizer, decodes_locally, token_bytes
from tests.helpers import tiny_tokenizer

TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=40)
CORPUS = [
    "héllo wörld, the snow ☃ falls; it's, don't, we're, do'do",
    "日本語 text and more text",
    "naïve café: déjà vu!",
] * 20


@functools.cache
def metaspace_bpe():
    """A SentencePiece-style tokenizer (Llama 2's, Mistral's): a word's first token carries the space, and
    characters outside its vocabulary are byte tokens of the vocabulary (not special), which its decoder
    reads a run at a time: a run that is not UTF-8 decodes to U+FFFD, even a complete character in it."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(
        CORPUS[:3], trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "</s>"])
    )
    vocab = trained.get_vocab()
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
        for m in json.loads(trained.to_str())["model"]["merges"]
    ]
    backend = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence(  # Llama 2's and Mistral's: the decode's first space is stripped
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


@functools.cache
def wordpiece_with_decoder_cleanup():
    """Cleanup in the decoder itself, transformers' flag off: the probe sees it all the same."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=True)
    backend.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=False
    )


@functools.cache
def wordpiece_with_cleanup():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )


def streamed(tokenizer, tokens: list[int]) -> list[str]:
    detokenizer = Detokenizer(tokenizer)
    return [detokenizer.add(t, done=k == len(tokens) - 1) for k, t in enumerate(tokens)]


def check_joins(tokenizer, tokens: list[int]) -> None:
    """The deltas join to the whole decode, and what was sent at each token is already final text
    (a prefix of it): a partial character is never sent and taken back."""
    deltas = streamed(tokenizer, tokens)
    whole = tokenizer.decode(tokens, skip_special_tokens=True)
    assert "".join(deltas) == whole
    sent = ""
    for delta in deltas:
        sent += delta
        assert whole.startswith(sent)


@settings(max_examples=80, deadline=None)
@given(text=TEXT, ids=st.lists(st.integers(0, 420), max_size=30))
def test_byte_fallback_bpe_deltas_join_to_the_whole_decode(text, ids):
    tokenizer = metaspace_bpe()
    assert decodes_locally(tokenizer)
    check_joins(tokenizer, tokenizer.encode(text, add_special_tokens=False))
    check_joins(tokenizer, [min(i, len(tokenizer) - 1) for i in ids])  # any ids: stray bytes, </s>


def test_a_run_of_byte_tokens_is_held_until_it_ends():
    """A complete character followed by a stray byte: the run decodes to U+FFFD as a whole, so nothing
    of it is sent until a token that is not a byte (or the end) closes the run."""
    tokenizer = metaspace_bpe()
    byte = {b: tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xF0, 0x9F, 0x98, 0x80, 0xC3)}
    smile = [byte[0xF0], byte[0x9F], byte[0x98], byte[0x80]]
    word = tokenizer.encode("snow", add_special_tokens=False)
    for tokens in (smile + [byte[0xF0], byte[0x9F]], smile + [byte[0xC3]] + word, word + smile + word):
        check_joins(tokenizer, tokens)
    deltas = streamed(tokenizer, word + smile + word)
    assert deltas[len(word) : len(word) + 4] == [""] * 4  # held while the run goes on


def test_flush_sends_what_was_held_when_a_sequence_ends_without_a_token():
    """A stream's closing event with no token (`StreamEvents`): the held text comes out then."""
    tokenizer = metaspace_bpe()
    byte = {b: tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xF0, 0x9F, 0x98, 0x80)}
    word = tokenizer.encode("snow", add_special_tokens=False)
    tokens = word + [byte[0xF0], byte[0x9F], byte[0x98], byte[0x80]]
    for cleanup in (tokenizer, wordpiece_with_cleanup()):
        ids = tokens if cleanup is tokenizer else cleanup.encode("it ' s", add_special_tokens=False)
        detokenizer = Detokenizer(cleanup)
        sent = "".join(detokenizer.add(t) for t in ids)
        whole = cleanup.decode(ids, skip_special_tokens=True)
        assert sent != whole, "something was held back"
        assert sent + detokenizer.flush() == whole
        assert detokenizer.flush() == ""


@settings(max_examples=40, deadline=None)
@given(text=TEXT)
def test_a_tokenizer_that_cleans_up_spaces_decodes_the_whole_list(text):
    for tokenizer in (wordpiece_with_cleanup(), wordpiece_with_decoder_cleanup()):
        assert not decodes_locally(tokenizer)  # " ." becomes "." across tokens
        check_joins(tokenizer, tokenizer.encode(text + " a . b , c", add_special_tokens=False))
        for rewritten in ("it ' s", "do ' do", "don ' t", "a ' b ' c"):  # " ' " -> "'" three tokens on
            check_joins(tokenizer, tokenizer.encode(rewritten, add_special_tokens=False))


def test_smollm2_deltas_join_and_a_partial_character_waits(smollm2):
    """Byte-level BPE: '☃' is three bytes over tokens; nothing of it is sent until its last byte comes."""
    _, tokenizer = smollm2
    assert decodes_locally(tokenizer)
    for text in ("Hello, world! ☃ snow 日本語 déjà vu", " leading space", "\n\nnew lines  two  spaces"):
        check_joins(tokenizer, tokenizer.encode(text, add_special_tokens=False))
    tokens = tokenizer.encode("a☃", add_special_tokens=False)
    assert len(tokens) >= 3
    deltas = streamed(tokenizer, tokens + [tokenizer.eos_token_id])
    assert deltas[0] == "a" and all(d == "" for d in deltas[1:-2]) and deltas[-2] == "☃"


def test_the_last_token_sends_what_is_left_even_a_partial_character(smollm2):
    _, tokenizer = smollm2
    tokens = tokenizer.encode("☃", add_special_tokens=False)[:-1]  # the character cut short
    assert "".join(streamed(tokenizer, tokens)) == tokenizer.decode(tokens) and tokenizer.decode(tokens)


def test_each_token_decodes_a_short_window_however_long_the_stream(smollm2):
    """4,000 tokens of text: every decode covers a few tokens (it was the whole list: O(n^2))."""
    _, tokenizer = smollm2
    tokens = tokenizer.encode("The quick brown fox, ☃, jumps over 日本 the lazy dog. " * 300)[:4000]
    lengths = []
    decode = tokenizer.decode

    class Counting:
        def decode(self, ids, **options):
            lengths.append(len(ids))
            return decode(ids, **options)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    counting = Counting()
    assert decodes_locally(counting)  # probed once per tokenizer, before the stream
    lengths.clear()
    deltas = streamed(counting, tokens)
    assert "".join(deltas) == decode(tokens, skip_special_tokens=True)
    assert len(tokens) == 4000 and max(lengths) <= 8


def test_the_tiny_character_tokenizer_streams_character_by_character():
    tokenizer = tiny_tokenizer()
    tokens = tokenizer.encode("ab c", add_special_tokens=False)
    assert streamed(tokenizer, tokens) == ["a", "b", " ", "c"]


@pytest.mark.parametrize("text", ["an emoji 🎉, and ☃ more", "français は nice", "plain words only"])
def test_token_bytes_join_to_the_texts_utf8(smollm2, text):
    """OpenAI's logprob ``bytes``: a token inside a character (decoding alone to U+FFFD) gives its own
    bytes, so the tokens' bytes join to the text."""
    _, tokenizer = smollm2
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == text.encode()


def test_byte_fallback_tokens_give_their_byte():
    tokenizer = metaspace_bpe()
    ids = tokenizer("🎉", add_special_tokens=False)["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    byte_ids = [i for i, piece in zip(ids, pieces) if piece.startswith("<0x")]
    assert len(byte_ids) == 4, pieces
    assert b"".join(token_bytes(tokenizer, i) for i in byte_ids) == "🎉".encode()


@pytest.mark.parametrize(
    "text", ["<|im_start|>assistant\nHi ☃<|im_end|>", "<tool_call>\n{}\n</tool_call><|im_end|>x"]
)
def test_with_special_tokens_kept_the_deltas_join_to_the_raw_decode(smollm2, text):
    """A reply parser reads the special tokens that mark a turn's end: kept, the deltas join to the decode
    with them, and a partial character still waits."""
    _, tokenizer = smollm2
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert any(t in tokenizer.all_special_ids for t in tokens)
    detokenizer = Detokenizer(tokenizer, skip_special_tokens=False)
    deltas = [detokenizer.add(t, done=k == len(tokens) - 1) for k, t in enumerate(tokens)]
    whole = tokenizer.decode(tokens, skip_special_tokens=False)
    assert "".join(deltas) == whole == text
    assert all("\ufffd" not in d for d in deltas)


def test_a_special_token_added_after_the_first_call_is_known_as_one(smollm2):
    """What is read once per tokenizer is read again after tokens are added (a notebook that fine-tunes
    adds its own): the server leaves a special token's text out of a reply served as text."""
    import copy

    from hfaccel.api.detokenize import special_texts

    tokenizer = copy.deepcopy(smollm2[1])
    assert "<|tool|>" not in special_texts(tokenizer)  # read once
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    assert "<|tool|>" in special_texts(tokenizer)
