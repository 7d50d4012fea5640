"""The API's OpenAPI 3.0 document (``GET /openapi.json``) and its human page
(``GET /docs``, made from the document: no script, nothing fetched from elsewhere).

Written by hand beside the handlers, and fuzzed against them in the tests
(tests/test_api_fuzz.py, schemathesis): every answer's status and body must be one this
document lists.
"""

from __future__ import annotations

import html
from typing import Any

from aiohttp import web

from comfy_assets.api.app import json_response
from comfy_assets.jobs.states import State

JSON = "application/json"
UUID = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(kind: str, **more: Any) -> dict[str, Any]:
    return {"type": kind, "nullable": True, **more}


def _error(description: str, **headers: Any) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "description": description,
        "content": {JSON: {"schema": _ref("Error")}},
    }
    if headers:
        answer["headers"] = headers
    return answer


_RETRY_AFTER = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
COMMON = {
    "401": _error("no known bearer token"),
    "429": _error("too many requests from this client", **_RETRY_AFTER),
    "503": _error("the store or the broker is unavailable"),
}
NOT_FOUND = {"404": _error("no such job of this client")}
JOB_ID = {
    "name": "job_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": UUID},
}


def _job(status: str, description: str) -> dict[str, Any]:
    return {status: {"description": description, "content": {JSON: {"schema": _ref("Job")}}}}


SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["message"],
        "properties": {
            "message": {"type": "string"},
            "errors": {"type": "array", "items": _ref("Problem")},
            "differs": {"type": "array", "items": {"type": "string"}},
        },
    },
    "Problem": {
        "type": "object",
        "required": ["field", "message"],
        "properties": {
            "field": {"type": "string", "description": "a JSON pointer into the request"},
            "message": {"type": "string"},
        },
    },
    "JobRequest": {
        "type": "object",
        "description": "One job line (docs/api.md): the workflow inline in API format, "
        "`set` overrides, `inputs` as base64 data URIs, `take`, and an optional webhook.",
        "required": ["id", "workflow"],
        "properties": {
            "id": {"type": "string", "pattern": UUID},
            "workflow": {"type": "object", "additionalProperties": True},
            "set": {"type": "object", "additionalProperties": True},
            "inputs": {
                "type": "object",
                "additionalProperties": {"type": "string", "pattern": "^data:"},
            },
            "take": {"type": "integer", "minimum": 1},
            "webhook": {"type": "string"},
        },
    },
    "File": {
        "type": "object",
        "required": ["name", "bytes", "sha256", "url"],
        "properties": {
            "name": {"type": "string"},
            "bytes": {"type": "integer", "minimum": 0},
            "sha256": {"type": "string"},
            "url": {"type": "string"},
        },
    },
    "Job": {
        "type": "object",
        "required": [
            "id",
            "state",
            "take",
            "attempts",
            "servers",
            "reason",
            "created_at",
            "updated_at",
            "finished_at",
            "webhook",
            "files",
            "links",
        ],
        "properties": {
            "id": {"type": "string"},
            "state": {"type": "string", "enum": [s.value for s in State]},
            "take": {"type": "integer"},
            "attempts": {"type": "integer", "description": "tries, the one under way included"},
            "servers": {"type": "array", "items": {"type": "string"}},
            "reason": _nullable("string", description="why it is a dead letter"),
            "created_at": {"type": "string"},
            "updated_at": {"type": "string"},
            "finished_at": _nullable("string"),
            "webhook": _nullable("string"),
            "files": {"type": "array", "items": _ref("File")},
            "links": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    },
    "Event": {
        "type": "object",
        "required": ["id", "time", "from", "to", "server", "attempt", "detail"],
        "properties": {
            "id": {"type": "integer"},
            "time": {"type": "string"},
            "from": _nullable("string"),
            "to": {"type": "string"},
            "server": _nullable("string"),
            "attempt": _nullable("integer"),
            "detail": _nullable("string"),
        },
    },
    "Server": {
        "type": "object",
        "required": ["name", "healthy", "health", "queue", "lease", "store_health"],
        "properties": {
            "name": {"type": "string"},
            "healthy": {"type": "boolean", "nullable": True},
            "health": _nullable("string"),
            "queue": _nullable("integer"),
            "lease": {"type": "object", "nullable": True, "additionalProperties": True},
            "store_health": {
                "type": "object",
                "nullable": True,
                "description": "quarantined, on trial or ok, as the workers judged it",
                "additionalProperties": True,
            },
        },
    },
    "Status": {
        "type": "object",
        "required": ["status"],
        "properties": {
            "status": {"type": "string"},
            "problems": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    },
}


def document() -> dict[str, Any]:
    """The OpenAPI 3.0.3 document of the API."""
    paths: dict[str, Any] = {
        "/v1/jobs": {
            "post": {
                "operationId": "submitJob",
                "summary": "Submit one job; 202 once it is in the store and the queue",
                "requestBody": {
                    "required": True,
                    "content": {JSON: {"schema": _ref("JobRequest")}},
                },
                "responses": {
                    **_job("202", "accepted: durable in the store and confirmed by the broker"),
                    **_job("200", "this id with this content was accepted before"),
                    "400": _error("the body is not JSON"),
                    "409": _error("this id is another job (the fields that differ)"),
                    "413": _error("the body is over the limit"),
                    "422": _error("not a valid job: every error with its JSON pointer"),
                    **COMMON,
                },
            }
        },
        "/v1/jobs/{job_id}": {
            "parameters": [JOB_ID],
            "get": {
                "operationId": "getJob",
                "summary": "A job: state, take, attempts, servers, reason, times, files",
                "responses": {**_job("200", "the job"), **NOT_FOUND, **COMMON},
            },
        },
        "/v1/jobs/{job_id}/files/{name}": {
            "parameters": [
                JOB_ID,
                {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}},
            ],
            "get": {
                "operationId": "getFile",
                "summary": "One output file: ETag (its sha256) and Range requests",
                "responses": {
                    "200": {
                        "description": "the file",
                        "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}},
                    },
                    "206": {
                        "description": "the range asked for",
                        "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}},
                    },
                    "304": {"description": "not modified (If-None-Match)"},
                    "416": {"description": "the range is beyond the end"},
                    "404": _error("no such job of this client, or no such file"),
                    **COMMON,
                },
            },
        },
        "/v1/jobs/{job_id}/events": {
            "parameters": [JOB_ID],
            "get": {
                "operationId": "getEvents",
                "summary": "A job's transitions; live with Accept: text/event-stream",
                "responses": {
                    "200": {
                        "description": "the events, oldest first",
                        "content": {
                            JSON: {
                                "schema": {
                                    "type": "object",
                                    "required": ["events"],
                                    "properties": {
                                        "events": {"type": "array", "items": _ref("Event")}
                                    },
                                }
                            },
                            "text/event-stream": {"schema": {"type": "string"}},
                        },
                    },
                    **NOT_FOUND,
                    **COMMON,
                },
            },
        },
        "/v1/jobs/{job_id}/cancel": {
            "parameters": [JOB_ID],
            "post": {
                "operationId": "cancelJob",
                "summary": "Cancel a job: a dead letter 'cancelled by <client>'",
                "responses": {
                    **_job("200", "cancelled"),
                    "409": _error("the job has already ended"),
                    **NOT_FOUND,
                    **COMMON,
                },
            },
        },
        "/v1/jobs/{job_id}/requeue": {
            "parameters": [JOB_ID],
            "post": {
                "operationId": "requeueJob",
                "summary": "Send a dead letter or a degraded job back to the queue",
                "responses": {
                    **_job("202", "pending again, and in the queue"),
                    "409": _error("the job is neither a dead letter nor degraded"),
                    **NOT_FOUND,
                    **COMMON,
                },
            },
        },
        "/v1/servers": {
            "get": {
                "operationId": "getServers",
                "summary": "Each server's health and lease",
                "responses": {
                    "200": {
                        "description": "the servers",
                        "content": {
                            JSON: {
                                "schema": {
                                    "type": "object",
                                    "required": ["servers"],
                                    "properties": {
                                        "servers": {"type": "array", "items": _ref("Server")}
                                    },
                                }
                            }
                        },
                    },
                    **COMMON,
                },
            }
        },
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "Liveness (no token)",
                "security": [],
                "responses": {
                    "200": {
                        "description": "serving",
                        "content": {JSON: {"schema": _ref("Status")}},
                    }
                },
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "Readiness: the store answers and the broker is connected (no token)",
                "security": [],
                "responses": {
                    "200": {"description": "ready", "content": {JSON: {"schema": _ref("Status")}}},
                    "503": {
                        "description": "not ready",
                        "content": {JSON: {"schema": _ref("Status")}},
                    },
                },
            }
        },
    }
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "comfy-assets API",
            "version": "1",
            "description": "Submit ComfyUI jobs, follow them, fetch their files (docs/api.md).",
        },
        "paths": paths,
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def docs_page(doc: dict[str, Any]) -> str:
    """The ``/docs`` page: every operation with its summary and answers."""
    rows = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method == "parameters":
                continue
            answers = ", ".join(
                f"{code} {html.escape(a['description'])}" for code, a in op["responses"].items()
            )
            rows.append(
                f"<h2><code>{method.upper()} {html.escape(path)}</code></h2>"
                f"<p>{html.escape(op['summary'])}</p><p><small>{answers}</small></p>"
            )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>comfy-assets API</title>"
        "</head><body><h1>comfy-assets API</h1><p>Every route but /healthz and /readyz "
        "needs <code>Authorization: Bearer TOKEN</code>. The machine-readable document: "
        "<a href='/openapi.json'>/openapi.json</a>.</p>" + "".join(rows) + "</body></html>"
    )


async def openapi_json(request: web.Request) -> web.Response:
    return json_response(document())


async def docs(request: web.Request) -> web.Response:
    return web.Response(text=docs_page(document()), content_type="text/html")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_get("/docs", docs)
