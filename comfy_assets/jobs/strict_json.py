"""JSON as job files need it: no repeated keys, no numbers JSON cannot carry (NaN,
Infinity, 1e400), and values quoted short in error messages."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any, TypeGuard

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


def is_shot(value: object) -> TypeGuard[int]:
    """An integer from 0 to MAX_SHOT (not a bool): a shot number."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SHOT


# C0 and C1 control characters and DEL: no name a person means holds one, and a newline
# or an escape sequence in one would split a log line or a CSV row, or drive a terminal.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


# What no server and no store takes in a string, though JSON's \u escapes write both:
# NUL (PostgreSQL's text columns refuse it, and a file name ends at it) and a lone UTF-16
# surrogate (it has no UTF-8 encoding, so no POST body, row or log line can hold it).
UNTAKEABLE = re.compile(r"[\x00\ud800-\udfff]")
TAKEN_BY_NONE = "which neither a ComfyUI server nor the store can take"


def character_name(char: str) -> str:
    """``char`` in words for an error: "a NUL character (U+0000)", "a lone UTF-16
    surrogate (U+D800)", "a control character (U+001B)"."""
    code = ord(char)
    if code == 0:
        return "a NUL character (U+0000)"
    if 0xD800 <= code <= 0xDFFF:
        return f"a lone UTF-16 surrogate (U+{code:04X})"
    return f"a control character (U+{code:04X})"


def text_problems(obj: dict[str, Any]) -> list[tuple[str, str]]:
    """``(field, message)`` for each field of the parsed line ``obj`` holding a string no
    server or store takes (``UNTAKEABLE``, in a key or a value, at any depth), or a key
    holding a control character (node ids and input names never do; a newline or an
    escape sequence in one would split or drive the lines that name it). Fields are named
    as ``first_non_finite``'s are reported: ``set``, ``inputs`` and ``header`` entries
    one by one (``set.3.text``), a bad key by the object holding it; a place deeper in a
    value is written after the message as a path of JSON strings (``at ["3"]["inputs"]
    ["text"]``). Keys and values are shown ASCII-escaped, so the message itself holds
    none of them."""
    found: list[tuple[str, str]] = []
    for key, value in obj.items():
        if (bad := _bad_key(key)) is not None:
            found.append(("json", f"the key {_shown(key)} holds {bad}"))
            continue
        if key in ("set", "header", "inputs") and isinstance(value, dict):
            fields = []
            for sub, inner in value.items():
                if (bad := _bad_key(sub)) is not None:
                    found.append((key, f"the key {_shown(sub)} holds {bad}"))
                else:
                    fields.append((f"{key}.{sub}", inner))
        else:
            fields = [(key, value)]
        for name, inner in fields:
            problem = first_untakeable(inner)
            if problem is not None:
                found.append((name, problem))
    return found


def first_untakeable(value: Any) -> str | None:
    """Why ``value`` (a string, or any depth of objects and arrays) cannot be sent or
    stored: the first string holding ``UNTAKEABLE``, or a key holding one or a control
    character, in words with where it is; None when there is none. Walks without
    recursion."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            char = UNTAKEABLE.search(item)
            if char is not None:
                at = f" at {where}" if where else ""
                return f"holds {character_name(char[0])}{at}, {TAKEN_BY_NONE}"
        elif isinstance(item, dict):
            for key, inner in reversed(list(item.items())):
                path = f"{where}[{_shown(key)}]"
                if (bad := _bad_key(key)) is not None:
                    at = f" at {where}" if where else ""
                    return f"the key {_shown(key)}{at} holds {bad}"
                stack.append((inner, path))
        elif isinstance(item, list):
            stack.extend((inner, f"{where}[{i}]") for i, inner in reversed(list(enumerate(item))))
    return None


def _bad_key(key: str) -> str | None:
    char = UNTAKEABLE.search(key) or CONTROL_CHARACTERS.search(key)
    return None if char is None else character_name(char[0])


def _shown(text: str) -> str:
    """``text`` as an ASCII JSON string (every control character and surrogate escaped),
    cut to a readable length."""
    shown = json.dumps(text)
    return shown if len(shown) <= _SHOWN_CHARS else shown[: _SHOWN_CHARS - 4] + '..."'


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
    # How many were ever made: a line whose decoding made none holds none, and its
    # fields need no walk (``LineParser.sendable``).
    made = 0

    def __init__(self, text: str) -> None:
        self.text = text
        NonFinite.made += 1


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
