"""What a turn's output must look like, decided before it is generated.

:func:`plan_output` turns a conversation's tools, ``tool_choice`` and
structured-output request into the constraints the engine enforces (see
:mod:`mlxtrio.engine.types`): grammars that hold tool calls and structured
outputs, openings that force a call, masks that forbid one. It knows the model
only by :class:`OutputFacts`, and reports what the request asks that cannot be
held to as a :class:`ConstraintError` (the API layer answers it with a 400
before any stream starts).

Grammars compile off the Trio thread, cached (:mod:`.compiler`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..chat.conversation import Conversation, OutputFormat, ToolSpec
from ..engine.model import LoadedModel
from ..engine.types import GrammarConstraint, TextConstraint
from .build import ANY_OBJECT, ToolGrammar, output_grammar
from .calls import CALL_GRAMMARS, CallVocabulary, call_grammar
from .compiler import GrammarCompiler, GrammarError
from .harmony import channel_grammar, turn_grammar
from .shapes import CallShape, call_shape, tool_family

log = logging.getLogger("mlxtrio.grammar")

Constraint = TextConstraint | GrammarConstraint


class ConstraintError(ValueError):
    """The request asks for an output form this model cannot be held to;
    ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class OutputFacts:
    """What planning needs to know of a loaded model."""

    model: str  # its public name, for messages
    tokenizer: Any  # mlx-lm's TokenizerWrapper: markers, tool parser, EOS
    grammars: GrammarCompiler | None  # None: the grammar engine cannot read it
    call_token: int | None = None  # the tool-call start marker, when one token
    call_end_token: int | None = None  # the closing marker, when one token
    call_mask_token: int | None = None  # masking it forbids calls (and nothing else)
    think_start_token: int | None = None  # the reasoning opener, when one token
    harmony: dict[str, int] | None = None  # a Harmony model's marker ids
    added_tokens: Mapping[str, int] = field(default_factory=dict)  # by text

    @property
    def reasons(self) -> bool:
        return bool(getattr(self.tokenizer, "has_thinking", False))

    @classmethod
    def of(cls, model: str, loaded: LoadedModel, grammars: GrammarCompiler | None) -> OutputFacts:
        return cls(
            model=model,
            tokenizer=loaded.tokenizer,
            grammars=grammars,
            call_token=loaded.tool_call_token,
            call_end_token=loaded.tool_call_end_token,
            call_mask_token=loaded.tool_call_mask_token,
            think_start_token=_single(getattr(loaded.tokenizer, "think_start_tokens", None)),
            harmony=loaded.harmony,
            added_tokens=loaded.added_tokens,
        )

    @property
    def calls_tools(self) -> bool:
        return bool(getattr(self.tokenizer, "has_tool_calling", False))


