"""Secrets every server sharing the store must agree on (the reasoning-sealing
key), so that replicas behind one load balancer read each other's blobs.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "mlxtrio_secrets",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.LargeBinary(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("mlxtrio_secrets")
