"""--reasoning-parser: a reasoning model's thinking told apart from its answer, piece
by piece (frontend/reasoning.py), with a tiny model whose tokenizer has <think> and
</think> tokens and whose template opens the thinking (tests/conftest.py:
tiny_reasoner_dir); end to end through the real processes:
tests/e2e/test_reasoning_served.py."""

from __future__ import annotations

import pytest

from conftest import END_THINK, THINK
from frontend.reasoning import Reasoning, ReasoningParser

R1 = Reasoning("deepseek_r1", THINK, END_THINK, thinks_first=True)
QWEN3 = Reasoning("qwen3", THINK, END_THINK, thinks_first=False)


def split(parser: ReasoningParser, text: str, size: int) -> tuple[str, str]:
    reasoning, content = "", ""
    for i in range(0, len(text), size):
        r, c = parser.push(text[i:i + size])
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


# (reply, thinking at its start?) -> (thinking, answer)
CASES = [
    (("Let me see.\n</think>\n\nIt is 4.", True), ("Let me see.\n", "It is 4.")),
    (("\nno end of thinking </thin", True), ("no end of thinking </thin", "")),
    (("a </thing> is not the tag</think>b", True), ("a </thing> is not the tag", "b")),
    (("<think>\nhmm\n</think>\n\nHi <think> stays", False), ("hmm\n", "Hi <think> stays")),
    (("  \n<think>x</think>", False), ("x", "")),
    (("Hi, no thinking. </think>", False), ("", "Hi, no thinking. </think>")),
    (("<thin", False), ("", "<thin")),
    (("\n\n", False), ("", "\n\n")),
]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_replies_split_the_same_however_they_are_cut(case, size):
    (text, thinking), expected = case
    parser = ReasoningParser(thinking=thinking, fresh=not thinking, strip=thinking)
    assert split(parser, text, size) == expected


def test_where_a_reply_starts_is_read_from_its_prompt():
    for reasoning in (R1, QWEN3):
        assert reasoning.thinking_at_start([5, THINK, 6])
        assert not reasoning.thinking_at_start([THINK, 6, END_THINK, 7])
        assert reasoning.thinking_at_start([END_THINK, 3, THINK, 7])
    assert R1.thinking_at_start([1, 2]) and not QWEN3.thinking_at_start([1, 2])
    # Tokens of thinking, the tags included: all of an unfinished one.
    def thought(reasoning, prompt_ids, output_ids):
        return reasoning.num_tokens(reasoning.thinking_at_start(prompt_ids), output_ids)

    assert thought(R1, [THINK], [1, 2, END_THINK, 3]) == 3
    assert thought(R1, [THINK], [1, 2]) == 2
    assert thought(QWEN3, [1], [THINK, 2, END_THINK, 4]) == 3
    assert thought(QWEN3, [1], [2, 3]) == 0
    assert thought(QWEN3, [THINK, END_THINK], [1, END_THINK]) == 0


def test_the_tags_must_be_tokens(tiny_llama_dir, tiny_reasoner_dir):
    from common.tokenizer import load_decoder

    assert Reasoning.resolve("qwen3", load_decoder(tiny_reasoner_dir)) == QWEN3
    with pytest.raises(ValueError, match="has no <think> token"):
        Reasoning.resolve("qwen3", load_decoder(tiny_llama_dir))
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'"):
        Reasoning.resolve("r2", load_decoder(tiny_reasoner_dir))


# -- end to end -----------------------------------------------------------------------
