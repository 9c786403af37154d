"""The published wire schemas, as a test helper: validate what the server sends
against both OpenAPI documents in ``tests/spec/schemas`` (see its README;
``$MLXTRIO_SPEC_DIR`` points elsewhere) - Open Responses (strict clients, conformance tools) and OpenAI's own
(the official SDKs).

Both documents are OpenAPI 3.1, so ``components.schemas`` are JSON Schema
2020-12: each document is registered with ``referencing`` under a URN and an
object is validated against ``{"$ref": "<urn>#/components/schemas/<Name>"}``.
Streaming events are looked up by their ``type`` in :data:`EVENT_SCHEMAS`; a type
without a schema is a test failure, unless :data:`UNDEFINED_EVENTS` records that
the document genuinely does not define that event. Open Responses has function
tools only: what it has no words for (custom tools and their calls, hosted and
namespace tools) is left out of what is checked against it
(:func:`open_responses_view`) and checked against the OpenAI document in full.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_DIR = Path(os.environ.get("MLXTRIO_SPEC_DIR", Path(__file__).parent / "spec")) / "schemas"

OPEN_RESPONSES = "openresponses"
OPENAI = "openai"
DOCUMENTS = {
    OPEN_RESPONSES: "openresponses-openapi.json",
    OPENAI: "openai-openapi.json",
}

# Streaming event ``type`` -> schema name, per document. Every event type the
# server emits on /v1/responses must be here (or in UNDEFINED_EVENTS).
EVENT_SCHEMAS: dict[str, dict[str, str]] = {
    OPEN_RESPONSES: {
        "response.created": "ResponseCreatedStreamingEvent",
        "response.queued": "ResponseQueuedStreamingEvent",
        "response.in_progress": "ResponseInProgressStreamingEvent",
        "response.completed": "ResponseCompletedStreamingEvent",
        "response.incomplete": "ResponseIncompleteStreamingEvent",
        "response.failed": "ResponseFailedStreamingEvent",
        "response.output_item.added": "ResponseOutputItemAddedStreamingEvent",
        "response.output_item.done": "ResponseOutputItemDoneStreamingEvent",
        "response.content_part.added": "ResponseContentPartAddedStreamingEvent",
        "response.content_part.done": "ResponseContentPartDoneStreamingEvent",
        "response.output_text.delta": "ResponseOutputTextDeltaStreamingEvent",
        "response.output_text.done": "ResponseOutputTextDoneStreamingEvent",
        "response.refusal.delta": "ResponseRefusalDeltaStreamingEvent",
        "response.refusal.done": "ResponseRefusalDoneStreamingEvent",
        "response.reasoning.delta": "ResponseReasoningDeltaStreamingEvent",
        "response.reasoning.done": "ResponseReasoningDoneStreamingEvent",
        "response.reasoning_summary_part.added": "ResponseReasoningSummaryPartAddedStreamingEvent",
        "response.reasoning_summary_part.done": "ResponseReasoningSummaryPartDoneStreamingEvent",
        "response.reasoning_summary_text.delta": "ResponseReasoningSummaryDeltaStreamingEvent",
        "response.reasoning_summary_text.done": "ResponseReasoningSummaryDoneStreamingEvent",
        "response.function_call_arguments.delta": (
            "ResponseFunctionCallArgumentsDeltaStreamingEvent"
        ),
        "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneStreamingEvent",
        "error": "ErrorStreamingEvent",
    },
    OPENAI: {
        "response.created": "ResponseCreatedEvent",
        "response.queued": "ResponseQueuedEvent",
        "response.in_progress": "ResponseInProgressEvent",
        "response.completed": "ResponseCompletedEvent",
        "response.incomplete": "ResponseIncompleteEvent",
        "response.failed": "ResponseFailedEvent",
        "response.output_item.added": "ResponseOutputItemAddedEvent",
        "response.output_item.done": "ResponseOutputItemDoneEvent",
        "response.content_part.added": "ResponseContentPartAddedEvent",
        "response.content_part.done": "ResponseContentPartDoneEvent",
        "response.output_text.delta": "ResponseTextDeltaEvent",
        "response.output_text.done": "ResponseTextDoneEvent",
        "response.refusal.delta": "ResponseRefusalDeltaEvent",
        "response.refusal.done": "ResponseRefusalDoneEvent",
        "response.reasoning_text.delta": "ResponseReasoningTextDeltaEvent",
        "response.reasoning_text.done": "ResponseReasoningTextDoneEvent",
        "response.reasoning_summary_part.added": "ResponseReasoningSummaryPartAddedEvent",
        "response.reasoning_summary_part.done": "ResponseReasoningSummaryPartDoneEvent",
        "response.reasoning_summary_text.delta": "ResponseReasoningSummaryTextDeltaEvent",
        "response.reasoning_summary_text.done": "ResponseReasoningSummaryTextDoneEvent",
        "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
        "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
        "response.custom_tool_call_input.delta": "ResponseCustomToolCallInputDeltaEvent",
        "response.custom_tool_call_input.done": "ResponseCustomToolCallInputDoneEvent",
        "error": "ResponseErrorEvent",
    },
}

# Events a document does not define at all (checked: no schema in it has that
# ``type``), so there is nothing to validate them against there.
UNDEFINED_EVENTS: dict[str, frozenset[str]] = {
    # Open Responses 2026-04-24 has function tools only: no custom (freeform)
    # tools, no custom_tool_call items, no events for their input.
    OPEN_RESPONSES: frozenset(
        {"response.custom_tool_call_input.delta", "response.custom_tool_call_input.done"}
    ),
    OPENAI: frozenset(),
}

# What Open Responses has no vocabulary for, so that it cannot be validated
# there (its ``Tool`` is ``FunctionTool`` only, its ``ItemField`` has no
# ``custom_tool_call``): left out of what is checked against it. The official
# API wins: the server sends them as OpenAI does, and they are checked against
# the OpenAI document in full.
OPEN_RESPONSES_TOOLS = frozenset({"function"})
OPEN_RESPONSES_TOOL_CHOICES = frozenset({"function", "allowed_tools"})
OUTSIDE_OPEN_RESPONSES_ITEMS = frozenset({"custom_tool_call"})


def open_responses_view(response: dict[str, Any]) -> dict[str, Any]:
    """``response`` without what Open Responses cannot express (see above)."""
    view = dict(response)
    if isinstance(view.get("output"), list):
        view["output"] = [
            item
            for item in view["output"]
            if not (isinstance(item, dict) and item.get("type") in OUTSIDE_OPEN_RESPONSES_ITEMS)
        ]
    if isinstance(view.get("tools"), list):
        view["tools"] = [
            tool
            for tool in view["tools"]
            if isinstance(tool, dict) and tool.get("type") in OPEN_RESPONSES_TOOLS
        ]
    choice = view.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") not in OPEN_RESPONSES_TOOL_CHOICES:
        view["tool_choice"] = "required"  # a named custom tool: a call is required
    return view


# Object schemas, per document (None: the document does not define one).
RESPONSE = {OPEN_RESPONSES: "ResponseResource", OPENAI: "Response"}
# Open Responses defines neither GET /responses/{id}/input_items nor DELETE;
# OpenAI documents no body for its DELETE (a bare 200), so there is no deleted
# object schema in either document.
INPUT_ITEMS = {OPEN_RESPONSES: None, OPENAI: "ResponseItemList"}
ERROR_BODY = {OPEN_RESPONSES: "ErrorPayload", OPENAI: "ErrorResponse"}


@dataclass(frozen=True)
class Problem:
    document: str
    schema: str
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.document}#{self.schema} at {self.path or '/'}: {self.message}"


class Schemas:
    """Both documents, registered once; validators are cached per schema."""

    def __init__(self, directory: Path) -> None:
        import referencing
        from referencing.jsonschema import DRAFT202012

        resources = []
        self.documents: dict[str, dict[str, Any]] = {}
        for key, file in DOCUMENTS.items():
            document = _nullable_as_null(json.loads((directory / file).read_text()))
            self.documents[key] = document
            resources.append((f"urn:{key}", DRAFT202012.create_resource(document)))
        self.registry = referencing.Registry().with_resources(resources)

    def has(self, document: str, name: str) -> bool:
        return name in self.documents[document]["components"]["schemas"]

    @functools.cache  # noqa: B019 - one instance per session
    def validator(self, document: str, name: str) -> Any:
        import jsonschema

        if not self.has(document, name):
            raise KeyError(f"{DOCUMENTS[document]} defines no schema {name!r}")
        return jsonschema.Draft202012Validator(
            {"$ref": f"urn:{document}#/components/schemas/{name}"}, registry=self.registry
        )

    def problems(self, document: str, name: str, instance: Any) -> list[Problem]:
        errors = self.validator(document, name).iter_errors(instance)
        return [
            Problem(document, name, "/".join(map(str, e.absolute_path)), _explain(e))
            for e in errors
        ]

    def check(self, names: dict[str, str | None], instance: Any) -> list[Problem]:
        """``instance`` against the schema each document names (``None``: skip)."""
        out = []
        for document, name in names.items():
            if name is not None:
                out.extend(self.problems(document, name, instance))
        return out

    def check_response(self, response: Any) -> list[Problem]:
        """A Response object against both documents (Open Responses: its view)."""
        return self.problems(OPENAI, RESPONSE[OPENAI], response) + self.problems(
            OPEN_RESPONSES, RESPONSE[OPEN_RESPONSES], _view(response)
        )

    def check_event(self, event: dict[str, Any]) -> list[Problem]:
        """A streaming event against its schema in both documents; an event type
        a document does not map (and does not list as undefined) is a problem."""
        kind = event.get("type")
        out = []
        for document in DOCUMENTS:
            name = EVENT_SCHEMAS[document].get(str(kind))
            if name is None:
                if kind not in UNDEFINED_EVENTS[document]:
                    out.append(Problem(document, "?", "type", f"no schema for event {kind!r}"))
                continue
            instance = event
            if document == OPEN_RESPONSES:
                item = event.get("item")
                if isinstance(item, dict) and item.get("type") in OUTSIDE_OPEN_RESPONSES_ITEMS:
                    continue
                if "response" in event:
                    instance = {**event, "response": _view(event["response"])}
            out.extend(self.problems(document, name, instance))
        return out


def _nullable_as_null(node: Any) -> Any:
    """The documents are OpenAPI 3.1, but some schemas (OpenAI's chat
    completion chunks: ``finish_reason``, ``logprobs``) still say
    ``nullable: true`` in 3.0's words, which JSON Schema ignores: read it as
    the document means it, null allowed."""
    if isinstance(node, list):
        return [_nullable_as_null(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable_as_null(value) for key, value in node.items()}
    if node.get("nullable") is True:
        if isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
        if isinstance(node.get("enum"), list) and None not in node["enum"]:
            node["enum"] = [*node["enum"], None]
    return node


def _view(response: Any) -> Any:
    return open_responses_view(response) if isinstance(response, dict) else response


def _explain(error: Any) -> str:
    """The message, plus the deepest sub-errors of a oneOf/anyOf (which branch failed)."""
    if not error.context:
        return str(error.message)[:300]
    best = sorted(error.context, key=lambda e: -len(e.absolute_path))[:4]
    inner = "; ".join(f"[{'/'.join(map(str, e.absolute_path))}] {e.message[:160]}" for e in best)
    return f"{error.message[:160]} <- {inner}"


@functools.cache
def load() -> Schemas:
    """The session's :class:`Schemas`; skips the test without the documents."""
    return Schemas(SCHEMA_DIR)
