"""Optional compiled kernels. Each has a PyTorch fallback in ``amod.ops``; Triton is not required."""
