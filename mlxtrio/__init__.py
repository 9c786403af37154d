"""mlxtrio: a local MLX inference server for coding agents, on Trio."""

from ._system_blas import preload as _preload_system_blas

# Before anything imports MLX: see _system_blas.
SYSTEM_BLAS = _preload_system_blas()
