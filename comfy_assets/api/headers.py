"""Request headers a handler reads as numbers, each read within bounds: a client's text
is never handed to ``int()`` unchecked (it refuses over 4300 digits, and a huge number
would travel on into the store's queries).

``Range`` is read by ``files.byte_range``; the request line and ``Content-Length`` by
aiohttp's parser (400 for a malformed one, 413 past ``--max-body-bytes``).
"""

from __future__ import annotations

import re

from comfy_assets.api.shared import Answer, error

# Event ids are the store's integer keys: 64-bit, so at most 19 digits.
_EVENT_ID = re.compile(r"[0-9]{1,19}")
EVENT_ID_PATTERN = "^[0-9]{0,19}$"
MAX_EVENT_ID = 2**63 - 1


def last_event_id(text: str | None) -> int:
    """The event id of a ``Last-Event-ID`` header (0 when absent or empty: from the
    first event). Raises ``Answer`` (400) for anything but an id this API sends: up to
    19 digits, at most 2**63 - 1."""
    if not text:
        return 0
    if _EVENT_ID.fullmatch(text) is None or int(text) > MAX_EVENT_ID:
        # Not quoted back: a header's bytes need not be text an answer can carry.
        raise Answer(error(400, "Last-Event-ID: expected an event id (an integer)"))
    return int(text)
