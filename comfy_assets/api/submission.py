"""A ``POST /v1/jobs`` body, validated into the queue message a worker renders.

The body is one job line (``id``, ``workflow`` inline in API format, ``set``, ``inputs``,
``take``) plus an optional ``webhook`` URL. Input files come inline as base64 data URIs
(``"1.image": "data:image/png;base64,iVBOR..."``), each within ``--max-input-bytes``.

The validation is the queue message's (``service.messages.parse_message``, which is the
job-file parser's ``job_from_dict``): the body becomes the message ``enqueue`` would
write for that job line, and every error comes back with the job-file parser's message,
its field turned into a JSON pointer into the request (``set.1.color`` ->
``/set/1.color``). The message published is ``service.messages.job_message`` of the
validated job, as for ``enqueue``: one way to make a job, whatever brought it.

What the API refuses beyond a job line: a ``workflow`` given as a path (the API reads no
files), ``shot``, ``duration_s`` and ``optional`` (films are cut from job files: a
storyboard's shots under the delivery policy stop at its first dead letter, which a
client submitting single jobs would not expect), the message's own fields
(``partition``, ``line``, ``policy``, ``priority``: the API sets them), and a job whose
message would be over ``--max-message-bytes`` (a worker would refuse it).

Every body is also checked against the request's model (``models.request_model``, the
definition the OpenAPI document is made from), so the API never takes a body its document
does not admit: a problem the model finds is answered in the parser's words when the
parser (or the API) names that field too, else in the model's (``model_problems``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import mimetypes
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from comfy_assets.api.models import PATTERN_WORDS, TOKEN, integral, request_model
from comfy_assets.jobs.model import Header, Job, JobFile, JobFileError, LineError
from comfy_assets.jobs.strict_json import first_untakeable, kind_of, quoted
from comfy_assets.service.messages import job_message, parse_message, queue_problems

SOURCE = "request"
# parse_message resolves a workflow path inside this folder; the API refuses paths
# before, so nothing is ever read there.
NO_FILES = Path("/nonexistent/the-api-reads-no-files")
NOT_IN_API = ("shot", "duration_s", "optional")
# Fields of the parser that are about the request as a whole, not one of its fields.
WHOLE = {"json", "job", "body", "message", "file"}
# The parts of a data URI; models.DATA_URI, its whole form, is checked too.
_DATA_URI = re.compile(rf"data:({TOKEN}/{TOKEN})?((?:;{TOKEN}={TOKEN})*);base64,(.*)", re.S)


@dataclass(frozen=True)
class Problem:
    """One error of a request: ``field`` a JSON pointer into the body ("" for the whole
    body), ``message`` as the job-file parser words it."""

    field: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"field": self.field, "message": self.message}


@dataclass(frozen=True)
class Submission:
    """A valid request: its ``job``, the ``message`` to publish (UTF-8 JSON), its
    ``content`` (what a retry must repeat: ``content_of``) and ``webhook`` (unchecked
    here: ``api.webhook_urls`` resolves it)."""

    job: Job
    message: bytes
    content: dict[str, Any]
    webhook: str | None


class Invalid(Exception):
    """A request that is not a valid job; ``problems`` lists every error."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{p.field or '/'}: {p.message}" for p in problems))


