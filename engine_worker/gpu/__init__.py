"""The CUDA engine's parts: Triton kernels (attention.py, ops.py), step-input buffers
on the device, CUDA graphs (graphs.py) and memory sizing (memory.py).

The kernels also run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1,
set before this package is imported), which is how they are tested without a GPU.
"""
