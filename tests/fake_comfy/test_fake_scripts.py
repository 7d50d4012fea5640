"""The fake ComfyUI's script words (error, oom, drop, hang, slow, partial, late, silent, restart,
busy) against the recordings of the real server's failures (data/recorded/*.json)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import websockets

from fake_comfy import FakeComfy, workflows
from tests.fake_comfy.recordings import (
    NODE_S,
    WAIT_S,
    Socket,
    post,
    posted_by_me,
    recorded_http,
    recorded_run,
    recording,
)

# -- script words ------------------------------------------------------------------------


async def test_script_words_are_consumed_one_per_post_including_refused_ones(
    tmp_path: Path,
) -> None:
    fake = FakeComfy(script=["500", "invalid", "error"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        answers = [
            await post(c, workflows.solid_and_inverted(), None, pid) for pid in ("a", "b", "c", "d")
        ]
        await fake.wait_idle(WAIT_S)
        statuses = {pid: (await c.get(f"/history/{pid}")).json() for pid in ("c", "d")}
    assert [a.status_code for a in answers] == [500, 400, 200, 200]
    assert answers[0].headers["content-type"] == "text/plain; charset=utf-8"
    assert answers[0].text == "500 Internal Server Error\n\nServer got itself in trouble"
    invalid = answers[1].json()
    assert invalid["error"] == {
        "type": "prompt_outputs_failed_validation",
        "message": "Prompt outputs failed validation",
        "details": "",
        "extra_info": {},
    }
    assert invalid["node_errors"]["1"]["errors"][0]["type"] == "value_smaller_than_min"
    assert invalid["node_errors"]["1"]["dependent_outputs"] == ["3", "4"]
    assert statuses["c"]["c"]["status"]["status_str"] == "error"
    assert statuses["d"]["d"]["status"]["status_str"] == "success"
    assert fake.stats["prompts"] == {
        "a": {"posted": 1, "executed": 0},
        "b": {"posted": 1, "executed": 0},
        "c": {"posted": 1, "executed": 1},
        "d": {"posted": 1, "executed": 1},
    }
    # Every POST in the order it came, refused ones too, each with its time.
    posts = fake.stats["posts"]
    assert [p["prompt_id"] for p in posts] == ["a", "b", "c", "d"]
    times = [p["time"] for p in posts]
    assert times == sorted(times)
    assert fake.script == []


def test_unknown_script_words_are_refused_when_added() -> None:
    with pytest.raises(ValueError, match="unknown script word"):
        FakeComfy(script=["ok", "explode"])
    fake = FakeComfy(script=["ok"])
    fake.script.append("busy=2")
    with pytest.raises(ValueError, match="unknown script word"):
        fake.script.append("oops")
    assert fake.script == ["ok", "busy=2"]


async def test_error_fails_at_the_second_node_with_the_recorded_index_error(tmp_path: Path) -> None:
    fake = FakeComfy(script=["error"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with posted_by_me(fake, workflows.solid_and_inverted(), "e") as (url, c, sock):
        messages = await sock.until_done("e")
        await fake.wait_idle(WAIT_S)
        entry = (await c.get("/history/e")).json()["e"]
        await sock.close()
    error = next(m["data"] for m in messages if m["type"] == "execution_error")
    recorded_error = recorded_run("execution_error", "07b4a31632094e96ae93b6dde7525e35")[-3]["data"]
    for key in ("exception_message", "exception_type", "traceback"):
        assert error[key] == recorded_error[key]
    assert (error["node_id"], error["node_type"], error["executed"]) == ("3", "SaveImage", ["1"])
    assert [m["type"] for m in messages[-3:]] == ["execution_error", "status", "executing"]
    assert (entry["status"]["status_str"], entry["status"]["completed"], entry["outputs"]) == (
        "error",
        False,
        {},
    )
    assert list(tmp_path.iterdir()) == []


async def test_a_nul_byte_in_a_prefix_is_the_nodes_value_error_and_the_next_prompt_runs(
    tmp_path: Path,
) -> None:
    # As a real v0.8.0 answers it (checked on one): os calls refuse the path, the node
    # fails with ValueError "embedded null byte", and the server goes on.
    fake = FakeComfy(prompt_seconds=NODE_S, output_dir=tmp_path)
    bad = workflows.solid_and_inverted()
    bad["3"]["inputs"]["filename_prefix"] = "\x00nul"
    async with posted_by_me(fake, bad, "nul") as (url, c, sock):
        messages = await sock.until_done("nul")
        await post(c, workflows.solid_and_inverted(), "me", "next")
        await sock.until_done("next")
        await sock.close()
    error = next(m["data"] for m in messages if m["type"] == "execution_error")
    assert (error["exception_type"], error["exception_message"]) == (
        "ValueError",
        "embedded null byte\n",
    )
    assert error["node_type"] == "SaveImage"
    assert [r["outcome"] for r in fake.stats["runs"]] == ["error", "success"]


async def test_oom_is_an_execution_error_with_comfyuis_tip(tmp_path: Path) -> None:
    fake = FakeComfy(script=["oom"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with posted_by_me(fake, workflows.solid_and_inverted(), "o") as (url, c, sock):
        messages = await sock.until_done("o")
        await sock.close()
    error = next(m["data"] for m in messages if m["type"] == "execution_error")
    assert error["exception_type"] == "torch.OutOfMemoryError"
    assert error["exception_message"].endswith(
        "This error means you ran out of memory on your GPU.\n\nTIPS: If the workflow worked "
        "before you might have accidentally set the batch_size to a large number."
    )
    assert fake.stats["runs"][0]["outcome"] == "error"


async def test_drop_cuts_the_clients_socket_and_the_prompt_still_finishes(tmp_path: Path) -> None:
    fake = FakeComfy(script=["drop"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with posted_by_me(fake, workflows.solid_and_inverted(), "d") as (url, c, sock):
        with pytest.raises(websockets.ConnectionClosedError) as closed:
            await sock.until_done("d")
        assert closed.value.rcvd is None  # no close frame, as when a process dies
        await fake.wait_idle(WAIT_S)
        entry = (await c.get("/history/d")).json()["d"]
    assert entry["status"]["status_str"] == "success" and list(entry["outputs"]) == ["3", "4"]
    assert fake.stats["prompts"]["d"] == {"posted": 1, "executed": 1}


async def test_hang_waits_for_an_interrupt_that_lands_at_the_second_node(tmp_path: Path) -> None:
    fake = FakeComfy(script=["hang"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with posted_by_me(fake, workflows.blur_chain(), "h") as (url, c, sock):
        await post(c, workflows.single_image(), "me", "next")
        await sock.until("executing", node="2", prompt_id="h")
        queue = (await c.get("/queue")).json()
        assert [item[1] for item in queue["queue_running"]] == ["h"]
        assert [item[1] for item in queue["queue_pending"]] == ["next"]
        # Naming a pending prompt does nothing (interrupt_reconnect.json).
        skipped = await c.post("/interrupt", json={"prompt_id": "next"})
        assert (skipped.status_code, skipped.content) == (200, b"")
        assert [item[1] for item in (await c.get("/queue")).json()["queue_running"]] == ["h"]
        await c.post("/interrupt", json={"prompt_id": "h"})
        messages = await sock.until_done("h")
        await sock.until_done("next")
        await fake.wait_idle(WAIT_S)
        entry = (await c.get("/history/h")).json()["h"]
        await sock.close()
    interrupted = next(m["data"] for m in messages if m["type"] == "execution_interrupted")
    assert {k: v for k, v in interrupted.items() if k != "timestamp"} == {
        "prompt_id": "h",
        "node_id": "2",
        "node_type": "ImageBlur",
        "executed": ["1"],
    }
    assert (entry["status"]["status_str"], entry["outputs"], entry["meta"]) == ("error", {}, {})
    assert entry["status"]["messages"][-1][0] == "execution_interrupted"
    assert [(r["prompt_id"], r["outcome"]) for r in fake.stats["runs"]] == [
        ("h", "interrupted"),
        ("next", "success"),
    ]


async def test_slow_takes_ten_times_the_node_time(tmp_path: Path) -> None:
    fake = FakeComfy(script=["slow"], prompt_seconds=0.005, output_dir=tmp_path)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        await post(c, workflows.blur_chain(), None, "s")
        (run,) = await fake.wait_for_runs(1, WAIT_S)
    # Five nodes of 10 x 5 ms each: at least a quarter of a second (a lower bound only).
    assert run["end"] - run["start"] >= 5 * 10 * 0.005
    assert run["outcome"] == "success"


async def test_partial_answers_node_errors_and_runs_the_other_output(tmp_path: Path) -> None:
    fake = FakeComfy(script=["partial"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        r = await post(c, workflows.solid_and_inverted(), None, "p")
        await fake.wait_idle(WAIT_S)
        entry = (await c.get("/history/p")).json()["p"]
    recorded_errors = recorded_http("validation_errors", label="link to a missing node")
    assert r.status_code == 200
    assert r.json()["node_errors"] == recorded_errors["response"]["body"]["node_errors"]
    assert entry["prompt"][4] == ["4"] and list(entry["outputs"]) == ["4"]
    assert [p.name for p in tmp_path.iterdir()] == ["inverted_00001_.png"]


async def test_late_writes_history_after_execution_success_and_keeps_the_prompt_queued(
    tmp_path: Path,
) -> None:
    fake = FakeComfy(script=["late"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with posted_by_me(fake, workflows.solid_and_inverted(), "l") as (url, c, sock):
        await sock.until("execution_success", prompt_id="l")
        assert (await c.get("/history/l")).json() == {}
        running = (await c.get("/queue")).json()["queue_running"]
        assert [item[1] for item in running] == ["l"]
        messages = await sock.until_done("l")
        assert (await c.get("/history/l")).json()["l"]["status"]["status_str"] == "success"
        assert (await c.get("/queue")).json()["queue_running"] == []
        assert [m["type"] for m in messages][-2:] == ["status", "executing"]
        await sock.close()
    (run,) = fake.stats["runs"]
    assert run["start"] < run["last_message"] < run["end"]


async def test_silent_prompt_runs_but_its_client_hears_nothing_of_it(tmp_path: Path) -> None:
    fake = FakeComfy(script=["silent"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with posted_by_me(fake, workflows.solid_and_inverted(), "quiet") as (url, c, sock):
        await fake.wait_for_runs(1, WAIT_S)
        await post(c, workflows.single_image(), "me", "loud")
        messages = await sock.until_done("loud")
        entry = (await c.get("/history/quiet")).json()["quiet"]
        await sock.close()
    assert messages[0] == {
        "type": "status",
        "data": {"status": {"exec_info": {"queue_remaining": 1}}},
    }
    assert not [m for m in messages if m["data"].get("prompt_id") == "quiet"]
    assert entry["status"]["status_str"] == "success"
    assert fake.stats["prompts"]["quiet"] == {"posted": 1, "executed": 1}


async def test_restart_cuts_sockets_and_forgets_queue_and_history(tmp_path: Path) -> None:
    fake = FakeComfy(script=["ok", "hang", "restart"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with posted_by_me(fake, workflows.single_image(), "before") as (url, c, sock):
        await sock.until_done("before")
        # "crash" and "pending" wait behind the hanging prompt, so both are queued for sure.
        for pid in ("hang", "crash", "pending"):
            await post(c, workflows.blur_chain(), "me", pid)
        await sock.until("executing", node="2", prompt_id="hang")
        await c.post("/interrupt")
        with pytest.raises(websockets.ConnectionClosedError) as closed:
            await sock.until_done("crash")
        assert closed.value.rcvd is None  # no close frame, as after SIGKILL (restart.json)
        await fake.wait_for_runs(3, WAIT_S)
        assert (await c.get("/queue")).json() == {"queue_running": [], "queue_pending": []}
        assert (await c.get("/history/crash")).json() == {}
        assert (await c.get("/history/before")).json() == {}
        again = await Socket.open(url, "me")
        greeting = recording("restart")["exchanges"][-1]["message"]
        greeting["data"]["sid"] = "me"
        assert again.greeting == greeting  # empty queue after the restart
        # A restarted server numbers from 0 again.
        assert (await post(c, workflows.single_image(), "me", "after")).json()["number"] == 0
        await again.until_done("after")
        await again.close()
    stats = fake.stats
    assert [(r["prompt_id"], r["outcome"]) for r in stats["runs"]] == [
        ("before", "success"),
        ("hang", "interrupted"),
        ("crash", "lost"),
        ("after", "success"),
    ]
    assert stats["prompts"]["pending"] == {"posted": 1, "executed": 0}


async def test_busy_queues_another_clients_prompts_first(tmp_path: Path) -> None:
    fake = FakeComfy(script=["busy=2"], busy=1, prompt_seconds=NODE_S, output_dir=tmp_path)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        number = (await post(c, workflows.single_image(), "me", "mine")).json()["number"]
        runs = await fake.wait_for_runs(4, WAIT_S)
    assert number == 3
    assert [r["prompt_id"] == "mine" for r in runs] == [False, False, False, True]
    assert len({r["client_id"] for r in runs[:3]} - {"me"}) == 1
    assert all(r["outcome"] == "success" for r in runs)
