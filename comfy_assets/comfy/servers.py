"""Naming the ComfyUI servers: ``gpu0=http://127.0.0.1:8188`` items."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class ServerSpec:
    """One server: a short ``name`` for logs and leases, and its base ``url`` (no
    trailing slash)."""

    name: str
    url: str


def _check_url(url: str, item: str) -> str:
    parts = urlsplit(url)
    try:
        port = parts.port  # raises ValueError for a port that is not a number
    except ValueError as exc:
        raise ValueError(f"server {item!r}: bad port in URL {url!r}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"server {item!r}: not an http(s)://host[:port] URL")
    if parts.query or parts.fragment or parts.path.strip("/"):
        raise ValueError(f"server {item!r}: URL must be http(s)://host[:port] only")
    if port == 0:
        raise ValueError(f"server {item!r}: port 0")
    return url.rstrip("/")


def parse_servers(items: list[str] | str) -> list[ServerSpec]:
    """Parse ``name=url`` items (a list, each possibly comma-separated, or one
    comma-separated string). A bare URL is named ``gpu<i>`` after its position.
    Raises ValueError naming the item for a bad URL or name, a duplicate name or URL,
    or no server at all."""
    raw = [items] if isinstance(items, str) else list(items)
    flat = [part.strip() for item in raw for part in item.split(",") if part.strip()]
    if not flat:
        raise ValueError("no server given (expected name=http://host:port)")
    specs: list[ServerSpec] = []
    names: set[str] = set()
    urls: set[str] = set()
    for i, item in enumerate(flat):
        name, sep, url = item.partition("=")
        if not sep:
            name, url = f"gpu{i}", item
        name, url = name.strip(), _check_url(url.strip(), item)
        if not _NAME.match(name):
            raise ValueError(f"server {item!r}: bad name {name!r} (letters, digits, _ . -)")
        if name in names:
            raise ValueError(f"server {item!r}: duplicate name {name!r}")
        if url in urls:
            raise ValueError(f"server {item!r}: URL {url} given twice")
        names.add(name)
        urls.add(url)
        specs.append(ServerSpec(name, url))
    return specs
