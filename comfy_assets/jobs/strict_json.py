"""JSON as job files need it: no repeated keys, no numbers JSON cannot carry (NaN,
Infinity, 1e400), and values quoted short in error messages."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

# Values quoted in errors are cut to this many characters (a whole workflow is no help).
_SHOWN_CHARS = 80
# Far deeper than a job line or an API-format workflow needs (a few levels), and far below
# Python's recursion limit, which json's decoder, json.dumps and every recursive walk of a
# value meet near 1,000 levels with a RecursionError instead of an error to report.
MAX_DEPTH = 64


class TooDeep(ValueError):
    """JSON nested deeper than ``MAX_DEPTH``: a ValueError, so every place that reports
    "not usable JSON" for a too-long integer reports this too."""

    def __init__(self) -> None:
        super().__init__(f"nested more than {MAX_DEPTH} levels deep (objects and arrays)")


def loads_bounded(decode: Callable[[str], Any], text: str) -> Any:
    """``decode(text)`` (``json.loads`` or a decoder's ``decode``), refused with
    ``TooDeep`` when nested more than ``MAX_DEPTH`` levels, however deep: the decoder's
    own RecursionError near 1,000 levels is raised as ``TooDeep`` too. Other errors of
    ``decode`` (``json.JSONDecodeError``, ``ValueError``) pass through."""
    try:
        value = decode(text)
    except RecursionError:
        raise TooDeep() from None
    # Fewer brackets than levels allowed (those in strings count too) can't nest too deep:
    # most job lines are checked by two counts in C, not a walk.
    if text.count("[") + text.count("{") > MAX_DEPTH and too_deep(value):
        raise TooDeep()
    return value


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """True if ``value`` nests dicts and lists more than ``limit`` levels deep (the
    value itself is level 1). Walks without recursion, so any depth can be checked."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def is_link(value: Any) -> bool:
    """ComfyUI's API format writes a link as ``["<node id>", <output index>]``."""
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], int)
        and not isinstance(value[1], bool)
    )


# The store keeps shot numbers in a 32-bit INTEGER column (PostgreSQL's int4).
MAX_SHOT = 2**31 - 1


def is_shot(value: Any) -> bool:
    """An integer from 0 to MAX_SHOT (not a bool): a shot number."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SHOT


# C0 and C1 control characters and DEL: no name a person means holds one, and a newline
# or an escape sequence in one would split a log line or a CSV row, or drive a terminal.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def quoted(value: Any) -> str:
    """``value`` as JSON spells it (``true``, ``null``, ``"text"``), cut to a readable length."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def kind_of(value: Any) -> str:
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


class DuplicateKey(ValueError):
    pass


def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` that raises DuplicateKey (the key) for a key repeated in
    one object: json.loads keeps the last of two, and a repeated key is a typo to report."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return obj


FINITE_HINT = "ComfyUI accepts finite numbers only: no NaN, Infinity or beyond 1.8e308"


class NonFinite:
    """A number JSON cannot carry, as written in the file (``NaN``, ``-Infinity``,
    ``1e400``): kept as a marker so the error can name it and its field."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def parse_float(text: str) -> float | NonFinite:
    value = float(text)
    return value if math.isfinite(value) else NonFinite(text)


def first_non_finite(value: Any) -> str | None:
    """The first non-finite number inside ``value`` (any depth) as written, or None.

    Finds the decoder's markers and also real ``nan``/``inf`` floats (a dict that came
    from ``json.loads`` rather than from a job file).
    """
    if isinstance(value, NonFinite):
        return value.text
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)  # NaN, Infinity, -Infinity
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, list):
        return None
    for item in value:
        text = first_non_finite(item)
        if text is not None:
            return text
    return None


decoder = json.JSONDecoder(
    object_pairs_hook=no_duplicates, parse_float=parse_float, parse_constant=NonFinite
)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
