"""The store's tables. Change them only together with a new Alembic revision
in ``migrations/versions``."""

from __future__ import annotations

from sqlalchemy import BigInteger, Index, LargeBinary, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class ResponseRow(Base):
    __tablename__ = "mlxtrio_responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    previous_response_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[int] = mapped_column(BigInteger)
    model: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(32))
    instructions: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The conversation delta this turn added (internal messages, JSON), for replay.
    input_messages: Mapped[str] = mapped_column(Text)
    # The request's input items as sent (JSON), for GET .../input_items.
    input_items: Mapped[str] = mapped_column(Text)
    # The full response object (JSON), for GET /v1/responses/{id}.
    response: Mapped[str] = mapped_column(Text)
    # The client (API key) that created it; "" with one key or none. Only the
    # owner may read, continue or delete it.
    owner: Mapped[str] = mapped_column(String(64), default="", server_default="")

    __table_args__ = (Index("ix_mlxtrio_responses_expires_at", "expires_at"),)


class SecretRow(Base):
    """A secret every server sharing the store uses (the reasoning-sealing key):
    the first server to ask creates it."""

    __tablename__ = "mlxtrio_secrets"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[bytes] = mapped_column(LargeBinary)
