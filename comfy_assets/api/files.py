"""A job's output file over HTTP: its content type, ``ETag`` (its sha256, from the done
record), conditional requests and single ``Range`` requests (RFC 9110), so a browser
scrubs a video and a client resumes a download; or, for a store that presigns URLs, a
redirect to the file's presigned URL (``redirect_response``), whose server answers the
ranges.

Only a file named in the job's done record is ever opened, at the path the store gives
it; the request's name is matched against the record, never joined to a folder.
"""

from __future__ import annotations

import mimetypes
import re
from pathlib import Path
from typing import Literal

from aiohttp import web

CHUNK = 256 * 1024
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")
# Byte positions past this are beyond any file; a position of more digits is read as it,
# since int() refuses text of over 4300 digits and costs time on shorter ones.
BEYOND_ANY_FILE = 10**18


def position(digits: str) -> int:
    """The byte position ``digits`` (ASCII digits, leading zeros allowed) says, capped at
    ``BEYOND_ANY_FILE`` whatever its length."""
    digits = digits.lstrip("0")
    return BEYOND_ANY_FILE if len(digits) > 18 else int(digits or "0")


def byte_range(header: str | None, size: int) -> tuple[int, int] | None | Literal["unsatisfiable"]:
    """The ``(first, last)`` byte (inclusive) of a ``Range`` header for a file of
    ``size`` bytes; None to send the whole file (no header, several ranges, another
    unit); "unsatisfiable" for a range beyond the end. Positions of any length are read
    (``position``): a 5000-digit one is beyond the end, never an error."""
    if not header:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        return None
    first, last = match[1], match[2]
    if not first and not last:
        return None
    if not first:  # the last N bytes
        n = position(last)
        if n == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - n), size - 1
    start = position(first)
    end = min(position(last), size - 1) if last else size - 1
    if start >= size or (last and position(last) < start):
        return "unsatisfiable"
    return start, end


def _etag_matches(request: web.Request, etag: str) -> bool:
    """``If-None-Match`` of ``request`` names ``etag`` (or is ``*``)."""
    if_none = request.headers.get("If-None-Match")
    if not if_none:
        return False
    return if_none.strip() == "*" or etag in [t.strip() for t in if_none.split(",")]


async def redirect_response(
    request: web.Request, url: str, name: str, sha256: str, size: int
) -> web.StreamResponse:
    """Answer ``request`` for a stored file (``name``, ``size`` bytes, ``sha256`` hex)
    whose bytes are at the presigned GET URL ``url``: ``307 Temporary Redirect`` there
    (the method and a ``Range`` header go with it; clients drop ``Authorization`` on a
    redirect to another host), ``304`` when ``If-None-Match`` names its ETag. ``HEAD``
    is answered here, ``200`` with the file's headers and no body: a URL presigned for
    GET refuses HEAD. ``Cache-Control: no-store``: the URL expires."""
    etag = f'"{sha256}"'
    common = {"ETag": etag, "Cache-Control": "private, no-store"}
    if _etag_matches(request, etag):
        return web.Response(status=304, headers=common)
    if request.method == "HEAD":
        response = web.StreamResponse(status=200, headers={**common, "Accept-Ranges": "bytes"})
        response.content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
        response.content_length = size  # the file's, though no body is sent
        await response.prepare(request)
        return response
    return web.Response(status=307, headers={**common, "Location": url})


async def file_response(
    request: web.Request, path: Path, sha256: str, size: int
) -> web.StreamResponse:
    """Answer ``request`` with the file at ``path`` (``size`` bytes, ``sha256`` hex):
    200, 206 for a range, 304 when ``If-None-Match`` names its ETag, 416 for a range
    beyond its end. Raises ``FileNotFoundError`` when it is gone or not the size the
    done record says (the caller answers 404)."""
    if path.stat().st_size != size:
        raise FileNotFoundError(f"{path.name}: not the size of its done record")
    etag = f'"{sha256}"'
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    common = {"ETag": etag, "Accept-Ranges": "bytes", "Cache-Control": "private, max-age=0"}
    if _etag_matches(request, etag):
        return web.Response(status=304, headers=common)
    wanted = byte_range(request.headers.get("Range"), size)
    if_range = request.headers.get("If-Range")
    if if_range is not None and if_range.strip() != etag:
        wanted = None  # the client's copy is another version: send this one whole
    if wanted == "unsatisfiable":
        return web.Response(status=416, headers={**common, "Content-Range": f"bytes */{size}"})
    first, last = (0, size - 1) if wanted is None else wanted
    status = 200 if wanted is None else 206
    response = web.StreamResponse(status=status, headers=common)
    response.content_type = kind
    response.content_length = max(0, last - first + 1)
    if status == 206:
        response.headers["Content-Range"] = f"bytes {first}-{last}/{size}"
    await response.prepare(request)
    if request.method == "HEAD":
        return response
    with path.open("rb") as f:
        f.seek(first)
        left = last - first + 1
        while left > 0:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                break
            await response.write(chunk)
            left -= len(chunk)
    await response.write_eof()
    return response
