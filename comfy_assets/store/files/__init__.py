"""The files side of the store: ``FileStore``, a folder (``FolderFileStore``) or an S3
bucket (``S3FileStore``). See ``base``."""

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


def files_of(store: object) -> FileStore:
    """The file store of ``store`` (a ``Store``): ``store.file_store`` where the store
    holds one, else the folder of ``store.root``. The one place readers get it from."""
    found: FileStore | None = getattr(store, "file_store", None)
    return found if found is not None else FolderFileStore(getattr(store, "root"))  # noqa: B009


__all__ = [
    "DEFAULT_URL_EXPIRY_S",
    "FileStore",
    "FileStoreFull",
    "FileStoreRefused",
    "FileStoreUnavailable",
    "FolderFileStore",
    "OutputRef",
    "StoredFile",
    "files_of",
]
