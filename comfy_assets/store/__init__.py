"""Result store: jobs, claims, server leases, done records, dead letters and events.

SQLite (``<root>/store.db``, WAL) by default, PostgreSQL by URL, the same code for both.

- ``schema``: the tables and the engine settings
- ``errors``: ``StoreError``, the base of every error the store raises
- ``records``: what the store returns and raises
- ``statements``: prebuilt hot statements (compare-and-set updates, upserts)
- ``register``: registering a job file's jobs in bulk
- ``retry``: calls that lose their database connection, tried again; outages, full disks
- ``owners``: the processes holding claims and leases, and their heartbeats
- ``clock``: the database's clock, which every expiry is judged by
- ``location``: a store's location, a folder or ``s3://BUCKET/PREFIX``
- ``files``: the files side (``FileStore``: a folder or an object store)
- ``store``: the ``Store`` class
"""

from comfy_assets.store.errors import StoreError
from comfy_assets.store.owners import OWNER_BEAT_S, OWNER_DEAD_S, OwnerRecord
from comfy_assets.store.records import (
    AttemptEntry,
    AttemptRecord,
    ClaimLost,
    ClaimStatus,
    FileRecord,
    JobBrief,
    JobRecord,
    ModelLoadRecord,
    OutputFile,
    OutputFileLike,
    PartitionConflict,
    RegisterResult,
    RenderingStart,
    ServerLease,
    StoreConflict,
    UnknownJob,
    Via,
)
from comfy_assets.store.retry import StoreDiskFull, StoreUnavailable, off_loop
from comfy_assets.store.schema import metadata
from comfy_assets.store.store import (
    DB_URL_ENV,
    OUTCOMES,
    TRANSITION_FIELDS,
    BadDbUrl,
    NoDatabase,
    NoLocalFolder,
    NoStore,
    OtherStoresDatabase,
    Store,
)

__all__ = [
    "DB_URL_ENV",
    "OUTCOMES",
    "OWNER_BEAT_S",
    "OWNER_DEAD_S",
    "TRANSITION_FIELDS",
    "AttemptEntry",
    "BadDbUrl",
    "AttemptRecord",
    "ClaimLost",
    "ClaimStatus",
    "FileRecord",
    "NoDatabase",
    "OtherStoresDatabase",
    "NoLocalFolder",
    "NoStore",
    "JobBrief",
    "JobRecord",
    "ModelLoadRecord",
    "OutputFile",
    "OutputFileLike",
    "OwnerRecord",
    "PartitionConflict",
    "RegisterResult",
    "RenderingStart",
    "ServerLease",
    "Store",
    "StoreConflict",
    "StoreDiskFull",
    "StoreError",
    "StoreUnavailable",
    "UnknownJob",
    "Via",
    "metadata",
    "off_loop",
]
