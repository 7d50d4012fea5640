"""One ComfyUI server: every route this project uses, typed results, typed errors.

Requests go over aiohttp, imported on the first one: per request it costs a fraction
of httpx's CPU (bench/http_clients.py), and a batch makes four per job. A caller with an
answer of its own (``comfy.health``'s probe, over the standard library's http.client,
which starts in a blink) reads it with ``read_json``: one reading of answers for both.

Error mapping (what failed, so callers classify by type):
refused / cannot connect → ServerUnreachable; reset, closed, protocol error → ConnectionLost;
any timeout → RequestTimeout; 5xx → ServerError; POST /prompt 400 → PromptRejected;
POST /upload/image 400 or 413 → InputRejected; GET /view 404 → OutputMissing; a /view
answer of another type than the file → NotTheFile; any other unexpected status or body →
UnexpectedAnswer.
Shapes: data/recorded/*.json (ComfyUI v0.8.0).

Credentials (a server behind an authenticating proxy) travel only as HTTP basic auth, on
every request and on the ``/ws`` handshake; ``base_url``, ``name`` and every error
carry the URL without them.
"""

from __future__ import annotations

import base64
import json
import logging
import mimetypes
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import TYPE_CHECKING, Any, Self, TypeVar
from urllib.parse import quote, urlencode, urlsplit

from comfy_assets.comfy.answers import (
    Answer,
    MappedErrors,
    json_dumps,
    quoted,
    unreachable_reason,
    unsafe_name,
    view_content_type,
)
from comfy_assets.comfy.capabilities import Capabilities
from comfy_assets.comfy.errors import (
    ComfyError,
    ConnectionLost,
    InputRejected,
    NotTheFile,
    OutputMissing,
    OutputTooLarge,
    PromptRejected,
    RequestTimeout,
    ServerError,
    ServerUnreachable,
    UnexpectedAnswer,
)
from comfy_assets.comfy.servers import Credentials, split_credentials
from comfy_assets.comfy.types import (
    HistoryEntry,
    PostResult,
    QueueState,
    SystemStats,
    UploadedFile,
    excerpt,
    format_node_errors,
)

if TYPE_CHECKING:  # imported where used: a health probe loads neither
    import aiohttp
    from websockets.asyncio.client import ClientConnection
    from yarl import URL

T = TypeVar("T")

_WS_MAX_MESSAGE = 64 * 1024 * 1024  # bytes; binary previews can exceed websockets' 1 MiB
_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization"})