def pointer(field: str) -> str:
    """The JSON pointer (RFC 6901) of a parser's field name: ``set.1.color`` ->
    ``/set/1.color``, ``inputs.1.image`` -> ``/inputs/1.image``, ``id`` -> ``/id``; ""
    for a field about the whole body (``json``, ``job``, ``message``)."""
    head, _, rest = field.partition(".")
    if head in WHOLE or not head:
        return ""
    parts = [head] + ([rest] if rest else [])
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def _refused_fields(obj: dict[str, Any], problems: list[Problem]) -> str | None:
    """Take out of ``obj`` (a copy of the body) what the API does not pass to the job
    parser, each with its problem: the webhook (returned if a string; a problem if not
    a URL it takes), the fields of a film, the fields the API sets itself, and a workflow named
    by file (left as ``{}``)."""
    webhook = obj.pop("webhook", None)
    if webhook is not None and not isinstance(webhook, str):
        problems.append(Problem("/webhook", f"expected a URL string, got {kind_of(webhook)}"))
    elif webhook is not None and (untakeable := first_untakeable(webhook)) is not None:
        problems.append(Problem("/webhook", untakeable))
    for name in NOT_IN_API:
        if name in obj:
            del obj[name]
            problems.append(
                Problem(
                    f"/{name}",
                    "not taken by the API: films are cut from job files "
                    "(`comfy-assets run` or Dagster)",
                )
            )
    for name in ("partition", "line", "policy", "priority"):  # the message's, set by the API
        if name in obj:
            del obj[name]
            problems.append(Problem(f"/{name}", "unknown field"))
    if isinstance(obj.get("workflow"), str):
        problems.append(
            Problem(
                "/workflow",
                "expected the workflow inline (an API-format object): the API reads no files",
            )
        )
        obj["workflow"] = {}
    # A webhook that is not a string is a problem above: the body is refused.
    return webhook if isinstance(webhook, str) else None


def parse_submission(
    obj: Any, *, partition: str, max_input_bytes: int, max_message_bytes: int
) -> Submission:
    """Validate one decoded request body (see the module docstring) as a job of
    ``partition``. Raises ``Invalid`` listing every problem."""
    if not isinstance(obj, dict):
        raise Invalid([Problem("", f"expected a JSON object, got {kind_of(obj)}")])
    given, obj = obj, dict(obj)
    problems: list[Problem] = []
    webhook = _refused_fields(obj, problems)
    if "take" in obj:
        obj["take"] = integral(obj["take"])
    inputs = obj.get("inputs")
    if isinstance(inputs, dict):
        obj["inputs"] = _inline_inputs(inputs, max_input_bytes, problems)
    shape = model_problems(given)
    body = json.dumps({**obj, "partition": partition}).encode()
    try:
        queued = parse_message(body, workflows_dir=NO_FILES, source=SOURCE, max_bytes=len(body))
    except JobFileError as e:
        found = [_problem(err) for err in e.errors]
        if any(p.field == "/workflow" for p in problems):  # said once, not as "{}"
            found = [p for p in found if p.field != "/workflow"]
        problems += found
        raise Invalid(problems + _unsaid(shape, problems)) from None
    except RecursionError:
        raise Invalid([Problem("", "nested too deeply")]) from None
    problems += _unsaid(shape, problems)
    if problems:
        raise Invalid(problems)
    job = queued.job
    job_file = JobFile(path=Path(SOURCE), sha256="", header=Header(), jobs=[job])
    too_big = queue_problems(job_file, max_message_bytes, partition)
    if too_big:
        raise Invalid([_problem(err) for err in too_big])
    message = job_message(job, None, partition)
    return Submission(job, message, content_of(obj, job, webhook), webhook)


