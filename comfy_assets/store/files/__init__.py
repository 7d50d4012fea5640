"""The files side of the store: ``FileStore``, a folder (``FolderFileStore``) or an S3
bucket (``S3FileStore``), made from a store's location by ``file_store_for``. See
``base``."""

from __future__ import annotations

from pathlib import Path

from comfy_assets.store.files.base import (
    DEFAULT_URL_EXPIRY_S,
    FileStore,
    FileStoreFull,
    FileStoreRefused,
    FileStoreUnavailable,
    OutputRef,
    StoredFile,
)
from comfy_assets.store.files.folder import FolderFileStore
from comfy_assets.store.files.s3 import S3FileStore
from comfy_assets.store.files.s3_config import S3Settings


def file_store_for(location: str | Path) -> FileStore:
    """The file store of a store's ``location``: ``s3://BUCKET/PREFIX`` an S3FileStore
    (endpoint, region and credentials from the environment and the AWS profile files),
    a Path or any other text that is not a URL a FolderFileStore of that folder. The one
    place a ``--store`` value becomes a FileStore. Nothing is reached yet (``check``
    does). Raises FileStoreRefused for a location no file store here reads (another
    scheme, an ``s3://`` location that is not ``s3://BUCKET/PREFIX``) and for an
    AWS_PROFILE that does not exist."""
    from comfy_assets.store.location import local_folder

    try:
        folder = local_folder(location)
    except ValueError as e:
        raise FileStoreRefused(str(e)) from e
    if folder is not None:
        return FolderFileStore(folder)
    try:
        return S3FileStore(str(location))
    except FileStoreRefused:
        raise
    except ValueError as e:
        raise FileStoreRefused(str(e)) from e


__all__ = [
    "DEFAULT_URL_EXPIRY_S",
    "FileStore",
    "FileStoreFull",
    "FileStoreRefused",
    "FileStoreUnavailable",
    "FolderFileStore",
    "OutputRef",
    "S3FileStore",
    "S3Settings",
    "StoredFile",
    "file_store_for",
]
