"""Multipart uploads left open in a bucket, found and aborted.

The client aborts a multipart upload that fails, retrying the abort like any request; an
outage longer than its retries leaves the upload open (no object a reader can see, but
parts the bucket keeps and bills). The client has no call to list or abort uploads, so
this module sends the two S3 requests itself (ListMultipartUploads,
AbortMultipartUpload), signed with Signature V4 (``signed_request``): only with static
credentials (keys from the variables or a profile); with the client's own chain
(instance profiles...) there is nothing to sign with, and a bucket lifecycle rule
(``AbortIncompleteMultipartUpload``) is the way.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from comfy_assets.store.files.s3_config import S3Location, S3Settings

_S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
# Seconds a request of ours may take.
REQUEST_TIMEOUT_S = 30


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: ``status`` and ``body``."""

    status: int
    body: bytes


def signed_request(
    settings: S3Settings,
    method: str,
    bucket: str,
    key: str = "",
    query: dict[str, str] | None = None,
    body: bytes = b"",
) -> Answer:
    """``method`` on ``/bucket/key?query`` of ``settings``' endpoint (AWS's regional one
    when None), path style, signed with Signature V4 by its static credentials. Raises
    ValueError without credentials, OSError when the endpoint does not answer."""
    if settings.access_key_id is None or settings.secret_access_key is None:
        raise ValueError("signing a request needs an access key and its secret")
    endpoint = (settings.endpoint or f"https://s3.{settings.region}.amazonaws.com").rstrip("/")
    host = urllib.parse.urlsplit(endpoint).netloc
    path = "/" + urllib.parse.quote(f"{bucket}/{key}" if key else bucket, safe="/-_.~")
    canonical_query = "&".join(
        f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
        for k, v in sorted((query or {}).items())
    )
    amz_date = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    payload = hashlib.sha256(body).hexdigest()
    headers = {"host": host, "x-amz-content-sha256": payload, "x-amz-date": amz_date}
    if settings.session_token:
        headers["x-amz-security-token"] = settings.session_token
    signed = ";".join(sorted(headers))
    canonical_headers = "".join(f"{k}:{headers[k]}\n" for k in sorted(headers))
    canonical = "\n".join([method, path, canonical_query, canonical_headers, signed, payload])
    scope = f"{amz_date[:8]}/{settings.region}/s3/aws4_request"
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{digest}"
    signing_key = ("AWS4" + settings.secret_access_key).encode()
    for part in scope.split("/"):
        signing_key = hmac.new(signing_key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(signing_key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={settings.access_key_id}/{scope}, "
        f"SignedHeaders={signed}, Signature={signature}"
    )
    url = endpoint + path + (f"?{canonical_query}" if canonical_query else "")
    request = urllib.request.Request(url, data=body or None, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
            return Answer(answer.status, answer.read())
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read())


@dataclass(frozen=True)
class OpenUpload:
    """A multipart upload not completed nor aborted: its ``key``, ``upload_id`` and when
    it was ``initiated``."""

    key: str
    upload_id: str
    initiated: datetime.datetime


def open_uploads(settings: S3Settings, where: S3Location, prefix: str) -> list[OpenUpload]:
    """The uploads open under ``prefix`` (a key below the location's prefix); the first
    1,000 (one page: more are aborted at the next call). Raises ValueError without
    credentials, OSError for no answer, RuntimeError naming the status for a refusal."""
    full = f"{where.prefix}/{prefix}" if where.prefix else prefix
    answer = signed_request(settings, "GET", where.bucket, query={"uploads": "", "prefix": full})
    if answer.status != 200:
        raise RuntimeError(f"ListMultipartUploads answered {answer.status}{_code(answer)}")
    return [
        OpenUpload(
            u.findtext(f"{_S3_NS}Key", ""),
            u.findtext(f"{_S3_NS}UploadId", ""),
            datetime.datetime.fromisoformat(
                u.findtext(f"{_S3_NS}Initiated", "").replace("Z", "+00:00")
            ),
        )
        for u in ET.fromstring(answer.body).iter(f"{_S3_NS}Upload")
    ]


def abort_upload(settings: S3Settings, bucket: str, upload: OpenUpload) -> None:
    """Abort ``upload`` (one already gone is fine). Raises OSError for no answer,
    RuntimeError naming the status for a refusal."""
    answer = signed_request(
        settings, "DELETE", bucket, upload.key, query={"uploadId": upload.upload_id}
    )
    if answer.status not in (200, 204, 404):
        raise RuntimeError(f"AbortMultipartUpload answered {answer.status}{_code(answer)}")


def _code(answer: Answer) -> str:
    try:
        code = ET.fromstring(answer.body).findtext("Code")
    except ET.ParseError:
        return ""
    return f" {code}" if code else ""
