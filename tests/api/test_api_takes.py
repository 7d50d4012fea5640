"""Exactly once under hurried clients, on PostgreSQL: the API in process, two workers in
process on the machine's RabbitMQ, two fake ComfyUI servers whose own records count what
each prompt executed.

Takes are a sequence: take N of a job is accepted once (202), a repeat answers 200, an
older take 409; messages of older takes are acked as superseded without a render, so the
job ends with its newest take's picture and every take's prompt runs at most once,
whether the takes came one after another before any worker ran, or raced each other
(and their own repeats) while the workers rendered. Twenty identical POSTs of a new id
at once get one 202 and nineteen 200s.
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from comfy_assets.api.submission import parse_submission
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.api_support import api_client, auth, job_body, make_api
from tests.service.test_worker_rabbitmq import make_worker, running_worker
from tests.support import executed, fake_servers, fast_config, posted, wait_until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.timeout(180)]


def prompt_of(body: dict[str, Any]) -> str:
    """The prompt_id the job of ``body`` renders under."""
    sub = parse_submission(
        body, partition="api-alice", max_input_bytes=1 << 20, max_message_bytes=1 << 22
    )
    return sub.job.prompt_id


def executions(fakes: list[FakeComfy], prompt_id: str) -> int:
    return sum(executed(f, prompt_id) for f in fakes)


def posts(fakes: list[FakeComfy], prompt_id: str) -> int:
    return sum(posted(f, prompt_id) for f in fakes)


async def state_of(client: TestClient, job_id: str) -> dict[str, Any]:
    answer = await client.get(f"/v1/jobs/{job_id}", headers=auth())
    assert answer.status == 200
    return await answer.json()


async def ends_with_take(client: TestClient, job_id: str, take: int) -> dict[str, Any]:
    """The job once it has succeeded at ``take``."""
    found: dict[str, Any] = {}

    async def check() -> bool:
        found.update(await state_of(client, job_id))
        return found["state"] == "succeeded" and found["take"] == take

    deadline = asyncio.get_running_loop().time() + 90
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"job ended as {found}"
        await asyncio.sleep(0.05)
    return found


async def post(client: TestClient, body: dict[str, Any]) -> int:
    answer = await client.post("/v1/jobs", json=body, headers=auth())
    return answer.status


async def test_each_take_is_accepted_once_and_rendered_at_most_once(
    tmp_path: Path, pg_url: str, queue: str
) -> None:
    fakes = [FakeComfy(prompt_seconds=0.05), FakeComfy(prompt_seconds=0.05)]
    root = tmp_path / "store"
    async with AsyncExitStack() as stack:
        stores = [stack.enter_context(Store(root, pg_url)) for _ in range(3)]
        specs = await stack.enter_async_context(fake_servers(*fakes))
        client = await api_client(make_api(stores[0], queue))
        await stack.enter_async_context(client)

        # One after another, before any worker runs: three takes, a repeat, an older one.
        sequential = job_body(str(uuid.uuid4()))
        takes = {t: dict(sequential, take=t) for t in (1, 2, 3)}
        assert [await post(client, takes[t]) for t in (1, 2, 3)] == [202, 202, 202]
        assert await post(client, takes[3]) == 200
        older = await client.post("/v1/jobs", json=takes[2], headers=auth())
        assert older.status == 409, await older.text()
        assert "take 2 is older" in (await older.json())["message"]

        workers = [
            make_worker(queue, specs, stores[i], tmp_path, config=fast_config()) for i in (1, 2)
        ]
        for worker in workers:
            await stack.enter_async_context(running_worker(worker))
        view = await ends_with_take(client, sequential["id"], 3)
        assert view["files"] and all(f["name"].startswith("take-3/") for f in view["files"])
        assert [executions(fakes, prompt_of(takes[t])) for t in (1, 2, 3)] == [0, 0, 1]
        events = (
            await (await client.get(f"/v1/jobs/{sequential['id']}/events", headers=auth())).json()
        )["events"]
        details = [e["detail"] or "" for e in events]
        assert "take 2 → 3" in details and not any(d.startswith("take 3 → ") for d in details)
        for t in (1, 2):
            assert f"message of take {t} superseded by take 3; acked, not rendered" in details

        # Racing, while the workers render: take k and two copies of take k + 1 at once.
        racing = job_body(str(uuid.uuid4()), set={"1.color": 255})
        assert await post(client, racing) == 202
        answers: dict[int, list[int]] = {}
        for k in (2, 4, 6):
            got = await asyncio.gather(
                post(client, dict(racing, take=k)),
                post(client, dict(racing, take=k + 1)),
                post(client, dict(racing, take=k + 1)),
            )
            answers[k], answers[k + 1] = [got[0]], sorted(got[1:])
            if k == 4:  # let a render of take 5 start before the next race
                prompt = prompt_of(dict(racing, take=5))
                await wait_until(lambda p=prompt: posts(fakes, p) > 0, 60, "take 5 posted")
        for k in (2, 4, 6):
            assert answers[k][0] in (202, 409), answers  # 409: take k + 1 came first
            assert answers[k + 1] == [200, 202], answers  # accepted once, the copy a repeat
        await ends_with_take(client, racing["id"], 7)
        runs = {t: executions(fakes, prompt_of(dict(racing, take=t))) for t in range(1, 8)}
        assert runs[7] == 1 and all(n <= 1 for n in runs.values()), runs
        for worker in workers:
            worker.request_stop("test over")
    counts = [w.counts for w in workers]
    assert sum(c["superseded"] for c in counts) >= 2  # takes 1 and 2 of the first job
    assert sum(c["requeued"] for c in counts) == 0


@pytest.mark.parametrize("database", ["postgresql", "sqlite"])
async def test_twenty_identical_posts_of_a_new_id_get_one_202(
    tmp_path: Path, pg_url: str, queue: str, database: str
) -> None:
    with Store(tmp_path / "store", pg_url if database == "postgresql" else None) as store:
        async with await api_client(make_api(store, queue)) as client:
            for _ in range(3):
                body = job_body(str(uuid.uuid4()))
                statuses = await asyncio.gather(*(post(client, body) for _ in range(20)))
                assert sorted(statuses) == [200] * 19 + [202], statuses
