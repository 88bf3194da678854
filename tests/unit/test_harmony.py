"""gpt-oss's harmony replies (frontend/harmony.py): the parser alone, however its text
is cut (over the real processes and HTTP: tests/e2e/test_harmony_served.py)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from conftest import HARMONY_ANSWER as ANSWER, HARMONY_CALL as CALL, HARMONY_THINK as THINK
from frontend.harmony import HarmonyParser
from frontend.reasoning import Reasoning

PREAMBLE = "<|channel|>commentary<|message|>Checking.<|end|>"


CASES = [
    (THINK + ANSWER, "Two and two. Four?", "It is 4."),
    (THINK + CALL, "Two and two. Four?",
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'),
    (PREAMBLE + "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}",
     "", 'Checking.<tool_call>{"name": "f", "arguments": {}'),   # cut short: left open
    (THINK + "<|start|>assistant<|channel|>fin", "Two and two. Four?", ""),   # a header cut
    ("<|channel|>analysis<|message|>Hmm <|e", "Hmm <|e", ""),   # not a tag after all
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_replies_split_the_same_however_they_are_cut(case, size):
    text, reasoning, content = case
    parser = HarmonyParser(calls=True)
    got = ["", ""]
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        more, answer = parser.take(piece, final=k == len(pieces) - 1)
        got[0] += more
        got[1] += answer
    assert got == [reasoning, content]
    assert parser.thought == bool(reasoning)


def test_where_a_reply_starts_and_what_it_thought(tiny_harmony_dir, tiny_llama_dir):
    tok = Tokenizer.from_file(str(tiny_harmony_dir / "tokenizer.json"))
    harmony = Reasoning.resolve("gpt_oss", tok)
    final = tok.encode("final", add_special_tokens=False).ids
    assert harmony.answer_after == (50258, *final, 50259)
    # after <|start|>assistant at a header; after the final header in its body
    assert harmony.thinking_at_start([1, 50257, 5])
    assert not harmony.thinking_at_start([1, 50257, 50258, *final, 50259])
    # the analysis messages' tokens, <|channel|> to <|end|>: not the call's
    think = tok.encode(THINK, add_special_tokens=False).ids
    for reply in (THINK + ANSWER, THINK + CALL, PREAMBLE + THINK + ANSWER + THINK):
        ids = tok.encode(reply, add_special_tokens=False).ids
        assert harmony.num_tokens(True, ids) == len(think) * reply.count(THINK)
        assert harmony.num_tokens(False, ids) == 0
    assert harmony.num_tokens(True, think[:5]) == 5   # cut short in its analysis
    with pytest.raises(ValueError, match=r"no <\|start\|> token"):
        Reasoning.resolve("gpt_oss", Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json")))


# -- end to end -----------------------------------------------------------------------
