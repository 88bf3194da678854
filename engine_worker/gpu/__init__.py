"""The CUDA engine's parts: Triton kernels (attention.py, ops.py), step-input buffers
on the device, CUDA graphs (graphs.py) and memory sizing (memory.py).

The kernels also run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1,
set before this package is imported), which is how they are tested without a GPU.
"""

from __future__ import annotations

import os


def _interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns a loop
    bound into an int with int(array), which NumPy 2.4 refuses for arrays of one
    dimension. Index through the array's single element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_scalar_index()
