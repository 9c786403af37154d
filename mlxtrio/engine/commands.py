"""What the Trio side asks of the engine thread, and the wire form that carries
the same requests to the other ranks of a distributed model.

The Trio side puts commands on the engine's queue; the engine thread applies
them at the safepoint between two steps. A command is *frozen* as the engine
takes it off the queue: anything it reads of Trio-side state (whether a
submitted handle was cancelled before it could start) is read once, then, so
that every rank of a distributed model applies the very same decision (see
:mod:`.distributed.lockstep`).

The wire form is JSON: every field is plain data (token ids, sampling
parameters, a grammar's source text, prefix-cache entry ids), so a rank never
unpickles what another sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .handle import GenerationHandle
from .types import Entry, GrammarConstraint, Match, SamplingParams, TextConstraint


@dataclass(frozen=True)
class Submit:
    """Start ``handle``'s sequence. ``withdrawn``: it was cancelled (or ended)
    before the engine took the command; it only gets its terminal event."""

    handle: GenerationHandle
    withdrawn: bool = False


@dataclass(frozen=True)
class Cancel:
    """Drop ``handle``'s sequence, keeping what it prefilled in the cache."""

    handle: GenerationHandle


@dataclass(frozen=True)
class Share:
    """Another request waits for ``handle``'s KV: snapshot it once it holds
    ``at`` tokens (see :mod:`.cache.reuse`)."""

    handle: GenerationHandle
    at: int


@dataclass(frozen=True)
class Drop:
    """The prefix index evicted these snapshots."""

    entry_ids: tuple[int, ...]


@dataclass(frozen=True)
class ForgetDisk:
    """These block files are gone or unreadable."""

    names: tuple[bytes, ...]


@dataclass(frozen=True)
class Shutdown:
    """End the engine loop (running sequences end cancelled)."""


Command = Submit | Cancel | Share | Drop | ForgetDisk | Shutdown


def freeze(command: Command) -> Command:
    """``command`` with the Trio-side state it depends on read now."""
    if isinstance(command, Submit):
        handle = command.handle
        return Submit(handle, withdrawn=handle.done or handle.cancel_requested)
    return command


# -- the wire form -------------------------------------------------------------


class WireError(ValueError):
    """A command batch this rank cannot read (the ranks run different code)."""


def encode(commands: Iterable[Command]) -> bytes:
    """The batch as compact JSON; handles are named by their serial number."""
    return json.dumps([_encode(c) for c in commands], separators=(",", ":")).encode()


def _encode(command: Command) -> dict[str, Any]:
    if isinstance(command, Submit):
        handle = command.handle
        match = handle.match
        if match is not None and match.disk:
            raise WireError("a distributed engine reads no KV blocks from disk")
        return {
            "op": "submit",
            "id": handle.serial,
            "withdrawn": command.withdrawn,
            "prompt": handle.prompt,
            "sampling": _encode_sampling(handle.sampling),
            "key": list(handle.cache_key) if handle.cache_key else None,  # type: ignore[call-overload]
            "boundary": handle.boundary,
            "match": None
            if match is None
            else {"entry": match.entry.id if match.entry else None, "length": match.length},
        }
    if isinstance(command, Cancel):
        return {"op": "cancel", "id": command.handle.serial}
    if isinstance(command, Share):
        return {"op": "share", "id": command.handle.serial, "at": command.at}
    if isinstance(command, Drop):
        return {"op": "drop", "entries": list(command.entry_ids)}
    if isinstance(command, ForgetDisk):
        return {"op": "forget_disk", "names": [name.hex() for name in command.names]}
    return {"op": "shutdown"}


def _encode_sampling(params: SamplingParams) -> dict[str, Any]:
    values = {f.name: getattr(params, f.name) for f in fields(params) if f.name != "constraints"}
    values["stop_token_ids"] = list(params.stop_token_ids)
    values["constraints"] = [_encode_constraint(c) for c in params.constraints]
    return values


def _encode_constraint(constraint: TextConstraint | GrammarConstraint) -> dict[str, Any]:
    if isinstance(constraint, TextConstraint):
        return {"text": {**asdict(constraint), "openings": list(constraint.openings)}}
    if not constraint.source:
        raise WireError("a grammar constraint without its source cannot reach other ranks")
    return {
        "grammar": {
            "source": constraint.source,
            "after": constraint.after,
            "repeat": constraint.repeat,
        }
    }


def decode(
    payload: bytes,
    handles: dict[int, GenerationHandle],
    compile_grammar: Callable[[str], Any],
) -> list[Command]:
    """The batch another rank :func:`encode`\\ d. ``handles`` maps serial numbers
    to this rank's handles: submits add theirs, the other commands name one
    (a command for a handle this rank no longer has is left out: its sequence
    has ended here too). ``compile_grammar`` turns a grammar's source into
    the compiled grammar this rank's processors copy."""
    try:
        items = json.loads(payload)
        return [c for c in (_decode(item, handles, compile_grammar) for item in items) if c]
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"unreadable command batch: {exc}") from exc


def _decode(
    item: dict[str, Any],
    handles: dict[int, GenerationHandle],
    compile_grammar: Callable[[str], Any],
) -> Command | None:
    op = item["op"]
    if op == "submit":
        handle = _remote_handle(item, compile_grammar)
        handles[handle.serial] = handle
        return Submit(handle, withdrawn=bool(item["withdrawn"]))
    if op in ("cancel", "share"):
        found = handles.get(int(item["id"]))
        if found is None:
            return None
        return Cancel(found) if op == "cancel" else Share(found, int(item["at"]))
    if op == "drop":
        return Drop(tuple(int(i) for i in item["entries"]))
    if op == "forget_disk":
        return ForgetDisk(tuple(bytes.fromhex(n) for n in item["names"]))
    if op == "shutdown":
        return Shutdown()
    raise ValueError(f"unknown command {op!r}")


def _remote_handle(item: dict[str, Any], compile_grammar: Callable[[str], Any]) -> GenerationHandle:
    """This rank's copy of a handle submitted on rank 0: the same prompt,
    sampling and cache match; nobody reads its events."""
    key = tuple(item["key"]) if item["key"] is not None else None
    match = None
    if item["match"] is not None:
        entry_id = item["match"]["entry"]
        entry = None if entry_id is None else Entry(int(entry_id), key, [], 0, True)
        match = Match(entry, int(item["match"]["length"]))
    handle = GenerationHandle(
        list(item["prompt"]),
        _decode_sampling(item["sampling"], compile_grammar),
        _no_cancel,
        key,
        match,
    )
    handle.serial = int(item["id"])
    handle.boundary = int(item["boundary"])
    return handle


def _decode_sampling(
    values: dict[str, Any], compile_grammar: Callable[[str], Any]
) -> SamplingParams:
    constraints: list[TextConstraint | GrammarConstraint] = []
    for spec in values.pop("constraints"):
        if "text" in spec:
            text = spec["text"]
            constraints.append(
                TextConstraint(tuple(text["openings"]), text["after"], bool(text["repeat"]))
            )
        else:
            grammar = spec["grammar"]
            constraints.append(
                GrammarConstraint(
                    compile_grammar(grammar["source"]),
                    grammar["after"],
                    bool(grammar["repeat"]),
                    source=grammar["source"],
                )
            )
    params = SamplingParams(**values)
    return replace(
        params, stop_token_ids=tuple(params.stop_token_ids), constraints=tuple(constraints)
    )


def _no_cancel(handle: GenerationHandle) -> None:
    """Other ranks cancel only on rank 0's word."""
