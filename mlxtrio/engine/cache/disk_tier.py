"""KV blocks on disk: one safetensors file per block, written by its own thread.

A block's file is ``<name as hex>.safetensors`` in the model's directory under
``<data_dir>/kv-cache/``. Its metadata carries the block's name, its token
count, each tensor's MLX dtype (bfloat16 is stored as its bits, since NumPy has
no such type) and a BLAKE2 checksum of every tensor's bytes. A read checks all
of them: a truncated, corrupted or foreign file is reported unreadable and
deleted, never served.

Threads: the engine thread turns new blocks into NumPy arrays (:func:`to_host`,
the only MLX call here) and queues them; :class:`DiskWriter`'s thread writes
each file to a temporary name and renames it into place, so a crash never
leaves a half-written block under a real name; reads run on Trio's worker
threads (:func:`read_blocks`) and return NumPy arrays, which the engine thread
turns back into MLX arrays. Neither the Trio loop nor the engine thread ever
waits for the disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .blocks import BLOCK_TOKENS

log = logging.getLogger("mlxtrio.engine")

FORMAT = "mlxtrio-kv-block-1"
SUFFIX = ".safetensors"
OWNER = "model.json"  # which model a block directory belongs to
MAX_PENDING_BYTES = 512 << 20  # queued for writing; newer blocks are skipped beyond it

HostLayers = list[tuple[Any, Any]]  # per layer: (keys, values) as NumPy arrays
HostBlock = tuple[HostLayers, list[str]]  # and the MLX dtype of each tensor


def file_name(name: bytes) -> str:
    return name.hex() + SUFFIX


def to_host(layers: list[tuple[Any, Any]]) -> HostBlock:
    """NumPy copies of a block's MLX arrays (engine thread)."""
    import mlx.core as mx
    import numpy as np

    host: HostLayers = []
    dtypes: list[str] = []
    for pair in layers:
        arrays = []
        for array in pair:
            dtype = str(array.dtype).removeprefix("mlx.core.")
            if array.dtype == mx.bfloat16:
                array = array.view(mx.uint16)
            arrays.append(np.array(array, copy=True))
            dtypes.append(dtype)
        host.append((arrays[0], arrays[1]))
    return host, dtypes


def from_host(block: HostBlock) -> list[tuple[Any, Any]]:
    """MLX arrays of a block read from disk (engine thread)."""
    import mlx.core as mx

    layers, dtypes = block
    out = []
    kinds = iter(dtypes)
    for pair in layers:
        arrays = []
        for array in pair:
            converted = mx.array(array)
            if next(kinds) == "bfloat16":
                converted = converted.view(mx.bfloat16)
            arrays.append(converted)
        out.append((arrays[0], arrays[1]))
    return out