class _HideSecretHeaders(logging.Filter):
    """websockets logs every handshake header at DEBUG ("> %s: %s"): the Authorization
    value (base64 of user:password) is shown as ``***``."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 2 and str(args[0]).lower() in _SECRET_HEADERS:
            record.args = (args[0], "***")
        return True


# A child of websockets' own logger: its level and handlers apply, and the filter only
# to our sockets.
_WS_LOG = logging.getLogger("websockets.client.comfy_assets")
_WS_LOG.addFilter(_HideSecretHeaders())


class ComfyClient:
    """HTTP client of one ComfyUI server over one ``aiohttp.ClientSession``.

    ``base_url`` like ``http://127.0.0.1:8188``; ``credentials`` (or a
    ``user:password@`` in ``base_url``, taken out of it) are sent as HTTP basic auth on
    every request and on the ``/ws`` handshake. ``name`` (default: the URL without
    credentials) prefixes error messages; ``timeout_s`` bounds connecting and each read
    of an answer (seconds; a long download goes on while data keeps coming). Redirects
    are not followed (a 3xx is an unexpected answer). Use as ``async with
    ComfyClient(url) as client: ...``; the session opens on the first request, in the
    running event loop. Raises ``ValueError`` for a URL that is not http(s)://host[:port].
    """

    def __init__(
        self,
        base_url: str,
        *,
        credentials: Credentials | None = None,
        name: str | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        base_url, in_url = split_credentials(base_url)
        credentials = credentials or in_url
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) server URL: {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.name = name or self.base_url
        self.timeout_s = timeout_s
        self._authenticated = credentials is not None
        self.auth_headers: dict[str, str] = {}
        """``Authorization`` for every request and the socket (empty without credentials)."""
        if credentials is not None:
            # user:password in UTF-8, base64 (aiohttp's BasicAuth would encode latin-1).
            token = f"{credentials.user}:{credentials.password}".encode()
            self.auth_headers["Authorization"] = "Basic " + base64.b64encode(token).decode()
        self._http: aiohttp.ClientSession | None = None
        self._output_classes: dict[str, bool] = {}  # is_output_node answers

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            import aiohttp

            timeout = self.timeout_s
            self._http = aiohttp.ClientSession(
                headers=self.auth_headers,
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=timeout, sock_connect=timeout, sock_read=timeout
                ),
                # Many followers of one server share this client.
                connector=aiohttp.TCPConnector(limit=64, ssl=self.base_url.startswith("https://")),
                # Answers are ComfyUI's: no cookies to keep, nothing to follow.
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._http

    def _url(self, path: str) -> URL:
        """``base_url + path`` as given: paths and queries are quoted by the caller."""
        from yarl import URL

        return URL(self.base_url + path, encoded=True)

    # -- routes -----------------------------------------------------------------------

    async def system_stats(self) -> SystemStats:
        """GET /system_stats (basics.json)."""
        body = await self._get_json("/system_stats")
        return self._parse("GET /system_stats", SystemStats.from_json, body)

    async def queue(self) -> QueueState:
        """GET /queue: running and pending entries (three_in_a_row.json)."""
        body = await self._get_json("/queue")
        return self._parse("GET /queue", QueueState.from_json, body)

    async def post_prompt(
        self, prompt: dict[str, Any], *, prompt_id: str, client_id: str
    ) -> PostResult:
        """POST /prompt. Returns the run ``number``; a 200 may carry ``node_errors`` (some
        outputs dropped). Raises PromptRejected on 400 (validation_errors.json)."""
        route = "POST /prompt"
        payload = {"prompt": prompt, "client_id": client_id, "prompt_id": prompt_id}
        response = await self._request("POST", "/prompt", route, json=payload)
        if response.status == 400:
            raise self._rejected(route, response)
        self._check(route, response)
        return self._parse(route, PostResult.from_json, self._json(route, response))

    async def history(self, prompt_id: str) -> HistoryEntry | None:
        """GET /history/{prompt_id}; None for ``{}`` (unknown, not finished yet, or
        forgotten by a restart: basics.json, restart.json)."""
        route = f"GET /history/{prompt_id}"
        body = await self._get_json(f"/history/{quote(prompt_id, safe='')}", route)
        if not isinstance(body, dict):
            raise self._unexpected(route, f"body is {type(body).__name__}, not an object")
        if not body:
            return None
        if prompt_id not in body:
            raise self._unexpected(route, f"answer names other prompts: {list(body)[:3]}")
        return self._parse(route, lambda b: HistoryEntry.from_json(prompt_id, b[prompt_id]), body)

    async def interrupt(self, prompt_id: str | None = None) -> None:
        """POST /interrupt, for one prompt or whatever runs. 200 with an empty body whether
        or not it stopped anything; it lands between nodes (interrupt_reconnect.json)."""
        payload = {} if prompt_id is None else {"prompt_id": prompt_id}
        await self._post_ok("/interrupt", payload)

    async def delete_from_queue(self, prompt_ids: list[str]) -> None:
        """POST /queue ``{"delete": [...]}``. Loses the race against a prompt that already
        started: check /queue and /history afterwards (interrupt_reconnect.json)."""
        await self._post_ok("/queue", {"delete": list(prompt_ids)})

    async def object_info(self) -> Capabilities:
        """GET /object_info: the node classes this server has and the model files its
        loaders list (``capabilities.py``; basics.json). Large on a real server with
        custom nodes: asked once per server start, not per job."""
        body = await self._get_json("/object_info")
        return self._parse(
            "GET /object_info", lambda b: Capabilities.from_object_info(self.name, b), body
        )

    async def is_output_node(self, class_type: str) -> bool:
        """Whether ``class_type`` is an output node on this server (``output_node`` of
        GET /object_info/{class}; basics.json). Asked once per class per client; an
        unknown class (``{}``) is not one."""
        known = self._output_classes.get(class_type)
        if known is not None:
            return known
        route = f"GET /object_info/{class_type}"
        body = await self._get_json(f"/object_info/{quote(class_type, safe='')}", route)
        if not isinstance(body, dict):
            raise self._unexpected(route, f"body is {type(body).__name__}, not an object")
        info = body.get(class_type)
        answer = isinstance(info, dict) and info.get("output_node") is True
        self._output_classes[class_type] = answer
        return answer

    async def free(self, unload_models: bool = True, free_memory: bool = True) -> None:
        """POST /free (basics.json)."""
        await self._post_ok("/free", {"unload_models": unload_models, "free_memory": free_memory})

    async def upload_input(
        self,
        data: bytes,
        filename: str,
        *,
        subfolder: str = "",
        overwrite: bool = False,
        type: str = "input",
    ) -> UploadedFile:
        """POST /upload/image: stores ``data`` as ``filename`` in ``subfolder`` of the
        server's ``type`` folder (input, temp or output), multipart fields ``image``,
        ``type``, ``subfolder``, ``overwrite`` (data/recorded/upload.json, README fact 12).

        Returns the UploadedFile the server answered; a prompt names it
        ``uploaded.prompt_name`` ("subfolder/name"). The name answered is not always
        ``filename``: a file of that name with other bytes already there makes it
        ``name (1).ext`` unless ``overwrite``; the same bytes give the same name and are
        not written again.

        ``filename`` must be a plain name: ComfyUI joins it to the subfolder before any
        check, so ``../x.png`` is stored one folder up (upload.json); ValueError for a
        name with a separator, ``.``/``..``, or a control character. ``subfolder`` is the
        server's to check: one leaving its folder is refused (400).

        Raises InputRejected (400 or 413, permanent), ServerError (5xx: an unknown
        ``type`` is a 500 in v0.8.0), UnexpectedAnswer (a name that is unsafe to put in a
        prompt, a subfolder or type other than those sent, another shape), and the
        connection errors of every route.
        """
        import aiohttp

        problem = unsafe_name(filename)
        if problem is not None:
            raise ValueError(f"upload file name {quoted(filename)}: {problem}")
        where = f"{subfolder}/{filename}" if subfolder else filename
        route = f"POST /upload/image {where}"
        form = aiohttp.FormData()
        content_type = mimetypes.guess_type(filename)[0] or "application/octet-stream"
        form.add_field("image", data, filename=filename, content_type=content_type)
        form.add_field("type", type)
        form.add_field("subfolder", subfolder)
        form.add_field("overwrite", "true" if overwrite else "false")
        response = await self._request("POST", "/upload/image", route, form=form)
        if response.status in (400, 413):
            raise self._input_rejected(route, response)
        self._check(route, response)
        uploaded = self._parse(route, UploadedFile.from_json, self._json(route, response))
        if (uploaded.subfolder, uploaded.type) != (subfolder, type):
            raise self._unexpected(
                route,
                f"answered subfolder {quoted(uploaded.subfolder)} and type "
                f"{quoted(uploaded.type)}, not those sent",
            )
        problem = unsafe_name(uploaded.name)
        if problem is not None:
            raise self._unexpected(route, f"answered name {quoted(uploaded.name)}: {problem}")
        return uploaded

    def _input_rejected(self, route: str, response: Answer) -> InputRejected:
        """400 or 413 of POST /upload/image, in words (ComfyUI's 400 has no body)."""
        body = excerpt(response.text)
        if body:
            detail = f"refused: {body}"
        elif response.status == 413:
            detail = "refused: larger than the server's upload limit"
        else:
            detail = (
                "refused, no reason given (ComfyUI answers so for a subfolder or name "
                "that leaves its input folder, or a request without a file)"
            )
        return InputRejected(
            f"{self.name}: {route} {response.status}, {detail}",
            server=self.base_url,
            status=response.status,
            detail=detail,
        )

    async def view(self, filename: str, subfolder: str, type: str) -> bytes:
        """GET /view whole in memory. Raises OutputMissing on 404."""
        chunks = [c async for c in self.iter_view(filename, subfolder, type)]
        return b"".join(chunks)

    async def iter_view(
        self,
        filename: str,
        subfolder: str,
        type: str,
        *,
        chunk_bytes: int = 1 << 16,
        max_bytes: int | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """GET /view streamed in chunks of up to ``chunk_bytes`` bytes. Raises
        OutputMissing on 404, UnexpectedAnswer on 400/403 (basics.json), OutputTooLarge
        when the file is over ``max_bytes`` bytes (by its Content-Length, before any
        chunk, or once the chunks pass it). Close it with ``contextlib.aclosing`` when
        not read to the end."""
        query = urlencode({"filename": filename, "subfolder": subfolder, "type": type})
        route = f"GET /view {subfolder + '/' if subfolder else ''}{filename}"
        with self._mapped(route):
            request = self._session().get(self._url(f"/view?{query}"), allow_redirects=False)
            async with request as response:
                if response.status != 200:
                    answer = Answer(response.status, response.headers, await response.read())
                    if answer.status == 404:
                        raise OutputMissing(
                            f"{self.name}: {route}: 404 not found", server=self.base_url
                        )
                    self._check(route, answer)
                self._check_view_type(route, filename, response.headers)
                if max_bytes is not None:
                    length = response.headers.get("content-length", "")
                    if length.isdigit() and int(length) > max_bytes:
                        raise self._too_large(route, f"{int(length)} bytes", max_bytes)
                size = 0
                async for chunk in response.content.iter_chunked(chunk_bytes):
                    size += len(chunk)
                    if max_bytes is not None and size > max_bytes:
                        raise self._too_large(route, f"more than {max_bytes} bytes", max_bytes)
                    yield chunk

    def _check_view_type(self, route: str, filename: str, headers: Mapping[str, str]) -> None:
        """Raise NotTheFile when the answer's media type is not the one ComfyUI sends for
        ``filename`` (``view_content_type``). Accepted besides: no Content-Type at all (it
        says nothing), and application/octet-stream on either side, since two machines'
        MIME tables may disagree on a rare extension."""
        got = headers.get("content-type", "").split(";")[0].strip().lower()
        expected = view_content_type(filename)
        if not got or got == expected or "application/octet-stream" in (got, expected):
            return
        raise NotTheFile(
            f"{self.name}: {route}: answered {got}, not the file "
            f"({expected} expected): something between us and ComfyUI answered instead?",
            server=self.base_url,
        )

    def _too_large(self, route: str, size: str, limit: int) -> OutputTooLarge:
        return OutputTooLarge(
            f"{self.name}: {route}: {size}, over the limit of {limit} bytes (max_output_bytes)",
            server=self.base_url,
            limit=limit,
        )

    def ws_url(self, client_id: str) -> str:
        """``ws://host:port/ws?clientId=...`` (wss for https)."""
        scheme = "wss" if self.base_url.startswith("https") else "ws"
        rest = self.base_url.split("://", 1)[1]
        return f"{scheme}://{rest}/ws?{urlencode({'clientId': client_id})}"

    async def connect_ws(self, client_id: str) -> ClientConnection:
        """Open /ws with this clientId (errors mapped like HTTP ones). A new socket with
        the same clientId replaces the old one on the server (README fact 4)."""
        import websockets

        route = "WS /ws"
        try:
            return await websockets.connect(
                self.ws_url(client_id),
                additional_headers=self.auth_headers or None,
                logger=_WS_LOG,
                open_timeout=self.timeout_s,
                max_size=_WS_MAX_MESSAGE,
                compression=None,  # local JSON messages: deflate costs CPU, saves nothing
                close_timeout=2.0,  # seconds; a dead server must not hold up our exit
            )
        except websockets.InvalidStatus as exc:
            status = exc.response.status_code
            body = exc.response.body.decode("utf-8", "replace") if exc.response.body else ""
            raise self._bad_status(route, status, body) from exc
        except (websockets.InvalidHandshake, websockets.ConnectionClosed) as exc:
            raise ConnectionLost(f"{self.name}: {route}: {exc}", server=self.base_url) from exc
        except TimeoutError as exc:
            raise RequestTimeout(
                f"{self.name}: {route}: no answer within {self.timeout_s:g} s", server=self.base_url
            ) from exc
        except ConnectionRefusedError as exc:
            raise ServerUnreachable(
                f"{self.name}: {route}: connection refused ({self.base_url})",
                server=self.base_url,
                reason="connection refused",
            ) from exc
        except OSError as exc:
            raise ServerUnreachable(
                f"{self.name}: {route}: cannot connect ({exc}) ({self.base_url})",
                server=self.base_url,
                reason=unreachable_reason(exc, self.base_url),
            ) from exc

    # -- plumbing ---------------------------------------------------------------------

    def _mapped(self, route: str) -> MappedErrors:
        """Turn aiohttp's errors into our typed errors, naming server and route."""
        return MappedErrors(self, route)

    async def _request(
        self, method: str, path: str, route: str, *, json: Any = None, form: Any = None
    ) -> Answer:
        """One request, its answer read whole; ``json`` is sent as a compact UTF-8 body
        (NaN or infinity raise ValueError: JSON has neither), ``form`` (an
        ``aiohttp.FormData``) as it encodes itself."""
        data = form
        headers = None
        if json is not None:
            data = json_dumps(json).encode()
            headers = {"Content-Type": "application/json"}
        with self._mapped(route):
            request = self._session().request(
                method, self._url(path), data=data, headers=headers, allow_redirects=False
            )
            async with request as response:
                return Answer(response.status, response.headers, await response.read())

    async def _get_json(self, path: str, route: str | None = None) -> Any:
        route = route or f"GET {path}"
        response = await self._request("GET", path, route)
        self._check(route, response)
        return self._json(route, response)

    def read_json(self, route: str, answer: Answer, parse: Callable[[Any], T]) -> T:
        """``parse`` of the JSON body of a 200 ``answer`` to ``route`` ("GET /queue"),
        as every route here reads it. Raises ServerError (5xx), UnexpectedAnswer (any
        other status, a body that is not JSON or not of the shape ``parse`` expects)."""
        self._check(route, answer)
        return self._parse(route, parse, self._json(route, answer))

    async def _post_ok(self, path: str, payload: dict[str, Any]) -> None:
        route = f"POST {path}"
        response = await self._request("POST", path, route, json=payload)
        self._check(route, response)

    def _check(self, route: str, response: Answer) -> None:
        """Raise for any status but 200: ServerError for 5xx, UnexpectedAnswer otherwise."""
        status = response.status
        if status == 200:
            return
        raise self._bad_status(route, status, response.text)

    def _bad_status(self, route: str, status: int, body: str) -> ComfyError:
        """ServerError for a 5xx answer, UnexpectedAnswer for any other but 200."""
        if status >= 500:
            return ServerError(
                f"{self.name}: {route}: {status} {excerpt(body)}".rstrip(),
                server=self.base_url,
                status=status,
                body=body,
            )
        return self._unexpected(route, self._status_text(status, body))

    def _status_text(self, status: int, body: str) -> str:
        """``status 404 <body>``; for a 401 what to do about it instead of the body (a
        proxy's login page)."""
        if status == 401:
            if self._authenticated:
                return "status 401 (the user and password of the server URL were refused)"
            return (
                "status 401 (the server or a proxy in front of it wants a user and password: "
                "give them in the URL, http://user:password@host:port)"
            )
        return f"status {status} {excerpt(body)}".rstrip()

    def _json(self, route: str, response: Answer) -> Any:
        try:
            return json.loads(response.body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise self._unexpected(route, f"body is not JSON: {excerpt(response.text)!r}") from exc
        except RecursionError as exc:  # json's decoder stops near 1,000 levels of nesting
            raise self._unexpected(route, "body is JSON nested too deeply to read") from exc

    def _parse(self, route: str, parse: Callable[[Any], T], body: Any) -> T:
        try:
            return parse(body)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise self._unexpected(
                route, f"unexpected shape ({type(exc).__name__}: {exc})"
            ) from exc

    def _rejected(self, route: str, response: Answer) -> ComfyError:
        """400 of POST /prompt: ``{"error": {type, message, details}, "node_errors"}``."""
        body = self._json(route, response)
        try:
            error = body["error"]
            error_type = str(error["type"])
            node_errors = body.get("node_errors") or {}
            text = f"{excerpt(error_type)}: {excerpt(str(error.get('message', '')))}"
            details = error.get("details")
            if details and details != error.get("message"):
                text += f" ({excerpt(str(details))})"
            if node_errors:
                text += f": {format_node_errors(node_errors)}"
        except (KeyError, TypeError, AttributeError) as exc:
            raise self._unexpected(
                route, f"400 of unexpected shape: {excerpt(response.text)}"
            ) from exc
        return PromptRejected(
            f"{self.name}: {route} 400, {text}",
            server=self.base_url,
            error_type=error_type,
            node_errors=node_errors,
            detail=text,
        )

    def _unexpected(self, route: str, what: str) -> UnexpectedAnswer:
        return UnexpectedAnswer(f"{self.name}: {route}: {what}", server=self.base_url)
