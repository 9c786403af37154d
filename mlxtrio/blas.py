"""Give MLX's CPU backend a fast BLAS on Linux, and say which one it uses.

The ``mlx[cpu]`` wheel links a bundled *reference* BLAS: 3-5 GFLOP/s at
float32 matrix products, where an optimised one does 100-250 on the same
machine. Loading an optimised library into the global symbol scope *before*
MLX is imported makes the dynamic linker resolve MLX's ``cblas_*`` calls to it,
as ``LD_PRELOAD`` would, for every way the server is started (``mlxtrio
serve``, plain ``hypercorn -k trio``). With one in place the engine computes in
float32 (:mod:`mlxtrio.engine.precision`).

What is loaded, first found first:

1. ``MLXTRIO_SYSTEM_BLAS=/path/to/lib.so`` (``0`` turns all of this off);
2. the system OpenBLAS (Debian/Ubuntu ``libopenblas0-pthread``): the system's
   library wins when it is installed;
3. Intel MKL from PyPI, which ``pip install 'mlxtrio[cpu-blas]'`` brings on
   x86-64 Linux (and ``make run`` / ``make test`` install): no root needed.

An OpenBLAS older than the CPU it runs on (Debian 12's 0.3.21 on a 2023 Xeon)
falls back to its slowest kernels (5x slower here); unless
``OPENBLAS_CORETYPE`` is set, it is told the best kernel family the CPU's
instruction set supports.

Runs once, from ``mlxtrio/__init__.py``. Does nothing on macOS (MLX uses
Accelerate) or if MLX was imported already.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from pathlib import Path

_SYSTEM_OPENBLAS = (
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
_SETTING = "MLXTRIO_SYSTEM_BLAS"
INSTALL_HINT = (
    "pip install 'mlxtrio[cpu-blas]' (x86-64), or the system OpenBLAS "
    "(Debian/Ubuntu: apt-get install libopenblas0-pthread)"
)


def preload() -> str | None:
    """Load the first BLAS found (see the module docstring) into the global
    symbol scope; the path loaded, or None."""
    setting = os.environ.get(_SETTING, "auto")
    if setting == "0" or not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
        return None
    paths = [setting] if setting not in ("", "auto", "1") else _candidates()
    for path in paths:
        if "openblas" in Path(path).name:
            _choose_openblas_kernels()
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return path
    return None


def _candidates() -> list[str]:
    system = [path for pattern in _SYSTEM_OPENBLAS for path in sorted(glob.glob(pattern))]
    return [*system, *_pip_mkl()]


def _pip_mkl() -> list[str]:
    """MKL's single dynamic library, where the ``mkl`` wheel put it (under the
    environment's prefix, not in site-packages)."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        files = distribution("mkl").files or []
    except PackageNotFoundError:
        return []
    found = (Path(f.locate()).resolve() for f in files if f.name.startswith("libmkl_rt.so"))
    return sorted(str(path) for path in found)


def _choose_openblas_kernels() -> None:
    """Set ``OPENBLAS_CORETYPE`` (unless set) to the best kernel family the
    CPU supports, so an OpenBLAS that does not know this CPU model does not
    fall back to its generic kernels. Every OpenBLAS that supports these
    instructions has these families."""
    if "OPENBLAS_CORETYPE" in os.environ:
        return
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"
    elif {"avx2", "fma"} <= flags:
        os.environ["OPENBLAS_CORETYPE"] = "Haswell"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def provider() -> str | None:
    """The file of the library MLX's ``cblas_sgemm`` resolves to here (the
    global scope's), or None when none is loaded there (MLX then uses the
    reference BLAS its wheel bundles). Linux only."""
    try:
        process = ctypes.CDLL(None)
        symbol = process.cblas_sgemm
        info = _DlInfo()
        if not process.dladdr(ctypes.cast(symbol, ctypes.c_void_p), ctypes.byref(info)):
            return None
    except (AttributeError, OSError):
        return None
    return info.dli_fname.decode() if info.dli_fname else None


def describe() -> str:
    """A short name for the BLAS MLX's CPU backend uses: ``Accelerate``,
    ``OpenBLAS 0.3.21 SkylakeX (system)``, ``MKL 2026.2 (pip)``, or
    ``reference (slow)``."""
    if sys.platform == "darwin":
        return "Accelerate"
    path = provider()
    if path is None:
        return "reference (slow)"
    where = "pip" if path.startswith((sys.prefix, sys.base_prefix)) else "system"
    library = ctypes.CDLL(path)
    if "mkl" in Path(path).name:
        return f"MKL {_mkl_version(library)} ({where})".replace("  ", " ")
    if "openblas" in path:
        return f"OpenBLAS {_openblas_config(library)} ({where})".replace("  ", " ")
    return f"{Path(path).name} ({where})"


def is_fast() -> bool:
    """Whether MLX's CPU backend multiplies through an optimised BLAS."""
    return sys.platform == "darwin" or provider() is not None


def _openblas_config(library: ctypes.CDLL) -> str:
    """``0.3.21 SkylakeX``: the version and the kernels chosen for this CPU."""
    try:
        library.openblas_get_config.restype = ctypes.c_char_p
        library.openblas_get_corename.restype = ctypes.c_char_p
        config = (library.openblas_get_config() or b"").decode().split()
        core = (library.openblas_get_corename() or b"").decode()
    except AttributeError:
        return ""
    version = config[1] if len(config) > 1 and config[0] == "OpenBLAS" else ""
    return f"{version} {core}".strip()


def _mkl_version(library: ctypes.CDLL) -> str:
    try:
        buffer = ctypes.create_string_buffer(256)
        library.mkl_get_version_string(buffer, len(buffer))
    except AttributeError:
        return ""
    words = buffer.value.decode(errors="replace").split()
    return words[words.index("Version") + 1].split("-")[0] if "Version" in words else ""
