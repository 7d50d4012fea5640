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

__all__ = [
    "DEFAULT_URL_EXPIRY_S",
    "FileStore",
    "FileStoreFull",
    "FileStoreRefused",
    "FileStoreUnavailable",
    "FolderFileStore",
    "OutputRef",
    "StoredFile",
]
