"""The ``Store``: jobs, claims, transitions, done records, dead letters, server leases.

One class made of its parts: ``claims`` (registration, job claims), ``owners`` (the
processes holding them, their heartbeats, the database's clock), ``transitions``
(state changes and their records), ``queries`` (reading), ``leases`` (server leases),
``health`` (servers' failures, quarantines and the workflows known to fail);
``base`` holds what they share. See ``base`` for how every call stays one transaction.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TypedDict, Unpack

import sqlalchemy as sa

from comfy_assets.store.base import folder_name
from comfy_assets.store.belongs import claim_database
from comfy_assets.store.claims import Claims
from comfy_assets.store.clock import DbClock
from comfy_assets.store.errors import StoreError
from comfy_assets.store.files import FileStore, FileStoreRefused, file_store_for
from comfy_assets.store.files.s3_config import parse_location
from comfy_assets.store.health import ServerHealth
from comfy_assets.store.leases import ServerLeases
from comfy_assets.store.live import Live
from comfy_assets.store.location import (
    NoDatabase,
    OtherStoresDatabase,
    check_database,
    local_folder,
    store_location,
)
from comfy_assets.store.queries import Queries
from comfy_assets.store.retry import (
    DEFAULT_RETRY_S,
    Outage,
    StoreDiskFull,
    StoreUnavailable,
    database_place,
    disk_full,
    refused_for_good,
    retried,
)
from comfy_assets.store.schema import (
    create_tables,
    make_engine,
)
from comfy_assets.store.segment_reads import SegmentReads
from comfy_assets.store.transitions import OUTCOMES, TRANSITION_FIELDS, Transitions

# The store's database URL from the environment, for every command and the Dagster
# resource: a password there does not show in `ps` as a --db-url would.
DB_URL_ENV = "COMFY_ASSETS_DB_URL"


class NoStore(StoreError, ValueError):
    """No result store where one was expected (``Store.existing``)."""


class BadDbUrl(StoreError, ValueError):
    """A ``db_url`` SQLAlchemy cannot open: not a URL, or a driver it does not have."""


class NoLocalFolder(StoreError, ValueError):
    """A local path asked of a store whose files are in an object store."""


__all__ = [
    "DB_URL_ENV",
    "OUTCOMES",
    "TRANSITION_FIELDS",
    "BadDbUrl",
    "NoDatabase",
    "NoLocalFolder",
    "NoStore",
    "OtherStoresDatabase",
    "Store",
]


class StoreOptions(TypedDict, total=False):
    """What ``Store.existing`` passes on to ``Store``: ``retry_s``, ``file_store``."""

    retry_s: float
    file_store: FileStore | None


class Store(Claims, Transitions, Queries, SegmentReads, ServerLeases, ServerHealth, Live):
    """Jobs and their history in SQLite (``<root>/store.db``) or PostgreSQL (``db_url``
    such as ``postgresql+psycopg://postgres@127.0.0.1/db``); creates missing tables.

    ``location`` is where the files are (``store.location``): a folder, which also holds
    the SQLite database when ``db_url`` is None, or ``s3://BUCKET/PREFIX``, which needs
    ``db_url`` (NoDatabase otherwise). ``file_store`` reads and writes them (by default
    ``file_store_for(location)``; a test may give its own). Make one Store per process (a
    new one after fork); threads may share it. A call whose database connection is lost
    is tried again for ``retry_s`` seconds, then raises StoreUnavailable
    (``store.retry``); ``outage`` says when the database goes away and comes back. A
    write the database's disk has no room for raises StoreDiskFull.

    Opening raises BadDbUrl for a URL SQLAlchemy cannot use, FileStoreRefused for a
    location no file store reads, OtherStoresDatabase for a database that holds another
    object store's records (``store.belongs``: one database per store). A PostgreSQL server that cannot be reached is tried
    again for ``retry_s`` seconds (a restart, a failover), then StoreUnavailable; one
    that refuses us (unknown role or database, a wrong password) raises
    StoreUnavailable at once.
    """

    def __init__(
        self,
        location: str | Path,
        db_url: str | None = None,
        *,
        retry_s: float = DEFAULT_RETRY_S,
        file_store: FileStore | None = None,
    ) -> None:
        self.location = store_location(location)
        check_database(self.location, db_url)
        self.file_store = file_store_for(self.location) if file_store is None else file_store
        self.retry_s = retry_s  # how long a call that loses its connection is tried again
        self.outage = Outage()
        self.clock = DbClock()
        self._database = "at --db-url"  # how a refusal names it (``claim_database``)
        if db_url is None:
            self.root.mkdir(parents=True, exist_ok=True)
            db_url = f"sqlite:///{self.root / 'store.db'}"
            self._database = str(self.root / "store.db")
        try:
            backend = sa.make_url(db_url).get_backend_name()
            if backend not in ("sqlite", "postgresql"):
                # The store's statements are written for these two (upserts, locks).
                raise BadDbUrl(
                    f"--db-url: the store is kept in PostgreSQL (postgresql+psycopg://...) "
                    f"or SQLite, not {backend}"
                )
            self.engine = make_engine(db_url)
        except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as e:
            # SQLAlchemy's message names neither the URL nor its password.
            raise BadDbUrl(f"--db-url: not a database URL SQLAlchemy can open ({e})") from e
        except ImportError as e:  # a dialect we take whose driver is not installed
            raise BadDbUrl(f"--db-url: its database driver is not installed ({e})") from e
        self.dialect = self.engine.dialect.name
        self.clock.same_host = self.dialect == "sqlite"
        try:
            self._create_tables()
        except BaseException:
            self.engine.dispose()
            raise

    def _create_tables(self) -> None:
        """``create_tables``, tried again while a PostgreSQL server is away (see the class
        docstring). Raises StoreUnavailable, StoreDiskFull."""
        what = "opening the store"
        started = time.monotonic()
        delay = 0.05
        stale_tried = False  # a connection lost since it was opened was replaced once
        while True:
            try:
                create_tables(self.engine)
                claim_database(
                    self.engine, self._object_store(), str(self.location), self._database
                )
                with self.engine.connect() as conn:
                    self.clock.measure(conn, self.dialect)
            except sa.exc.DBAPIError as e:
                if disk_full(e):
                    raise StoreDiskFull("its tables", database_place(self.engine), e) from e
                networked = self.dialect != "sqlite"
                if networked and e.connection_invalidated and not stale_tried:
                    # A connection lost since it was opened (its session killed, say)
                    # says nothing yet of the database now: opening goes on at once on a
                    # new one, and an outage is said only when that fails too (as
                    # ``retry.retried`` does for every call).
                    stale_tried = True
                    continue
                # A failure at the first try was not waited for, however long it took.
                waited = time.monotonic() - started if self.outage.away else 0.0
                if not networked or refused_for_good(e) or waited >= self.retry_s:
                    raise StoreUnavailable(what, waited, e) from e
                if not isinstance(e, sa.exc.OperationalError | sa.exc.InterfaceError):
                    raise StoreUnavailable(what, waited, e) from e
                self.outage.lost(what, e, self.retry_s)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
            else:
                self.outage.reached()
                return

    def _object_store(self) -> str | None:
        """The location an object store records in its database (``s3://BUCKET/PREFIX``
        as written to it: no trailing slash), None for a folder store. Raises
        FileStoreRefused for an ``s3://`` location that is not one."""
        if local_folder(self.location) is not None:
            return None
        try:
            return str(parse_location(str(self.location)))
        except ValueError as e:
            raise FileStoreRefused(str(e)) from e

    @property
    def root(self) -> Path:
        """The store's folder on this machine. Raises NoLocalFolder for an object store
        (its files are reached through ``file_store``)."""
        folder = local_folder(self.location)
        if folder is None:
            raise NoLocalFolder(f"the store {self.location} has no folder on this machine")
        return folder

    @classmethod
    def existing(
        cls, location: str | Path, db_url: str | None = None, **options: Unpack[StoreOptions]
    ) -> Store:
        """The store at ``location`` (or ``db_url``) for a command that reads or changes
        it, opened with ``options`` as ``Store`` takes them: raises NoStore rather than
        create an empty SQLite store where none was, NoDatabase for an object store
        without ``db_url``."""
        location = store_location(location)
        check_database(location, db_url)
        folder = local_folder(location)
        if db_url is None and folder is not None and not (folder / "store.db").is_file():
            raise NoStore(f"no result store at {location} (no store.db)")
        return cls(location, db_url, **options)

    @retried
    def ping(self) -> None:
        """Reach the database (``SELECT 1``); tried again like every call, so it returns
        once the database answers, or raises StoreUnavailable after ``retry_s``."""
        with self._read() as conn:
            conn.execute(sa.text("SELECT 1"))

    def close(self) -> None:
        """Close pooled connections."""
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def job_dir(self, partition: str, job_id: str) -> Path:
        """``<root>/<partition>/<job id>/`` of a folder store (not created), where its
        ``FolderFileStore`` keeps the job's outputs. Raises ValueError for a name that would
        leave the root (empty, ".", "..", or holding a slash), NoLocalFolder for an
        object store."""
        return self.root / folder_name(partition, "partition") / folder_name(job_id, "job id")
