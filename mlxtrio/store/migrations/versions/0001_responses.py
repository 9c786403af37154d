"""Create the responses table.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "mlxtrio_responses",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("previous_response_id", sa.String(64), nullable=True),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("instructions", sa.Text, nullable=True),
        sa.Column("input_messages", sa.Text, nullable=False),
        sa.Column("input_items", sa.Text, nullable=False),
        sa.Column("response", sa.Text, nullable=False),
    )
    op.create_index("ix_mlxtrio_responses_expires_at", "mlxtrio_responses", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_mlxtrio_responses_expires_at", "mlxtrio_responses")
    op.drop_table("mlxtrio_responses")