def _checksum(tensors: dict[str, Any]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for key in sorted(tensors):
        digest.update(key.encode())
        digest.update(tensors[key].tobytes())
    return digest.hexdigest()


def _tensors(layers: HostLayers) -> dict[str, Any]:
    tensors = {}
    for i, (keys, values) in enumerate(layers):
        tensors[f"k{i}"] = keys
        tensors[f"v{i}"] = values
    return tensors


def write_block(directory: Path, name: bytes, block: HostBlock) -> int:
    """Write one block's file atomically; returns its size in bytes."""
    from safetensors.numpy import save_file

    layers, dtypes = block
    tensors = _tensors(layers)
    metadata = {
        "format": FORMAT,
        "name": name.hex(),
        "tokens": str(BLOCK_TOKENS),
        "dtypes": json.dumps(dtypes),
        "checksum": _checksum(tensors),
    }
    final = directory / file_name(name)
    partial = final.with_suffix(f".{threading.get_ident()}.partial")
    try:
        save_file(tensors, str(partial), metadata=metadata)
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    return final.stat().st_size


class DamagedBlock(ValueError):
    """A block file that is not what its name says: never to be served."""


def read_block(directory: Path, name: bytes) -> HostBlock:
    """One block's arrays. Raises :class:`DamagedBlock` for a truncated,
    corrupt or foreign file, ``OSError`` when it cannot be read (or is gone)."""
    from safetensors import SafetensorError, safe_open

    path = directory / file_name(name)
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        layers = [(tensors[f"k{i}"], tensors[f"v{i}"]) for i in range(len(tensors) // 2)]
        dtypes = json.loads(metadata["dtypes"])
    except (SafetensorError, KeyError, ValueError, TypeError) as exc:
        raise DamagedBlock(str(exc)) from exc
    except Exception as exc:
        if not path.exists():
            raise FileNotFoundError(path) from exc
        if "header" in str(exc).lower() or "deserializ" in str(exc).lower():
            raise DamagedBlock(str(exc)) from exc
        raise
    if (
        metadata.get("format") != FORMAT
        or metadata.get("name") != name.hex()
        or metadata.get("checksum") != _checksum(tensors)
        or len(dtypes) != len(tensors)
        or any(k.shape[2] != BLOCK_TOKENS for k, _ in layers)
    ):
        raise DamagedBlock("checksum or metadata mismatch")
    return layers, dtypes


@dataclass
class ReadResult:
    blocks: list[HostBlock]  # read and verified, in order
    failed: bytes | None = None  # the block that stopped the read
    damaged: bool = False  # ...because its file is damaged (it was deleted)
    gone: bool = False  # ...because its file is not there (evicted meanwhile)


def read_blocks(directory: Path, names: tuple[bytes, ...]) -> ReadResult:
    """The blocks ``names`` in order, up to the first that cannot be read. A
    damaged file is deleted; one that cannot be read for now (or is gone) is
    left as it is. Blocking: run it on a worker thread."""
    result = ReadResult([])
    for name in names:
        try:
            result.blocks.append(read_block(directory, name))
        except DamagedBlock as exc:
            log.warning("ignoring damaged KV block file %s: %s", file_name(name), exc)
            (directory / file_name(name)).unlink(missing_ok=True)
            result.failed, result.damaged = name, True
            break
        except FileNotFoundError:
            result.failed, result.gone = name, True
            break
        except Exception as exc:  # the disk failed, for now: the file stays listed
            log.warning("could not read KV block file %s: %s", file_name(name), exc)
            result.failed = name
            break
    return result


def open_tier(base: Path, fingerprint: str, model: str) -> tuple[Path, list[tuple[bytes, int]]]:
    """This model's block directory under ``base`` and the blocks already in
    it (see :func:`scan`). Directories an earlier run of the same model left
    under another fingerprint (its weights changed since) are removed: their
    blocks can never be used again. Blocking."""
    directory = base / fingerprint[:16]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / OWNER).write_text(json.dumps({"model": model}))
    for other in base.iterdir():
        if other != directory and _owner(other) == model:
            log.info("removing KV blocks of an earlier version of %s: %s", model, other.name)
            shutil.rmtree(other, ignore_errors=True)
    return directory, scan(directory)


def _owner(directory: Path) -> str | None:
    try:
        return str(json.loads((directory / OWNER).read_text())["model"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def scan(directory: Path) -> list[tuple[bytes, int]]:
    """Block files already in ``directory`` as (name, size), oldest first;
    leftovers of interrupted writes are removed. Blocking."""
    directory.mkdir(parents=True, exist_ok=True)
    found = []
    for entry in os.scandir(directory):
        if entry.name.endswith(".partial"):
            Path(entry.path).unlink(missing_ok=True)
            continue
        if not entry.name.endswith(SUFFIX):
            continue
        try:
            name = bytes.fromhex(entry.name.removesuffix(SUFFIX))
            stat = entry.stat()
        except (ValueError, OSError):
            continue
        found.append((stat.st_mtime, name, stat.st_size))
    found.sort()
    return [(name, size) for _, name, size in found]


@dataclass
class _Job:
    name: bytes
    block: HostBlock | None  # None: delete the file
    nbytes: int = 0


class DiskWriter:
    """A thread that writes and deletes block files in queue order; ``written``
    is called on that thread with each (name, file size) it completed, or
    (name, None) for one it could not write."""

    def __init__(self, directory: Path, written: Callable[[bytes, int | None], None]) -> None:
        self.directory = directory
        self._written = written
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._thread = threading.Thread(target=self._run, name="mlxtrio-kv-disk", daemon=True)
        self._thread.start()

    def write(self, name: bytes, block: HostBlock) -> None:
        nbytes = sum(k.nbytes + v.nbytes for k, v in block[0])
        with self._lock:
            self._pending_bytes += nbytes
        self._jobs.put(_Job(name, block, nbytes))

    def has_room(self) -> bool:
        """False while the disk is behind by :data:`MAX_PENDING_BYTES`: new
        blocks are then not spilled (they stay in memory only)."""
        with self._lock:
            return self._pending_bytes < MAX_PENDING_BYTES

    def delete(self, names: list[bytes]) -> None:
        for name in names:
            self._jobs.put(_Job(name, None))

    def close(self, timeout: float = 5.0) -> None:
        """Finish queued jobs (for at most ``timeout`` seconds) and stop."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if job.block is None:
                    (self.directory / file_name(job.name)).unlink(missing_ok=True)
                    continue
                size = write_block(self.directory, job.name, job.block)
                self._written(job.name, size)
            except Exception:  # a full or failing disk loses spills, nothing else
                log.exception("could not write KV block file %s", file_name(job.name))
                self._written(job.name, None)
            finally:
                with self._lock:
                    self._pending_bytes -= job.nbytes
