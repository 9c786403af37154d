"""A Lark grammar without recursion, as one regular expression.

Custom tools (Codex's ``apply_patch``) describe their input with a Lark
grammar, but the model writes that input as a JSON string argument of a call,
escaped. The grammar engine constrains a JSON string by a regular expression
over its decoded value (JSON Schema ``pattern``), not by a grammar, so a
grammar without recursion is inlined into one: the language is the same. The
grammar is read with Lark's own grammar loader (so ``%import common.X`` and
Lark's syntax work as in Lark); a recursive rule, a template or a feature with
no regular equivalent raises :class:`GrammarNotRegular`.
"""

from __future__ import annotations

import ast
import functools
import re
from typing import Any


class GrammarNotRegular(ValueError):
    """The grammar cannot be written as one regular expression."""


# Characters with a meaning in the regex syntax of the grammar engine (Rust's
# regex crate, as in JSON Schema patterns): escaped in literals.
_META = set("\\.+*?()|[]{}^$#&-~")
_FLAGS = set("imsx")


# Only Lark's own grammar library may be imported: an import of anything else
# would make the server read files of its own choosing.
_IMPORT = re.compile(r"^\s*%import\s+([\w.]+)", re.MULTILINE)


@functools.lru_cache(maxsize=64)
def lark_to_regex(definition: str, start: str = "start") -> str:
    """The regular expression (anchored at both ends) of the language of the
    Lark grammar ``definition`` from rule ``start`` (cached: Codex sends the
    same grammar with every request). Raises :class:`GrammarNotRegular`, or
    ValueError for a grammar Lark cannot read."""
    from lark.exceptions import LarkError
    from lark.load_grammar import GrammarBuilder

    for module in _IMPORT.findall(definition):
        if not module.startswith("common."):
            raise GrammarNotRegular(f"%import {module}: only common.* can be imported")
    builder = GrammarBuilder()
    try:
        builder.load_grammar(definition)
        grammar = builder.build()
    except (LarkError, OSError) as exc:
        raise ValueError(f"not a valid Lark grammar: {exc}") from None
    if grammar.ignore:
        raise GrammarNotRegular(f"%ignore {', '.join(grammar.ignore)} has no regular form here")
    rules = {}
    for name, params, tree, _options in grammar.rule_defs:
        if params:
            raise GrammarNotRegular(f"rule {name!s} is a template")
        rules[str(name)] = tree
    terminals = {str(name): tree for name, (tree, _priority) in grammar.term_defs}
    if start not in rules:
        raise ValueError(f"the grammar has no {start!r} rule")
    return "^(?:" + _Inliner(rules, terminals).symbol(start, rule=True) + ")$"


class _Inliner:
    def __init__(self, rules: dict[str, Any], terminals: dict[str, Any]) -> None:
        self.rules, self.terminals = rules, terminals
        self.done: dict[str, str] = {}
        self.open: list[str] = []  # the symbols being inlined (a cycle is recursion)

    def symbol(self, name: str, rule: bool) -> str:
        if name in self.done:
            return self.done[name]
        if name in self.open:
            raise GrammarNotRegular(f"{' -> '.join([*self.open, name])} is recursive")
        table = self.rules if rule else self.terminals
        if name not in table:
            raise ValueError(f"the grammar uses {name} but does not define it")
        self.open.append(name)
        regex = self.tree(table[name])
        self.open.pop()
        self.done[name] = regex
        return regex

    def tree(self, node: Any) -> str:
        from lark import Token, Tree
        from lark.grammar import NonTerminal, Terminal

        if isinstance(node, NonTerminal):
            return "(?:" + self.symbol(node.name, rule=True) + ")"
        if isinstance(node, Terminal):
            return "(?:" + self.symbol(node.name, rule=False) + ")"
        if isinstance(node, Token):
            return _token(node)
        if not isinstance(node, Tree):
            raise GrammarNotRegular(f"unexpected grammar element {node!r}")
        kind, children = str(node.data), node.children
        if kind == "expansions":
            alternatives = [self.tree(child) for child in children]
            return (
                alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"
            )
        if kind == "expansion":
            return "".join(self.tree(child) for child in children)
        if kind in ("value", "literal"):
            return "".join(self.tree(child) for child in children)
        if kind == "alias":  # `expansion -> name`: the name only labels the tree
            return self.tree(children[0])
        if kind == "maybe":  # [ ... ]
            return "(?:" + self.tree(children[0]) + ")?"
        if kind == "expr":
            return self._repeat(children)
        if kind == "range":  # "a".."z"
            low, high = (ast.literal_eval(str(c)) for c in children)
            return "[" + _char(low) + "-" + _char(high) + "]"
        raise GrammarNotRegular(f"the grammar uses {kind!r}, which has no regular form")

    def _repeat(self, children: list[Any]) -> str:
        inner = "(?:" + self.tree(children[0]) + ")"
        op = str(children[1])
        if op in ("+", "*", "?"):
            return inner + op
        if op == "~":  # item ~ n or item ~ n..m
            bounds = [str(c) for c in children[2:]]
            return inner + "{" + ",".join(bounds) + "}"
        raise GrammarNotRegular(f"unknown operator {op!r}")


def _token(token: Any) -> str:
    text = str(token)
    if token.type == "STRING":
        flags = ""
        if not text.endswith('"'):
            text, flags = text.rstrip("i"), "i"
        literal = "".join(_char(c) for c in ast.literal_eval(text))
        return f"(?i:{literal})" if flags else literal
    if token.type == "REGEXP":
        body, _, flags = text[1:].rpartition("/")
        if set(flags) - _FLAGS:
            raise GrammarNotRegular(f"regex flags {flags!r} are not supported")
        # A terminal may be used twice: group names would clash.
        body = _NAMED_GROUP.sub("(?:", body)
        # With x, a trailing comment would swallow the closing parenthesis.
        return (
            f"(?{flags}:{body}\n)"
            if "x" in flags
            else f"(?{flags}:{body})"
            if flags
            else f"(?:{body})"
        )
    raise GrammarNotRegular(f"unexpected token {text!r}")


_NAMED_GROUP = re.compile(r"\(\?P?<(?![=!])[^>]*>")


def _char(c: str) -> str:
    if c in _META:
        return "\\" + c
    if c == "\n":
        return "\\n"
    if c == "\t":
        return "\\t"
    if c == "\r":
        return "\\r"
    if ord(c) < 0x20 or ord(c) == 0x7F:
        return f"\\x{{{ord(c):x}}}"
    return c


def llguidance_reads(definition: str) -> bool:
    """Whether the grammar engine's own Lark dialect reads ``definition``
    (it has extensions Python's Lark lacks: ``%json``, special tokens, ...)."""
    from llguidance import LLMatcher

    return not LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(definition))
