"""Naming the ComfyUI servers: ``gpu0=http://127.0.0.1:8188`` items.

A URL may carry a user and password (``http://render:s3cret@gpu0.internal:8188``, for a
server behind an authenticating proxy). They are taken out of the URL here, at parse
time, and kept apart in ``Credentials``: the client sends them as HTTP basic auth (on
``/ws`` too), and every text written downstream (errors, reasons, health lines, events,
CSV, Dagster metadata, message headers) only ever sees the URL without them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit, urlunsplit

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Credentials:
    """A user and password for HTTP basic auth, percent-decoded (``p%40ss`` in a URL
    is ``p@ss`` here). Neither shows in ``repr`` or ``str``."""

    user: str = field(repr=False)
    password: str = field(repr=False)

    def __repr__(self) -> str:
        return "Credentials(***)"

    __str__ = __repr__


def split_credentials(url: str) -> tuple[str, Credentials | None]:
    """``url`` without its ``user:password@`` part, and that part as ``Credentials``
    (None when the URL has none; a user without a password gets an empty password).
    Nothing else of the URL is checked or changed."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    clean = urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment))
    if not user and not password:
        return clean, None
    return clean, Credentials(unquote(user), unquote(password))


def redact_url(url: str) -> str:
    """``url`` with everything up to its last ``@`` after the scheme shown as ``***``
    (for messages about the URL itself); unchanged when it has no ``@``. Cruder than
    ``split_credentials`` on purpose: a password with an unencoded ``#`` or ``/``
    is hidden too."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}"


@dataclass(frozen=True)
class ServerSpec:
    """One server: a short ``name`` for logs and leases, its base ``url`` (no trailing
    slash, never with a user or password) and its ``credentials`` for basic auth.

    A ``url`` given with ``user:password@`` is split at construction, so a spec built
    anywhere (tests, Dagster config, a benchmark) never carries them in its URL.
    """

    name: str
    url: str
    credentials: Credentials | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        url, credentials = split_credentials(self.url)
        if credentials is not None or url != self.url:
            object.__setattr__(self, "url", url)
            if self.credentials is None:
                object.__setattr__(self, "credentials", credentials)


def _check_url(url: str, item: str) -> str:
    """The URL of ``item`` without credentials, checked; ``item`` is shown redacted."""
    parts = urlsplit(url)
    try:
        port = parts.port  # raises ValueError for a port that is not a number
    except ValueError as exc:
        raise ValueError(f"server {item!r}: bad port in URL {redact_url(url)!r}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"server {item!r}: not an http(s)://host[:port] URL")
    if parts.query or parts.fragment or parts.path.strip("/"):
        raise ValueError(f"server {item!r}: URL must be http(s)://host[:port] only")
    if port == 0:
        raise ValueError(f"server {item!r}: port 0")
    return url.rstrip("/")


def parse_servers(items: list[str] | str) -> list[ServerSpec]:
    """Parse ``name=url`` items (a list, each possibly comma-separated, or one
    comma-separated string). A bare URL is named ``gpu<i>`` after its position. A URL's
    ``user:password@`` becomes the spec's ``credentials`` (percent-decoded).
    Raises ValueError naming the item (its password never shown) for a bad URL or
    name, a duplicate name or URL, or no server at all."""
    raw = [items] if isinstance(items, str) else list(items)
    flat = [part.strip() for item in raw for part in item.split(",") if part.strip()]
    if not flat:
        raise ValueError("no server given (expected name=http://host:port)")
    specs: list[ServerSpec] = []
    names: set[str] = set()
    urls: set[str] = set()
    for i, item in enumerate(flat):
        name, sep, given = item.partition("=")
        if not sep:
            name, given = f"gpu{i}", item
        name, given = name.strip(), given.strip()
        shown = f"{name}={redact_url(given)}" if sep else redact_url(item)
        try:
            bare, credentials = split_credentials(given)
        except ValueError as exc:  # urlsplit: "Invalid IPv6 URL"
            raise ValueError(f"server {shown!r}: {exc}") from exc
        url = _check_url(bare, shown)
        if not _NAME.match(name):
            raise ValueError(f"server {shown!r}: bad name {name!r} (letters, digits, _ . -)")
        if name in names:
            raise ValueError(f"server {shown!r}: duplicate name {name!r}")
        if url in urls:
            raise ValueError(f"server {shown!r}: URL {url} given twice")
        names.add(name)
        urls.add(url)
        specs.append(ServerSpec(name, url, credentials))
    return specs
