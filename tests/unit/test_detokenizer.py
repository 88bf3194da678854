"""Incremental detokenization and stop strings, on GPT-2's real byte-level BPE."""

from __future__ import annotations

import pytest

from common.tokenizer import load_tokenizer
from frontend.detokenizer import IncrementalDetokenizer, StopStringMatcher


@pytest.fixture(scope="module")
def tok(tiny_gpt2_dir):
    return load_tokenizer(tiny_gpt2_dir).backend_tokenizer


def stream(tok, prompt_ids, output_ids, chunk=1):
    detok = IncrementalDetokenizer(tok, prompt_ids)
    pieces = [detok.push(output_ids[i:i + chunk]) for i in range(0, len(output_ids), chunk)]
    pieces.append(detok.flush())
    return pieces


def test_multibyte_characters_split_across_tokens_arrive_whole(tok):
    text = " naïve 日本語 🙂 done"
    ids = tok.encode(text).ids
    # Byte-level BPE splits these characters over several tokens: decoding a token
    # alone gives U+FFFD halves.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = stream(tok, tok.encode("Prompt:").ids, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "日" in pieces[[i for i, p in enumerate(pieces) if "日" in p][0]]


def test_prompt_text_never_leaks(tok):
    prompt = tok.encode("SECRET prompt text").ids
    out = tok.encode(" and the answer").ids
    assert "".join(stream(tok, prompt, out)) == " and the answer"


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_chunks_of_any_size_give_the_same_text(tok, chunk):
    ids = tok.encode("Hello, wörld! ½ + ¼ = ¾").ids
    assert "".join(stream(tok, [], ids, chunk)) == "Hello, wörld! ½ + ¼ = ¾"


def test_special_tokens_are_skipped(tok):
    ids = tok.encode("bye").ids + [50256]
    assert "".join(stream(tok, [], ids)) == "bye"


def feed(matcher, pieces):
    released = [matcher.push(p) for p in pieces]
    released.append(matcher.flush())
    return released


def test_stop_string_spanning_pieces_is_found_and_excluded():
    m = StopStringMatcher(["END"])
    released = feed(m, ["Hello E", "N", "D and more"])
    assert "".join(released) == "Hello "
    assert m.stopped == "END"


def test_only_a_possible_stop_prefix_is_held_back():
    m = StopStringMatcher(["\n\nUser:"])
    assert m.push("line one\n") == "line one"  # "\n" might start the stop string
    assert m.push("\nUs") == ""  # "\n\nUs" still might
    assert m.push("es") == "\n\nUses"  # no longer: released
    assert m.flush() == ""


def test_no_stop_string_releases_everything_at_the_end():
    m = StopStringMatcher(["xyz"])
    assert "".join(feed(m, ["ab", "cx", "y"])) == "abcxy"
    assert m.stopped is None


def test_earliest_of_several_stop_strings_wins():
    m = StopStringMatcher(["world", "lo w"])
    assert "".join(feed(m, ["hello world"])) == "hel"
    assert m.stopped == "lo w"

