"""Reading a lazily loaded model's weights into memory, in slices that a
load's progress can count (engine thread: it evaluates MLX arrays)."""

from __future__ import annotations

from typing import Any, cast

from .types import LoadProgress

READ_GRAIN = 64 << 20  # bytes of weights read between two progress updates


def read_weights(model: Any, progress: LoadProgress | None = None) -> None:
    """Evaluate every weight of ``model``, :data:`READ_GRAIN` bytes at a time,
    counting them in ``progress``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = [value for _, value in cast(list[tuple[str, Any]], tree_flatten(model.parameters()))]
    progress = progress or LoadProgress()
    progress.total_bytes = sum(int(w.nbytes) for w in weights)
    batch: list[Any] = []
    size = 0
    for weight in weights:
        batch.append(weight)
        size += int(weight.nbytes)
        if size >= READ_GRAIN:
            mx.eval(*batch)
            progress.done_bytes += size
            batch, size = [], 0
    mx.eval(*batch)
    progress.done_bytes = progress.total_bytes
