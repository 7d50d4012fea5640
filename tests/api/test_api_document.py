"""The request's one definition (``api/models.py``): the OpenAPI document made from it
refuses what the API refuses (``workflow: {}``, ``webhook: ""``), the schema and the
model judge bodies alike, and a rule only the model states is answered in our words."""

from __future__ import annotations

import uuid
from typing import Any

import jsonschema
import pytest

from comfy_assets.api.openapi import document
from comfy_assets.api.submission import Invalid, model_problems, parse_submission
from tests.api_support import data_uri, job_body


def _request_validator(webhooks: bool) -> jsonschema.Draft202012Validator:
    """The document's JobRequest schema, its references resolved in the document."""
    components = document(webhooks=webhooks)["components"]
    schema = {"$ref": "#/components/schemas/JobRequest", "components": components}
    return jsonschema.Draft202012Validator(schema)


def _problems(body: dict[str, Any]) -> list[tuple[str, str]]:
    try:
        parse_submission(body, partition="api-alice", max_input_bytes=1024, max_message_bytes=10**6)
    except Invalid as e:
        return [(p.field, p.message) for p in e.problems]
    return []


BODIES = [
    job_body(),
    job_body(take=3),
    job_body(inputs={"1.image": data_uri(b"\x89PNG")}, set={}),
    job_body(workflow={}),
    job_body(id="JOB-1"),
    job_body(take=0),
    job_body(take=True),
    job_body(set={"color": 1}),
    job_body(set={"1.color": ["2", 0]}),
    job_body(inputs={"1.image": "data:image/png;base64,abc"}),
    job_body(workflow={"1": {"class_type": "EmptyImage"}}),
    job_body(
        workflow={
            "nodes": {"class_type": "A", "inputs": {}},
            "links": {"class_type": "B", "inputs": {}},
        }
    ),
    job_body(priority=3),
    {"workflow": job_body()["workflow"]},
]


@pytest.mark.parametrize("body", BODIES)
def test_the_document_and_the_model_judge_a_body_alike(body: dict[str, Any]) -> None:
    admitted = _request_validator(webhooks=True).is_valid(body)
    assert admitted == (model_problems(body) == [])
    if not admitted:
        assert _problems(body), "a body the document refuses is refused by the API"


def test_the_document_refuses_an_empty_workflow_and_an_empty_webhook() -> None:
    on, off = _request_validator(webhooks=True), _request_validator(webhooks=False)
    assert not on.is_valid(job_body(workflow={})) and not off.is_valid(job_body(workflow={}))
    assert not on.is_valid(job_body(webhook=""))
    assert on.is_valid(job_body(webhook="https://hooks.example.com/render"))
    assert not off.is_valid(job_body(webhook="https://hooks.example.com/render"))
    assert off.is_valid(job_body(webhook=None)) and off.is_valid(job_body())
    assert _problems(job_body(workflow={})) == [
        ("/workflow", "inline workflow is not API format: it has no nodes")
    ]


def test_what_only_the_model_states_is_answered_in_our_words() -> None:
    # With no usable workflow the parser checks no `set` key; the model still does.
    body = {"id": str(uuid.uuid4()), "workflow": {}, "set": {"color": 1}, "priority": 3}
    assert sorted(_problems(body)) == [
        ("/priority", "unknown field"),
        ("/set/color", "expected '<node id>.<input name>', got \"color\""),
        ("/workflow", "inline workflow is not API format: it has no nodes"),
    ]


def test_an_integral_take_is_the_integer_it_equals() -> None:
    body = job_body(take=2.0)
    sub = parse_submission(body, partition="api-alice", max_input_bytes=10, max_message_bytes=10**6)
    assert sub.job.take == 2 and sub.content["take"] == 2
    assert ("/take", "expected an integer from 1 to 2147483647, got 2.5") in _problems(
        job_body(take=2.5)
    )
