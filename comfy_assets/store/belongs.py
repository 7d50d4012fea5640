"""The store a database belongs to: the first object store to open a database records
its location there (``comfy_store``), and a store opened at another location (another
prefix, another bucket, a folder) is refused before anything is written, since its
records would mix with the other store's (``status`` listing them, ``sync`` finding their
files gone, ``run`` catching their prompts up).

Folder stores record nothing: one shared folder is mounted at different paths on
different hosts, so its path does not name it. A database without the record (made
before it existed, or used by folder stores only) takes the first object store that
opens it.
"""

from __future__ import annotations

import time

import sqlalchemy as sa

from comfy_assets.store.location import OtherStoresDatabase
from comfy_assets.store.schema import begin, store_table
from comfy_assets.store.statements import insert_for


def claim_database(
    engine: sa.Engine, location: str | None, shown_location: str, database: str
) -> None:
    """Record ``location`` (``s3://BUCKET/PREFIX`` as the file store writes it; None for
    a folder store, which records nothing) as the store of ``engine``'s database, unless
    one is recorded already, in one transaction: two hosts opening it at once agree on
    the first. Raises OtherStoresDatabase naming ``database`` (how the user gave it: "at
    --db-url"), the recorded location and ``shown_location`` when the recorded one is not
    ``location``; sqlalchemy DBAPIError for a database that fails."""
    dialect = engine.dialect.name
    with engine.begin() as conn:
        begin(conn, write=location is not None)
        if location is not None:
            conn.execute(
                insert_for(dialect, store_table)
                .values(id=1, location=location, recorded_at=time.time())
                .on_conflict_do_nothing()
            )
        recorded = conn.execute(
            sa.select(store_table.c.location).where(store_table.c.id == 1)
        ).scalar_one_or_none()
    if recorded is not None and recorded != location:
        raise OtherStoresDatabase(
            f"the database {database} holds the records of the store {recorded}, not "
            f"{shown_location}: one database per store"
        )
