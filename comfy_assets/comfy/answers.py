"""Reading ComfyUI's answers: an HTTP answer read whole, the errors a request's failure
maps to (refused, reset, timeout: see ``comfy.client``), file names safe to put in a
prompt, the Content-Type ``/view`` sends, and the one-line words of each failure."""

from __future__ import annotations

import errno
import json
import mimetypes
import socket
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from comfy_assets.comfy.errors import ConnectionLost, RequestTimeout, ServerUnreachable

if TYPE_CHECKING:
    from comfy_assets.comfy.client import ComfyClient


@dataclass(frozen=True)
class Answer:
    """An HTTP answer read whole: ``status``, ``headers`` (looked up case-insensitively),
    ``body`` (bytes)."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def text(self) -> str:
        """The body as text (UTF-8, undecodable bytes replaced): for error messages."""
        return self.body.decode("utf-8", "replace")


# Types ComfyUI's /view sends as application/octet-stream, so a browser won't show them.
_FORCED_DOWNLOAD = frozenset(
    {"text/html", "text/html-sandboxed", "application/xhtml+xml", "text/javascript", "text/css"}
)


class MappedErrors:
    """``ComfyClient._mapped``: a plain context manager, since one wraps every request."""

    def __init__(self, client: ComfyClient, route: str) -> None:
        self.client = client
        self.route = route

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, _: object
    ) -> Literal[False]:
        if exc is None:
            return False
        import aiohttp

        client, where = self.client, f"{self.client.name}: {self.route}"
        if isinstance(exc, TimeoutError):  # aiohttp's timeouts are TimeoutErrors too
            raise RequestTimeout(
                f"{where}: no answer within {client.timeout_s:g} s", server=client.base_url
            ) from exc
        if isinstance(exc, aiohttp.ClientConnectorError):
            reason = unreachable_reason(exc, client.base_url)
            raise ServerUnreachable(
                f"{where}: {reason} ({client.base_url})", server=client.base_url, reason=reason
            ) from exc
        if isinstance(exc, aiohttp.ClientError):
            # Reset, closed before the answer ended, a malformed answer: the request may
            # have reached the server.
            raise ConnectionLost(
                f"{where}: connection lost ({lost_reason(exc)})", server=client.base_url
            ) from exc
        return False


def lost_reason(exc: BaseException) -> str:
    """aiohttp's reason for a lost connection, in words. Two of its errors carry a repr
    where a reason should be (aiohttp 3.14 client_proto.py ``connection_lost``): a server
    that closes the connection in the middle of the answer's headers gives
    ``ServerDisconnectedError`` the half-read head as its message, and one that closes it
    in the middle of the body gives ``ClientPayloadError`` the repr of its cause, an
    ``HttpProcessingError`` whose ``message`` is the words."""
    import aiohttp  # imported already: the request that failed went over it
    from aiohttp.http_exceptions import HttpProcessingError

    if isinstance(exc, aiohttp.ServerDisconnectedError) and not isinstance(exc.message, str):
        code = getattr(exc.message, "code", None)
        status = f", status {code}" if isinstance(code, int) else ""
        return f"the server closed it in the middle of the answer's headers{status}"
    cause = exc.__cause__
    if isinstance(exc, aiohttp.ClientPayloadError) and isinstance(cause, HttpProcessingError):
        return f"the answer's body could not be read: {cause.message.rstrip('.')}"
    return str(exc) or type(exc).__name__


def unsafe_name(name: str) -> str | None:
    """Why ``name`` is not a plain file name to put in a prompt or send for upload (a
    separator, empty, ``.`` or ``..``, a control character), or None."""
    if name in ("", ".", ".."):
        return "empty, '.' or '..'"
    if ".." in name:
        return "'..' in it"
    if "/" in name or "\\" in name:
        return "a path separator in it"
    control = next((c for c in name if unicodedata.category(c) == "Cc"), None)
    if control is not None:
        return f"control character U+{ord(control):04X} in it"
    return None


def quoted(text: str) -> str:
    """``text`` in double quotes, control characters escaped as JSON does (one line)."""
    return json.dumps(text, ensure_ascii=False)


def view_content_type(filename: str) -> str:
    """The Content-Type ComfyUI v0.8.0 sends for a file of ``/view``: its MIME type by
    name, or application/octet-stream (server.py ``view_image``)."""
    guessed = mimetypes.guess_type(filename)[0] or "application/octet-stream"
    return "application/octet-stream" if guessed in _FORCED_DOWNLOAD else guessed


def json_dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def unreachable_reason(exc: BaseException, base_url: str) -> str:
    """A few words for people, from the OS error under ``exc`` (aiohttp keeps it as
    ``os_error``; with several addresses tried, one OSError carries their common errno):
    "connection refused", "host not found: NAME", or "cannot connect: <the error>"."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or (
            type(seen) is OSError and seen.errno == errno.ECONNREFUSED
        ):
            return "connection refused"
        if isinstance(seen, socket.gaierror):
            return f"host not found: {urlsplit(base_url).hostname}"
        seen = getattr(seen, "os_error", None) or seen.__cause__ or seen.__context__
    return f"cannot connect: {exc}"
