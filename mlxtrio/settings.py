"""One settings object for the whole server.

Values come from, in rising priority: the defaults below, ``MLXTRIO_*`` environment
variables, then explicit overrides (CLI flags). Every field is documented in the
README's settings table; keep the two in step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EMBEDDED_MODEL_NAME = "mlxtrio-tiny"
EMBEDDED_MODEL_PATH = Path(__file__).parent / "assets" / "tiny-chat"

ENV_PREFIX = "MLXTRIO_"
COMPUTE_DTYPES = ("auto", "model", "float32", "bfloat16", "float16")
SHARDINGS = ("auto", "tensor", "pipeline")
SPECULATION_MODES = ("auto", "on", "off")


def physical_memory() -> int:
    """Bytes of RAM (8 GiB when the platform will not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class SettingsError(ValueError):
    """A setting has a value that cannot be used; the message names it."""


@dataclass(frozen=True)
class Settings:
    # Models. ``model`` is a local path or a hub id; empty means the embedded model.
    model: str = ""
    model_name: str = ""  # public name; defaults to the path's last part
    extra_models: tuple[str, ...] = ()  # more models, each "name=path" or "path"
    # alias -> served model name; "*" catches any unknown name (Claude Code sends
    # claude-* names for background work).
    aliases: Mapping[str, str] = field(default_factory=dict)
    # Models on demand: every subdirectory of models_dir holding an mlx-lm
    # model is served under its directory's name (and so is every model in the
    # local Hugging Face cache); a model loads on the first request naming it.
    models_dir: str = ""
    max_loaded_models: int = 0  # loaded at once; 0 = the memory budget alone decides
    keep_alive_seconds: float = 300.0  # idle time before a model is unloaded; 0 = never
    # Per model: name=seconds, comma-separated (overrides keep_alive_seconds).
    model_keep_alive: Mapping[str, str] = field(default_factory=dict)
    pinned_models: tuple[str, ...] = ()  # never unloaded

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = field(default="", repr=False)  # secrets stay out of reprs and logs
    # Browser origins allowed to call the server (comma-separated, fnmatch
    # patterns such as http://localhost:*, or *). Empty: no CORS at all, and
    # requests that carry any Origin are refused.
    cors_origins: str = ""
    # Extra Host names accepted on a loopback address (a reverse proxy that
    # keeps the public name); loopback names always are. * turns the check off.
    allowed_hosts: str = ""

    # Admission: running sequences per model (0 = auto: as many as fit a
    # quarter of memory at 8k tokens of KV each, 4 to 16; see engine/sizing.py),
    # and how many may wait for a slot.
    capacity: int = 0
    waiting_room: int = 16

    # One memory budget across the served models: the weights as loaded plus
    # the KV that admitted requests can reach (prompt + output cap) must fit
    # in it; the prefix caches live in what is left and shrink first. 0 =
    # auto (three quarters of physical memory).
    memory_limit_bytes: int = 0
    # Prefix KV cache budget per model in bytes: -1 = auto (20 % of physical
    # memory, at most 16 GiB), 0 = off.
    prefix_cache_bytes: int = -1
    # Its disk tier per model, in data_dir/kv-cache (survives restarts): -1 =
    # auto (a quarter of the free space there at start, at most 32 GiB), 0 = off.
    prefix_cache_disk_bytes: int = -1
    # Context served per model, in tokens: 0 = the model's own; a smaller value
    # bounds prompt + output (less KV memory; clients compact sooner).
    context_length: int = 0
    default_max_tokens: int = 4096  # clamped to max_output_tokens
    max_output_tokens: int = 32768
    # Prefill is paced by time: each engine step prefills for about
    # prefill_step_seconds (running streams wait that long for their next token,
    # and a hang-up is noticed within it), in chunks of at most prefill_chunk tokens.
    prefill_chunk: int = 2048
    prefill_step_seconds: float = 0.25
    # Floating-point type to compute in: auto = float32 on a CPU with a fast BLAS
    # (several times faster prefill there), else the checkpoint's own; "model"
    # always keeps the checkpoint's; or float32 / bfloat16 / float16.
    compute_dtype: str = "auto"
    # A model served across ranks (python -m mlxtrio serve under mlx.launch):
    # how mlx-lm shards it (auto = tensor parallel where the model supports
    # it, else pipeline), and how long a lock-step round may go unanswered
    # before the world is given up and the server exits.
    sharding: str = "auto"
    rank_timeout: float = 60.0
    # Speculative decoding (drafts from the conversation itself, verified
    # several tokens per step): auto = where it measures faster on this
    # machine, on = whenever there is a draft (benchmarks), off.
    speculation: str = "auto"

    # Images in requests (checked before anything else; 400 naming the block):
    # decoded bytes, pixels on a side, total pixels (decompression bombs), and
    # how many per request. Remote http(s) image URLs are fetched only when
    # fetch_image_urls is on: a server must not fetch what a prompt names.
    image_max_bytes: int = 5 << 20
    image_max_side: int = 8000
    image_max_pixels: int = 32 << 20
    images_per_request: int = 100
    fetch_image_urls: bool = False

    sse_keepalive: float = 10.0
    sse_drain_timeout: float = 30.0
    max_body_bytes: int = 10 * 1024 * 1024
    shutdown_grace: float = 5.0

    # Response store: "" = SQLite file in data_dir, "none" = no store, or any
    # SQLAlchemy URL (postgresql://... uses psycopg 3).
    database_url: str = field(default="", repr=False)
    data_dir: str = ""  # default: the platform's user data dir for mlxtrio
    response_retention: int = 7 * 24 * 3600
    store_timeout: float = 5.0  # any store call (reads, deletes, start-up)
    store_write_timeout: float = 5.0
    store_sweep_interval: float = 300.0
    log_level: str = "info"

    def keep_alive(self, model: str) -> float:
        """Seconds ``model`` may stay idle before it is unloaded (0: never)."""
        return float(self.model_keep_alive.get(model, self.keep_alive_seconds))

    @property
    def model_path(self) -> str:
        return self.model or str(EMBEDDED_MODEL_PATH)

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if not self.model:
            return EMBEDDED_MODEL_NAME
        return self.model.rstrip("/").split("/")[-1]

    @property
    def prefix_cache_budget(self) -> int:
        if self.prefix_cache_bytes >= 0:
            return self.prefix_cache_bytes
        return min(physical_memory() // 5, 16 << 30)

    @property
    def prefix_cache_disk_budget(self) -> int:
        if self.prefix_cache_disk_bytes >= 0:
            return self.prefix_cache_disk_bytes
        import shutil

        place = self.data_path
        while not place.exists() and place != place.parent:
            place = place.parent
        try:
            free = shutil.disk_usage(place).free
        except OSError:
            return 0
        return min(free // 4, 32 << 30)

    @property
    def kv_cache_path(self) -> Path:
        return self.data_path / "kv-cache"

    @property
    def data_path(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        from platformdirs import user_data_dir

        return Path(user_data_dir("mlxtrio", appauthor=False))

    @property
    def store_url(self) -> str | None:
        if self.database_url.lower() == "none":
            return None
        return self.database_url or f"sqlite:///{self.data_path / 'responses.db'}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults, then ``MLXTRIO_*`` variables, then ``overrides`` (None skipped)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = _parse(f.name, f.type, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.capacity < 0:
            raise SettingsError(f"capacity must be 0 (auto) or more (got {self.capacity})")
        positive = (
            "default_max_tokens",
            "max_output_tokens",
            "prefill_chunk",
            "image_max_bytes",
            "image_max_side",
            "image_max_pixels",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise SettingsError(
                f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)} "
                f"(got {self.compute_dtype!r})"
            )
        if self.speculation not in SPECULATION_MODES:
            raise SettingsError(
                f"speculation must be one of {', '.join(SPECULATION_MODES)} "
                f"(got {self.speculation!r})"
            )
        if self.sharding not in SHARDINGS:
            raise SettingsError(
                f"sharding must be one of {', '.join(SHARDINGS)} (got {self.sharding!r})"
            )
        if self.rank_timeout < 2:
            # Rank 0 exchanges with idle ranks every second: less would give up
            # on a world that is merely idle.
            raise SettingsError(
                f"rank_timeout must be at least 2 seconds (got {self.rank_timeout})"
            )
        if self.max_loaded_models < 0:
            raise SettingsError(
                f"max_loaded_models must be 0 (no limit) or more (got {self.max_loaded_models})"
            )
        if self.keep_alive_seconds < 0:
            raise SettingsError(
                f"keep_alive_seconds must be 0 (never) or more (got {self.keep_alive_seconds})"
            )
        for name, seconds in self.model_keep_alive.items():
            try:
                float(seconds)
            except ValueError:
                raise SettingsError(
                    f"model_keep_alive: {name}={seconds!r} is not a number of seconds"
                ) from None
        if self.memory_limit_bytes < 0:
            raise SettingsError(
                f"memory_limit_bytes must be 0 (auto) or more (got {self.memory_limit_bytes})"
            )
        if self.images_per_request < 0:
            raise SettingsError(
                f"images_per_request must be 0 or more (got {self.images_per_request})"
            )
        if self.waiting_room < 0:
            raise SettingsError(f"waiting_room must be 0 or more (got {self.waiting_room})")
        if not 0 < self.port < 65536:
            raise SettingsError(f"port must be in 1..65535 (got {self.port})")
        if not 60 <= self.response_retention <= 7776000:
            raise SettingsError("response_retention must be within [60, 7776000] seconds")
        for name in (
            "prefill_step_seconds",
            "sse_keepalive",
            "sse_drain_timeout",
            "shutdown_grace",
            "store_timeout",
            "store_write_timeout",
            "store_sweep_interval",
        ):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name} must be positive")


def parse_aliases(text: str, what: str = "aliases", form: str = "alias=model") -> dict[str, str]:
    """``"a=b,claude-*=mlxtrio-tiny"`` -> ``{"a": "b", "claude-*": "mlxtrio-tiny"}``."""
    aliases: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        alias, sep, target = item.partition("=")
        if not sep or not alias.strip() or not target.strip():
            raise SettingsError(f"{what}: {item!r} is not of the form {form}")
        aliases[alias.strip()] = target.strip()
    return aliases


def parse_setting(name: str, kind: Any, raw: str) -> Any:
    """``raw`` (an environment variable's or a flag's text) as setting ``name``'s type."""
    return _parse(name, kind, raw)


def _parse(name: str, kind: Any, raw: str) -> Any:
    kind = str(kind)
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            return _boolean(raw)
        if kind.startswith("tuple"):
            return tuple(p.strip() for p in raw.split(",") if p.strip())
        if kind.startswith("Mapping"):
            return parse_aliases(raw, name, "alias=model" if name == "aliases" else "name=value")
    except ValueError as exc:
        raise SettingsError(f"{ENV_PREFIX}{name.upper()}={raw!r}: {exc}") from None
    return raw


def _boolean(raw: str) -> bool:
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected on/off (1, true, yes, on or 0, false, no, off)")
