"""A radix tree over token sequences: longest-prefix lookups in time linear in
the prompt, cheap enough to run on the Trio thread.

Edges hold runs of tokens, so a lookup compares whole runs with list-slice
equality (C speed) and only binary-searches inside the one edge where the
prompt leaves the tree. mlx-lm's ``PromptTrie`` copies the path at every node
it visits, which made one lookup against a 33k-token entry take 2.5 s.

Pure Python, no MLX. Not thread-safe: one owner (the Trio thread).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(eq=False)
class _Node(Generic[V]):
    edge: list[int]  # the tokens from the parent to this node
    parent: _Node[V] | None = None
    children: dict[int, _Node[V]] = field(default_factory=dict)  # by first edge token
    value: V | None = None
    values_below: int = 0  # values in this subtree, this node's own included


@dataclass
class PrefixMatch(Generic[V]):
    """What a lookup found for a query.

    ``on_path``: ``(length, value)`` for every stored sequence that is a prefix
    of the query, shortest first. ``common``: the longest common prefix of the
    query with any stored sequence. ``below``: one value whose sequence starts
    with those ``common`` tokens (None when nothing is stored past the root).
    """

    on_path: list[tuple[int, V]]
    common: int
    below: V | None


class RadixTree(Generic[V]):
    """Maps token sequences to values."""

    def __init__(self) -> None:
        self._root: _Node[V] = _Node([])
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def get(self, tokens: list[int]) -> V | None:
        node = self._find(tokens)
        return node.value if node is not None else None

    def insert(self, tokens: list[int], value: V) -> V | None:
        """Store ``value`` under ``tokens``; returns the value it replaced."""
        node = self._root
        depth = 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = _Node(tokens[depth:], node)
                node.children[tokens[depth]] = leaf
                node = leaf
                break
            shared = _shared_length(child.edge, tokens, depth)
            if shared < len(child.edge):
                child = self._split(child, shared)
            node, depth = child, depth + shared
        old, node.value = node.value, value
        if old is None:
            self._size += 1
            self._count(node, +1)
        return old

    def remove(self, tokens: list[int]) -> V | None:
        """Forget ``tokens``; returns its value, or None if it was not stored."""
        node = self._find(tokens)
        if node is None or node.value is None:
            return None
        old, node.value = node.value, None
        self._size -= 1
        self._count(node, -1)
        self._prune(node)
        return old

    def match(self, tokens: list[int]) -> PrefixMatch[V]:
        """Walk ``tokens`` down the tree (see :class:`PrefixMatch`)."""
        on_path: list[tuple[int, V]] = []
        node, depth = self._root, 0
        while True:
            if node.value is not None and depth:
                on_path.append((depth, node.value))
            if depth == len(tokens):
                return PrefixMatch(on_path, depth, _any_value(node))
            child = node.children.get(tokens[depth])
            if child is None:
                return PrefixMatch(on_path, depth, _any_value(node) if depth else None)
            shared = _shared_length(child.edge, tokens, depth)
            if shared < len(child.edge):
                return PrefixMatch(on_path, depth + shared, _any_value(child))
            node, depth = child, depth + shared

    def values(self) -> Iterator[V]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.value is not None:
                yield node.value
            stack.extend(node.children.values())

    # -- internals --------------------------------------------------------------

    def _find(self, tokens: list[int]) -> _Node[V] | None:
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None or tokens[depth : depth + len(child.edge)] != child.edge:
                return None
            node, depth = child, depth + len(child.edge)
        return node

    def _split(self, child: _Node[V], at: int) -> _Node[V]:
        """Insert a node ``at`` tokens into ``child``'s edge; returns it."""
        parent = child.parent
        assert parent is not None
        middle = _Node(child.edge[:at], parent, values_below=child.values_below)
        parent.children[middle.edge[0]] = middle
        child.edge = child.edge[at:]
        child.parent = middle
        middle.children[child.edge[0]] = child
        return middle

    @staticmethod
    def _count(node: _Node[V] | None, delta: int) -> None:
        while node is not None:
            node.values_below += delta
            node = node.parent

    @staticmethod
    def _prune(node: _Node[V]) -> None:
        """Drop empty leaves and merge a valueless node into its only child."""
        while node.parent is not None and node.value is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node.parent is not None and node.value is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[child.edge[0]] = child


def _any_value(node: _Node[V]) -> V | None:
    """A value stored at ``node`` or below it (descends one branch)."""
    current: _Node[V] | None = node
    while current is not None and current.value is None:
        current = next((c for c in current.children.values() if c.values_below), None)
    return current.value if current is not None else None


def _shared_length(edge: list[int], tokens: list[int], start: int) -> int:
    """How many leading tokens of ``edge`` equal ``tokens[start:]`` (binary search
    over slice comparisons: linear work, done in C)."""
    high = min(len(edge), len(tokens) - start)
    if edge[:high] == tokens[start : start + high]:
        return high
    low = 0  # edge[:low] is known to match
    while low < high - 1:
        mid = (low + high) // 2
        if edge[low:mid] == tokens[start + low : start + mid]:
            low = mid
        else:
            high = mid
    return low


def common_prefix_length(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``."""
    return _shared_length(a[:limit], b, 0)
