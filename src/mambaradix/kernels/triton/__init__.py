"""Triton kernels of the ``cuda`` backend (``kernels/cuda_backend.py``): paged attention, the
short causal conv and the Mamba2 scan are this project's own; Gated DeltaNet runs fla-core's
kernels (``gdn.py``). On CPU tensors they run under ``TRITON_INTERPRET=1`` (the tests)."""
