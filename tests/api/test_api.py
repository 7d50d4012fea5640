"""The HTTP API in process over a SQLite store and the machine's RabbitMQ: what a client
sees for each request (202 once durable, 200 for a retry, 409, 422 with the job-file
parser's messages, 400, 401, 404 across clients, 413, 429), the message a worker gets,
files with ETag and Range, cancel and requeue, and a job published again after a crash
between the store and the broker."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from comfy_assets.api import routes_jobs
from comfy_assets.api.app import Limits
from comfy_assets.api.publisher import Publisher
from comfy_assets.api.submission import parse_submission, pointer
from comfy_assets.jobs.model import JobFileError
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.service.messages import file_messages
from comfy_assets.store import OutputFile, Store, Via
from comfy_assets.store.api_jobs import ApiJob
from tests.api_support import (
    AMQP,
    api_client,
    auth,
    data_uri,
    job_body,
    make_api,
    queued,
)
from tests.support import wait_until

pytestmark = pytest.mark.rabbitmq


async def test_a_job_is_202_once_queued_200_when_sent_again_409_when_changed(
    store: Store, queue: str, tmp_path: Path
) -> None:
    client = await api_client(make_api(store, queue))
    body = job_body(inputs={"1.image": data_uri(b"\x89PNG not really")})
    body["workflow"]["1"] = {"class_type": "LoadImage", "inputs": {"image": "x.png"}}
    body["set"] = {}
    async with client:
        first = await client.post("/v1/jobs", json=body, headers=auth())
        assert first.status == 202, await first.text()
        view = await first.json()
        assert view["state"] == "pending" and view["id"] == body["id"]
        assert first.headers["Location"] == f"/v1/jobs/{body['id']}"
        again = await client.post("/v1/jobs", json=body, headers=auth())
        assert again.status == 200
        assert (await again.json())["id"] == body["id"]
        changed = dict(body, take=2, inputs={"1.image": data_uri(b"other bytes")})
        conflict = await client.post("/v1/jobs", json=changed, headers=auth())
        assert conflict.status == 409
        assert (await conflict.json())["differs"] == ["/inputs/1.image", "/take"]
    # One message, the one `enqueue` writes for the same job line (same partition).
    messages = await queued(queue)
    assert len(messages) == 1
    line = dict(body)
    line["inputs"] = {"1.image": "picture.png"}
    (tmp_path / "picture.png").write_bytes(b"\x89PNG not really")
    (tmp_path / "jobs.jsonl").write_text(json.dumps(line) + "\n")
    [(_, expected)] = file_messages(load_job_file(tmp_path / "jobs.jsonl"), "api-alice")
    got, want = json.loads(messages[0].body), json.loads(expected)
    got["inputs"]["1.image"].pop("path")  # named by content in the API, by path in a file
    want["inputs"]["1.image"].pop("path")
    assert want.pop("policy") == "delivery"  # a job file's header; the API has none
    assert got == want  # the same workflow (inputs named by content), set, take, bytes
    assert got["workflow"]["1"]["inputs"]["image"].startswith("comfy_assets/")
    record = store.get(body["id"])
    assert record is not None and record.partition == "api-alice" and record.state == "pending"


async def test_a_bad_job_gets_every_error_of_the_job_file_parser(
    store: Store, queue: str, tmp_path: Path
) -> None:
    bad = {
        "id": "job-1",
        "workflow": {"1": {"class_type": "EmptyImage", "inputs": {"width": 8}}},
        "set": {"9.color": 1, "1.height": True},
        "take": 0,
        "worklfow": 1,
    }
    (tmp_path / "jobs.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(JobFileError) as parsed:
        load_job_file(tmp_path / "jobs.jsonl")
    expected = sorted((pointer(e.field), e.message) for e in parsed.value.errors)
    assert len(expected) >= 4
    client = await api_client(make_api(store, queue))
    async with client:
        answer = await client.post("/v1/jobs", json=bad, headers=auth())
        assert answer.status == 422
        errors = (await answer.json())["errors"]
    assert sorted((e["field"], e["message"]) for e in errors) == expected
    assert {"/id", "/take", "/set/9.color", "/worklfow"} <= {e["field"] for e in errors}
    assert store.get("job-1") is None
    assert await queued(queue) == []


async def test_a_key_repeated_in_the_body_is_refused_as_in_a_job_file(
    store: Store, queue: str
) -> None:
    body = job_body()
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    text = json.dumps(body).replace(f'"id": "{body["id"]}"', f'"id": "{first}", "id": "{second}"')
    client = await api_client(make_api(store, queue))
    async with client:
        answer = await client.post("/v1/jobs", data=text.encode(), headers=auth())
        assert answer.status == 422
        (problem,) = (await answer.json())["errors"]
    assert problem == {"field": "", "message": 'key "id" repeated in an object'}
    assert store.get(first) is None and store.get(second) is None
    assert await queued(queue) == []


@asynccontextmanager
async def one_job_posted(store: Store, queue: str) -> AsyncIterator[tuple[TestClient, dict, str]]:
    """A client of the API over ``store`` and ``queue`` that has posted one job (202); yields
    the client, the job's body and its path (``/v1/jobs/<id>``)."""
    client = await api_client(make_api(store, queue))
    body = job_body()
    async with client:
        assert (await client.post("/v1/jobs", json=body, headers=auth())).status == 202
        yield client, body, f"/v1/jobs/{body['id']}"


