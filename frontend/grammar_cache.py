"""The frontend's check of structured-output constraints, off the event loop.

Each distinct constraint (a JSON schema, regex, grammar or choice list) is compiled
against the tokenizer once, in a worker thread, so a large schema never stalls the
event loop that serves every other stream. Clients send the same schema again and
again, so the result is kept: least recently used first out, bounded by the bytes of
the constraints and grammars held (a count would let a few huge schemas pin
gigabytes). A constraint that fails to compile raises and is not kept; one larger
than the whole budget is checked every time.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from common.structured import GrammarCompiler, StructuredOutput

DEFAULT_MAX_BYTES = 64 << 20


class CheckedGrammars:
    def __init__(self, compiler: GrammarCompiler, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.compiler = compiler
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._grammars: OrderedDict[StructuredOutput, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._grammars)

    async def check(self, output: StructuredOutput) -> str:
        """The grammar of ``output``, compiled in a worker thread unless already
        known. Raises InvalidRequestError naming the field."""
        grammar = self._grammars.get(output)
        if grammar is not None:
            self._grammars.move_to_end(output)
            return grammar
        grammar = await asyncio.to_thread(self.compiler.check, output)
        self._keep(output, grammar)
        return grammar

    def _keep(self, output: StructuredOutput, grammar: str) -> None:
        size = _size(output, grammar)
        if size > self.max_bytes or output in self._grammars:
            return
        self._grammars[output] = grammar
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            old, old_grammar = self._grammars.popitem(last=False)
            self.num_bytes -= _size(old, old_grammar)


def _size(output: StructuredOutput, grammar: str) -> int:
    return len(output.spec) + len(output.kind) + len(grammar)
