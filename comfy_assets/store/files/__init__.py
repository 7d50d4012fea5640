"""The files side of the store: ``FileStore``, a folder (``FolderFileStore``) or an S3
bucket (``S3FileStore``). See ``base``."""

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


def file_store_for(location: str | Path) -> FileStore:
    """The file store of a store's ``location``: a folder (``Path``, or text that is not
    a URL) or ``s3://BUCKET/PREFIX``. The one place a ``--store`` value becomes a
    FileStore. Raises FileStoreRefused for a location no file store here reads."""
    from comfy_assets.store.location import local_folder

    try:
        folder = local_folder(location)
    except ValueError as e:
        raise FileStoreRefused(str(e)) from e
    if folder is None:
        # Stand-in until the S3 store lands (w45a's file_store_for replaces this one).
        raise FileStoreRefused(f"--store {location}: no S3 client in this build")
    return FolderFileStore(folder)


__all__ = [
    "DEFAULT_URL_EXPIRY_S",
    "FileStore",
    "FileStoreFull",
    "FileStoreRefused",
    "FileStoreUnavailable",
    "FolderFileStore",
    "OutputRef",
    "StoredFile",
    "file_store_for",
]
