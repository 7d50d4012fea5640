"""A free TCP port of 127.0.0.1 for a server a test starts (in this process or another)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# The lowest port tried; the highest is just below the system's ephemeral range.
LOWEST = 10000


def ephemeral_low() -> int:
    """The first port of the system's ephemeral range (Linux's ip_local_port_range), or
    32768 where it cannot be read."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now, below the ephemeral range: a
    port from that range, once freed, can be taken by the local end of any outgoing
    connection (a database client's, an HTTP client's) before the server meant for it
    binds it, which then fails with "Address already in use". Raises RuntimeError when
    no port of the range is free after 200 tries."""
    high = ephemeral_low()
    for _ in range(200):
        port = random.randrange(LOWEST, high) if high > LOWEST + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError(f"no free port of 127.0.0.1 between {LOWEST} and {high}")
