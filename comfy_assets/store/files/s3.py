"""``S3FileStore``: a store's files in a bucket of an S3 object store
(``--store s3://BUCKET/PREFIX``), through obstore (Rust's ``object_store``).

Keys, below ``PREFIX``:

- ``sha256/<hex>``: the outputs, by the SHA-256 of their bytes, so the same bytes are
  one object whichever jobs, takes or retries wrote them; the job's manifest (the store's
  done record: path, sha256, bytes, content type) names them.
- ``files/<key>``: the store's own files (``files/<partition>/results.csv``).

An output is hashed while it is read: up to ``small_max`` bytes in memory, then spooled
to a local temporary file (never whole in memory). Its key is known only once it is all
read, so nothing is sent before: an error of the chunks leaves no object and no upload.
A small output is one create-only PUT (``If-None-Match: *``; 412 means the same bytes
are there already: nothing more to do). A bigger one is a HEAD (there already with its
size: nothing sent) and then a multipart upload of ``part_bytes`` parts, ``concurrency``
at once, aborted on any failure; two writers of the same bytes at once both upload
identical bytes to one key, which leaves one object either way. An abort that cannot be
sent (the server gone for longer than the retries) leaves the upload open, unseen by
readers: ``check`` (every command's start) aborts the store's uploads open for a day.

Requests are retried by the client on connection errors, timeouts of reads, 5xx and
throttling (503 SlowDown), ``max_retries`` times with exponential backoff from
``RETRY_INIT_BACKOFF_S`` up to ``RETRY_MAX_BACKOFF_S`` and for ``retry_timeout_s`` at most,
then fail as FileStoreUnavailable (s3_errors): the caller waits and tries again.
"""

from __future__ import annotations

import asyncio
import datetime
import io
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, BinaryIO

import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError
from obstore.store import S3Store

from comfy_assets.comfy.download import safe_output_path
from comfy_assets.store.base import folder_name
from comfy_assets.store.errors import StoreError
from comfy_assets.store.files.base import (
    DEFAULT_URL_EXPIRY_S,
    FileStoreRefused,
    FileStoreUnavailable,
    OutputRef,
    StoredFile,
)
from comfy_assets.store.files.folder import content_type
from comfy_assets.store.files.s3_config import S3Location, S3Settings, parse_location
from comfy_assets.store.files.s3_errors import refused, s3_errors
from comfy_assets.store.files.s3_uploads import abort_upload, open_uploads
from comfy_assets.store.files.spool import Spool

if TYPE_CHECKING:
    from obstore import GetResult

# Outputs up to this size are held in memory and sent in one PUT; bigger ones are spooled
# to disk and sent in parts (bench/s3.py measures both sides of it).
SMALL_MAX_BYTES = 8 << 20
# A multipart upload's part size and how many parts are sent at once: at most
# PART_BYTES * PART_CONCURRENCY bytes of an upload are in memory.
PART_BYTES = 8 << 20
PART_CONCURRENCY = 4
# The client's retries (module docstring): about 0.2 + 0.4 + ... + 3.2 s of backoff with
# jitter, and never more than a minute of retrying one request.
MAX_RETRIES = 5
RETRY_INIT_BACKOFF_S = 0.2
RETRY_MAX_BACKOFF_S = 8.0
RETRY_TIMEOUT_S = 60.0
# A connection is made within this or the request is retried; a whole request (a part of
# PART_BYTES included, at 0.3 MB/s) ends within REQUEST_TIMEOUT_S: a store that hangs
# without refusing holds a job's outputs about this long a try, not minutes.
CONNECT_TIMEOUT_S = 5
REQUEST_TIMEOUT_S = 30
# The first contact (``check``) lists one key: a store that has not answered that within
# this, retries included, is named as down before anything starts, not two minutes on.
CHECK_TIMEOUT_S = 20
# HEAD requests in flight at once when a job's outputs are confirmed.
CONFIRM_CONCURRENCY = 16
# How many keys whose size the server confirmed are remembered (about 100 bytes each);
# past it they are forgotten and asked again.
CONFIRMED_MAX = 50_000
# A multipart upload open this long is one whose writer failed and could not abort it
# (an outage longer than the retries): no upload of ours lasts a day.
STALE_UPLOAD_S = 24 * 3600
# S3's longest presigned URL (Signature V4): seven days.
MAX_URL_EXPIRY_S = 7 * 24 * 3600

_OUTPUTS = "sha256"
_FILES = "files"
# Output names are checked as a folder store checks them (safe_output_path); no disk is
# involved, so the folder given is one that does not exist, hence holds no link.
_NO_FOLDER = Path("/nonexistent/comfy-assets-s3")
logger = logging.getLogger(__name__)


