"""Test-only fault injection: one documented hook, called once when a process starts.

``ROSESERVE_FAULT_PLUGIN=module:function`` names a function that each roseserve
process calls once, after it has built its main object and before it serves:
``function(component, target, **context)``. The reliability tests use it to wrap
methods of ``target`` (an engine step that takes longer, a tokenizer worker that
crashes or hangs on a marker text, a request whose sampling fails) and so exercise the
real failure paths of the real processes. Production never sets the variable, and no
loop reads anything for it: without it this function returns at once.

Components and targets: "engine" (engine_worker.server.EngineServer),
"tokenizer_worker" (tokenizer_worker.prompt_tokenizer.PromptTokenizer, context: slot),
"tokenizer_pool" (tokenizer_worker.pool.TokenizerPool), "frontend" (the FastAPI app).
"""

from __future__ import annotations

import importlib
import logging

from common.config import env_default

logger = logging.getLogger(__name__)


def install(component: str, target: object, **context) -> None:
    spec = env_default("FAULT_PLUGIN")
    if not spec:
        return
    module_name, _, function_name = spec.partition(":")
    logger.warning("fault injection is on in the %s: %s", component, spec)
    function = getattr(importlib.import_module(module_name), function_name or "install")
    function(component, target, **context)
