"""The API's OpenAPI 3.1 document (``GET /openapi.json``) and its human page
(``GET /docs``, made from the document: no script, nothing fetched from elsewhere); both
open without a token.

The routes and their answers are listed here; every body's schema is generated from the
typed models the API validates requests with (``models``), so the request the document
describes is the one the API checks. Fuzzed against the handlers in the tests
(tests/api/test_api_fuzz.py, schemathesis): every answer's status and body must be one this
document lists, and a request it admits is never refused as invalid.
"""

from __future__ import annotations

import html
from typing import Any

from aiohttp import web

from comfy_assets.api.headers import EVENT_ID_PATTERN
from comfy_assets.api.models import UUID, schemas
from comfy_assets.api.shared import API, json_response

JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


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


def _json(description: str, schema: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": _ref(schema)}}}


def _job(status: str, description: str) -> dict[str, Any]:
    return {status: _json(description, "Job")}


RANGE = {
    "name": "Range",
    "in": "header",
    "required": False,
    "description": "one range of bytes (`bytes=0-99`, `bytes=100-`, `bytes=-100`); "
    "anything else sends the whole file",
    "schema": {"type": "string"},
}
LAST_EVENT_ID = {
    "name": "Last-Event-ID",
    "in": "header",
    "required": False,
    "description": "resume a stream after this event id",
    "schema": {"type": "string", "pattern": EVENT_ID_PATTERN},
}


def document(*, webhooks: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the API; ``webhooks``: the API has a webhook secret
    (else a job's ``webhook`` must be null or absent)."""
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
                    "409": _error(
                        "this id is another job (the fields that differ), or the take is "
                        "older than the job's"
                    ),
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
                RANGE,
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
                    "307": {
                        "description": "with an object store: the file is at the presigned "
                        "GET URL of Location (no bytes through the API)",
                        "headers": {"Location": {"schema": {"type": "string"}}},
                    },
                    "416": {"description": "the range is beyond the end"},
                    "404": _error("no such job of this client, or no such file"),
                    **COMMON,
                },
            },
        },
        "/v1/jobs/{job_id}/events": {
            "parameters": [JOB_ID, LAST_EVENT_ID],
            "get": {
                "operationId": "getEvents",
                "summary": "A job's transitions; live with Accept: text/event-stream",
                "responses": {
                    "200": {
                        "description": "the events, oldest first",
                        "content": {
                            JSON: {"schema": _ref("Events")},
                            "text/event-stream": {"schema": {"type": "string"}},
                        },
                    },
                    "400": _error("Last-Event-ID is not an event id"),
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
                "summary": "Each server's health and lease; failure reasons of your own jobs only",
                "responses": {
                    "200": _json("the servers", "Servers"),
                    **COMMON,
                },
            }
        },
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "Liveness (no token)",
                "security": [],
                "responses": {"200": _json("serving", "Status")},
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "Readiness: the store answers and the broker is connected (no token)",
                "security": [],
                "responses": {
                    "200": _json("ready", "Status"),
                    "503": _json("not ready", "Status"),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document (no token)",
                "security": [],
                "responses": {
                    "200": {
                        "description": "the OpenAPI document",
                        "content": {JSON: {"schema": {"type": "object"}}},
                    }
                },
            }
        },
        "/docs": {
            "get": {
                "operationId": "docs",
                "summary": "This document as a page (no token)",
                "security": [],
                "responses": {
                    "200": {
                        "description": "the page",
                        "content": {"text/html": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "comfy-assets API",
            "version": "1",
            "description": "Submit ComfyUI jobs, follow them, fetch their files (docs/api.md).",
        },
        "paths": paths,
        "components": {
            "schemas": schemas(webhooks),
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
        "</head><body><h1>comfy-assets API</h1><p>Every route but /healthz, /readyz, "
        "/docs and /openapi.json needs <code>Authorization: Bearer TOKEN</code>. The machine-readable document: "
        "<a href='/openapi.json'>/openapi.json</a>.</p>" + "".join(rows) + "</body></html>"
    )


def _document_of(request: web.Request) -> dict[str, Any]:
    return document(webhooks=request.app[API].webhook_key is not None)


async def openapi_json(request: web.Request) -> web.Response:
    """``GET /openapi.json``: the document, as this API is configured."""
    return json_response(_document_of(request))


async def docs(request: web.Request) -> web.Response:
    """``GET /docs``: the document's page."""
    return web.Response(text=docs_page(_document_of(request)), content_type="text/html")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_get("/docs", docs)
