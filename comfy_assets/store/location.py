"""Where a store is: a folder (``--store DIR``) or an object store (``--store
s3://BUCKET/PREFIX``), as every command, the Dagster resource and ``COMFY_ASSETS_STORE``
name it.

A folder is a ``Path``; an object store's location is kept as the text given (a ``Path``
would fold its ``//``). ``file_store_for`` (``store/files``) turns either into the
store's ``FileStore``; this module only tells them apart and says what each needs.
"""

from __future__ import annotations

import re
from pathlib import Path

from comfy_assets.store.errors import StoreError

# The object stores a location may name: S3 and the servers that speak its API.
OBJECT_STORE_SCHEMES = ("s3",)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class NoDatabase(StoreError, ValueError):
    """An object store named without ``--db-url``: its records need a database every
    host reaches (an object store holds files, not the store's tables)."""


class OtherStoresDatabase(StoreError, ValueError):
    """A database that holds the records of another object store than the one opened
    (another prefix, or a folder store): one database per store (``store/belongs.py``)."""


def store_location(value: str | Path) -> str | Path:
    """``value`` as a store's location: the text itself for ``s3://BUCKET/PREFIX``, else
    a ``Path`` (a folder). Raises ValueError for another scheme (``http://...``), which
    no store of ours reads. Used as the ``type`` of ``--store``."""
    if isinstance(value, Path):
        return value
    found = _SCHEME.match(value)
    if found is None:
        return Path(value)
    if found.group(1).lower() not in OBJECT_STORE_SCHEMES:
        raise ValueError(
            f"--store {value}: a folder or s3://BUCKET/PREFIX, not a {found.group(1)}:// URL"
        )
    return value


def local_folder(location: str | Path) -> Path | None:
    """The folder of a folder store, None for an object store."""
    found = store_location(location)
    return found if isinstance(found, Path) else None


def check_database(location: str | Path, db_url: str | None) -> None:
    """Raises NoDatabase when ``location`` is an object store and ``db_url`` is None
    (a folder keeps its SQLite database in itself)."""
    if db_url is None and local_folder(location) is None:
        raise NoDatabase(
            f"--store {location}: an object store keeps files, not the store's records: "
            "give --db-url postgresql+psycopg://... (or COMFY_ASSETS_DB_URL), a database "
            "every host of the farm reaches"
        )
