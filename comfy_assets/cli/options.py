"""Option types the commands share: numbers within bounds, sizes in bytes.

Light on purpose (the standard library only): ``health`` imports it at start-up.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable

# The exit code of a command given bad input (an option, a file it names): nothing done.
EXIT_BAD_INPUT = 2


def add_command(sub: argparse._SubParsersAction, name: str, what: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``: ``what`` (what it does, lower case, no full
    stop) is its line in the program's ``--help`` and, as a sentence, the first thing its
    own ``--help`` says after the usage."""
    return sub.add_parser(name, help=what, description=f"{what[0].upper()}{what[1:]}.")


def bad_input(message: object) -> int:
    """Say ``error: message`` on stderr; return ``EXIT_BAD_INPUT`` for the command to exit
    with."""
    print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def bounded(
    kind: type[int] | type[float], low: float, *, strict: bool = False
) -> Callable[[str], int | float]:
    """An argparse ``type``: ``kind(text)``, finite and ``>= low`` (``> low`` if strict).

    A bad value raises ``argparse.ArgumentTypeError``, which argparse prints after the
    option's name (``argument --attempts: expected an integer >= 1, got '0'``) and exits 2.
    """
    what = "an integer" if kind is int else "a number"
    expected = f"expected {what} {'>' if strict else '>='} {low:g}"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from e
        # NaN compares false to everything, and an infinite lease or delay overflows later.
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
        return value

    return parse


_BYTE_SIZE = re.compile(r"\s*(\d+)\s*(B|KiB|MiB|GiB|TiB)?\s*", re.IGNORECASE)
_BYTE_UNITS = {"b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def byte_size(text: str) -> int:
    """An argparse ``type``: a size in bytes >= 1, as an integer or with a binary unit
    (``4GiB``, ``512MiB``, ``64KiB``, ``100B``; case does not matter). Raises
    ``argparse.ArgumentTypeError`` otherwise."""
    match = _BYTE_SIZE.fullmatch(text)
    size = int(match[1]) * _BYTE_UNITS[(match[2] or "b").lower()] if match else 0
    if size < 1:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes >= 1 (an integer, or with B, KiB, MiB, GiB, TiB), "
            f"got {text!r}"
        )
    return size


def byte_size_text(size: int) -> str:
    """``size`` (bytes) as ``byte_size`` reads it, in the largest unit that divides it
    (``4GiB``, ``1536KiB``, ``100B``)."""
    unit = max((u for u, n in _BYTE_UNITS.items() if size % n == 0), key=_BYTE_UNITS.__getitem__)
    return f"{size // _BYTE_UNITS[unit]}{'B' if unit == 'b' else unit[0].upper() + 'iB'}"


def add_size_option(p: argparse.ArgumentParser, flag: str, default: int | None, help: str) -> None:
    """``flag SIZE``: a size in bytes, as ``byte_size`` reads it (``default``: bytes, or
    None for a default the command works out)."""
    p.add_argument(flag, type=byte_size, default=default, metavar="SIZE", help=help)


# The default of --max-input-bytes (jobs/inputs.py MAX_INPUT_BYTES, which imports more
# than ``health`` needs at start-up; tests/jobs/test_jobfile_inputs.py keeps the two equal).
MAX_INPUT_BYTES = 64 * 1024**2


def add_input_options(p: argparse.ArgumentParser) -> None:
    """``--follow-input-links`` and ``--max-input-bytes``: what a job line's input files
    may be (``jobs.inputs.InputRules``; read with ``input_rules``)."""
    p.add_argument(
        "--follow-input-links",
        action="store_true",
        help="accept an input file that is a link leading out of the job file's folder tree",
    )
    add_size_option(
        p,
        "--max-input-bytes",
        MAX_INPUT_BYTES,
        f"the largest input file a job line may name (default {byte_size_text(MAX_INPUT_BYTES)})",
    )
