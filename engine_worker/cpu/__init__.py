"""The CPU platform (platform.py): the C kernels (csrc/; built for this CPU by build.py,
bound by kernels.py), their packed weight formats as linear methods (formats.py), their
decode attention (attention.py) and the shared decoder's whole step in one C call
(fused.py)."""
