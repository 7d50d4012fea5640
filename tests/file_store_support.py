"""A file store whose files are not on this disk as far as its readers can tell, for the
readers' tests until the S3 store is here: ``LinkedFileStore`` keeps the bytes in a
hidden folder (a ``FolderFileStore``), answers None for every local path and gives
presigned-looking URLs (an HMAC of the path and expiry, as a presigned URL carries its
signature), which ``serve_links`` serves over HTTP (GET only, ranges, 403 for a bad
signature), as an object store serves presigned GETs."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote

from aiohttp import web
from aiohttp.test_utils import TestServer

from comfy_assets.store.files import DEFAULT_URL_EXPIRY_S, FolderFileStore, OutputRef, StoredFile

SECRET = b"the fake store's signing key"
# (method, path, Authorization header) of each request a links_app was sent.
REQUESTS = web.AppKey("requests", list[tuple[str, str, str | None]])


def signature(path: str, expires_s: int) -> str:
    return hmac.new(SECRET, f"{path} {expires_s}".encode(), hashlib.sha256).hexdigest()


class LinkedFileStore:
    """A FileStore (comfy_assets.store.files.base) over the folder ``hidden`` that
    readers must reach by URL: ``output_path``/``file_path`` are None, URLs are
    ``<base_url>/<path>?X-Amz-Expires=..&X-Amz-Signature=..``. ``expiries``: every
    ``expires_s`` a URL was asked for; ``opened``: every output and file read
    (``<partition>/<job id>/<path>`` or the key); ``written``: every key written."""

    def __init__(self, hidden: Path, base_url: str = "http://objects.test") -> None:
        self.folder = FolderFileStore(hidden)
        self.base_url = base_url
        self.expiries: list[int] = []
        self.opened: list[str] = []
        self.written: list[str] = []

    @property
    def location(self) -> str:
        return "s3://fake-bucket/farm"

    def check(self) -> None:
        self.folder.check()

    async def write_output(
        self, partition: str, job_id: str, path: str, chunks: AsyncIterator[bytes]
    ) -> StoredFile:
        return await self.folder.write_output(partition, job_id, path, chunks)

    async def confirm_outputs(
        self, partition: str, job_id: str, files: Sequence[OutputRef]
    ) -> str | None:
        return await self.folder.confirm_outputs(partition, job_id, files)

    def output_problem(self, partition: str, job_id: str, file: OutputRef) -> str | None:
        return self.folder.output_problem(partition, job_id, file)

    def remove_stale_outputs(
        self, partition: str, job_id: str, keep: Sequence[OutputRef], take: int
    ) -> None:
        """Objects may be shared: nothing is removed."""

    def open_output(self, partition: str, job_id: str, file: OutputRef) -> BinaryIO:
        self.opened.append(f"{partition}/{job_id}/{file.path}")
        return self.folder.open_output(partition, job_id, file)

    def output_path(self, partition: str, job_id: str, file: OutputRef) -> Path | None:
        return None

    def _url(self, relative: str, expires_s: int) -> str:
        self.expiries.append(expires_s)
        sig = signature(relative, expires_s)
        return (
            f"{self.base_url.rstrip('/')}/{quote(relative)}"
            f"?X-Amz-Expires={expires_s}&X-Amz-Signature={sig}"
        )

    def output_url(
        self, partition: str, job_id: str, file: OutputRef, expires_s: int = DEFAULT_URL_EXPIRY_S
    ) -> str | None:
        return self._url(f"{partition}/{job_id}/{file.path}", expires_s)

    def write_file(self, key: str, source: bytes | Path, content_type: str) -> None:
        self.written.append(key)
        self.folder.write_file(key, source, content_type)

    def open_file(self, key: str) -> BinaryIO:
        self.opened.append(key)
        return self.folder.open_file(key)

    def file_path(self, key: str) -> Path | None:
        return None

    def file_url(self, key: str, expires_s: int = DEFAULT_URL_EXPIRY_S) -> str | None:
        return self._url(key, expires_s)

    def file_location(self, key: str) -> str:
        return f"{self.location}/files/{key}"

    def list_files(self, prefix: str) -> Iterator[tuple[str, int]]:
        return self.folder.list_files(prefix)


def links_app(store: LinkedFileStore) -> web.Application:
    """An HTTP server of ``store``'s URLs: GET with a good signature gets the bytes (with
    ranges), anything else 403, a file not there 404. ``requests``: (method, path,
    Authorization header) of each request."""
    app = web.Application()
    seen: list[tuple[str, str, str | None]] = []
    app[REQUESTS] = seen

    async def get(request: web.Request) -> web.StreamResponse:
        relative = request.match_info["path"]
        seen.append((request.method, relative, request.headers.get("Authorization")))
        expires = int(request.query.get("X-Amz-Expires", "0"))
        good = hmac.compare_digest(
            request.query.get("X-Amz-Signature", ""), signature(relative, expires)
        )
        if request.method != "GET" or not good or "Authorization" in request.headers:
            return web.Response(status=403, text="SignatureDoesNotMatch")
        path = store.folder.root / relative
        if not path.is_file():
            return web.Response(status=404, text="NoSuchKey")
        return web.FileResponse(path)

    app.router.add_route("*", "/{path:.+}", get)
    return app


async def serve_links(store: LinkedFileStore) -> TestServer:
    """Start ``links_app(store)`` on 127.0.0.1 and point ``store``'s URLs at it."""
    server = TestServer(links_app(store), host="127.0.0.1")
    await server.start_server()
    store.base_url = str(server.make_url(""))
    return server
