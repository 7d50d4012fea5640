"""The API's clients: ``--tokens FILE``, one ``NAME:TOKEN`` a line.

Blank lines and lines starting with ``#`` are skipped. A name is 1 to 64 letters, digits,
``.``, ``_`` or ``-`` (it names the client's partition, ``api-<name>``); a token at least
16 characters with no white space. A repeated name or token is an error, so one token
is never two clients. Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MIN_TOKEN_CHARS = 16


class TokensError(ValueError):
    """A tokens file that cannot be used; the message names the file and line (never a
    token)."""


class Clients:
    """Bearer tokens -> client names."""

    def __init__(self, tokens: dict[str, str]) -> None:
        # Keyed by the token's sha256: a lookup by hash, then a constant-time compare.
        self._by_hash = {hashlib.sha256(t.encode()).digest(): (t, n) for t, n in tokens.items()}

    @classmethod
    def load(cls, path: Path) -> Clients:
        """Read ``path`` (see the module docstring). Raises TokensError."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokensError(f"--tokens {path}: cannot read: {e}") from e
        tokens: dict[str, str] = {}
        names: set[str] = set()
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, token = line.partition(":")
            where = f"--tokens {path}:{number}"
            if not sep or not NAME.fullmatch(name):
                raise TokensError(
                    f"{where}: expected NAME:TOKEN, NAME of 1 to 64 letters, digits, '.', '_', '-'"
                )
            if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
                raise TokensError(
                    f"{where}: the token of {name!r} must have at least {MIN_TOKEN_CHARS} "
                    "characters and no white space"
                )
            if name in names:
                raise TokensError(f"{where}: client {name!r} repeated")
            if token in tokens:
                raise TokensError(f"{where}: the token of {name!r} is another client's too")
            names.add(name)
            tokens[token] = name
        if not tokens:
            raise TokensError(f"--tokens {path}: no NAME:TOKEN line")
        return cls(tokens)

    def client(self, authorization: str | None) -> str | None:
        """The client name of an ``Authorization: Bearer TOKEN`` header, or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        token = token.strip()
        found = self._by_hash.get(hashlib.sha256(token.encode()).digest())
        if found is None or not hmac.compare_digest(found[0].encode(), token.encode()):
            return None
        return found[1]

    @property
    def names(self) -> list[str]:
        """Every client's name, sorted."""
        return sorted(n for _, n in self._by_hash.values())


def partition_of(client: str) -> str:
    """The store partition of ``client``'s jobs: ``api-<client>`` (its results.csv is
    ``<store>/api-<client>/results.csv``)."""
    return f"api-{client}"
