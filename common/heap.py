"""A process's start-up heap, kept out of the cyclic garbage collector's walks.

A full collection walks every object the process holds: in an engine process
serving the default model on a CPU, 173,000 objects (torch's modules, the model,
the tokenizer, the interpreter's own) take 48-71 ms, a stall of several decode steps
for every running stream whenever the collector decides to run one. What a process
loads before it serves lives as long as the process, so it is collected once and
frozen (moved to the permanent generation); collections then walk only what serving
made, and the stall is gone (under 0.1 ms measured the same way).
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then leave every object alive now out of later collections;
    returns how many objects that is."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("start-up heap frozen: %d objects left out of garbage collections", frozen)
    return frozen
