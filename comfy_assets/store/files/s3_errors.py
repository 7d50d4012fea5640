"""What an S3 client's error means for the farm, in one place: the credentials or the
bucket refused (``FileStoreRefused``), the bucket full or over its quota
(``FileStoreFull``), the server down, slow or throttling after the client's bounded
retries (``FileStoreUnavailable``), an object not there (``FileNotFoundError``). Each
message is one line naming the store's location and what was being done, with the S3
error code and HTTP status when the server sent them; never the client's own text,
which runs over many lines and holds request details.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from obstore.exceptions import (
    BaseError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnknownConfigurationKeyError,
)

from comfy_assets.store.errors import StoreError
from comfy_assets.store.files.base import (
    FileStoreFull,
    FileStoreRefused,
    FileStoreUnavailable,
)

_CODE = re.compile(r"<Code>([A-Za-z0-9.]+)</Code>")
_STATUS = re.compile(r"status code: (\d{3})")

# S3 error codes saying who is asking is not let in (AWS's list; MinIO and SeaweedFS
# answer the same codes).
_REFUSED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AuthorizationHeaderMalformed",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
        "TokenRefreshRequired",
        "NoSuchBucket",
    }
)
# Codes for no room: MinIO's quota, S3 servers over their disks; HTTP 507 is the same.
_FULL_CODES = frozenset(
    {"QuotaExceeded", "XMinioAdminBucketQuotaExceeded", "XMinioStorageFull", "StorageFull"}
)


def _code_and_status(text: str) -> tuple[str | None, int | None]:
    code = _CODE.search(text)
    status = _STATUS.search(text)
    return (code.group(1) if code else None, int(status.group(1)) if status else None)


def _why(error: BaseException, code: str | None, status: int | None) -> str:
    """A short cause: ``403 SignatureDoesNotMatch``, ``connection failed``."""
    if code or status:
        return " ".join(str(p) for p in (status, code) if p)
    text = str(error).lower()
    # The client's text names its settings too ("retry_timeout: 60s"): match its errors'
    # own words only.
    for needle, what in (
        ("timed out", "timed out"),
        # A request that got no answer in time: its text also says "error sending
        # request", but the connection was made, so "connection failed" would be untrue.
        ("timedout", "timed out"),
        ("kind: timeout", "timed out"),
        ("error sending request", "connection failed"),
        ("connection", "connection failed"),
    ):
        if needle in text:
            return what
    return type(error).__name__


def store_error(error: BaseException, location: str, doing: str) -> StoreError | None:
    """The store's error for the client's ``error`` while ``doing`` (``storing an
    output``) at ``location``, or None when ``error`` is not the client's (ours, or the
    chunks' own, raised as it is)."""
    if not isinstance(error, BaseError):
        return None
    return _mapped(error, location, doing)


def _mapped(error: BaseError, location: str, doing: str) -> StoreError:
    code, status = _code_and_status(str(error))
    why = _why(error, code, status)
    # A quota's refusal may come as a 403: the code says which.
    if code in _FULL_CODES or status == 507:
        return FileStoreFull(f"{location}: {doing}: the object store is full ({why})")
    if code == "NoSuchBucket":
        return FileStoreRefused(f"{location}: {doing}: the bucket does not exist ({why})")
    if (
        isinstance(error, PermissionDeniedError | UnauthenticatedError)
        or code in _REFUSED_CODES
        or status in (401, 403)
    ):
        return FileStoreRefused(f"{location}: {doing}: the credentials were refused ({why})")
    if isinstance(error, UnknownConfigurationKeyError):
        return FileStoreRefused(f"{location}: {doing}: the client's settings were refused")
    return FileStoreUnavailable(f"{location}: {doing}: the object store is unavailable ({why})")


@contextmanager
def s3_errors(location: str, doing: str, key: str = "") -> Iterator[None]:
    """Raise the client's errors inside as the store's (``store_error``); an object not
    found as FileNotFoundError naming ``key``."""
    try:
        yield
    except (FileNotFoundError, NotFoundError) as e:
        raise FileNotFoundError(f"{location}: {doing}: no object {key}") from e
    except BaseError as e:
        raise _mapped(e, location, doing) from e


def refused(error: StoreError) -> FileStoreRefused:
    """``error`` as FileStoreRefused, with its message."""
    if isinstance(error, FileStoreRefused):
        return error
    return FileStoreRefused(str(error))
