"""Building blocks of the request models: JSON-typed scalars with their official
ranges, and tagged unions whose members are picked by one field.

Request models are strict (a boolean is not a number, ``"0.5"`` is not a number,
a number is not a string) but keep every field a client sends: newer clients send
newer fields, and what we do not read is still echoed or stored as given.

Union members are tagged ``~key:value`` (see :func:`variant`). pydantic puts the
tag in the location of every error inside a member; the ``~`` marks it so that
:func:`is_variant` can drop it when a location is shown to a client.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

MAX_INT32 = 2**31 - 1
VARIANT_MARK = "~"
# Error types raised here: "expected" carries what the value must be (a phrase
# that completes 'Field "x" must be ...'); "invalid" carries a whole message.
EXPECTED = "expected"
INVALID = "invalid"


class RequestModel(BaseModel):
    """Base of every request model: strict JSON types, unknown fields kept."""

    model_config = ConfigDict(strict=True, extra="allow")

    def wire(self) -> dict[str, Any]:
        """The fields as the client sent them (for echoes and stored copies)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


def expect(phrase: str) -> WrapValidator:
    """Report any failure of the annotated value as 'must be <phrase>', naming
    both bounds of a range instead of pydantic's one-sided messages."""
    return _reported_as(EXPECTED, phrase)


def verbatim(message: str) -> WrapValidator:
    """Report any failure of the annotated value with exactly ``message`` (for
    messages clients are known to match)."""
    return _reported_as(INVALID, message)


def _reported_as(kind: str, text: str) -> WrapValidator:
    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(kind, text) from None

    return WrapValidator(check)


def _integral(value: Any) -> Any:
    """JSON has one number type: ``5.0`` is the integer 5 (as JavaScript's
    ``Number.isInteger`` says), while ``5.5``, ``true`` and ``"5"`` are not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _utf8_bytes_at_most(limit: int) -> WrapValidator:
    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        text = handler(value)
        try:
            size = len(text.encode())
        except UnicodeEncodeError:  # a lone surrogate: not text
            size = limit + 1
        if size > limit:
            raise PydanticCustomError(EXPECTED, f"a string of at most {limit} bytes (UTF-8)")
        return text

    return WrapValidator(check)


# -- scalars with their official ranges ------------------------------------------

UnitInterval = Annotated[
    float, Field(ge=0, le=1, allow_inf_nan=False), expect("a number between 0 and 1")
]
ZeroToTwo = Annotated[
    float, Field(ge=0, le=2, allow_inf_nan=False), expect("a number between 0 and 2")
]
Penalty = Annotated[
    float, Field(ge=-2, le=2, allow_inf_nan=False), expect("a number between -2 and 2")
]
TokenCount = Annotated[
    int,
    Field(ge=1, le=MAX_INT32),
    BeforeValidator(_integral),
    expect(f"an integer between 1 and {MAX_INT32}"),
]
PositiveInt = Annotated[
    int, Field(ge=1), BeforeValidator(_integral), expect("an integer of at least 1")
]
Seed = Annotated[
    int,
    Field(ge=-(2**63), le=2**64 - 1),
    BeforeValidator(_integral),
    expect(f"a 64-bit integer (between {-(2**63)} and {2**64 - 1})"),
]
TopLogprobs = Annotated[
    int, Field(ge=0, le=20), BeforeValidator(_integral), expect("an integer between 0 and 20")
]
RetentionSeconds = Annotated[
    int,
    Field(ge=60, le=7776000),
    BeforeValidator(_integral),
    verbatim("metadata.retention_seconds must be an integer in [60, 7776000]"),
]
NonEmpty = Annotated[str, Field(min_length=1)]

Item = TypeVar("Item")


def _empty_if_null(value: Any) -> Any:
    return [] if value is None else value


# An optional array where clients send null for "none" (the OpenAI schemas allow it).
ListOrNull = Annotated[list[Item], BeforeValidator(_empty_if_null)]
CacheSalt = Annotated[str, _utf8_bytes_at_most(256)]


# -- tagged unions ---------------------------------------------------------------


def variant(key: str, value: str) -> Tag:
    """The tag of the union member whose ``key`` field is ``value``."""
    return Tag(f"{VARIANT_MARK}{key}:{value}")


def dispatch(
    key: str,
    *,
    default: str | None = None,
    known: tuple[str, ...] = (),
    fallback: str | None = None,
) -> Discriminator:
    """Pick a union member by the string at ``key`` of an object (``default``
    when the key is absent). With ``fallback``, any value outside ``known`` goes
    to the member tagged ``fallback`` (types this server accepts and ignores)."""

    def tag(value: Any) -> str | None:
        if isinstance(value, BaseModel):
            kind = getattr(value, key, default)
        elif isinstance(value, dict):
            kind = value.get(key, default)
        else:
            return None
        kind = kind if isinstance(kind, str) else ""
        if fallback is not None and kind not in known:
            kind = fallback
        return f"{VARIANT_MARK}{key}:{kind}"

    return Discriminator(tag)


def is_variant(segment: str | int) -> bool:
    """Whether an error-location segment is a union tag (not a field name)."""
    return isinstance(segment, str) and segment.startswith(VARIANT_MARK)


def variant_key(tag: str) -> str:
    """The field a union is dispatched on, from one of its tags."""
    return tag.removeprefix(VARIANT_MARK).partition(":")[0]


def variant_values(tags: str) -> list[str]:
    """The values of pydantic's quoted tag list (``"'~type:a', '~type:b'"``)."""
    return [t.strip().strip("'").partition(":")[2] for t in tags.split(",") if t.strip()]


# Shapes: a field that is a string or an array (or an object) of something.
STRING, ARRAY, OBJECT = (Tag(VARIANT_MARK + name) for name in ("string", "array", "object"))


def shape(phrase: str) -> Discriminator:
    """Pick a union member by JSON type; any other type must be ``phrase``."""

    def tag(value: Any) -> str | None:
        if isinstance(value, str):
            return STRING.tag
        if isinstance(value, list):
            return ARRAY.tag
        if isinstance(value, dict | BaseModel):
            return OBJECT.tag
        return None

    return Discriminator(tag, custom_error_type=EXPECTED, custom_error_message=phrase)
