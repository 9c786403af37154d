"""Model names, aliases and the engines behind them."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping

from .engine import Engine


class UnknownModel(LookupError):
    def __init__(self, name: str, available: list[str]) -> None:
        super().__init__(f'Model "{name}" not found. Available models: {", ".join(available)}')
        self.name = name


class ModelRegistry:
    """Resolves a requested model name to its engine.

    Order: an exact model name, an exact alias, then alias patterns (``claude-*``,
    ``*``) in the order they were configured.
    """

    def __init__(self, aliases: Mapping[str, str] | None = None) -> None:
        self._engines: dict[str, Engine] = {}
        self.aliases = dict(aliases or {})

    def add(self, engine: Engine) -> None:
        self._engines[engine.name] = engine

    def __iter__(self) -> Iterator[Engine]:
        return iter(self._engines.values())

    def __len__(self) -> int:
        return len(self._engines)

    @property
    def default(self) -> Engine:
        return next(iter(self._engines.values()))

    def names(self) -> list[str]:
        return list(self._engines)

    def resolve(self, name: str) -> Engine:
        if name in self._engines:
            return self._engines[name]
        target = self.aliases.get(name)
        if target is None:
            for pattern, candidate in self.aliases.items():
                if any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(name, pattern):
                    target = candidate
                    break
        if target is not None and target in self._engines:
            return self._engines[target]
        raise UnknownModel(
            name, self.names() + [a for a in self.aliases if not any(c in a for c in "*?[")]
        )
