"""How a pool takes, probes and follows its servers (``PoolSettings``), and ``knob``: a
dataclass field that carries the sentence saying what it does."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


def knob(default: object, doc: str) -> Any:
    """A dataclass field with ``default`` and ``metadata["doc"]``, one or two sentences:
    the one text of a setting, which the commands' ``--help`` and config schemas show."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclass
class PoolSettings:
    """How a ``Pool`` takes, probes and follows its servers (seconds everywhere; each
    field's ``metadata["doc"]`` says what it does)."""

    server_lease_s: float = knob(
        30.0,
        "Seconds a server stays ours without renewal: one prompt of ours per server, across "
        "runs and workers.",
    )
    probe_timeout_s: float = knob(
        3.0, "Seconds to wait for a server's answer when checking it is up."
    )
    max_queue: int | None = knob(
        None, "Skip a server with this many prompts queued; none: no limit."
    )
    unhealthy_wait_s: float = knob(
        5.0, "Seconds before a server that did not answer is checked again."
    )
    poll_s: float = knob(1.0, "Seconds between looks at a server's history while a prompt runs.")
    unreachable_timeout_s: float | None = knob(
        None,
        "Seconds with no server reachable after which acquiring one raises "
        "NoServerReachable; none waits for ever.",
    )
