"""The frontend's checked-grammar cache: compiles off the event loop, bounded by bytes."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.errors import InvalidRequestError
from common.structured import StructuredOutput
from frontend.grammar_cache import CheckedGrammars


class SlowCompiler:
    """Stands in for GrammarCompiler: 0.5 s per check, the grammar 2x the spec."""

    def __init__(self) -> None:
        self.calls = 0

    def check(self, output: StructuredOutput) -> str:
        self.calls += 1
        time.sleep(0.5)
        if output.spec == "bad":
            raise InvalidRequestError("does not compile", output.param)
        return output.spec * 2


def schema(spec: str) -> StructuredOutput:
    return StructuredOutput(kind="regex", spec=spec, param="guided_regex")


def test_a_slow_compile_does_not_stall_the_event_loop():
    cache = CheckedGrammars(SlowCompiler())

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        grammar = await cache.check(schema("abc"))
        task.cancel()
        return grammar, ticks

    grammar, ticks = asyncio.run(main())
    assert grammar == "abcabc"
    assert ticks >= 20  # the loop ran on through the 0.5 s compile


def test_the_cache_is_bounded_by_bytes_least_recently_used_out():
    compiler = SlowCompiler()
    # Each entry: spec 100 + kind 5 + grammar 200 = 305 bytes; three fit in 1000.
    cache = CheckedGrammars(compiler, max_bytes=1000)

    async def main():
        for name in "abcd":
            await cache.check(schema(name * 100))
        await cache.check(schema("b" * 100))  # known: no compile, now the most recent
        await cache.check(schema("a" * 100))  # evicted by "d": compiled again
        return compiler.calls

    assert asyncio.run(main()) == 5
    assert cache.num_bytes == 3 * 305 and len(cache) == 3


def test_a_failure_is_not_kept_and_an_oversized_grammar_is_not_cached():
    compiler = SlowCompiler()
    cache = CheckedGrammars(compiler, max_bytes=100)

    async def main():
        for _ in range(2):
            with pytest.raises(InvalidRequestError):
                await cache.check(schema("bad"))
        for _ in range(2):
            await cache.check(schema("x" * 60))  # 185 bytes: over the budget
        return compiler.calls

    assert asyncio.run(main()) == 4
    assert len(cache) == 0 and cache.num_bytes == 0
