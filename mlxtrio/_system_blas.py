"""Make MLX's CPU backend multiply through the system OpenBLAS on Linux.

The ``mlx[cpu]`` wheel links a bundled *reference* BLAS, about ten times slower
at float32 matrix products than OpenBLAS. Loading the system OpenBLAS into the
global symbol scope *before* MLX is imported makes the dynamic linker resolve
MLX's ``cblas_*`` calls to it, exactly as ``LD_PRELOAD`` would, but for every
way the server is started (``mlxtrio serve``, plain ``hypercorn -k trio``).
With it in place the engine computes in float32 (see
:mod:`mlxtrio.engine.precision`).

Runs once, from ``mlxtrio/__init__.py``. Does nothing on macOS (Accelerate), if
MLX was imported already, if no OpenBLAS is installed
(Debian/Ubuntu: ``apt-get install libopenblas0-pthread``), or with
``MLXTRIO_SYSTEM_BLAS=0``; ``MLXTRIO_SYSTEM_BLAS=/path/to/libopenblas.so`` picks
the library.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

_CANDIDATES = (
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def preload() -> str | None:
    """Load the system OpenBLAS globally; the path loaded, or None."""
    setting = os.environ.get("MLXTRIO_SYSTEM_BLAS", "auto")
    if setting == "0" or not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
        return None
    paths = [setting] if setting not in ("", "auto", "1") else _candidates()
    for path in paths:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return path
    return None


def _candidates() -> list[str]:
    return [path for pattern in _CANDIDATES for path in sorted(glob.glob(pattern))]
