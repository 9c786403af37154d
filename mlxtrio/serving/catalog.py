"""Which models this server can serve: found on disk at start, loaded on demand.

Three places, first name wins:

* ``--model`` (the embedded model when none is given) and ``EXTRA_MODELS``
  (``name=path`` or a path), as before;
* ``models_dir``: each subdirectory holding an mlx-lm model (a ``config.json``
  and safetensors weights), named by the directory's name;
* the local Hugging Face cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``): each repository's snapshot that holds a
  ``config.json`` and safetensors, named ``owner/name`` as on the Hub.

Nothing is downloaded and nothing is loaded here: a listing and a few small
JSON files per model.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..settings import Settings

log = logging.getLogger("mlxtrio.models")


@dataclass(frozen=True)
class ModelSpec:
    """A servable model, as found on disk."""

    name: str
    path: str
    source: str  # "model" (--model / EXTRA_MODELS), "models_dir" or "hf_cache"
    size_bytes: int = 0  # its weight files on disk
    context: int | None = None  # max_position_embeddings, when the config says
    family: str | None = None  # the config's model_type
    # Half-precision weights, not quantised: float32 on a CPU with a fast BLAS.
    upcast_on_cpu: bool = False

    def wire(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "source": self.source,
            "size_bytes": self.size_bytes,
            "family": self.family,
        }


def discover(settings: Settings) -> list[ModelSpec]:
    """Every model the settings name or the places above hold, by name."""
    found: dict[str, ModelSpec] = {}
    for name, path in configured(settings):
        found.setdefault(name, describe(name, path, "model"))
    if settings.models_dir:
        for name, directory in _models_dir(Path(settings.models_dir).expanduser()):
            found.setdefault(name, describe(name, str(directory), "models_dir"))
    for name, directory in _hf_cache():
        found.setdefault(name, describe(name, str(directory), "hf_cache"))
    return list(found.values())


def configured(settings: Settings) -> list[tuple[str, str]]:
    """(public name, path) for the main model and each extra model."""
    specs = [(settings.served_model_name, settings.model_path)]
    for item in settings.extra_models:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = item.rstrip("/").split("/")[-1], item
        specs.append((name.strip(), path.strip()))
    return specs


def describe(name: str, path: str, source: str) -> ModelSpec:
    """``path``'s size on disk, context and family, where it can tell."""
    directory = _local_directory(path)
    if directory is None:
        return ModelSpec(name, path, source)
    config = _config(directory)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    context = config.get("max_position_embeddings") or (text or {}).get("max_position_embeddings")
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors") if f.exists())
    family = config.get("model_type")
    half = "quantization" not in config and _stored_dtype(directory) in ("BF16", "F16")
    return ModelSpec(
        name,
        path,
        source,
        size,
        int(context) if isinstance(context, int) else None,
        str(family) if family else None,
        half,
    )


def is_model_directory(directory: Path) -> bool:
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def _models_dir(base: Path) -> list[tuple[str, Path]]:
    try:
        entries = sorted(base.iterdir())
    except OSError as exc:
        log.warning("models_dir %s cannot be listed: %s", base, exc)
        return []
    return [
        (entry.name, entry) for entry in entries if entry.is_dir() and is_model_directory(entry)
    ]


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME")
    base = Path(home).expanduser() if home else Path("~/.cache/huggingface").expanduser()
    return base / "hub"


def _hf_cache() -> list[tuple[str, Path]]:
    """``owner/name`` and the snapshot ``refs/main`` points at (else the newest)."""
    base = hf_cache_dir()
    try:
        repos = sorted(base.glob("models--*"))
    except OSError:
        return []
    found = []
    for repo in repos:
        snapshot = _snapshot(repo)
        if snapshot is not None and is_model_directory(snapshot):
            found.append(("/".join(repo.name.split("--")[1:]), snapshot))
    return found


def _snapshot(repo: Path) -> Path | None:
    try:
        main = repo / "snapshots" / (repo / "refs" / "main").read_text().strip()
        if main.is_dir():
            return main
    except OSError:
        pass
    try:
        snapshots = sorted((repo / "snapshots").iterdir(), key=lambda p: p.stat().st_mtime)
    except OSError:
        return None
    return snapshots[-1] if snapshots else None


def _local_directory(path: str) -> Path | None:
    """The directory a model path names: a local directory, or a hub id
    found in the local cache."""
    directory = Path(path).expanduser()
    if directory.is_dir():
        return directory
    if path.count("/") == 1 and not path.startswith(("/", ".", "~")):
        snapshot = _snapshot(hf_cache_dir() / ("models--" + path.replace("/", "--")))
        return snapshot if snapshot is not None and snapshot.is_dir() else None
    return None


def _stored_dtype(directory: Path) -> str | None:
    """The type most of the weights are stored in, from the first weight
    file's header (safetensors: an 8-byte length, then JSON)."""
    for weights in sorted(directory.glob("*.safetensors")):
        try:
            with weights.open("rb") as f:
                length = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(min(length, 64 << 20)))
        except (OSError, ValueError):
            return None
        kinds = [v.get("dtype") for k, v in header.items() if k != "__metadata__"]
        return max(set(kinds), key=kinds.count) if kinds else None
    return None


def _config(directory: Path) -> dict[str, Any]:
    try:
        loaded = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}
