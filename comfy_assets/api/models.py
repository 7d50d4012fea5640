"""The API's request and answers as typed models (pydantic): the one definition that both
the request's validation (``submission.parse_submission`` checks every body against
``request_model``) and the OpenAPI document (``openapi.document``: its
``components/schemas`` are these models' JSON Schemas) are made from.

A body the model refuses is refused by the API, so the API never takes a body the
document does not admit; every rule of one field is the model's (a lowercase UUID, a workflow of
at least one node with a ``class_type`` and ``inputs``, ``set`` keys of the form
``<node id>.<input name>`` whose values are not links, inputs as base64 data URIs, a take
from 1 to 2**31 - 1, no unknown field), so a body the model admits is one the API takes,
except for the rules JSON Schema cannot state, which the job-file parser checks after it
and the schemas' descriptions name: a ``set`` or ``inputs`` key must name a literal input
of a node of the workflow (not one of both), each input's decoded bytes and the whole
queue message must be within ``--max-input-bytes`` and ``--max-message-bytes``, and a
webhook's host must resolve to public addresses.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    create_model,
)
from pydantic.json_schema import (
    GenerateJsonSchema,
    JsonSchemaMode,
    JsonSchemaValue,
    models_json_schema,
)
from pydantic_core import PydanticCustomError, core_schema

from comfy_assets.api.webhook_urls import MAX_URL_CHARS
from comfy_assets.jobs.model import UUID_PATTERN
from comfy_assets.jobs.parse import MAX_TAKE
from comfy_assets.jobs.states import State
from comfy_assets.jobs.strict_json import is_link
from comfy_assets.jobs.workflows import UI_MESSAGE
from comfy_assets.store.health import HealthState

UUID = f"^{UUID_PATTERN.pattern}$"
# What the job-file parser's ``key.partition(".")`` needs: a node id and an input name.
NODE_INPUT = r"^[^.]+\.[\s\S]+$"
# A data URI whose payload ``base64.b64decode(..., validate=True)`` decodes: groups of
# four, the last one padded.
TOKEN = "[A-Za-z0-9_.+-]+"  # a media type's part, a parameter's name or value
DATA_URI = (
    rf"^data:(?:{TOKEN}/{TOKEN})?(?:;{TOKEN}={TOKEN})*;base64,"
    r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
)
WEBHOOK_URL = r"^[Hh][Tt][Tt][Pp][Ss]?://[^\x00-\x20\x7f/?#@]+(?:[/?#][^\x00-\x20\x7f]*)?$"
# ComfyUI's API format writes a link as ["<node id>", <output index>].
LINK = {
    "type": "array",
    "minItems": 2,
    "maxItems": 2,
    "prefixItems": [{"type": "string"}, {"type": "integer"}],
}

# What a pattern asks for, in the words of an error.
PATTERN_WORDS = {
    UUID: "a lowercase hyphenated UUID",
    NODE_INPUT: "'<node id>.<input name>'",
    DATA_URI: "a data URI (data:<type>;base64,<the file's bytes>)",
    WEBHOOK_URL: "an http(s) URL",
}


def _not_ui_format(workflow: dict[str, Any]) -> dict[str, Any]:
    if "nodes" in workflow and "links" in workflow:
        raise PydanticCustomError("ui_format", f"inline workflow {UI_MESSAGE}")
    return workflow


def integral(value: Any) -> Any:
    """``value``, an integral float (``2.0``) made the integer it equals: JSON has one
    kind of number, and JSON Schema's "integer" is any number without a fraction."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def _literal(value: Any) -> Any:
    if is_link(value):
        raise PydanticCustomError("link", "a link; set only literal values")
    return value


class Node(BaseModel):
    """One node of an API-format workflow; other keys (``_meta``) ride along."""

    model_config = ConfigDict(extra="allow", strict=True)

    class_type: str
    inputs: dict[str, Any]


NodeInput = Annotated[str, Field(pattern=NODE_INPUT)]
Workflow = Annotated[
    dict[str, Node],
    Field(
        min_length=1,
        description="The workflow inline in ComfyUI's API format: node id -> node.",
        json_schema_extra={"not": {"required": ["nodes", "links"]}},
    ),
    AfterValidator(_not_ui_format),
]
SetValue = Annotated[Any, AfterValidator(_literal), WithJsonSchema({"not": LINK})]
DataUri = Annotated[str, Field(pattern=DATA_URI)]
WebhookUrl = Annotated[str, Field(max_length=MAX_URL_CHARS, pattern=WEBHOOK_URL)]

