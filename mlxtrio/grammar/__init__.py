"""Grammars that hold generation to a required form, for the grammar engine
(llguidance): tool calls in each family's markup with arguments that match the
tool's JSON Schema, structured outputs, and custom tools' Lark grammars.

Nothing here imports MLX. :mod:`.build` writes grammars as text, :mod:`.compiler`
compiles them off the Trio thread into matchers the engine thread copies per
sequence (:mod:`mlxtrio.engine.grammar` applies them as logits processors).
"""