class S3FileStore:
    """The files of a store in ``location`` (``s3://BUCKET/PREFIX``), reached with
    ``settings`` (default: from the environment and the AWS profile files). See the
    module docstring for the keys, the writes and the retries. Raises ValueError for a
    location that is not ``s3://BUCKET/PREFIX``, FileStoreRefused (a ValueError) for an
    AWS_PROFILE that does not exist."""

    def __init__(
        self,
        location: str | S3Location,
        settings: S3Settings | None = None,
        *,
        spool_dir: Path | None = None,
        small_max: int = SMALL_MAX_BYTES,
        part_bytes: int = PART_BYTES,
        concurrency: int = PART_CONCURRENCY,
        max_retries: int = MAX_RETRIES,
        retry_timeout_s: float = RETRY_TIMEOUT_S,
    ) -> None:
        self.where = parse_location(location) if isinstance(location, str) else location
        if settings is None:
            try:
                settings = S3Settings.from_environment()
            except ValueError as e:
                raise FileStoreRefused(f"{self.where}: {e}") from e
        self.settings = settings
        self.spool_dir = spool_dir
        self.small_max = small_max
        self.part_bytes = part_bytes
        self.concurrency = concurrency
        self._confirmed: dict[str, int] = {}
        self._retries = (max_retries, retry_timeout_s)
        self._store = _client(self.where, self.settings, *self._retries)
        # Clients of the buckets a job line's s3:// inputs name (``open_object``).
        self._buckets: dict[str, S3Store] = {}

    @property
    def _unsigned(self) -> bool:
        """Whether requests go unsigned: an endpoint of our own and no credentials."""
        return self.settings.access_key_id is None and self.settings.endpoint is not None

    @property
    def location(self) -> str:
        return str(self.where)

    def check(self) -> None:
        """List one key of the bucket: a wrong endpoint, bucket or credential fails here.
        (Credentials that may read but not write fail at the first write, also as
        FileStoreRefused.) Then abort the multipart uploads left open for a day
        (``abort_stale_uploads``; its failure is logged, the store still works). Raises
        FileStoreRefused, one line."""
        try:
            first = _client(self.where, self.settings, self._retries[0], CHECK_TIMEOUT_S, True)
            with s3_errors(self.location, "reaching the bucket"):
                next(iter(obstore.list(first, _FILES, chunk_size=1)), None)
        except StoreError as e:
            # At a first contact an endpoint that does not answer is as wrong as a bucket
            # that does not exist.
            if isinstance(e, FileStoreRefused) and self._unsigned and "credentials" in str(e):
                # Without credentials the requests go unsigned: "refused" alone would send
                # the user looking for a wrong key rather than a missing one.
                raise FileStoreRefused(
                    f"{e}; no credentials were found, so the requests went unsigned (set "
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
                ) from e
            raise refused(e) from e
        try:
            self.abort_stale_uploads()
        except FileStoreUnavailable as e:
            logger.warning("%s", e)

    def abort_stale_uploads(self, older_than_s: float = STALE_UPLOAD_S) -> int:
        """Abort the multipart uploads of ours (outputs, store files) open for
        ``older_than_s`` seconds or more; how many (0 without static credentials:
        module s3_uploads). Raises FileStoreUnavailable naming what failed."""
        if self.settings.access_key_id is None:
            return 0
        now = datetime.datetime.now(datetime.UTC)
        cutoff = now - datetime.timedelta(seconds=older_than_s)
        aborted = 0
        try:
            for prefix in (f"{_OUTPUTS}/", f"{_FILES}/"):
                for upload in open_uploads(self.settings, self.where, prefix):
                    if upload.initiated <= cutoff:
                        abort_upload(self.settings, self.where.bucket, upload)
                        aborted += 1
        except (OSError, RuntimeError, ValueError) as e:
            raise FileStoreUnavailable(
                f"{self.location}: aborting the multipart uploads left open: {e}"
            ) from e
        return aborted

    # -- outputs ---------------------------------------------------------------------

    async def write_output(
        self, partition: str, job_id: str, path: str, chunks: AsyncIterator[bytes]
    ) -> StoredFile:
        folder_name(partition, "partition")
        folder_name(job_id, "job id")
        relative = PurePosixPath(path)
        subfolder = relative.parent.as_posix()
        safe_output_path(_NO_FOLDER, "" if subfolder == "." else subfolder, relative.name)
        media = content_type(relative.name)
        with Spool(self.small_max, self.spool_dir) as spool:
            async for chunk in chunks:
                spool.write(chunk)
            sha256 = spool.finish()
            key = _output_key(sha256)
            with s3_errors(self.location, f"storing the output {path}", key):
                if spool.path is None:
                    await self._put_small(key, spool.data, media)
                elif not await self._stored_with_size(key, spool.size):
                    await obstore.put_async(
                        self._store,
                        key,
                        spool.path,
                        attributes={"Content-Type": media},
                        use_multipart=True,
                        chunk_size=self.part_bytes,
                        max_concurrency=self.concurrency,
                    )
                    self._confirm(key, spool.size)
            return StoredFile(sha256, spool.size, media)

    async def _put_small(self, key: str, data: bytes | bytearray, media: str) -> None:
        try:
            await obstore.put_async(
                self._store, key, data, mode="create", attributes={"Content-Type": media}
            )
        except AlreadyExistsError:
            return  # 412: the same bytes are stored already, by this job or another
        self._confirm(key, len(data))

    def _confirm(self, key: str, size: int) -> None:
        """Remember that the server confirmed ``key`` holds ``size`` bytes."""
        if len(self._confirmed) >= CONFIRMED_MAX:
            self._confirmed.clear()
        self._confirmed[key] = size

    async def _stored_with_size(self, key: str, size: int) -> bool:
        try:
            meta = await obstore.head_async(self._store, key)
        except (FileNotFoundError, NotFoundError):
            return False
        if meta["size"] != size:
            return False
        self._confirm(key, size)
        return True

    async def confirm_outputs(
        self, partition: str, job_id: str, files: Sequence[OutputRef]
    ) -> str | None:
        """Sizes the server confirmed to this object already (a PUT answered 200, a
        multipart upload completed, a HEAD before one) are not asked again; the others by
        HEAD requests, ``CONFIRM_CONCURRENCY`` at once. The checksum is the key itself,
        written only by a writer that hashed the bytes it sent."""
        limit = asyncio.Semaphore(CONFIRM_CONCURRENCY)

        async def problem(file: OutputRef) -> str | None:
            key = _output_key(file.sha256)
            if self._confirmed.get(key) == file.bytes:
                return None
            async with limit:
                with s3_errors(self.location, f"confirming the output {file.path}", key):
                    try:
                        meta = await obstore.head_async(self._store, key)
                    except (FileNotFoundError, NotFoundError):
                        return f"missing: {file.path}"
                if meta["size"] == file.bytes:
                    self._confirm(key, file.bytes)
                return _size_problem(file, meta["size"])

        problems = await asyncio.gather(*(problem(f) for f in files))
        return next((p for p in problems if p is not None), None)

    def output_problem(self, partition: str, job_id: str, file: OutputRef) -> str | None:
        key = _output_key(file.sha256)
        with s3_errors(self.location, f"checking the output {file.path}", key):
            try:
                meta = obstore.head(self._store, key)
            except (FileNotFoundError, NotFoundError):
                return f"missing: {file.path}"
        return _size_problem(file, meta["size"])

    def remove_stale_outputs(
        self, partition: str, job_id: str, keep: Sequence[OutputRef], take: int
    ) -> None:
        """Nothing to do: an object may be another job's output too, and a job's outputs
        are what its manifest names, not what is under a folder."""

    def open_output(self, partition: str, job_id: str, file: OutputRef) -> BinaryIO:
        return self._open(_output_key(file.sha256), f"reading the output {file.path}")

    def output_path(self, partition: str, job_id: str, file: OutputRef) -> Path | None:
        return None

    def output_url(
        self, partition: str, job_id: str, file: OutputRef, expires_s: int = DEFAULT_URL_EXPIRY_S
    ) -> str | None:
        return self._sign(_output_key(file.sha256), expires_s)

    # -- the store's own files -------------------------------------------------------

    def write_file(self, key: str, source: bytes | Path, content_type: str) -> None:
        object_key = _file_key(key)
        with s3_errors(self.location, f"writing {key}", object_key):
            # A big file is sent in parts from the disk, the rest in one PUT.
            big = isinstance(source, Path) and source.stat().st_size > self.small_max
            body = source.read_bytes() if isinstance(source, Path) and not big else source
            obstore.put(
                self._store,
                object_key,
                body,
                attributes={"Content-Type": content_type},
                use_multipart=big,
                chunk_size=self.part_bytes,
                max_concurrency=self.concurrency,
            )

    def open_file(self, key: str) -> BinaryIO:
        return self._open(_file_key(key), f"reading {key}")

    def file_path(self, key: str) -> Path | None:
        return None

    def file_url(self, key: str, expires_s: int = DEFAULT_URL_EXPIRY_S) -> str | None:
        return self._sign(_file_key(key), expires_s)

    def file_location(self, key: str) -> str:
        return f"s3://{self.where.bucket}/{self._full(_file_key(key))}"

    def list_files(self, prefix: str) -> Iterator[tuple[str, int]]:
        # The client lists whole path segments: list the folder the prefix is in, and
        # keep the keys that start with it.
        folder = f"{_FILES}/{prefix}".rsplit("/", 1)[0]
        start = len(_FILES) + 1
        with s3_errors(self.location, f"listing {prefix or 'the files'}"):
            for batch in obstore.list(self._store, folder, chunk_size=1000):
                for meta in batch:
                    key = meta["path"][start:]
                    if key.startswith(prefix):
                        yield key, meta["size"]

    def open_object(self, url: str) -> BinaryIO:
        """The object ``s3://BUCKET/KEY`` of this store's endpoint, any bucket, read with
        its credentials (a job line's input). Raises FileNotFoundError for no such
        object, FileStoreRefused for a URL that is not ``s3://BUCKET/KEY`` (its message
        says why and leaves the URL to the caller, who names it already)."""
        try:
            where = parse_location(url, part="key")
        except ValueError as e:
            raise FileStoreRefused(str(e).removeprefix(f"{url!r}: ")) from e
        if not where.prefix:
            raise FileStoreRefused("it names a bucket, not an object (s3://BUCKET/KEY)")
        client = self._buckets.get(where.bucket)
        if client is None:
            client = _client(S3Location(where.bucket, ""), self.settings, *self._retries)
            self._buckets[where.bucket] = client
        with s3_errors(self.location, f"reading {url}", url):
            result = obstore.get(client, where.prefix)
        stream = _ObjectStream(result, self.location, f"reading {url}", url)
        return io.BufferedReader(stream, 1 << 20)

    # -- parts -----------------------------------------------------------------------

    def _open(self, key: str, doing: str) -> BinaryIO:
        with s3_errors(self.location, doing, key):
            result = obstore.get(self._store, key)
        return io.BufferedReader(_ObjectStream(result, self.location, doing, key), 1 << 20)

    def _sign(self, key: str, expires_s: int) -> str:
        if not 1 <= expires_s <= MAX_URL_EXPIRY_S:
            raise ValueError(
                f"a presigned URL's expiry is 1 to {MAX_URL_EXPIRY_S} s, not {expires_s}"
            )
        if self.settings.access_key_id is None and self.settings.endpoint is not None:
            # An endpoint reached without credentials serves its objects unsigned.
            return f"{self.settings.endpoint.rstrip('/')}/{self.where.bucket}/{self._full(key)}"
        with s3_errors(self.location, "signing a URL", key):
            return obstore.sign(self._store, "GET", key, datetime.timedelta(seconds=expires_s))

    def _full(self, key: str) -> str:
        return f"{self.where.prefix}/{key}" if self.where.prefix else key


