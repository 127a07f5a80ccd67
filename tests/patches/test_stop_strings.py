"""`stop_strings.stop_string_check`, the engine's stop strings, on a byte-level tokenizer: characters split over
tokens and tokens that decode to nothing."""

from __future__ import annotations

import pytest

from hfaccel.patches.stop_strings import stop_string_check


class ByteTokenizer:
    """Each id is a run of UTF-8 bytes; decoding joins them and replaces broken characters, as a
    byte-level BPE tokenizer does. Id 0 decodes to nothing (a special or padding token)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = [b""] + pieces

    def encode(self, *pieces: bytes) -> list[int]:
        return [self.pieces.index(p) for p in pieces]

    def decode(self, ids: list[int], clean_up_tokenization_spaces: bool | None = None) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


EMOJI = "🎉".encode()
TOKENIZER = ByteTokenizer([b"a", b" ", b",", b"c", b"%", EMOJI[:2], EMOJI[2:3], EMOJI[3:]])


def fired(check, ids: list[int], prompt: list[int] = ()) -> list[int]:
    """The generated lengths at which `check` fires."""
    return [n for n in range(1, len(ids) + 1) if check(list(prompt), ids[:n])]


def test_a_character_split_over_tokens_fires_at_its_last_byte():
    ids = TOKENIZER.encode(b"a", b" ", EMOJI[:2], EMOJI[2:3], EMOJI[3:], b",", b"a")
    assert fired(stop_string_check(TOKENIZER, ["🎉"]), ids) == [5]
    assert fired(stop_string_check(TOKENIZER, ["🎉,"]), ids) == [6]
    assert fired(stop_string_check(TOKENIZER, ["a 🎉"]), ids) == [5]


def test_a_stop_string_of_several_split_characters_fires_at_each_of_its_ends():
    """A window that begins inside a character decodes to U+FFFD there: that is no text to match against,
    so the window widens until it holds the whole stop string."""
    split = [EMOJI[:2], EMOJI[2:3], EMOJI[3:]]
    ids = TOKENIZER.encode(b"a", *split, *split, *split, b"a")
    assert fired(stop_string_check(TOKENIZER, ["🎉🎉"]), ids) == [7, 10]
    assert fired(stop_string_check(TOKENIZER, ["a🎉🎉"]), ids) == [7]


@pytest.mark.parametrize("empty", [1, 5, 40])
def test_tokens_that_decode_to_nothing_inside_a_stop_string_do_not_hide_it(empty):
    ids = TOKENIZER.encode(b"a", b"c") + [0] * empty + TOKENIZER.encode(b"%", b"a")
    assert fired(stop_string_check(TOKENIZER, ["c%"]), ids) == [2 + empty + 1]


def test_a_stop_string_begun_in_the_prompt_fires_only_where_asked():
    prompt = TOKENIZER.encode(b"a", b"c")
    ids = TOKENIZER.encode(b"%", b"a")
    assert fired(stop_string_check(TOKENIZER, ["c%"], in_prompt=True), ids, prompt) == [1]
    assert fired(stop_string_check(TOKENIZER, ["c%"], in_prompt=False), ids, prompt) == []
    assert fired(stop_string_check(TOKENIZER, ["%"], in_prompt=False), ids, prompt) == [1]


def test_an_earlier_match_does_not_fire_again():
    ids = TOKENIZER.encode(b"c", b"%", b"a", b"a", b"a")
    assert fired(stop_string_check(TOKENIZER, ["c%"]), ids) == [2]


def test_a_tokenizer_that_cleans_up_spaces_still_stops_where_its_tokens_spell_the_string():
    """HF's StopStringCriteria matches the tokens' own strings; a tokenizer whose decode cleans up the
    space before punctuation ("a ." -> "a.") must not hide " ." from the check."""
    from tests.helpers import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    ids = tokenizer("ab .", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "ab."  # the clean-up this tokenizer applies
    assert fired(stop_string_check(tokenizer, [" ."]), ids) == [len(ids)]


def test_stop_strings_with_a_cleaning_tokenizer_stop_where_hf_stops():
    import torch

    import hfaccel
    from tests.helpers import tiny_model, tiny_tokenizer

    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    space, dot = tokenizer.convert_tokens_to_ids(" "), tokenizer.convert_tokens_to_ids(".")
    ask = dict(
        input_ids=torch.tensor([tokenizer("abc")["input_ids"]]),
        max_new_tokens=8,
        stop_strings=[" ."],
        tokenizer=tokenizer,
        sequence_bias={(space,): 100.0, (space, dot): 200.0},  # " ." comes at once
    )
    expected = model.generate(**ask)
    assert expected.shape[1] < ask["input_ids"].shape[1] + 8  # HF stopped at " ."
    hfaccel.patch(model)
    try:
        assert torch.equal(model.generate(**ask), expected)
    finally:
        hfaccel.unpatch(model)


def test_openai_stops_do_not_match_a_character_still_being_decoded():
    """Under OpenAI's stop (`openai_stops`, `hfaccel serve`) a U+FFFD that only stands for a character
    still being decoded ends no stop string (the answer never holds it: vLLM holds it back); transformers'
    stop strings read the token strings as they are, U+FFFD included."""
    from hfaccel.patches.stop_strings import openai_stops

    ids = TOKENIZER.encode(b"a", EMOJI[:2], EMOJI[2:3], EMOJI[3:], b"a")
    assert fired(stop_string_check(TOKENIZER, ["\ufffd"]), ids) == [2]
    with openai_stops():
        assert fired(stop_string_check(TOKENIZER, ["\ufffd"]), ids) == []
        assert fired(stop_string_check(TOKENIZER, ["a🎉"]), ids) == [4]


def test_an_id_beyond_the_tokenizer_breaks_a_stop_string_as_in_hf():
    """The model's vocabulary (256) is larger than the tokenizer's (98): an id beyond it decodes to
    nothing, but in HF's StopStringCriteria it matches nothing, so "Q", 175, "w" does not spell "Qw"."""
    import torch

    import hfaccel
    from tests.helpers import tiny_model, tiny_tokenizer

    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    q, w = tokenizer.convert_tokens_to_ids("Q"), tokenizer.convert_tokens_to_ids("w")
    assert tokenizer.decode([q, 175, w]) == "Qw"
    check = stop_string_check(tokenizer, ["Qw"])
    assert fired(check, [q, 175, w, q, w]) == [5], "a match after the unknown id still fires"
    ask = dict(
        input_ids=torch.tensor([tokenizer("abc")["input_ids"]]),
        max_new_tokens=6,
        stop_strings=["Qw"],
        tokenizer=tokenizer,
        sequence_bias={(q,): 100.0, (q, 175): 200.0, (q, 175, w): 300.0},
    )
    expected = model.generate(**ask)
    assert expected[0, -6:-3].tolist() == [q, 175, w]  # HF went on past "Q", 175, "w"
    hfaccel.patch(model)
    try:
        assert torch.equal(model.generate(**ask), expected)
    finally:
        hfaccel.unpatch(model)


@pytest.mark.parametrize("empty", ["", []])
def test_empty_stop_strings_are_refused_naming_them(empty):
    """HF stops at the first token for "" and raises for []: the engine refuses both, as it refuses [""]."""
    import torch

    import hfaccel
    from tests.helpers import tiny_model, tiny_tokenizer

    model, tokenizer = hfaccel.patch(tiny_model("llama")), tiny_tokenizer()
    with pytest.raises(ValueError, match="stop_strings must be non-empty strings"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, stop_strings=empty, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="stop_strings must be non-empty strings"):
        hfaccel.generate(model, [[5, 6, 7]], max_new_tokens=3, stop_strings=empty, tokenizer=tokenizer)
