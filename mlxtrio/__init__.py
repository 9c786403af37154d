"""mlxtrio: a local MLX inference server for coding agents, on Trio."""

from .blas import preload as _preload_blas

# Before anything imports MLX: see blas.py. The path loaded, or None.
SYSTEM_BLAS = _preload_blas()