def content_of(obj: dict[str, Any], job: Job, webhook: str | None) -> dict[str, Any]:
    """What makes two requests of one id the same job: the workflow as sent (its
    sha256), ``set``, each input's sha256 and type, ``take`` and the webhook."""
    workflow = json.dumps(obj.get("workflow"), sort_keys=True, separators=(",", ":"))
    return {
        "workflow": hashlib.sha256(workflow.encode()).hexdigest(),
        "set": job.set,
        # The name it is uploaded under: its sha256 and the suffix its type gives.
        "inputs": {
            item.key: item.upload_name for item in job.inputs if hasattr(item, "upload_name")
        },
        "take": job.take,
        "webhook": webhook,
    }


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The JSON pointers of the fields where ``new`` differs from ``old`` (both from
    ``content_of``): ``/workflow``, ``/set``, ``/inputs/1.image``, ``/take``, ``/webhook``."""
    found = []
    for name in ("workflow", "set", "inputs", "take", "webhook"):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if name == "inputs" and isinstance(a, dict) and isinstance(b, dict):
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            found += [pointer(f"inputs.{k}") for k in keys]
        else:
            found.append(f"/{name}")
    return found


def _problem(err: LineError) -> Problem:
    return Problem(pointer(err.field), err.message)


def model_problems(obj: Any) -> list[Problem]:
    """Where the decoded body ``obj`` breaks the request's model (``models``; its
    ``webhook`` checked as a URL: whether webhooks are on is the route's to say), each as
    a JSON pointer and our words for it."""
    try:
        request_model(True).model_validate(obj)
    except ValidationError as e:
        return [
            Problem(_loc_pointer(err["loc"]), _words(err))
            for err in e.errors()
            # A webhook string is the route's to judge (``webhook_urls.check_url``: a
            # stricter rule than the model's pattern, and its host resolved).
            if not (err["loc"][:1] == ("webhook",) and isinstance(err["input"], str))
        ]
    return []


def _unsaid(shape: list[Problem], said: list[Problem]) -> list[Problem]:
    """The problems of ``shape`` at no field of ``said`` nor inside one (the parser's
    words for a field stand; the model's fill in what the parser did not refuse)."""
    fields = [p.field for p in said]
    return [
        p
        for p in shape
        if not any(p.field == f or p.field.startswith(f + "/") or not f for f in fields)
    ]


def _loc_pointer(loc: tuple[int | str, ...]) -> str:
    # pydantic marks a dict key's own error with a trailing "[key]".
    parts = [str(part) for part in loc if part != "[key]"]
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def _words(err: ErrorDetails) -> str:
    """One pydantic error in the parser's manner: what was expected, what came."""
    kind, value, ctx = err["type"], err["input"], err.get("ctx", {})
    if kind == "missing":
        return "missing"
    if kind == "extra_forbidden":
        return "unknown field"
    expected = {
        "string_type": "a string",
        "int_type": "an integer",
        "dict_type": "an object",
        "model_type": "an object",
        "none_required": "null",
        "string_pattern_mismatch": PATTERN_WORDS.get(str(ctx.get("pattern")), "a string"),
        "string_too_long": f"at most {ctx.get('max_length')} characters",
        "greater_than_equal": f"at least {ctx.get('ge')}",
        "less_than_equal": f"at most {ctx.get('le')}",
        "too_short": "at least one entry",
    }
    if kind in expected:
        got = kind_of(value) if kind.endswith("_type") else quoted(value)
        return f"expected {expected[kind]}, got {got}"
    return err["msg"]


def _inline_inputs(
    given: dict[str, Any], max_input_bytes: int, problems: list[Problem]
) -> dict[str, Any]:
    """``inputs`` of the request as a queue message carries them (``{"path", "sha256",
    "size", "base64"}``), each data URI decoded and checked; the problems of the others
    appended to ``problems`` and those left out."""
    found: dict[str, Any] = {}
    for key, value in given.items():
        where = pointer(f"inputs.{key}")
        if not isinstance(value, str):
            problems.append(
                Problem(
                    where,
                    "expected a data URI (data:<type>;base64,<the file's bytes>), "
                    f"got {kind_of(value)}",
                )
            )
            continue
        match = _DATA_URI.fullmatch(value)
        if match is None:
            problems.append(
                Problem(where, "expected a data URI (data:<type>;base64,<the file's bytes>)")
            )
            continue
        try:
            data = base64.b64decode(match[3], validate=True)
        except (binascii.Error, ValueError) as e:
            problems.append(Problem(where, f"not base64: {e}"))
            continue
        if len(data) > max_input_bytes:
            problems.append(
                Problem(
                    where,
                    f"{len(data)} bytes, over the limit of {max_input_bytes} bytes "
                    "(--max-input-bytes)",
                )
            )
            continue
        digest = hashlib.sha256(data).hexdigest()
        suffix = mimetypes.guess_extension(match[1] or "") or ""
        found[key] = {
            "path": f"{digest[:16]}{suffix}",
            "sha256": digest,
            "size": len(data),
            "base64": base64.b64encode(data).decode(),
        }
    return found
