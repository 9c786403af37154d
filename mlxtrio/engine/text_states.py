"""mlx-lm's text state machine, for the output parser on the Trio side
(:mod:`mlxtrio.chat.output`).

The machine itself is pure Python - it splits detokenized text at a model
family's markers and touches no array - but ``mlx_lm.generate`` imports MLX,
so the import is written here, under ``engine/`` with every other MLX import
(the import contracts in ``pyproject.toml`` check it).
"""

from mlx_lm.generate import TextStateMachine, make_text_state_machine

__all__ = ["TextStateMachine", "make_text_state_machine"]