class _ObjectStream(io.RawIOBase):
    """The bytes of one GET, read as the client's stream of chunks arrives."""

    def __init__(self, result: GetResult, location: str, doing: str, key: str) -> None:
        super().__init__()
        self._chunks = iter(result.stream(min_chunk_size=1 << 20))
        self._pending = memoryview(b"")
        self._where = (location, doing, key)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            with s3_errors(*self._where):
                chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._pending = memoryview(chunk)
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def _client(
    where: S3Location,
    settings: S3Settings,
    max_retries: int,
    retry_timeout_s: float,
    first_contact: bool = False,
) -> S3Store:
    request_timeout_s = CHECK_TIMEOUT_S if first_contact else REQUEST_TIMEOUT_S
    config: dict[str, Any] = {"region": settings.region}
    if settings.endpoint:
        config["endpoint"] = settings.endpoint
    if settings.access_key_id:
        config["access_key_id"] = settings.access_key_id
        config["secret_access_key"] = settings.secret_access_key or ""
        if settings.session_token:
            config["session_token"] = settings.session_token
    elif settings.endpoint:
        # An endpoint of our own without credentials: unsigned requests, rather than the
        # client's search for an instance's credentials, which only AWS hosts have.
        config["skip_signature"] = True
    return S3Store(
        where.bucket,
        prefix=where.prefix or None,
        config=config,  # type: ignore[arg-type]
        client_options={
            "allow_http": bool(settings.endpoint and settings.endpoint.startswith("http://")),
            "connect_timeout": datetime.timedelta(seconds=CONNECT_TIMEOUT_S),
            "timeout": datetime.timedelta(seconds=request_timeout_s),
        },
        retry_config={
            "max_retries": max_retries,
            "retry_timeout": datetime.timedelta(seconds=retry_timeout_s),
            "backoff": {
                "init_backoff": datetime.timedelta(seconds=RETRY_INIT_BACKOFF_S),
                "max_backoff": datetime.timedelta(seconds=RETRY_MAX_BACKOFF_S),
                "base": 2,
            },
        },
    )


def _output_key(sha256: str) -> str:
    return f"{_OUTPUTS}/{sha256}"


def _file_key(key: str) -> str:
    parts = PurePosixPath(key).parts
    if not parts or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"store file key {key!r} would leave the store")
    return f"{_FILES}/{key}"


def _size_problem(file: OutputRef, size: int) -> str | None:
    if size != file.bytes:
        return f"changed: {file.path} ({size} bytes, recorded {file.bytes})"
    return None
