"""Alembic environment: runs on the connection and metadata the store hands over
(``ResponseStore.open`` sets both in the config's attributes)."""

from alembic import context

attributes = context.config.attributes
context.configure(
    connection=attributes["connection"],
    target_metadata=attributes["target_metadata"],
    render_as_batch=True,
)
with context.begin_transaction():
    context.run_migrations()
