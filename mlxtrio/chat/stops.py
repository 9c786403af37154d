"""Stop sequences matched on visible text, across delta boundaries.

:class:`StopScanner` releases text as soon as it cannot be the start of a stop
sequence and holds back only the longest tail that still could be. After a match
it releases nothing more.
"""

from __future__ import annotations


class StopScanner:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s and s.strip()]
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Feed text; return what is safe to show now."""
        if self.matched is not None or not text:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        first: tuple[int, str] | None = None
        for stop in self.stops:
            at = buffer.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            self.matched = first[1]
            self._held = ""
            return buffer[: first[0]]
        keep = self._partial_tail(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """End of text: what was held back was not a stop after all."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best
