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


# -- what logprobs show of one token (common/tokenizer.TokenStrings) -----------------

TEXT = "héllo wörld 🌹, 你好\n\tq"


def sentencepiece_tokenizer():
    """Llama 2's kind: SentencePiece words (▁ for a space) with byte fallback
    (<0xNN> for what the vocabulary lacks), and a special token added."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("▁", "h", "l", "o", "w", "r", "d", "q", ",", "▁h", "ll", "llo", "▁w"):
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("l", "l"), ("ll", "o"), ("▁", "w")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    return tok


def test_a_tokens_bytes_are_its_own_and_join_into_the_text(tok):
    from common.tokenizer import TokenStrings

    for backend, special in ((tok, "<|endoftext|>"), (sentencepiece_tokenizer(), "</s>")):
        strings = TokenStrings(backend)
        ids = backend.encode(TEXT).ids
        raw = [strings.raw(t) for t in ids]
        joined = b"".join(raw).decode()
        # SentencePiece adds a space before the first word, which its decoder drops.
        assert joined.removeprefix(" ") == TEXT, backend
        assert any(r and r[0] >= 0x80 and not _utf8(r) for r in raw)   # part of a character
        for t, r in zip(ids, raw):
            assert strings.text(t) == r.decode("utf-8", "replace")
        special_id = backend.token_to_id(special)
        assert strings.raw(special_id) == special.encode() and strings.text(special_id) == special
    # A SentencePiece word keeps its space (decoded alone, the space is stripped).
    sp = sentencepiece_tokenizer()
    word = sp.token_to_id("▁w")
    assert sp.decode([word]) == "w" and TokenStrings(sp).text(word) == " w"


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False