@dataclass(frozen=True)
class OutputPlan:
    """The constraints, tokens that end the turn like EOS does (a call marker
    that cannot be masked, where calls are not allowed), and a reasoning
    budget the plan imposes (reasoning nobody asked for, opened by the
    template itself)."""

    constraints: tuple[Constraint, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    reasoning_budget: int | None = None


# Reasoning a request did not ask for, where the model's own template opens it
# in the prompt: bounded, so that it cannot run to the output cap.
UNASKED_REASONING_BUDGET = 512


def forbid(token: int) -> TextConstraint:
    """A constraint that ``token`` is never generated: after it, the output
    would have to go on with one of no openings. Used for the tool-call marker
    when no tool is offered, so that a model drawn to call one answers instead
    (a call of no offered tool could only be dropped)."""
    return TextConstraint((), after=token, repeat=True)


async def plan_output(
    facts: OutputFacts, conversation: Conversation, starts_in_reasoning: bool
) -> OutputPlan:
    """What the output must look like: reasoning only when asked (see
    :func:`_unasked_reasoning`), tool calls (:func:`_tool_calls`) and
    structured output. ``starts_in_reasoning``: the rendered prompt opened the
    reasoning block, so the answer's constraints start after it. Raises
    :class:`ConstraintError`."""
    if facts.harmony is not None:
        return OutputPlan(await _harmony(facts, conversation))
    calls = (
        _no_calls(facts)
        if not conversation.calls_allowed
        else await _calls_and_format(facts, conversation, starts_in_reasoning)
    )
    reasoning = _unasked_reasoning(facts, conversation, starts_in_reasoning)
    return OutputPlan(
        (*reasoning.constraints, *calls.constraints),
        calls.stop_token_ids,
        reasoning.reasoning_budget,
    )


async def _calls_and_format(
    facts: OutputFacts, conversation: Conversation, starts_in_reasoning: bool
) -> OutputPlan:
    constraints = list(await _tool_calls(facts, conversation, starts_in_reasoning))
    wanted = conversation.output_format
    if wanted is not None and _required_tools(facts, conversation) is None:
        # (A required call is the answer: the format has nothing to hold.)
        constraints.append(
            await _structured_output(facts, conversation, starts_in_reasoning, wanted)
        )
    return OutputPlan(tuple(constraints))


def _unasked_reasoning(
    facts: OutputFacts, conversation: Conversation, starts_in_reasoning: bool
) -> OutputPlan:
    """With reasoning off, the reasoning opener is masked like the tool-call
    marker (a model that opens it unasked may never close it, and think until
    the output cap). A template that opens the reasoning in the prompt itself
    keeps its reasoning, under :data:`UNASKED_REASONING_BUDGET`."""
    if conversation.thinking or not facts.reasons:
        return OutputPlan()
    if starts_in_reasoning:
        return OutputPlan(reasoning_budget=UNASKED_REASONING_BUDGET)
    if facts.think_start_token is None:
        return OutputPlan()
    return OutputPlan((forbid(facts.think_start_token),))


async def _harmony(facts: OutputFacts, conversation: Conversation) -> tuple[Constraint, ...]:
    """A Harmony model's messages: one grammar armed at every ``<|channel|>``
    (:mod:`.harmony`), holding calls to the offered tools and their
    schemas, a required call, a structured answer."""
    ids = facts.harmony
    grammars = facts.grammars
    assert ids is not None
    wanted = conversation.output_format
    if grammars is None:
        if wanted is not None:
            raise ConstraintError(
                f"model {facts.model!r} cannot be constrained to a format (the grammar engine "
                "cannot read its tokenizer)",
                wanted.param,
            )
        return ()
    required = _required_tools(facts, conversation) if conversation.calls_allowed else None
    offered = conversation.tools if conversation.calls_allowed else []
    callable_tools = [t for t in offered if required is None or t.name in required]
    tools = [await _tool_grammar(grammars, tool) for tool in callable_tools]
    output = None
    if wanted is not None and required is None:
        if wanted.schema is not None:
            error = await grammars.check_schema(wanted.schema, wanted.strict)
            if error:
                raise ConstraintError(f"the schema cannot be enforced: {error}", wanted.param)
        output = (wanted.schema, wanted.strict)
    whole_turn = required is not None or output is not None
    text = (
        turn_grammar(ids, tools, required=required is not None, output=output)
        if whole_turn
        else channel_grammar(ids, tools)
    )
    try:
        matcher = await grammars.matcher(text)
    except GrammarError as exc:
        raise ConstraintError(f"the output cannot be constrained: {exc}", "tools") from None
    if whole_turn:
        return (GrammarConstraint(matcher, source=text),)
    return (GrammarConstraint(matcher, after=ids["<|channel|>"], repeat=True, source=text),)


def _no_calls(facts: OutputFacts) -> OutputPlan:
    """Tools are shown but may not be called (a summary): the marker is
    masked, or, where it cannot be, it ends the turn."""
    if facts.call_mask_token is not None:
        return OutputPlan((forbid(facts.call_mask_token),))
    if facts.call_token is not None:
        return OutputPlan(stop_token_ids=(facts.call_token,))
    return OutputPlan()


def _required_tools(facts: OutputFacts, conversation: Conversation) -> list[str] | None:
    """The tools one of which ``tool_choice`` obliges the model to call, or
    None when it need not (or cannot: no tool calling, or the named tool is
    not offered)."""
    requirement = conversation.required_tool
    offered = list(dict.fromkeys(tool.name for tool in conversation.tools))
    if requirement is None or not offered or not facts.calls_tools:
        return None
    if requirement.name is None:
        return offered
    return [requirement.name] if requirement.name in offered else None


async def _tool_calls(
    facts: OutputFacts, conversation: Conversation, starts_in_reasoning: bool
) -> tuple[Constraint, ...]:
    """What the model's tool calls must look like.

    With no tool offered (none given, or ``tool_choice`` none) the tool-call
    marker is masked where it is a token of its own: a call could only be
    dropped, leaving an empty answer. With tools, every call the model opens
    is held to its family's markup for an offered tool: in a family with a
    call grammar (:data:`~mlxtrio.grammar.calls.CALL_GRAMMARS`) the whole call,
    arguments matching the tool's schema, up to its closing marker; in the
    others its opening (:data:`~mlxtrio.grammar.shapes.CALL_SHAPES`). The
    model picks among the offered names by its own logits. When
    ``tool_choice`` requires a call, the output must also open one (after its
    reasoning, when the prompt starts inside it). Nothing is constrained for
    models without tool calling.
    """
    if not facts.calls_tools:
        return ()
    if not conversation.tools:
        mask = facts.call_mask_token
        return (forbid(mask),) if mask is not None else ()
    offered = list(dict.fromkeys(tool.name for tool in conversation.tools))
    required = _required_tools(facts, conversation)
    # A grammar names only the tools a call may name: the required ones.
    callable_tools = [t for t in conversation.tools if t.name in (required or offered)]
    body = await _call_grammar(facts, callable_tools)
    shape = None if body is not None else call_shape(facts.tokenizer.tool_parser)
    constraints: list[Constraint] = []
    if body is not None:
        constraints.append(body)
    elif shape is not None and facts.call_token is not None:
        constraints.append(
            TextConstraint(shape.openings(offered), after=facts.call_token, repeat=True)
        )
    if required is None:
        return tuple(constraints)
    # With a grammar, the required opening is the marker alone.
    return (*constraints, _required_call(facts.tokenizer, shape, required, starts_in_reasoning))


async def _call_grammar(facts: OutputFacts, tools: list[ToolSpec]) -> GrammarConstraint | None:
    """The grammar every call's body follows (naming one of ``tools``), or
    None when the model's family has none (or it cannot be constrained)."""
    grammars = facts.grammars
    family = tool_family(facts.tokenizer.tool_parser)
    if grammars is None or facts.call_token is None or family not in CALL_GRAMMARS:
        return None
    wanted = [await _tool_grammar(grammars, tool) for tool in tools]
    eos = tuple(sorted(getattr(facts.tokenizer, "eos_token_ids", None) or ()))
    vocab = CallVocabulary(facts.call_end_token, eos, facts.added_tokens)
    text = call_grammar(family, wanted, vocab)
    if text is None:
        return None
    try:
        matcher = await grammars.matcher(text)
    except GrammarError as exc:  # each schema passed on its own: not expected
        log.warning("tool calls are not constrained: their grammar failed: %s", exc)
        return None
    return GrammarConstraint(matcher, after=facts.call_token, repeat=True, source=text)


async def _tool_grammar(grammars: GrammarCompiler, tool: ToolSpec) -> ToolGrammar:
    """``tool`` as its calls are constrained. A strict tool's schema must be
    one the grammar engine holds to exactly (a :class:`ConstraintError`
    otherwise); any other tool's keywords it does not implement are ignored,
    and a schema it cannot read at all leaves the arguments any JSON object."""
    schema = tool.arguments_schema
    error = await grammars.check_schema(schema, tool.strict)
    if error and tool.strict:
        raise ConstraintError(
            f'tool "{tool.name}" is strict, but its schema cannot be enforced: {error}', "tools"
        )
    if error:
        log.info("tool %r: arguments held to any JSON object: %s", tool.name, error)
        return ToolGrammar(tool.name, ANY_OBJECT)
    return ToolGrammar(tool.name, schema, tool.strict)


async def _structured_output(
    facts: OutputFacts,
    conversation: Conversation,
    starts_in_reasoning: bool,
    wanted: OutputFormat,
) -> GrammarConstraint:
    """The answer is JSON matching the requested schema, then the end of the
    turn; a tool call may come instead when tools are offered. Reasoning stays
    free: the grammar starts once it closes, when the prompt opened it."""
    grammars = facts.grammars
    if grammars is None:
        raise ConstraintError(
            f"model {facts.model!r} cannot be constrained to a format (the grammar engine "
            "cannot read its tokenizer)",
            wanted.param,
        )
    schema = wanted.schema
    if schema is not None:
        error = await grammars.check_schema(schema, wanted.strict)
        if error:
            raise ConstraintError(f"the schema cannot be enforced: {error}", wanted.param)
    tokenizer = facts.tokenizer
    marker = facts.call_token if conversation.tools else None
    after = _reasoning_end(tokenizer, starts_in_reasoning)
    text = output_grammar(
        schema, wanted.strict, sorted(tokenizer.eos_token_ids), marker, after is not None
    )
    try:
        matcher = await grammars.matcher(text)
    except GrammarError as exc:
        raise ConstraintError(f"the schema cannot be enforced: {exc}", wanted.param) from None
    return GrammarConstraint(matcher, after=after, source=text)


def _required_call(
    tokenizer: Any, shape: CallShape | None, allowed: list[str], starts_in_reasoning: bool
) -> TextConstraint:
    """The output opens a call of one of ``allowed`` (just the start marker when
    a grammar holds the call's body, or for a family of unknown shape): from
    the first token, or after the reasoning when the prompt opened it."""
    bodies = shape.openings(allowed, canonical=True) if shape is not None else ("",)
    openings = [tokenizer.tool_call_start + body for body in bodies]
    after = _reasoning_end(tokenizer, starts_in_reasoning)
    if after is not None:  # what templates put between </think> and the answer
        openings = ["\n\n" + text for text in openings]
    return TextConstraint(tuple(openings), after)


def _reasoning_end(tokenizer: Any, starts_in_reasoning: bool) -> int | None:
    """The token that closes the reasoning the prompt opened, after which the
    answer's constraints start; None when the output starts with the answer
    (or the closing marker is not one token)."""
    ends: list[int] = list(tokenizer.think_end_tokens or ())
    return ends[0] if starts_in_reasoning and len(ends) == 1 else None


def _single(tokens: object) -> int | None:
    """The one token of a marker spelled as one token, else None."""
    ids = list(tokens) if isinstance(tokens, list | tuple) else []
    return int(ids[0]) if len(ids) == 1 else None
