"""Claim and lease owners: ``host:pid:random``, and whether one of this host is gone."""

from __future__ import annotations

import os
import socket
import uuid


def new_owner() -> str:
    """A claim/lease owner id naming this host and process: ``host:pid:random``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def owner_alive(owner: str) -> bool:
    """False only for an owner of this host whose process is gone (its claims need not
    wait for their lease); True when unsure (another host, or an id of another shape)."""
    host, _, rest = owner.partition(":")
    pid_text = rest.split(":", 1)[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return True
    pid = int(pid_text)
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
