"""Job events: the row the store keeps and the JSON log line beside it.

Every event row has a matching log line on the ``comfy_assets.jobs.events`` logger (INFO), one
JSON object per line with the same fields, so machines can follow a batch without the
database. This module configures no handler: the application chooses where lines go.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from typing import Any

LOGGER = logging.getLogger("comfy_assets.jobs.events")


@dataclass(frozen=True)
class Event:
    """One thing that happened to one job.

    ``time`` is seconds since the epoch. ``from_state`` is None when the job was first
    registered. ``from_state == to_state`` marks something that is not a state change
    (a claim taken over, inputs changed while pending). ``id`` is the row id (ascending in
    insertion order), None before the row is written.
    """

    id: int | None
    time: float
    job_id: str
    partition: str
    from_state: str | None
    to_state: str
    server: str | None = None
    attempt: int | None = None
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (JSON-ready)."""
        # Not dataclasses.asdict: its deep copy dominated writing 10,000 events.
        return {name: getattr(self, name) for name in _FIELDS}


_FIELDS = tuple(f.name for f in fields(Event))


def event_json(event: Event) -> str:
    """One line of JSON (no newline inside) for ``event``."""
    return json.dumps(event.to_dict(), ensure_ascii=False, separators=(",", ":"))


def log_event(event: Event) -> None:
    """Write ``event`` as a JSON line at INFO on ``comfy_assets.jobs.events``.

    The dict is also attached as ``record.event`` for handlers that want the fields.
    """
    if LOGGER.isEnabledFor(logging.INFO):
        LOGGER.info(event_json(event), extra={"event": event.to_dict()})
