"""Which webhook URLs the API calls: http(s) only, and only public addresses unless
``--allow-private-webhooks``.

A webhook is a request our host makes to a place a client names, so without a check a
client could make the API call what only our network reaches: the cloud's metadata
service (169.254.169.254, fd00:ec2::254), loopback (our own ComfyUI servers, RabbitMQ's
management UI), a private network. A URL is refused when it is not http(s), has user
info, or any address its host resolves to is not a global unicast address
(``ipaddress``'s ``is_global``: loopback, link-local, private, shared, reserved,
multicast and unspecified ranges are all outside it); an IPv6 address that reaches an
IPv4 one through a translator (IPv4-mapped, 6to4, NAT64) is judged by that IPv4 address,
and a local-use NAT64 prefix is refused. The check is made at submission
(422) and again at each delivery: a host that is an address is checked before the
delivery connects (``delivery_problem``: aiohttp connects to an address without asking
its resolver), and a name by the resolver the delivery connects through
(``GuardedResolver``), so a name that resolves elsewhere later (DNS rebinding) is
refused too, and so is a URL accepted by an API process allowed private addresses when
one that is not delivers it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import ipaddress
import socket
from urllib.parse import urlsplit

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

MAX_URL_CHARS = 2000
_DNS_THREADS = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="webhook-dns")


class RefusedUrl(ValueError):
    """A webhook URL the API will not call; the message says why."""


def address_problem(text: str) -> str | None:
    """Why the address ``text`` may not be called (``127.0.0.1, a loopback address``), or
    None for a global one."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return f"{text!r}, not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return f"{ip}, a local-use NAT64 address"
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            ip = embedded
    # Some reserved IPv6 ranges count as global to ipaddress (::/8 holds the deprecated
    # IPv4-compatible ``::127.0.0.1`` and the translated ``::ffff:0:127.0.0.1``).
    if ip.is_global and not ip.is_multicast and not ip.is_reserved:
        return None
    # The narrowest kind first: 0.0.0.0 and 127.0.0.1 are in ipaddress's private ranges too.
    for kind in ("unspecified", "loopback", "link_local", "multicast", "private", "reserved"):
        if getattr(ip, f"is_{kind}"):
            article = "an" if kind[0] == "u" else "a"
            return f"{ip}, {article} {kind.replace('_', '-')} address"
    return f"{ip}, not a public address"


# RFC 6052's well-known NAT64 prefix (the IPv4 address in the last 32 bits) and RFC
# 8215's local-use one (a network's own translator: never a public address).
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one reaches through a translator, judged in its place:
    IPv4-mapped (``::ffff:127.0.0.1``), 6to4 (``2002:7f00:1::``) or NAT64
    (``64:ff9b::7f00:1``); None for any other."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def url_problem(url: str) -> str | None:
    """What is wrong with ``url`` before it is resolved, or None."""
    if len(url) > MAX_URL_CHARS:
        return f"longer than {MAX_URL_CHARS} characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return f"not a URL: {e}"
    if parts.scheme not in ("http", "https"):
        return f"not an http(s) URL (scheme {parts.scheme!r})"
    if not parts.hostname:
        return "no host"
    if parts.username is not None or parts.password is not None:
        return "user info in a webhook URL is refused"
    if port == 0:
        return "port 0"
    if any(ord(c) < 33 or ord(c) == 127 for c in url):
        return "white space or control characters"
    return None


def delivery_problem(url: str, *, allow_private: bool) -> str | None:
    """Why a delivery to ``url`` is not made, found before it connects: ``url_problem``,
    or, unless ``allow_private``, a host that is an address (``http://127.0.0.1/``,
    ``http://[::1]/``) outside the public ones, which aiohttp would connect to without
    asking ``GuardedResolver``. None: go ahead (a name is the resolver's to judge)."""
    problem = url_problem(url)
    if problem is not None or allow_private:
        return problem
    host = urlsplit(url).hostname or ""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    problem = address_problem(host)
    if problem is None:
        return None
    return f"its host is {problem} (refused unless --allow-private-webhooks)"


async def check_url(url: str, *, allow_private: bool, timeout_s: float = 5.0) -> None:
    """Refuse ``url`` (raise RefusedUrl) when it is not http(s) or, unless
    ``allow_private``, when its host resolves to an address that is not public (or does
    not resolve within ``timeout_s`` seconds)."""
    problem = url_problem(url)
    if problem is not None:
        raise RefusedUrl(problem)
    if allow_private:
        return
    host = urlsplit(url).hostname or ""
    loop = asyncio.get_running_loop()
    lookup = functools.partial(socket.getaddrinfo, host, None, type=socket.SOCK_STREAM)
    try:
        # On threads of their own: a name that resolves slowly (a client's choice) holds
        # one of them, never one of the store's.
        infos = await asyncio.wait_for(loop.run_in_executor(_DNS_THREADS, lookup), timeout_s)
    except (OSError, TimeoutError) as e:
        raise RefusedUrl(f"its host {host!r} does not resolve: {e}") from e
    for info in infos:
        problem = address_problem(str(info[4][0]))
        if problem is not None:
            raise RefusedUrl(
                f"its host {host!r} resolves to {problem} (refused unless --allow-private-webhooks)"
            )


class GuardedResolver(AbstractResolver):
    """aiohttp's resolver, answering only public addresses (``address_problem``): a
    delivery cannot reach what the submission check refused, whatever the name resolves
    to by then. ``allow_private`` lets every address through."""

    def __init__(self, allow_private: bool) -> None:
        self._inner = DefaultResolver()
        self.allow_private = allow_private

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        if self.allow_private:
            return found
        allowed = [r for r in found if address_problem(r["host"]) is None]
        if not allowed:
            problem = address_problem(found[0]["host"]) if found else "nothing"
            raise OSError(f"webhook host {host!r} resolves to {problem}; not called")
        return allowed

    async def close(self) -> None:
        await self._inner.close()
