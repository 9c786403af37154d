"""Stored responses belong to the API key that created them.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Existing rows were written with one key or none: owner "" (see transport).
    with op.batch_alter_table("mlxtrio_responses") as batch:
        batch.add_column(sa.Column("owner", sa.String(64), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("mlxtrio_responses") as batch:
        batch.drop_column("owner")