async def test_tokens_and_clients_see_only_their_own_jobs(store: Store, queue: str) -> None:
    async with one_job_posted(store, queue) as (client, body, job):
        for path in ("/v1/jobs/" + body["id"], "/v1/servers"):
            assert (await client.get(path)).status == 401
            wrong = {"Authorization": "Bearer alice-token-012345678"}
            assert (await client.get(path, headers=wrong)).status == 401
        assert (await client.post("/v1/jobs", json=job_body())).status == 401
        assert (await client.get("/healthz")).status == 200
        for path in (job, f"{job}/events", f"{job}/files/solid_00001_.png"):
            answer = await client.get(path, headers=auth("bob"))
            assert answer.status == 404
            assert (await answer.json())["message"] == f"no job {body['id']}" or "file" in path
        for path in (f"{job}/cancel", f"{job}/requeue"):
            assert (await client.post(path, headers=auth("bob"))).status == 404
        # Bob cannot take Alice's id either.
        assert (await client.post("/v1/jobs", json=body, headers=auth("bob"))).status == 409
        assert (await client.get(job, headers=auth())).status == 200
    assert store.get(body["id"]).state == "pending"  # type: ignore[union-attr]


async def test_malformed_large_and_too_many_requests(store: Store, queue: str) -> None:
    limits = Limits(
        max_input_bytes=1024,
        max_message_bytes=8192,
        max_body_bytes=16384,
        rate_per_s=0.001,
        burst=4,
    )
    client = await api_client(make_api(store, queue, limits=limits))
    async with client:
        bad = await client.post("/v1/jobs", data=b'{"id": ', headers=auth())
        assert bad.status == 400 and "not JSON" in (await bad.json())["message"]
        large = await client.post("/v1/jobs", data=b"x" * 20000, headers=auth())
        assert large.status == 413
        big_input = job_body(inputs={"1.image": data_uri(b"\0" * 2000)})
        refused = await client.post("/v1/jobs", json=big_input, headers=auth())
        assert refused.status == 422
        [problem] = (await refused.json())["errors"]
        assert problem["field"] == "/inputs/1.image" and "--max-input-bytes" in problem["message"]
        assert (await client.get("/v1/servers", headers=auth())).status == 200  # the 4th
        limited = await client.get("/v1/servers", headers=auth())
        assert limited.status == 429 and int(limited.headers["Retry-After"]) >= 1
        assert (await client.get("/v1/servers", headers=auth("bob"))).status == 200
    assert await queued(queue) == []


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "ftp://example.com/x",
        "http://127.0.0.1:8188/prompt",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.1.2.3/hook",
        "http://[::1]/hook",
        "http://localhost/hook",
        "http://user:pass@example.com/hook",
    ],
)
async def test_webhooks_to_our_own_network_are_refused(store: Store, queue: str, url: str) -> None:
    client = await api_client(make_api(store, queue, webhook_key=b"k" * 32))
    async with client:
        answer = await client.post("/v1/jobs", json=job_body(webhook=url), headers=auth())
        assert answer.status == 422
        [problem] = (await answer.json())["errors"]
        assert problem["field"] == "/webhook"
    assert await queued(queue) == []


