"""OpenAI's Harmony format (gpt-oss), read from the model's own special tokens.

A Harmony assistant turn is a sequence of messages, each
``<|start|>assistant<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>TEXT<|end|>``
(the first one's ``<|start|>assistant`` is the end of the prompt):
``analysis`` is reasoning, ``commentary`` with a ``functions.NAME`` recipient
is a tool call (the recipient may also stand before the channel, in the role),
``final`` and a recipient-less ``commentary`` (a preamble) are visible text.
A call ends the turn with ``<|call|>``, the answer with ``<|return|>``.

mlx-lm loads gpt-oss weights but knows nothing of the format, so a model is
taken for Harmony when its config says ``gpt_oss`` or its vocabulary holds
Harmony's markers as special tokens (fine-tunes keep them), and its tokenizer
is rewrapped (:func:`harmony_tokenizer`) with what the output parser
(:mod:`mlxtrio.chat.output`) reads: a response format for mlx-lm's text state
machine (header -> reasoning / text / tool call), the call's start and end
markers, and :func:`parse_tool_call`. ``<|call|>``, ``<|return|>`` and
``<|endoftext|>`` end generation; ``<|end|>`` never does (it only closes one
message). The ``openai-harmony`` package is not used: it needs OpenAI's
vocabulary file, which it downloads, and parses that vocabulary's ids only.

Pure Python (the tokenizer wrapper is mlx-lm's); built when the model loads.
"""

from __future__ import annotations

import json
import re
from typing import Any

# The markers a Harmony vocabulary holds as special tokens.
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>")
OPTIONAL_MARKERS = ("<|constrain|>", "<|endoftext|>")
STOPS = ("<|call|>", "<|return|>", "<|endoftext|>")

CALL_START = "to=functions."
CALL_END = "<|call|>"  # a stop token: never in the text, the call ends with the turn

# How the text state machine reads a Harmony turn (the prompt ends with
# "<|start|>assistant": output starts in a message header).
_HEADERS = [
    ("<|channel|>analysis<|message|>", "reasoning"),
    ("<|channel|>final<|message|>", "normal"),
    ("<|channel|>final <|constrain|>json<|message|>", "normal"),
    ("<|channel|>final json<|message|>", "normal"),
    ("<|channel|>commentary<|message|>", "normal"),  # a preamble
    (CALL_START, "tool"),  # the recipient, before or after the channel
]
# Inside a message's text a model may skip ahead to the next message without
# closing this one: ``<|start|>`` begins its header, ``<|channel|>`` its
# channel (the "channel" state reads the rest of a header). Markers that
# belong nowhere in text are dropped, never shown.
_LEAVING = [("<|end|>", "header"), ("<|start|>", "header"), ("<|channel|>", "channel")]
STRAY_MARKERS = ("<|message|>", "<|constrain|>", "<|startoftext|>", "<|endofprompt|>")
RESPONSE_FORMAT: dict[str, Any] = {
    "initial_state": "header",
    "transitions": {
        "header": _HEADERS,
        "channel": [(m.removeprefix("<|channel|>"), state) for m, state in _HEADERS],
        **{
            state: [*_LEAVING, *((m, state) for m in STRAY_MARKERS)]
            for state in ("reasoning", "normal")
        },
    },
}

_CALL = re.compile(r"^(?P<name>[^\s<]+)(?P<header>.*?)<\|message\|>(?P<arguments>.*)$", re.S)


def is_harmony(config: dict[str, Any], tokenizer: Any) -> bool:
    """Whether the model writes Harmony: gpt-oss, or a vocabulary whose
    special tokens include every Harmony marker."""
    if config.get("model_type") == "gpt_oss":
        return True
    return marker_ids(tokenizer) is not None


def marker_ids(tokenizer: Any) -> dict[str, int] | None:
    """Each Harmony marker's token id, or None when one of them is not a
    token of its own in the vocabulary."""
    added: dict[str, int] = getattr(tokenizer, "get_added_vocab", dict)()
    if not all(marker in added for marker in MARKERS):
        return None
    return {m: added[m] for m in (*MARKERS, *OPTIONAL_MARKERS) if m in added}


def harmony_tokenizer(wrapper: Any) -> Any:
    """``wrapper`` (mlx-lm's ``TokenizerWrapper``) rebuilt to read Harmony:
    its response format, the call markers and parser, and Harmony's stop
    tokens among its end-of-sequence tokens."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    ids = marker_ids(wrapper) or {}
    eos = set(wrapper.eos_token_ids) | {ids[m] for m in STOPS if m in ids}
    eos.discard(ids.get("<|end|>", -1))
    return TokenizerWrapper(
        wrapper._tokenizer,
        detokenizer_class=type(wrapper._detokenizer),
        eos_token_ids=sorted(eos),
        chat_template=getattr(wrapper, "_chat_template", None),
        tool_call_start=CALL_START,
        tool_call_end=CALL_END,
        tool_parser=parse_tool_call,
        response_format=RESPONSE_FORMAT,
    )


def parse_tool_call(text: str, tools: Any = None) -> dict[str, Any]:
    """One call, as the output parser collects it after ``to=functions.``:
    ``NAME <|constrain|>json<|message|>{ARGS}`` (recipient after the channel)
    or ``NAME<|channel|>commentary json<|message|>{ARGS}`` (before it).
    Raises ValueError for anything else."""
    found = _CALL.match(text.strip())
    if found is None:
        raise ValueError(f"not a Harmony call: {text[:80]!r}")
    arguments = found["arguments"].strip()
    return {"name": found["name"], "arguments": json.loads(arguments) if arguments else {}}
