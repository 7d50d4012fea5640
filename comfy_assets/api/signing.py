"""Webhook signatures as the Standard Webhooks specification defines them
(https://www.standardwebhooks.com, "Signature scheme"):

- ``webhook-id``: the delivery's id, the same on every retry (a receiver drops repeats);
- ``webhook-timestamp``: integer seconds since the epoch, of this attempt;
- ``webhook-signature``: ``v1,`` + base64(HMAC-SHA256(key, f"{id}.{timestamp}.{body}")).

The key is the secret of ``--webhook-secret-file``: a ``whsec_<base64>`` secret (the
specification's form) is the base64-decoded bytes after the prefix, any other text its
UTF-8 bytes (a trailing newline stripped).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from pathlib import Path

PREFIX = "whsec_"
MIN_KEY_BYTES = 16


class SecretError(ValueError):
    """A webhook secret file that cannot be used (the message shows no secret)."""


def load_key(path: Path) -> bytes:
    """The HMAC key of the secret in ``path`` (see the module docstring). Raises
    SecretError for an unreadable file, bad base64 after ``whsec_`` or a key under
    16 bytes."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise SecretError(f"--webhook-secret-file {path}: cannot read: {e}") from e
    if text.startswith(PREFIX):
        try:
            key = base64.b64decode(text[len(PREFIX) :], validate=True)
        except (binascii.Error, ValueError) as e:
            raise SecretError(f"--webhook-secret-file {path}: not base64 after {PREFIX}") from e
    else:
        key = text.encode()
    if len(key) < MIN_KEY_BYTES:
        raise SecretError(
            f"--webhook-secret-file {path}: the secret must have at least {MIN_KEY_BYTES} bytes"
        )
    return key


def signature(key: bytes, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: ``v1,<base64 of the HMAC-SHA256>``."""
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def headers(key: bytes, webhook_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three headers of one delivery attempt, and its content type."""
    return {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(key, webhook_id, timestamp, body),
        "content-type": "application/json",
    }


def verify(key: bytes, webhook_id: str, timestamp: str, body: bytes, header: str) -> bool:
    """True when one of the space-separated signatures of ``header`` is ours for this
    body (a receiver's check; the tests use it)."""
    try:
        expected = signature(key, webhook_id, int(timestamp), body)
    except ValueError:
        return False
    return any(hmac.compare_digest(expected, s) for s in header.split())
