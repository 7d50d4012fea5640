"""A quick path for the job lines of a big file whose shape repeats (``QuickLines``),
used by ``scan_job_file``'s pass: a million lines naming one workflow file differ only
in their values.

A line takes the quick path only when the answer is sure to be the one ``LineParser``
gives: decoded by json's C decoder with no hook per object (``flat_object``: an object
whose values are scalars or objects of scalars, with no key repeated), then checked
field by field for what differs from line to line (id, shot, duration_s, optional,
take), while what depends only on its shape (its keys, the workflow file it names, the
node inputs its ``set`` names) was checked once, on the first line of that shape, by
``LineParser.fields``. Quicker still, a line with the very text of a valid line of
id, workflow and set but for its id and its ``set`` values (``QuickLines.template``) is
matched on its bytes by one regex, which takes only values the decoder would take as
they are (short numbers, printable ASCII text, true, false, null), so no decoding is
needed. Any other line, and any line with a problem, goes through
``LineParser`` as before: its errors are those ``load_job_file`` gives, in the same
order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from comfy_assets.jobs.model import UUID_PATTERN
from comfy_assets.jobs.parse import MAX_TAKE, LineParser
from comfy_assets.jobs.strict_json import (
    NonFinite,
    is_number,
    is_shot,
    parse_float,
)

# The C scanner of json's decoder without ``object_pairs_hook`` (every object is built in
# C; repeated keys are found by counting instead, ``flat_object``), called as raw_decode
# calls it (typeshed does not list the attribute).
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder(
    parse_float=parse_float, parse_constant=NonFinite
).scan_once  # type: ignore[attr-defined]
# The end of a key: its closing quote, then a colon. A string value opening with a colon
# matches too: that only makes the count larger (the slow path then).
_KEY_END = re.compile(r'"\s*:')
# A job id as ``LineParser`` takes it (``UUID_PATTERN``), caught.
_ID = rb'"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"'
# A ``set`` value a template takes: an integer or a decimal short enough to be finite and
# decodable (no exponent: 1e400 is not), printable ASCII text without a quote or a
# backslash, true, false or null. Anything else (an array is a link) is decoded.
_VALUE = (
    rb"(?:-?(?:0|[1-9][0-9]{0,300})(?:\.[0-9]{1,300})?"
    rb'|"[\x20\x21\x23-\x5b\x5d-\x7e]*"|true|false|null)'
)
# A template's ``fullmatch``: the match of a line's bytes, its id as group 1, or None.
Template = Callable[[bytes], "re.Match[bytes] | None"]
# A shape: the line's keys in order, the workflow file it names, the keys of its ``set``.
Shape = tuple[tuple[str, ...], str, tuple[str, ...]]


def flat_object(text: str) -> dict[str, Any] | None:
    """``text`` decoded, when it is a JSON object whose values are scalars or objects of
    scalars, no key repeated, no non-finite number and no string or key a server or the
    store could not take; else None (``LineParser.parse_line`` judges it)."""
    # Not printable: a control character (or a rarer separator), for the slow path.
    if "\\" in text or not text.isprintable():
        return None
    made = NonFinite.made
    try:
        # The text is stripped: the value must end where the text does.
        obj, end = _scan(text, 0)
    except (StopIteration, ValueError, RecursionError):
        return None  # LineParser.parse_line reports it
    if end != len(text) or type(obj) is not dict or NonFinite.made != made:
        return None
    keys = len(obj)
    for value in obj.values():
        if type(value) is dict:
            keys += len(value)
            for inner in value.values():
                if type(inner) is dict or type(inner) is list:
                    return None
        elif type(value) is list:
            return None
    # Each key in the text is followed by one colon outside strings (no backslash: no
    # string holds a quote), so as many colons as keys in the dict means no key repeated;
    # colons in strings only make the count larger, and then the keys' ends are counted.
    if text.count(":") == keys or len(_KEY_END.findall(text)) == keys:
        return obj
    return None


class QuickLines:
    """Checks job lines of ``parser``'s file whose shape a valid line had before
    (``valid``), remembering the shapes of valid lines (``learn``)."""

    def __init__(self, parser: LineParser) -> None:
        self.parser = parser
        self.shapes: set[Shape] = set()

    @staticmethod
    def shape(obj: dict[str, Any]) -> Shape | None:
        """The shape of a parsed job line, or None for one the quick path does not take
        (an inline workflow, inputs: checked per line)."""
        spec = obj.get("workflow")
        overrides = obj.get("set", {})
        if type(spec) is not str or type(overrides) is not dict or "inputs" in obj:
            return None
        return (tuple(obj), spec, tuple(overrides))

    def valid(self, obj: dict[str, Any], shape: Shape | None) -> bool:
        """True when the line ``obj`` (from ``flat_object``) is sure to be valid: a valid
        line had its ``shape``, and its own values are as ``LineParser.fields`` wants."""
        if shape not in self.shapes:
            return False
        job_id = obj["id"]  # the shape of a valid line has an id
        if type(job_id) is not str or UUID_PATTERN.fullmatch(job_id) is None:
            return False
        if len(obj) == 3 and "set" in obj:  # id, workflow, set: the rest are defaults
            return True
        shot = obj.get("shot")
        if shot is not None and not is_shot(shot):
            return False
        duration = obj.get("duration_s")
        if duration is not None and not (is_number(duration) and duration > 0):
            return False
        if type(obj.get("optional", False)) is not bool:
            return False
        take = obj.get("take", 1)
        return type(take) is int and 1 <= take <= MAX_TAKE

    def template(self, obj: dict[str, Any], raw: bytes) -> Template | None:
        """A template of the valid line ``obj`` (read as ``raw``): a regex on the bytes of
        a line that has the same text but for its id and its ``set`` values, the id
        caught as its group 1; None when ``obj`` has other fields than id, workflow and
        set, or its text is spaced otherwise than json.dumps spaces it."""
        if set(obj) != {"id", "workflow", "set"}:
            return None
        overrides = obj["set"]
        if type(overrides) is not dict:
            return None
        for item, key in (", ", ": "), (",", ":"):

            def text(value: Any, key: str = key) -> bytes:
                return re.escape(json.dumps(value, ensure_ascii=False).encode() + key.encode())

            parts = []
            for name, value in obj.items():
                if name == "id":
                    part = text(name) + _ID
                elif name == "workflow":
                    part = text(name) + re.escape(json.dumps(value, ensure_ascii=False).encode())
                else:
                    entries = item.encode().join(text(k) + _VALUE for k in overrides)
                    part = text(name) + b"\\{" + entries + b"\\}"
                parts.append(part)
            pattern = re.compile(b"\\{" + item.encode().join(parts) + b"\\}\\r?\\n?")
            if pattern.fullmatch(raw):
                return pattern.fullmatch
        return None

    def learn(self, shape: Shape | None) -> None:
        """Remember ``shape``: a line of that shape was found valid by ``LineParser``
        (its ``set`` holds no array: a link there is an error of its value)."""
        if shape is not None:
            self.shapes.add(shape)
