"""Incremental detokenization in detail: which stop string ends the text, what is held
back while a stop string could still start, and windows over tokenizers whose pieces
carry their leading space (SentencePiece's "▁").

Two real ``tokenizers`` tokenizers: the tiny model's byte-level BPE (one token per
byte), and a word-level one with the Metaspace decoder, whose multi-character tokens
put several characters, or a whole stop string, into one delta.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models

from scheduler_svc.detokenizer import IncrementalDetokenizer
from shared.tokenizer import load_tokenizer

TEXT = "héllo wörld ✓ 日本語 🎉 end"
PIECES = [
    "<unk>",
    "<s>",
    "</s>",
    "▁say",
    "▁hello",
    "▁world",
    "▁1▁zz▁2▁aa▁3",
    "▁abc",
    "▁na▁na",
    "▁stop",
    "!",
]


@pytest.fixture(scope="module")
def byte_level(model: Path) -> Tokenizer:
    return load_tokenizer(model)


@pytest.fixture(scope="module")
def words() -> Tokenizer:
    tokenizer = Tokenizer(
        models.WordLevel({piece: i for i, piece in enumerate(PIECES)}, unk_token="<unk>")
    )
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.decoder = decoders.Metaspace()
    return tokenizer


def byte_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def word_ids(*pieces: str) -> list[int]:
    return [PIECES.index(piece) for piece in pieces]


def stream(detok: IncrementalDetokenizer, tokens: list[int]) -> str:
    """Feed ``tokens`` until the detokenizer stops; the text shown, flush included."""
    shown = ""
    for token in tokens:
        shown += detok.add(token)
        if detok.stopped:
            return shown
    return shown + detok.flush()


# --------------------------------------------------------------------------- which stop wins


@pytest.mark.parametrize("stop", [("ld", "wörld"), ("wörld", "ld")])
def test_the_earliest_stop_string_wins_when_two_end_together(
    byte_level: Tokenizer, stop: tuple[str, ...]
) -> None:
    # "wörld" and "ld" are both completed by the "d": the text ends before "wörld".
    detok = IncrementalDetokenizer(byte_level, stop)
    shown = stream(detok, byte_ids(byte_level, TEXT))
    assert detok.stopped
    assert (detok.text, detok.stop_reason) == ("héllo ", "wörld")
    assert shown == "héllo "


@pytest.mark.parametrize("stop", [("aa", "zz"), ("zz", "aa")])
def test_the_earliest_of_two_stop_strings_in_one_delta_wins(
    words: Tokenizer, stop: tuple[str, ...]
) -> None:
    detok = IncrementalDetokenizer(words, stop)
    shown = stream(detok, word_ids("▁say", "▁1▁zz▁2▁aa▁3", "▁world"))
    assert (detok.text, detok.stop_reason) == ("say 1 ", "zz")
    assert shown == "say 1 "


@pytest.mark.parametrize("stop", [("ab", "a"), ("a", "ab")])
def test_stop_strings_starting_at_the_same_place_go_by_the_order_listed(
    words: Tokenizer, stop: tuple[str, ...]
) -> None:
    detok = IncrementalDetokenizer(words, stop)
    stream(detok, word_ids("▁hello", "▁abc"))
    assert (detok.text, detok.stop_reason) == ("hello ", stop[0])


def test_a_stop_string_twice_in_one_delta_cuts_at_the_first(words: Tokenizer) -> None:
    detok = IncrementalDetokenizer(words, ("na",))
    assert stream(detok, word_ids("▁say", "▁na▁na", "▁world")) == "say "
    assert detok.text == "say " and detok.stop_reason == "na"


def test_a_stop_string_at_the_very_start_leaves_no_text(
    byte_level: Tokenizer, words: Tokenizer
) -> None:
    detok = IncrementalDetokenizer(byte_level, ("h",))
    assert stream(detok, byte_ids(byte_level, TEXT)) == ""
    assert detok.stopped and detok.text == "" and detok.stop_reason == "h"
    detok = IncrementalDetokenizer(words, ("st", "zz"))
    assert stream(detok, word_ids("▁stop", "▁say")) == ""
    assert detok.stopped and detok.text == "" and detok.stop_reason == "st"


def test_a_stop_string_split_over_many_deltas_is_found(byte_level: Tokenizer) -> None:
    # "✓ 日" arrives a byte at a time: 7 tokens, 3 characters.
    detok = IncrementalDetokenizer(byte_level, ("✓ 日", "never"))
    assert stream(detok, byte_ids(byte_level, TEXT)) == "héllo wörld "
    assert detok.stop_reason == "✓ 日"


def test_stop_strings_count_only_past_min_tokens(byte_level: Tokenizer) -> None:
    """vLLM's rule: a stop string ends the text once it has more than ``min_tokens``
    tokens, found in the text those later tokens add."""
    tokens = byte_ids(byte_level, TEXT)  # a token a byte: "héll" is five
    detok = IncrementalDetokenizer(byte_level, ("l",), min_tokens=5)
    assert stream(detok, tokens) == "héllo wör"
    assert detok.stopped and detok.stop_reason == "l"
    detok = IncrementalDetokenizer(byte_level, ("l",), min_tokens=4)  # the second "l"
    assert stream(detok, tokens) == "hél" and detok.stop_reason == "l"
    assert stream(IncrementalDetokenizer(byte_level, ("l",)), tokens) == "hé"


# --------------------------------------------------------------------------- held back text


@pytest.mark.parametrize("stop", [(), ("zzzz",), ("zz", "zzzzzz")])
def test_exactly_the_last_characters_that_could_start_a_stop_string_are_held_back(
    byte_level: Tokenizer, stop: tuple[str, ...]
) -> None:
    """Shown so far = the decoded text less its last ``len(longest stop) - 1``
    characters (none without stop strings), at every complete character."""
    held = max((len(s) for s in stop), default=1) - 1
    detok = IncrementalDetokenizer(byte_level, stop)
    tokens = byte_ids(byte_level, TEXT)
    shown = ""
    for count, token in enumerate(tokens, start=1):
        shown += detok.add(token)
        decoded = byte_level.decode(tokens[:count])
        if not decoded.endswith("\ufffd"):
            assert shown == decoded[: max(len(decoded) - held, 0)], count
    assert shown == TEXT[: len(TEXT) - held]
    assert detok.flush() == TEXT[len(TEXT) - held :]
    assert detok.stopped is False and detok.stop_reason is None


def test_flush_twice_shows_nothing_new(byte_level: Tokenizer) -> None:
    tokens = byte_ids(byte_level, "ab 日本")
    for detok in (
        IncrementalDetokenizer(byte_level),
        IncrementalDetokenizer(byte_level, ("zzz",)),
        IncrementalDetokenizer(byte_level, lazy=True),
    ):
        shown = "".join(detok.add(t) for t in tokens) + detok.flush()
        assert shown == "ab 日本" == detok.text
        assert detok.flush() == "" and detok.text == "ab 日本"
        detok.add(byte_ids(byte_level, "!")[0])  # streaming goes on after a flush
        assert detok.flush() in ("", "!") and detok.text == "ab 日本!"


def test_special_tokens_show_no_text(byte_level: Tokenizer, words: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_level)
    assert stream(detok, [1, *byte_ids(byte_level, "hi"), 2]) == "hi"
    detok = IncrementalDetokenizer(words, ("zz",))
    assert stream(detok, word_ids("<s>", "▁say", "</s>", "▁hello")) == "say hello"


def test_a_lazy_detokenizer_refuses_stop_strings() -> None:
    with pytest.raises(ValueError, match=r"^a lazy detokenizer cannot look for stop strings$"):
        IncrementalDetokenizer(
            Tokenizer(models.WordLevel({"a": 0}, unk_token="a")), ("x",), lazy=True
        )


# --------------------------------------------------------------------------- leading spaces


def test_pieces_with_a_leading_space_stream_with_their_space(words: Tokenizer) -> None:
    """A Metaspace decoder drops the space of a window's first piece: each delta is cut
    from a window that starts before the new token, so the space is kept."""
    tokens = word_ids("▁say", "▁hello", "▁world", "!", "▁say", "▁world") * 3
    detok = IncrementalDetokenizer(words)
    deltas = [detok.add(t) for t in tokens]
    assert deltas[:4] == ["say", " hello", " world", "!"]
    assert "".join(deltas) + detok.flush() == words.decode(tokens)
    assert all(d.startswith(" ") for d, t in zip(deltas[1:], tokens[1:], strict=True) if t != 10)


def test_load_tokenizer_reads_tokenizer_json(tmp_path: Path, words: Tokenizer) -> None:
    words.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.decode(word_ids("▁say", "▁hello")) == "say hello"


# --------------------------------------------------------------------------- keep_stop


def test_keep_stop_ends_the_text_with_the_stop_string(
    byte_level: Tokenizer, words: Tokenizer
) -> None:
    """``include_stop_str_in_output``: the text runs to the end of the earliest stop
    string (and not past it, though the delta that held it went on)."""
    detok = IncrementalDetokenizer(words, ("na",), keep_stop=True)
    assert stream(detok, word_ids("▁say", "▁na▁na", "▁world")) == "say na"
    assert detok.text == "say na" and detok.stop_reason == "na"
    detok = IncrementalDetokenizer(byte_level, ("✓ 日", "never"), keep_stop=True)
    assert stream(detok, byte_ids(byte_level, TEXT)) == "héllo wörld ✓ 日"
    kept = IncrementalDetokenizer(byte_level, ("h",), keep_stop=True)
    assert stream(kept, byte_ids(byte_level, TEXT)) == "h" and kept.text == "h"