async def test_private_webhooks_when_allowed(store: Store, queue: str) -> None:
    api = make_api(store, queue, webhook_key=b"k" * 32, allow_private_webhooks=True)
    client = await api_client(api)
    async with client:
        body = job_body(webhook="http://127.0.0.1:9/hook")
        assert (await client.post("/v1/jobs", json=body, headers=auth())).status == 202
        # Without a secret, no webhooks at all.
        api.webhook_key = None
        answer = await client.post(
            "/v1/jobs", json=job_body(webhook="http://127.0.0.1:9/"), headers=auth()
        )
        assert answer.status == 422
        assert "--webhook-secret-file" in (await answer.json())["errors"][0]["message"]


async def test_files_with_etag_and_ranges(store: Store, queue: str) -> None:
    client = await api_client(make_api(store, queue))
    body = job_body()
    data = bytes(range(256)) * 10
    sha = hashlib.sha256(data).hexdigest()
    async with client:
        assert (await client.post("/v1/jobs", json=body, headers=auth())).status == 202
        record = store.get(body["id"])
        assert record is not None
        folder = store.job_dir("api-alice", body["id"])
        folder.mkdir(parents=True)
        (folder / "solid_00001_.png").write_bytes(data)
        assert store.claim(body["id"], "test-owner") == "claimed"
        store.mark_done(
            body["id"], "test-owner", files=[OutputFile("solid_00001_.png", sha, len(data))]
        )
        view = await (await client.get(f"/v1/jobs/{body['id']}", headers=auth())).json()
        assert view["state"] == "succeeded"
        [entry] = view["files"]
        assert entry == {
            "name": "solid_00001_.png",
            "bytes": len(data),
            "sha256": sha,
            "content_type": "image/png",
            "url": f"/v1/jobs/{body['id']}/files/solid_00001_.png",
        }
        whole = await client.get(entry["url"], headers=auth())
        assert whole.status == 200 and await whole.read() == data
        assert whole.headers["ETag"] == f'"{sha}"' and whole.headers["Content-Type"] == "image/png"
        part = await client.get(entry["url"], headers={**auth(), "Range": "bytes=10-19"})
        assert part.status == 206 and await part.read() == data[10:20]
        assert part.headers["Content-Range"] == f"bytes 10-19/{len(data)}"
        tail = await client.get(entry["url"], headers={**auth(), "Range": "bytes=-5"})
        assert tail.status == 206 and await tail.read() == data[-5:]
        same = await client.get(entry["url"], headers={**auth(), "If-None-Match": f'"{sha}"'})
        assert same.status == 304
        beyond = await client.get(entry["url"], headers={**auth(), "Range": "bytes=99999-"})
        assert beyond.status == 416
        for name in ("other.png", "../store.db", "..%2Fstore.db"):
            assert (
                await client.get(f"/v1/jobs/{body['id']}/files/{name}", headers=auth())
            ).status == 404
        assert (await client.get(entry["url"], headers=auth("bob"))).status == 404


