"""What a turn's output must look like, for the grammar engine (llguidance):
tool calls in each family's markup with arguments that match the tool's JSON
Schema, structured outputs, and custom tools' Lark grammars.

:mod:`.planning` decides a turn's constraints from its conversation and a few
facts of the model (raising :class:`~.planning.ConstraintError`, which the
serving layer answers with a 400); :mod:`.build` writes grammars as text;
:mod:`.compiler` compiles them off the Trio thread into matchers the engine
thread copies per sequence (:mod:`mlxtrio.engine.processors.grammar_masks`
applies them); :mod:`.shapes` says how each family's calls begin;
:mod:`.custom_tools` and :mod:`.lark_regex` turn freeform tools' grammars into
constraints. Nothing here imports MLX.
"""