_REQUEST_FIELDS: dict[str, Any] = {
    "id": (Annotated[str, Field(pattern=UUID, description="a lowercase UUID you choose")], ...),
    "workflow": (Workflow, ...),
    "set": (
        dict[NodeInput, SetValue],
        Field(
            default_factory=dict,
            description="Literal values for node inputs; each key names a literal input "
            "of a node of `workflow`.",
        ),
    ),
    "inputs": (
        dict[NodeInput, DataUri],
        Field(
            default_factory=dict,
            description="Input files as base64 data URIs, each at most --max-input-bytes "
            "decoded; each key names a literal input of a node of `workflow`, not one "
            "`set` names.",
        ),
    ),
    "take": (Annotated[int, Field(ge=1, le=MAX_TAKE), BeforeValidator(integral)], 1),
}
_REQUEST_DOC = (
    "One job line (docs/api.md). Beyond this schema the API checks what JSON Schema "
    "cannot say: `set` and `inputs` keys name literal inputs of the workflow's nodes, no "
    "string anywhere holds a NUL or a lone UTF-16 surrogate, no key a control character, "
    "and the queue message is within --max-message-bytes."
)


@functools.cache
def request_model(webhooks: bool) -> type[BaseModel]:
    """The model of a ``POST /v1/jobs`` body: with ``webhooks`` (the API has a webhook
    secret) an optional ``webhook`` URL, else ``webhook`` null or absent."""
    webhook: tuple[Any, Any] = (
        (WebhookUrl | None, Field(default=None, description="its host must be public"))
        if webhooks
        else (None, Field(default=None, description="webhooks are off on this API"))
    )
    return create_model(
        "JobRequest",
        __config__=ConfigDict(extra="forbid", strict=True, title="JobRequest"),
        __doc__=_REQUEST_DOC,
        **_REQUEST_FIELDS,
        webhook=webhook,
    )


class Problem(BaseModel):
    """One error of a request."""

    field: str = Field(description="a JSON pointer into the request ('' for all of it)")
    message: str


class Error(BaseModel):
    """Every error answer; a 422 lists each problem, a 409 the fields that differ."""

    message: str
    errors: list[Problem] = []
    differs: list[str] = []


class File(BaseModel):
    """One output file of a job."""

    name: str
    bytes: int = Field(ge=0)
    sha256: str
    content_type: str = Field(description="its media type, as stored (image/png)")
    url: str


class Job(BaseModel):
    """A job as the API answers it (``views.job_view``)."""

    id: str
    state: State
    take: int
    attempts: int = Field(description="tries, the one under way included")
    servers: list[str]
    reason: str | None = Field(description="why it is a dead letter")
    created_at: str
    updated_at: str
    finished_at: str | None
    webhook: str | None
    files: list[File]
    links: dict[str, str]


class Event(BaseModel):
    """One transition of a job (``views.event_view``)."""

    model_config = ConfigDict(populate_by_name=True)

    id: int
    time: str
    from_: str | None = Field(alias="from")
    to: str
    server: str | None
    attempt: int | None
    detail: str | None


class Events(BaseModel):
    """A job's events, oldest first."""

    events: list[Event]


class Lease(BaseModel):
    """A server's lease in the store."""

    held: bool
    expires_at: str | None
    last_model: str | None


class Failure(BaseModel):
    """A failure of one of the asking client's jobs on a server."""

    job_id: str
    reason: str


class StoreHealth(BaseModel):
    """A server's health as the workers judged it; ``failures`` only of the asking
    client's own jobs (another client's reason quotes that client's inputs)."""

    state: HealthState
    until: str | None
    strikes: int
    failures: list[Failure]


class Server(BaseModel):
    """One server: the API's probe of it, its lease, its health in the store."""

    name: str
    healthy: bool | None
    health: str | None
    queue: int | None
    lease: Lease | None
    store_health: StoreHealth | None


class Servers(BaseModel):
    """Every server the API probes or the store knows."""

    servers: list[Server]


class Status(BaseModel):
    """Liveness or readiness, and what is not ready."""

    status: str
    problems: dict[str, str] = {}


ANSWERS: tuple[type[BaseModel], ...] = (Error, Job, Events, Servers, Status)


class _Generator(GenerateJsonSchema):
    """pydantic's JSON Schema, with a constrained dict's keys as ``propertyNames`` (its
    ``patternProperties`` would let any other key through) and no titles on fields."""

    def dict_schema(self, schema: core_schema.DictSchema) -> JsonSchemaValue:
        found = super().dict_schema(schema)
        patterns = found.pop("patternProperties", None)
        if patterns:
            ((pattern, values),) = patterns.items()
            found["propertyNames"] = {"pattern": pattern}
            found["additionalProperties"] = values
        return found

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def schemas(webhooks: bool) -> dict[str, Any]:
    """The OpenAPI document's ``components/schemas``: the request (``request_model``) and
    every answer, as JSON Schema 2020-12 (OpenAPI 3.1)."""
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [
        (request_model(webhooks), "validation"),
        *((m, "serialization") for m in ANSWERS),
    ]
    _, found = models_json_schema(
        models, ref_template="#/components/schemas/{model}", schema_generator=_Generator
    )
    return found["$defs"]
