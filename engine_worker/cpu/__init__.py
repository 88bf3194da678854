"""The CPU engine's parts: the C kernels (csrc/, their build and ctypes bindings in
kernels.py) and the one-call forward of the Llama family (fused.py)."""