async def test_cancel_then_requeue(store: Store, queue: str) -> None:
    async with one_job_posted(store, queue) as (client, body, job):
        cancelled = await client.post(f"{job}/cancel", headers=auth())
        assert cancelled.status == 200
        view = await cancelled.json()
        assert view["state"] == "failed_fatal" and view["reason"] == "cancelled by alice"
        assert (await client.post(f"{job}/cancel", headers=auth())).status == 409
        requeued = await client.post(f"{job}/requeue", headers=auth())
        assert requeued.status == 202 and (await requeued.json())["state"] == "pending"
        assert (await client.post(f"{job}/requeue", headers=auth())).status == 409
        events = (await (await client.get(f"{job}/events", headers=auth())).json())["events"]
    assert [(e["from"], e["to"], e["detail"]) for e in events] == [
        (None, "pending", "registered"),
        ("pending", "failed_fatal", "cancelled by alice"),
        ("failed_fatal", "pending", "requeued"),
    ]
    assert len(await queued(queue)) == 2  # submitted, then requeued


async def test_a_job_recorded_but_not_confirmed_is_published_again(
    store: Store, queue: str
) -> None:
    """The API died between the store and the broker: the next API publishes it."""
    api = make_api(store, queue)
    sub = parse_submission(
        job_body(), partition="api-alice", max_input_bytes=10, max_message_bytes=10**6
    )
    job_id = sub.job.id
    row = ApiJob(job_id, "alice", sub.content, sub.message, None, store.now() - 60)
    api.ledger.take(row, "api-alice", sub.job)  # and killed before the publish
    client = await api_client(api, background=True)
    async with client:
        await wait_until(
            lambda: api.ledger.get(job_id).published_at is not None,  # type: ignore[union-attr]
            10,
            "the job published again",
        )
    [message] = await queued(queue)
    assert message.message_id == job_id and message.body == sub.message
    assert store.get(job_id).state == "pending"  # type: ignore[union-attr]


async def test_a_broker_away_answers_503_and_the_same_request_later_publishes(
    store: Store, queue: str
) -> None:
    """No 202 without the broker's confirm: the job is recorded, the client told to send
    it again, and that retry (the broker back) publishes it and answers 200."""
    api = make_api(store, queue)
    api.publisher = Publisher("amqp://guest:guest@127.0.0.1:1/", queue, timeout_s=2)
    client = await api_client(api)
    body = job_body()
    async with client:
        away = await client.post("/v1/jobs", json=body, headers=auth())
        assert away.status == 503 and away.headers["Retry-After"] == "5"
        assert "send the same request again" in (await away.json())["message"]
        assert (await client.get("/readyz")).status == 503
        assert api.ledger.get(body["id"]).published_at is None  # type: ignore[union-attr]
        assert store.get(body["id"]).state == "pending"  # type: ignore[union-attr]
        api.publisher = Publisher(AMQP, queue)  # the broker is back
        again = await client.post("/v1/jobs", json=body, headers=auth())
        assert again.status == 200
        assert (await client.get("/readyz")).status == 200
    [message] = await queued(queue)
    assert message.message_id == body["id"]


async def test_a_higher_take_renders_the_job_again(store: Store, queue: str) -> None:
    client = await api_client(make_api(store, queue))
    body = job_body()
    async with client:
        assert (await client.post("/v1/jobs", json=body, headers=auth())).status == 202
        second = await client.post("/v1/jobs", json=dict(body, take=2), headers=auth())
        assert second.status == 202 and (await second.json())["take"] == 2
        same = await client.post("/v1/jobs", json=dict(body, take=2), headers=auth())
        assert same.status == 200
        back = await client.post("/v1/jobs", json=body, headers=auth())
        assert back.status == 409 and (await back.json())["differs"] == ["/take"]
    record = store.get(body["id"])
    assert record is not None and record.take == 2 and record.state == "pending"
    assert [e.detail for e in store.events(body["id"])] == ["registered", "take 1 → 2"]
    first, again = await queued(queue)
    assert json.loads(first.body).get("take", 1) == 1 and json.loads(again.body)["take"] == 2


