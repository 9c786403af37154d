"""Putting a function of ours in place of one that mlx-lm's and mlx-vlm's
model modules imported by name (engine thread, when a model loads).

A model module calls, say, ``scaled_dot_product_attention`` through the name
it imported, so the stand-in replaces that name in every model module loaded
so far. :func:`install` tags each stand-in with the function it replaces
(``replaces``; the stand-in calls it for what it does not handle itself), so
installing is idempotent.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

_MODEL_PACKAGES = ("mlx_lm.models.", "mlx_vlm.models.")


def install(name: str, homes: tuple[str, ...], wrap: Callable[[Any], Any]) -> int:
    """Put ``wrap(original)`` in place of ``name`` in every loaded model
    module that took it from one of ``homes`` (module names, e.g.
    ``mlx_lm.models.base``); returns how many modules hold the stand-in
    (``homes`` that are model modules included)."""
    originals = _originals(name, homes)
    installed = 0
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(_MODEL_PACKAGES):
            continue
        current = getattr(module, name, None)
        if getattr(current, "replaces", None) in originals:
            installed += 1
        elif current is not None and any(current is f for f in originals):
            replacement = wrap(current)
            replacement.replaces = current
            setattr(module, name, replacement)
            installed += 1
    return installed


def _originals(name: str, homes: tuple[str, ...]) -> list[Any]:
    found = []
    for home in homes:
        module = sys.modules.get(home)
        function = getattr(module, name, None) if module is not None else None
        found.append(getattr(function, "replaces", function))
    return [function for function in found if function is not None]
