"""Typed errors shared by every process.

An ``InvalidRequestError`` is the fault of one request (bad values, too long, unknown
token ids): it ends that request and nothing else. The HTTP frontend maps it to 400.
"""

from __future__ import annotations

from typing import Optional


class InvalidRequestError(ValueError):
    """A request that cannot be served as asked. ``param`` names the offending field."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(RuntimeError):
    """A model directory that cannot be loaded: a missing file or an unsupported architecture."""