async def test_a_large_input_is_taken_whole(store: Store, queue: str) -> None:
    """A body past the size validated on the event loop: the same answer, the same bytes
    in the message."""
    limits = Limits(
        max_input_bytes=1024**2, max_message_bytes=2 * 1024**2, max_body_bytes=4 * 1024**2
    )
    client = await api_client(make_api(store, queue, limits=limits))
    data = bytes(range(256)) * 1500  # 384,000 bytes
    body = job_body(inputs={"1.image": data_uri(data)}, set={})
    body["workflow"]["1"] = {"class_type": "LoadImage", "inputs": {"image": "x.png"}}
    async with client:
        assert (await client.post("/v1/jobs", json=body, headers=auth())).status == 202
    [message] = await queued(queue)
    sent = json.loads(message.body)["inputs"]["1.image"]
    assert sent["size"] == len(data) and sent["sha256"] == hashlib.sha256(data).hexdigest()


async def test_an_in_flight_job_is_cancelled_once_its_attempt_settles(
    store: Store, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel takes a rendering job's claim and answers 202 at once here (no wait);
    while the worker's server lease still holds its prompt, the job stays in flight (its
    worker records its end); once that attempt has settled, the API's own loop makes it
    the dead letter."""
    monkeypatch.setattr(routes_jobs, "CANCEL_WAIT_S", 0.0)
    api = make_api(store, queue)
    client = await api_client(api, background=True)
    body = job_body()
    job_id = body["id"]
    async with client:
        assert (await client.post("/v1/jobs", json=body, headers=auth())).status == 202
        prompt_id = store.get(job_id).prompt_id  # type: ignore[union-attr]
        assert store.claim(job_id, "worker-1") == "claimed"
        assert store.acquire_server("gpu0", "worker-1", 600, prompt_id=prompt_id)
        store.transition(job_id, "submitted", owner="worker-1", via=Via(server="gpu0", attempt=1))
        view = await (await client.get(f"/v1/jobs/{job_id}", headers=auth())).json()
        assert view["state"] == "submitted" and view["attempts"] == 1  # the one under way
        answer = await client.post(f"/v1/jobs/{job_id}/cancel", headers=auth())
        assert answer.status == 202 and (await answer.json())["state"] == "submitted"
        record = store.get(job_id)
        assert record is not None and record.claimed_by == "api-cancel:alice"
        assert not api.ledger.finish_cancel(record)  # its worker's attempt is under way
        # The attempt ends (interrupted): its worker records it, as settle does.
        store.transition(job_id, "failed_retryable", via=Via(server="gpu0", attempt=1), detail="x")
        store.release_server("gpu0", "worker-1")
        await wait_until(
            lambda: store.get(job_id).state == "failed_fatal",  # type: ignore[union-attr]
            20,
            "the cancel finished by the API",
        )
        view = await (await client.get(f"/v1/jobs/{job_id}", headers=auth())).json()
    assert view["reason"] == "cancelled by alice"
    assert store.claim(job_id, "worker-1") == "dead_lettered"  # its worker acks it


async def test_a_nul_in_a_set_value_is_422_naming_the_field(store: Store, queue: str) -> None:
    body = job_body(set={"1.color": 1, "3.filename_prefix": "a\u0000b"})
    client = await api_client(make_api(store, queue))
    async with client:
        answer = await client.post("/v1/jobs", json=body, headers=auth())
        assert answer.status == 422
        (problem,) = (await answer.json())["errors"]
    assert problem["field"] == "/set/3.filename_prefix"
    assert problem["message"].startswith("holds a NUL character (U+0000), which neither")
    assert store.get(body["id"]) is None
    assert await queued(queue) == []
