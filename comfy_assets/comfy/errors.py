"""Typed errors of the ComfyUI layer.

Each class says *what* failed, so a caller classifies transient vs permanent by type,
never by parsing strings (as HTTP clients type theirs: ConnectError, ReadTimeout, ...).
Every error carries the server's base URL in ``server``.
"""

from __future__ import annotations

from typing import Any


class ComfyError(Exception):
    """Base of every error raised by ``comfy_assets.comfy``.

    ``transient`` tells the runner whether another attempt may succeed.
    """

    transient: bool = True

    def __init__(self, message: str, *, server: str = "") -> None:
        super().__init__(message)
        self.server = server
        self.message = message


class ServerUnreachable(ComfyError):
    """The TCP connection was refused or could not be made (server down, restarting, a
    name that does not resolve). ``reason`` says which, in a few words for people
    ("connection refused", "host not found: gpu7.example")."""

    def __init__(self, message: str, *, server: str = "", reason: str = "") -> None:
        super().__init__(message, server=server)
        self.reason = reason or "cannot connect"


class ConnectionLost(ComfyError):
    """An established connection was reset or closed mid-request or mid-socket."""


class RequestTimeout(ComfyError):
    """The server did not answer within the client's timeout (seconds)."""


class ServerError(ComfyError):
    """A 5xx answer. ``status`` is the HTTP status, ``body`` the text (ComfyUI sends
    ``text/plain`` "500 Internal Server Error ..." for a body that is not JSON;
    data/recorded/validation_errors.json)."""

    def __init__(self, message: str, *, server: str = "", status: int, body: str) -> None:
        super().__init__(message, server=server)
        self.status = status
        self.body = body


class PromptRejected(ComfyError):
    """POST /prompt answered 400: the prompt failed validation (permanent).

    ``error_type`` is ComfyUI's ``error.type`` (``prompt_outputs_failed_validation``,
    ``invalid_prompt``, ``prompt_no_outputs``, ``no_prompt``); ``node_errors`` is the dict
    keyed by node id, as recorded in data/recorded/validation_errors.json. ``detail`` is
    the readable reason alone (type, message, node errors), without server and route.
    """

    transient = False

    def __init__(
        self,
        message: str,
        *,
        server: str = "",
        error_type: str,
        node_errors: dict[str, Any],
        detail: str = "",
    ) -> None:
        super().__init__(message, server=server)
        self.error_type = error_type
        self.node_errors = node_errors
        self.detail = detail or message


class InputRejected(ComfyError):
    """POST /upload/image refused the file (permanent: the same upload is refused again).
    ComfyUI v0.8.0 answers 400 with an empty body for a subfolder or name that leaves its
    input folder, or no file (data/recorded/upload.json); a file over its upload limit
    (100 MB by default) gets 413. ``status`` is the HTTP status, ``detail`` the reason in
    words without server and route."""

    transient = False

    def __init__(self, message: str, *, server: str = "", status: int, detail: str) -> None:
        super().__init__(message, server=server)
        self.status = status
        self.detail = detail


class UnexpectedAnswer(ComfyError):
    """The server answered something this client does not understand (a 4xx other than
    the recorded ones, a body that is not the recorded shape). Permanent: retrying the
    same request gets the same answer."""

    transient = False


class UnsafeOutputName(ComfyError):
    """A filename or subfolder from /history would escape the destination folder
    (``..``, an absolute path, a separator inside a file name) or holds a control
    character (a newline breaks line-based lists such as FFmpeg's concat file).
    Permanent."""

    transient = False


class NotTheFile(ComfyError):
    """GET /view answered 200 with a Content-Type ComfyUI never sends for that file name
    (an HTML login page of a proxy in between, say). Transient: the next attempt asks
    again; the bytes are not kept."""


class OutputTooLarge(ComfyError):
    """An output of /view is larger than the caller's limit (``limit`` bytes), by its
    Content-Length or by the bytes it sent. Permanent: the same prompt writes the same
    file again."""

    transient = False

    def __init__(self, message: str, *, server: str = "", limit: int) -> None:
        super().__init__(message, server=server)
        self.limit = limit


class OutputMissing(ComfyError):
    """GET /view answered 404 for a file that /history listed (deleted or moved on the
    server since). Transient: running the prompt again writes it again
    (404 shape: data/recorded/basics.json)."""


class PromptLost(ComfyError):
    """The prompt is neither in /queue nor in /history under its run number: the server
    restarted (or the prompt was deleted) and forgot it (data/recorded/restart.json).
    Transient: post it again."""


class DeadlineExceeded(ComfyError):
    """The prompt did not finish within the caller's deadline (seconds). Transient; the
    caller should interrupt the prompt so the server is free again."""


class PromptStalled(DeadlineExceeded):
    """The prompt runs, and nothing was heard of it (no ``executing``, ``progress`` or
    other message about it) for the caller's ``stall_s`` seconds: the server may be
    wedged inside a node. Transient; the caller interrupts the prompt as after a
    deadline, and a prompt that then stays running means a server that runs nothing."""


class NoServerReachable(Exception):
    """No server of the pool answered for ``waited_s`` seconds (each one's last probe
    failed; ``reasons`` by server name). Not a ComfyError on purpose: it is no attempt's
    failure (retrying would only burn attempts), it ends the batch with its unrun jobs
    still pending. ``what`` is "usable" when the servers answer but every one is
    quarantined (``pool/quarantine.py``); ``why``, when given, says why the batch stops
    before its wait is over."""

    def __init__(
        self, waited_s: float, reasons: dict[str, str], what: str = "reachable", why: str = ""
    ) -> None:
        listed = "; ".join(f"{name} {why}" for name, why in reasons.items())
        if why:  # it stops before the wait is over, and says why
            super().__init__(f"no server {what} ({listed}); {why}")
        else:
            super().__init__(f"no server {what} for {waited_s:.3g} s ({listed})")
        self.waited_s = waited_s
        self.reasons = reasons


class NoServerCanRun(Exception):
    """No server of the pool can run a job: each one checked lacks a node class or a
    model file it needs (read from its /object_info), and the others were unreachable
    for longer than the pool waits. Not a ComfyError: nothing was posted; the job is a
    dead letter with ``reason``, e.g. ``no server has checkpoint 'sdxl.safetensors'
    (gpu0, gpu1 checked)``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
