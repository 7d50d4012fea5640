"""Following one prompt against the fake server: each script word's outcome as the
client sees it, with posted/executed counts from the fake's own records."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import (
    DeadlineExceeded,
    PromptLost,
    PromptRejected,
    ServerError,
    ServerUnreachable,
    UnexpectedAnswer,
)
from comfy_assets.comfy.follow import PromptFollower, PromptOutcome
from fake_comfy import FakeComfy
from tests.conftest import IMAGE_WORKFLOW as IMAGE
from tests.support import wait_until

pytestmark = pytest.mark.timeout(30)

RECORDED = Path(__file__).resolve().parents[2] / "data" / "recorded"


def new_id() -> str:
    return str(uuid.uuid4())


def counts(fake: FakeComfy, prompt_id: str) -> tuple[int, int]:
    record = fake.stats["prompts"].get(prompt_id, {})
    return record.get("posted", 0), record.get("executed", 0)


class Recorder:
    """on_finished callback that notes each call and whether wait() had returned yet."""

    def __init__(self) -> None:
        self.calls = 0
        self.returned = False
        self.called_before_return = False

    def __call__(self) -> None:
        self.calls += 1
        self.called_before_return = not self.returned


async def post_and_wait(
    client: ComfyClient,
    prompt_id: str,
    *,
    workflow: dict | None = None,
    poll_s: float = 0.05,
    deadline_s: float = 10.0,
    on_finished: Recorder | None = None,
) -> PromptOutcome:
    client_id = uuid.uuid4().hex
    async with PromptFollower(client, client_id, poll_s=poll_s) as follower:
        post = await client.post_prompt(workflow or IMAGE, prompt_id=prompt_id, client_id=client_id)
        outcome = await follower.wait(
            prompt_id, post.number, deadline_s=deadline_s, on_finished=on_finished
        )
    if on_finished is not None:
        on_finished.returned = True
    return outcome


async def follow_script(
    word: str, **options: Any
) -> tuple[FakeComfy, str, Recorder, PromptOutcome]:
    """One prompt posted to a fake whose script is ``[word]`` (each node 10 ms) and followed
    to its end (``post_and_wait`` with ``options``); returns the fake, the prompt id, the
    on_finished recorder and the outcome."""
    fake = FakeComfy(script=[word], prompt_seconds=0.01)
    pid, finished = new_id(), Recorder()
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        outcome = await post_and_wait(client, pid, on_finished=finished, **options)
    return fake, pid, finished, outcome


async def test_ok_succeeds_with_both_outputs_and_frees_the_slot_once():
    fake, pid, finished, outcome = await follow_script("ok")
    assert outcome.status == "success"
    assert outcome.history is not None
    assert len([f for f in outcome.history.output_files if f.type == "output"]) == 2
    assert (outcome.error, outcome.reconnects) == (None, 0)
    assert (finished.calls, finished.called_before_return) == (1, True)
    assert counts(fake, pid) == (1, 1)


def http_requests(fake: FakeComfy) -> dict[str, int]:
    """The HTTP requests the fake answered, by route (the socket's upgrade left out)."""
    return {route: n for route, n in fake.stats["requests"].items() if route != "GET /ws"}


async def test_a_quick_prompt_costs_one_history_request_not_a_poll_loop():
    fake = FakeComfy(script=["ok"], prompt_seconds=0.01)
    pid = new_id()
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        outcome = await post_and_wait(client, pid, poll_s=30.0)
    assert outcome.status == "success"
    assert http_requests(fake) == {"POST /prompt": 1, "GET /history/{prompt_id}": 1}


async def test_error_reports_the_index_error_and_is_not_oom():
    fake, pid, finished, outcome = await follow_script("error")
    assert outcome.status == "error"
    assert outcome.error is not None
    assert outcome.error.exception_type == "IndexError"
    assert not outcome.error.is_oom
    assert finished.calls == 1
    assert counts(fake, pid) == (1, 1)


async def test_oom_is_an_error_recognised_as_out_of_memory():
    fake = FakeComfy(script=["oom"], prompt_seconds=0.01)
    pid = new_id()
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        outcome = await post_and_wait(client, pid)
    assert outcome.status == "error"
    assert outcome.error is not None and outcome.error.is_oom
    assert counts(fake, pid) == (1, 1)


async def test_500_on_post_raises_server_error_and_nothing_runs():
    fake = FakeComfy(script=["500"], prompt_seconds=0.01)
    pid = new_id()
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        with pytest.raises(ServerError) as info:
            await post_and_wait(client, pid)
    assert info.value.status == 500
    assert counts(fake, pid)[1] == 0


async def test_invalid_is_rejected_with_the_node_named_and_nothing_runs():
    fake = FakeComfy(script=["invalid"], prompt_seconds=0.01)
    pid = new_id()
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        with pytest.raises(PromptRejected) as info:
            await post_and_wait(client, pid)
    assert info.value.error_type == "prompt_outputs_failed_validation"
    assert "node " in str(info.value)
    assert not info.value.transient
    assert counts(fake, pid)[1] == 0


async def test_drop_reconnects_with_the_same_client_id_and_still_succeeds():
    fake = FakeComfy(script=["drop"], prompt_seconds=0.1)
    pid = new_id()
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        # No poll within the deadline: the finish must come over the new socket, which
        # only gets our events if it reconnected under the same clientId.
        outcome = await post_and_wait(client, pid, poll_s=60.0)
    assert outcome.status == "success"
    assert outcome.history is not None and outcome.history.output_files
    assert outcome.reconnects >= 1
    assert counts(fake, pid) == (1, 1)


async def test_late_history_is_waited_for_after_execution_success():
    fake, pid, finished, outcome = await follow_script("late")
    assert outcome.status == "success"
    assert outcome.history is not None and len(outcome.history.output_files) == 2
    assert finished.calls == 1
    assert counts(fake, pid) == (1, 1)


async def test_silent_socket_is_covered_by_polling_history():
    fake, pid, finished, outcome = await follow_script("silent")
    assert outcome.status == "success"
    assert outcome.history is not None and outcome.history.output_files
    assert finished.calls == 1
    assert counts(fake, pid) == (1, 1)


async def test_slow_prompt_succeeds():
    fake = FakeComfy(script=["slow"], prompt_seconds=0.01)
    pid = new_id()
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        outcome = await post_and_wait(client, pid, deadline_s=20)
    assert outcome.status == "success"
    assert counts(fake, pid) == (1, 1)


async def test_partial_post_reports_node_errors_and_one_output_less():
    fake = FakeComfy(script=["partial"], prompt_seconds=0.01)
    pid, client_id = new_id(), uuid.uuid4().hex
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        async with PromptFollower(client, client_id, poll_s=0.05) as follower:
            post = await client.post_prompt(IMAGE, prompt_id=pid, client_id=client_id)
            outcome = await follower.wait(pid, post.number, deadline_s=10)
    assert post.node_errors
    assert outcome.status == "success"
    assert outcome.history is not None and len(outcome.history.output_files) == 1
    assert counts(fake, pid) == (1, 1)


async def test_restart_mid_prompt_is_lost_not_waited_for_until_the_deadline():
    fake = FakeComfy(script=["restart"], prompt_seconds=0.05)
    pid, finished = new_id(), Recorder()
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        with pytest.raises(PromptLost) as info:
            await post_and_wait(client, pid, deadline_s=20, on_finished=finished)
    assert info.value.transient
    assert pid in str(info.value)
    assert finished.calls == 0
    assert counts(fake, pid)[0] == 1


async def test_a_success_forgotten_by_a_restart_before_history_was_read_is_lost():
    # Our prompt ends with execution_success; the next prompt on the server restarts it
    # before we read /history: the run is in neither /queue nor /history any more.
    fake = FakeComfy(script=["ok", "restart"], prompt_seconds=0.01)
    pid, other, client_id = new_id(), new_id(), uuid.uuid4().hex
    restarted = {"seen": False}

    async def after_finish() -> None:
        # Hold the /history request until the next prompt has restarted the server.
        lost = lambda: any(r["outcome"] == "lost" for r in fake.stats["runs"])  # noqa: E731
        await wait_until(lost, 10.0, "the restart")
        restarted["seen"] = True

    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        async with PromptFollower(client, client_id, poll_s=60.0) as follower:
            post = await client.post_prompt(IMAGE, prompt_id=pid, client_id=client_id)
            await client.post_prompt(IMAGE, prompt_id=other, client_id=uuid.uuid4().hex)
            with pytest.raises(PromptLost) as info:
                await follower.wait(pid, post.number, deadline_s=20, then=after_finish)
    assert restarted["seen"]
    assert "forgot" in str(info.value)
    assert fake.stats["prompts"][pid]["executed"] == 1


async def test_hang_exceeds_the_deadline_then_an_interrupt_ends_it_as_interrupted():
    fake = FakeComfy(script=["hang"], prompt_seconds=0.01)
    pid, client_id = new_id(), uuid.uuid4().hex
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        async with PromptFollower(client, client_id, poll_s=0.05) as follower:
            post = await client.post_prompt(IMAGE, prompt_id=pid, client_id=client_id)
            with pytest.raises(DeadlineExceeded) as info:
                await follower.wait(pid, post.number, deadline_s=0.3)
            await client.interrupt(pid)
            outcome = await follower.wait(pid, post.number, deadline_s=10)
    assert info.value.transient
    assert outcome.status == "interrupted"
    assert counts(fake, pid) == (1, 1)


async def test_a_prompt_found_in_the_queue_is_followed_from_another_client_id():
    fake = FakeComfy(script=["slow"], prompt_seconds=0.01)
    pid = new_id()
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        post = await client.post_prompt(IMAGE, prompt_id=pid, client_id="someone-else")
        queue = await client.queue()
        entry = queue.find(pid)
        assert entry is not None and entry.number == post.number
        finished = Recorder()
        async with PromptFollower(client, uuid.uuid4().hex, poll_s=0.05) as follower:
            outcome = await follower.wait(pid, entry.number, deadline_s=20, on_finished=finished)
    assert outcome.status == "success"
    assert outcome.history is not None and outcome.history.number == post.number
    assert finished.calls == 1
    assert counts(fake, pid) == (1, 1)


async def test_a_reposted_prompt_id_is_matched_by_run_number():
    fake = FakeComfy(script=["ok", "ok"], prompt_seconds=0.05)
    pid, client_id = new_id(), uuid.uuid4().hex
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        async with PromptFollower(client, client_id, poll_s=0.05) as follower:
            first = await client.post_prompt(IMAGE, prompt_id=pid, client_id=client_id)
            second = await client.post_prompt(IMAGE, prompt_id=pid, client_id=client_id)
            outcome = await follower.wait(pid, second.number, deadline_s=10)
    assert second.number > first.number
    assert outcome.status == "success"
    assert outcome.history is not None and outcome.history.number == second.number
    assert counts(fake, pid) == (2, 2)


async def test_a_foreign_broadcast_interrupt_does_not_end_our_prompt():
    # broadcast_and_missed.json: an anonymous prompt's execution_interrupted reaches us.
    fake = FakeComfy(script=["hang", "ok"], prompt_seconds=0.01)
    theirs, ours, client_id = new_id(), new_id(), uuid.uuid4().hex
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        async with PromptFollower(client, client_id, poll_s=0.05) as follower:
            async with httpx.AsyncClient(base_url=url) as anonymous:  # no client_id
                answer = await anonymous.post(
                    "/prompt", json={"prompt": IMAGE, "prompt_id": theirs}
                )
                assert answer.status_code == 200
            post = await client.post_prompt(IMAGE, prompt_id=ours, client_id=client_id)
            await client.interrupt(theirs)
            outcome = await follower.wait(ours, post.number, deadline_s=10)
    assert outcome.status == "success"
    assert outcome.history is not None and outcome.history.prompt_id == ours
    assert counts(fake, ours) == (1, 1)


async def test_server_gone_mid_prompt_keeps_trying_until_the_deadline():
    fake = FakeComfy(script=["hang"], prompt_seconds=0.01)
    pid, client_id = new_id(), uuid.uuid4().hex
    async with fake.serve(port=0) as url:
        client = ComfyClient(url, timeout_s=1.0)
        follower = PromptFollower(client, client_id, poll_s=0.05)
        await follower.__aenter__()
        post = await client.post_prompt(IMAGE, prompt_id=pid, client_id=client_id)
    try:  # the server is gone now: refused until the deadline
        with pytest.raises(DeadlineExceeded) as info:
            await follower.wait(pid, post.number, deadline_s=0.5)
        assert "server trouble" in str(info.value)
    finally:
        await follower.__aexit__(None, None, None)
        await client.aclose()


async def test_a_server_gone_longer_than_give_up_s_is_given_up_before_the_deadline(caplog):
    fake = FakeComfy(script=["hang"], prompt_seconds=0.01)
    pid, client_id = new_id(), uuid.uuid4().hex
    async with fake.serve(port=0) as url:
        client = ComfyClient(url, timeout_s=1.0)
        follower = PromptFollower(client, client_id, poll_s=0.05, give_up_s=0.3)
        await follower.__aenter__()
        post = await client.post_prompt(IMAGE, prompt_id=pid, client_id=client_id)
    try:  # the server is gone now: refused for good
        with pytest.raises(ServerUnreachable, match="given up"):
            await follower.wait(pid, post.number, deadline_s=60)
    finally:
        await follower.__aexit__(None, None, None)
        await client.aclose()
    said = [r.getMessage() for r in caplog.records if "no answer while prompt" in r.getMessage()]
    assert len(said) == 1  # once per outage, not once per poll
    assert said[0].startswith(f"{client.name}: no answer while prompt {pid} is there (")


async def test_a_server_restarted_on_the_same_port_has_forgotten_the_prompt():
    # restart.json: connections refused for a while, then /queue and /history are empty.
    first = FakeComfy(script=["hang"], prompt_seconds=0.01)
    pid, client_id = new_id(), uuid.uuid4().hex
    async with first.serve(port=0) as url:
        port = int(url.rsplit(":", 1)[1])
        client = ComfyClient(url, timeout_s=1.0)
        follower = PromptFollower(client, client_id, poll_s=0.05)
        await follower.__aenter__()
        post = await client.post_prompt(IMAGE, prompt_id=pid, client_id=client_id)
    second = FakeComfy(prompt_seconds=0.01)
    try:
        async with second.serve(port=port):
            with pytest.raises(PromptLost):
                await follower.wait(pid, post.number, deadline_s=10)
    finally:
        await follower.__aexit__(None, None, None)
        await client.aclose()
    assert counts(first, pid)[0] == 1
    assert counts(second, pid) == (0, 0)


async def test_the_socket_tells_the_queue_length_and_an_ended_prompt_leaves_it_at_once():
    # success.json's first prompt: `status` counts it until the status that follows its
    # execution_success, but from execution_success on it no longer occupies the server.
    exchanges = json.loads((RECORDED / "success.json").read_text())["exchanges"]
    messages = [e["message"] for e in exchanges if e["kind"] == "ws"]
    end = next(
        i
        for i, m in enumerate(messages)
        if m["type"] == "executing" and m["data"].get("node") is None
    )
    fake = FakeComfy()
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        async with PromptFollower(client, uuid.uuid4().hex) as follower:
            seen = []
            for message in messages[: end + 1]:
                follower._on_message(json.dumps(message))
                seen.append((message["type"], follower.queue_remaining()))
        assert follower.queue_remaining() is None  # closed: nothing known
    success = next(i for i, (kind, _) in enumerate(seen) if kind == "execution_success")
    assert seen[0] == ("status", 0)
    assert [n for _, n in seen[1:success]] == [1] * (success - 1)
    assert [n for _, n in seen[success:]] == [0, 0, 0]
    assert [kind for kind, _ in seen[success:]] == ["execution_success", "status", "executing"]


async def test_a_socket_message_nested_too_deeply_fails_the_follower_in_words():
    fake = FakeComfy()
    async with fake.serve(port=0) as url, ComfyClient(url, name="gpu9") as client:
        with pytest.raises(UnexpectedAnswer) as info:  # the follower's exit raises it
            async with PromptFollower(client, uuid.uuid4().hex) as follower:
                assert follower._on_message("[" * 100_000 + "]" * 100_000) is False
                assert follower.failed
    assert str(info.value).startswith(
        "gpu9: WS /ws: message not understood (maximum recursion depth exceeded"
    )


async def test_then_runs_after_the_finish_and_before_history_is_asked():
    # The pool's hand-over: the server's next prompt is posted in `then`, before this
    # run's /history request (so neither the request nor its answer delays it).
    fake = FakeComfy(script=["ok"], prompt_seconds=0.01)
    pid, finished = new_id(), Recorder()
    seen_in_then: list[tuple[int, dict[str, int]]] = []

    async def then() -> None:
        seen_in_then.append((finished.calls, http_requests(fake)))

    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        client_id = uuid.uuid4().hex
        async with PromptFollower(client, client_id, poll_s=30.0) as follower:
            post = await client.post_prompt(IMAGE, prompt_id=pid, client_id=client_id)
            outcome = await follower.wait(pid, post.number, on_finished=finished, then=then)
    assert outcome.status == "success"
    assert seen_in_then == [(1, {"POST /prompt": 1})]
    assert http_requests(fake) == {"POST /prompt": 1, "GET /history/{prompt_id}": 1}
