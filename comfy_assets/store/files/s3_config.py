"""Where an S3 store is and how it is reached: ``s3://BUCKET/PREFIX`` parsed
(``S3Location``), and the endpoint, region and credentials read the way AWS clients read
them (``S3Settings.from_environment``): the variables ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, then the profile ``AWS_PROFILE`` (or
``default``) of ``~/.aws/credentials`` and ``~/.aws/config`` (``AWS_SHARED_CREDENTIALS_FILE``,
``AWS_CONFIG_FILE``). A credential is never part of a message or a repr.
"""

from __future__ import annotations

import configparser
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# S3's rules for a bucket's name: 3 to 63 of lower-case letters, digits, dots and
# hyphens, beginning and ending with a letter or digit.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
DEFAULT_REGION = "us-east-1"


@dataclass(frozen=True)
class S3Location:
    """A bucket and a prefix in it (no slash at either end; "" for the bucket's top)."""

    bucket: str
    prefix: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def is_s3_location(location: str | Path) -> bool:
    """Whether ``location`` names an S3 store (``s3://...``) rather than a folder."""
    return isinstance(location, str) and location.startswith("s3://")


def parse_location(text: str, part: str = "prefix") -> S3Location:
    """``s3://BUCKET/PREFIX`` as an S3Location. Raises ValueError naming the text for
    another scheme, a bucket name S3 does not allow, or a prefix with an empty, ``.`` or
    ``..`` part (keys made of them are refused or rewritten by some servers); ``part``
    names what follows the bucket in those messages (``key`` for an object's URL)."""
    if not text.startswith("s3://"):
        raise ValueError(f"{text!r} is not an S3 store (s3://BUCKET/PREFIX)")
    bucket, _, prefix = text[len("s3://") :].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(
            f"{text!r}: bucket {bucket!r} is not a bucket name (3 to 63 lower-case letters, "
            "digits, dots and hyphens)"
        )
    prefix = prefix.strip("/")
    if prefix and any(p in ("", ".", "..") for p in prefix.split("/")):
        raise ValueError(f"{text!r}: {part} {prefix!r} has an empty, '.' or '..' part")
    if any(ord(c) < 32 or ord(c) == 127 for c in prefix):
        raise ValueError(f"{text!r}: {part} {prefix!r} has a control character")
    return S3Location(bucket, prefix)


@dataclass(frozen=True)
class S3Settings:
    """How to reach an S3 endpoint. ``endpoint`` None is AWS itself; ``access_key_id``
    None leaves the credentials to the client's own chain (instance profile, container
    credentials, web identity). The secret fields are left out of the repr."""

    endpoint: str | None = None
    region: str = DEFAULT_REGION
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str] | None = None, home: Path | None = None
    ) -> S3Settings:
        """The settings from ``environ`` (default ``os.environ``) and the AWS files under
        ``home`` (default the user's). A variable wins over the profile. Raises
        ValueError when ``AWS_PROFILE`` names a profile neither file has."""
        env = os.environ if environ is None else environ
        home = Path.home() if home is None else home
        name = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or ""
        profile = _profile(env, home, name or "default")
        if name and profile is None:
            raise ValueError(
                f"AWS_PROFILE={name}: no such profile in {_credentials_file(env, home)} "
                f"or {_config_file(env, home)}"
            )
        profile = profile or {}
        key_id = env.get("AWS_ACCESS_KEY_ID")
        if key_id:
            secret, token = env.get("AWS_SECRET_ACCESS_KEY"), env.get("AWS_SESSION_TOKEN")
        else:
            key_id = profile.get("aws_access_key_id")
            secret, token = profile.get("aws_secret_access_key"), profile.get("aws_session_token")
        return cls(
            endpoint=env.get("AWS_ENDPOINT_URL_S3")
            or env.get("AWS_ENDPOINT_URL")
            or profile.get("endpoint_url")
            or None,
            region=env.get("AWS_REGION")
            or env.get("AWS_DEFAULT_REGION")
            or profile.get("region")
            or DEFAULT_REGION,
            access_key_id=key_id or None,
            secret_access_key=secret or None,
            session_token=token or None,
        )


def _credentials_file(env: Mapping[str, str], home: Path) -> Path:
    return Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials")


def _config_file(env: Mapping[str, str], home: Path) -> Path:
    return Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config")


def _profile(env: Mapping[str, str], home: Path, name: str) -> dict[str, str] | None:
    """The profile ``name`` of the config file (section ``[profile NAME]``, or
    ``[default]``) overlaid by the credentials file's (section ``[NAME]``); None when
    neither has it. Raises ValueError naming a file that cannot be parsed."""
    found: dict[str, str] | None = None
    config_section = "default" if name == "default" else f"profile {name}"
    for path, section in (
        (_config_file(env, home), config_section),
        (_credentials_file(env, home), name),
    ):
        # No interpolation: a secret may hold a '%'.
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except configparser.Error as e:
            # The parser's own message quotes the line, which may hold a secret.
            lines = [str(n) for n, _ in getattr(e, "errors", [])]
            where = f" (line {', '.join(lines)})" if lines else ""
            raise ValueError(f"{path}: cannot be read as an AWS profile file{where}") from None
        if parser.has_section(section):
            found = {**(found or {}), **dict(parser.items(section))}
    return found
