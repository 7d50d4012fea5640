"""The fake ComfyUI against the recordings of the real one (data/recorded/*.json).

Talks to the fake with httpx and websockets only. Asserts on what a client sees (bodies,
messages, bytes) and on the fake's own records (posted / executed counts, run outcomes).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import av
import httpx
import pytest
import websockets
from PIL import Image

from fake_comfy import FakeComfy, workflows

RECORDED = Path(__file__).resolve().parents[2] / "data" / "recorded"
FAKE_DATA = Path(__file__).resolve().parents[2] / "fake_comfy" / "data"
WAIT_S = 5.0  # bound on every wait; a healthy fake answers in milliseconds
NODE_S = 0.001


def recording(case: str) -> dict[str, Any]:
    return json.loads((RECORDED / f"{case}.json").read_text())


def recorded_http(case: str, label: str | None = None, path: str | None = None) -> dict[str, Any]:
    for ex in recording(case)["exchanges"]:
        if ex["kind"] != "http":
            continue
        if (label is None or ex.get("label") == label) and (
            path is None or ex["request"]["path"] == path
        ):
            return ex
    raise LookupError(f"{case}: no exchange {label or path}")


def recorded_run(case: str, client: str) -> list[dict[str, Any]]:
    """Messages of `client` from the first POST up to the first `executing` with node null."""
    out: list[dict[str, Any]] = []
    posted = False
    for ex in recording(case)["exchanges"]:
        if ex["kind"] == "http" and ex["request"]["method"] == "POST":
            posted = True
        if ex["kind"] == "ws" and ex["client"] == client and posted:
            out.append(ex["message"])
            if ex["message"]["type"] == "executing" and ex["message"]["data"]["node"] is None:
                return out
    raise LookupError(f"{case}: no finished run for {client}")


def scrub(value: Any) -> Any:
    """Replaces what differs between runs (timestamps) by placeholders."""
    if isinstance(value, dict):
        return {
            k: ("<t>" if k in ("timestamp", "create_time") else scrub(v)) for k, v in value.items()
        }
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


def scrub_entry(entry: dict[str, Any]) -> dict[str, Any]:
    entry = scrub(entry)
    entry["prompt"][0] = "<number>"
    return entry


class Socket:
    """A websocket client that keeps what it receives."""

    def __init__(self, ws: Any, greeting: dict[str, Any]) -> None:
        self.ws = ws
        self.greeting = greeting
        self.messages: list[dict[str, Any]] = []

    @classmethod
    async def open(cls, url: str, client_id: str | None) -> Socket:
        query = f"?clientId={client_id}" if client_id else ""
        ws = await websockets.connect(url.replace("http://", "ws://") + "/ws" + query)
        greeting = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
        return cls(ws, greeting)

    async def next(self) -> dict[str, Any]:
        message = json.loads(await asyncio.wait_for(self.ws.recv(), WAIT_S))
        self.messages.append(message)
        return message

    async def until(self, kind: str, **data: Any) -> list[dict[str, Any]]:
        """Reads until a message of `kind` whose data has `data`; returns what was read."""
        start = len(self.messages)
        while True:
            m = await self.next()
            if m["type"] == kind and all(m["data"].get(k) == v for k, v in data.items()):
                return self.messages[start:]

    async def until_match(self, match: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        start = len(self.messages)
        while not match(await self.next()):
            pass
        return self.messages[start:]

    async def until_done(self, prompt_id: str) -> list[dict[str, Any]]:
        return await self.until("executing", node=None, prompt_id=prompt_id)

    async def close(self) -> None:
        await self.ws.close()


def new_id() -> str:
    return str(uuid.uuid4())


async def post(
    client: httpx.AsyncClient, prompt: dict[str, Any], client_id: str | None, prompt_id: str
) -> httpx.Response:
    body: dict[str, Any] = {"prompt": prompt, "prompt_id": prompt_id}
    if client_id is not None:
        body["client_id"] = client_id
    return await client.post("/prompt", json=body)


@pytest.fixture
def fake(tmp_path: Path) -> FakeComfy:
    return FakeComfy(prompt_seconds=NODE_S, output_dir=tmp_path / "out")


# -- routes as recorded (basics.json) ---------------------------------------------------


async def test_idle_routes_answer_the_recorded_bodies(fake: FakeComfy) -> None:
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        for path in ("/system_stats", "/queue", "/prompt", "/history?max_items=1"):
            want = recorded_http("basics", path=path)["response"]
            got = await c.get(path)
            assert (got.status_code, got.headers["content-type"], got.json()) == (
                want["status"],
                want["content_type"],
                want["body"],
            ), path
        unknown = await c.get(f"/history/{new_id()}")
        assert unknown.status_code == 200 and unknown.json() == {}
        free = await c.post("/free", json={"unload_models": True, "free_memory": True})
        assert (free.status_code, free.content, "content-type" in free.headers) == (200, b"", False)
        info = (await c.get("/object_info")).json()
        want = recorded_http("basics", path="/object_info")["response"]["body"]
        assert {name: info[name] for name in want} == want
        # Beside the recorded classes: the classes the input files need, from the v0.8.0
        # source (fake_comfy.recorded), the model loaders (their file lists empty here) and
        # SaveImageWebsocket, which ComfyUI ships in custom_nodes/ (progress.json).
        loaders = json.loads((FAKE_DATA / "model_nodes.json").read_text())
        custom = json.loads((FAKE_DATA / "custom_nodes.json").read_text())
        inputs = ["GetVideoComponents", "ImageFromBatch", "LoadVideo", "RepeatImageBatch"]
        assert sorted(set(info) - set(want)) == sorted([*inputs, *loaders, *custom])


async def test_view_refuses_missing_files_and_traversal_like_the_real_server(
    fake: FakeComfy,
) -> None:
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        for label in ("missing file", "traversal in filename", "traversal in subfolder"):
            want = recorded_http("basics", label=label)
            got = await c.get(want["request"]["path"])
            assert (got.status_code, got.content) == (want["response"]["status"], b""), label


# -- one prompt, as recorded (success.json, video.json) --------------------------------


async def test_a_prompt_sends_exactly_the_recorded_messages_and_history(fake: FakeComfy) -> None:
    post_ex = recorded_http("success", label="POST /prompt")
    body = post_ex["request"]["body"]
    client_id = body["client_id"]
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, client_id)
        assert sock.greeting == recording("success")["exchanges"][0]["message"]
        r = await c.post("/prompt", json=body)
        assert r.json() == post_ex["response"]["body"]  # number 0 on a fresh server too
        messages = await sock.until_done(body["prompt_id"])
        assert scrub(messages) == scrub(recorded_run("success", client_id))
        history = (await c.get(f"/history/{body['prompt_id']}")).json()
        want = recorded_http("success", label="history after executing node=null")
        assert list(history) == list(want["response"]["body"])
        pid = body["prompt_id"]
        assert scrub_entry(history[pid]) == scrub_entry(want["response"]["body"][pid])
        await sock.close()
    assert fake.stats["prompts"] == {body["prompt_id"]: {"posted": 1, "executed": 1}}


async def test_pngs_are_byte_identical_to_the_recorded_files(fake: FakeComfy) -> None:
    body = recorded_http("success", label="POST /prompt")["request"]["body"]
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        await c.post("/prompt", json=body)
        await fake.wait_idle(WAIT_S)
        for node in ("3", "4"):
            want = recorded_http("success", label=f"view output of node {node}")
            got = await c.get(want["request"]["path"])
            assert got.headers["content-type"] == "image/png"
            assert hashlib.sha256(got.content).hexdigest() == want["response"]["body"]["sha256"]


async def test_png_has_the_size_and_colour_the_workflow_asks_for(fake: FakeComfy) -> None:
    prompt = workflows.solid_and_inverted(color=0x102030, width=40, height=24, batch_size=2)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        await post(c, prompt, None, "p")
        await fake.wait_idle(WAIT_S)
        outputs = (await c.get("/history/p")).json()["p"]["outputs"]
        assert [i["filename"] for i in outputs["3"]["images"]] == [
            "solid_00001_.png",
            "solid_00002_.png",
        ]
        for node, colour in (("3", (0x10, 0x20, 0x30)), ("4", (0xEF, 0xDF, 0xCF))):
            for item in outputs[node]["images"]:
                got = await c.get("/view", params=item)
                image = Image.open(io.BytesIO(got.content))
                assert image.size == (40, 24)
                assert image.getcolors() == [(40 * 24, colour)]


async def test_mask_nodes_make_a_grey_image_of_the_chosen_channel(fake: FakeComfy) -> None:
    prompt = workflows.mask_error(color=0x11AA33)
    prompt["2"]["inputs"]["channel"] = "green"
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        await post(c, prompt, None, "m")
        await fake.wait_idle(WAIT_S)
        item = (await c.get("/history/m")).json()["m"]["outputs"]["4"]["images"][0]
        image = Image.open(io.BytesIO((await c.get("/view", params=item)).content))
        assert image.getcolors() == [(64 * 64, (0xAA, 0xAA, 0xAA))]


async def test_video_matches_the_recording_and_lasts_frames_over_fps(fake: FakeComfy) -> None:
    body = recorded_http("video", label="POST /prompt")["request"]["body"]
    client_id = body["client_id"]
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, client_id)
        await c.post("/prompt", json=body)
        messages = await sock.until_done(body["prompt_id"])
        assert scrub(messages) == scrub(recorded_run("video", client_id))
        want = recorded_http("video", label="view images of node 3")
        got = await c.get(want["request"]["path"])
        assert got.headers["content-type"] == "video/mp4"
        assert hashlib.sha256(got.content).hexdigest() == want["response"]["body"]["sha256"]

        await post(
            c,
            workflows.video(frames=12, fps=8.0, width=64, height=48, prefix="clips/x"),
            None,
            "v2",
        )
        await fake.wait_idle(WAIT_S)
        item = (await c.get("/history/v2")).json()["v2"]["outputs"]["3"]["images"][0]
        assert item == {"filename": "x_00001_.mp4", "subfolder": "clips", "type": "output"}
        data = (await c.get("/view", params=item)).content
        await sock.close()
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.name, stream.codec_context.pix_fmt) == ("h264", "yuv420p")
        assert (stream.width, stream.height, stream.frames) == (64, 48, 12)
        assert float(stream.duration * stream.time_base) == pytest.approx(12 / 8.0)


async def test_file_counters_continue_per_prefix_and_keep_subfolders(fake: FakeComfy) -> None:
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        # Two colours: the same workflow twice would be cached and write nothing.
        for pid, color in (("a", 1), ("b", 2)):
            image = workflows.single_image(prefix="shots/take", batch_size=2, color=color)
            await post(c, image, None, pid)
        await fake.wait_idle(WAIT_S)
        names = [
            item["filename"]
            for pid in ("a", "b")
            for item in (await c.get(f"/history/{pid}")).json()[pid]["outputs"]["2"]["images"]
        ]
    assert names == [f"take_0000{i}_.png" for i in (1, 2, 3, 4)]
    assert sorted(p.name for p in (fake.output_dir / "shots").iterdir()) == names


# -- validation (validation_errors.json) ------------------------------------------------


@pytest.mark.parametrize(
    "label",
    [
        "value below min",
        "required input missing",
        "unknown node class",
        "no output node",
        "link to a missing node",
        "no prompt key",
        "body is not JSON",
        "prompt_id that is not a UUID",
    ],
)
async def test_validation_answers_are_the_recorded_ones(fake: FakeComfy, label: str) -> None:
    ex = recorded_http("validation_errors", label=label)
    request, want = ex["request"], ex["response"]
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        if isinstance(request["body"], str):
            got = await c.post("/prompt", content=request["body"])
        else:
            got = await c.post("/prompt", json=request["body"])
        assert (got.status_code, got.headers["content-type"]) == (
            want["status"],
            want["content_type"],
        )
        if isinstance(want["body"], str):
            assert got.text == want["body"]
        else:
            body = got.json()
            if "number" in want["body"]:
                body["number"] = want["body"]["number"]
            assert body == want["body"]
        await fake.wait_idle(WAIT_S)
    executed = 1 if want["status"] == 200 else 0
    if isinstance(request["body"], dict) and "prompt_id" in request["body"]:
        assert fake.stats["prompts"][request["body"]["prompt_id"]] == {
            "posted": 1,
            "executed": executed,
        }


async def test_a_dropped_output_runs_only_the_valid_one(fake: FakeComfy) -> None:
    body = recorded_http("validation_errors", label="link to a missing node")["request"]["body"]
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        await c.post("/prompt", json=body)
        await fake.wait_idle(WAIT_S)
        entry = (await c.get(f"/history/{body['prompt_id']}")).json()[body["prompt_id"]]
    assert entry["prompt"][4] == ["4"] and list(entry["outputs"]) == ["4"]
    assert [p.name for p in fake.output_dir.iterdir()] == ["inverted_00001_.png"]


async def test_out_of_range_and_combo_values_are_rejected_with_node_errors(fake: FakeComfy) -> None:
    prompt = workflows.blur_chain()
    prompt["2"]["inputs"]["blur_radius"] = 99
    bad_combo = workflows.mask_error()
    bad_combo["2"]["inputs"]["channel"] = "purple"
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        big = (await post(c, prompt, None, "big")).json()
        combo = (await post(c, bad_combo, None, "combo")).json()
    assert big["error"]["type"] == "prompt_outputs_failed_validation"
    assert big["node_errors"]["2"]["errors"][0] == {
        "type": "value_bigger_than_max",
        "message": "Value 99 bigger than max of 31",
        "details": "blur_radius",
        "extra_info": {
            "input_name": "blur_radius",
            "input_config": ["INT", {"default": 1, "min": 1, "max": 31, "step": 1}],
            "received_value": 99,
        },
    }
    assert big["node_errors"]["2"]["dependent_outputs"] == ["5"]
    error = combo["node_errors"]["2"]["errors"][0]
    assert (error["type"], error["details"]) == (
        "value_not_in_list",
        "channel: 'purple' not in ['red', 'green', 'blue', 'alpha']",
    )
    assert fake.stats["runs"] == []


# -- the node output cache (cache_replay.json) ------------------------------------------


def recorded_prompt_messages(case: str, prompt_id: str) -> list[dict[str, Any]]:
    """The recorded socket messages that name ``prompt_id``, in order."""
    return [
        ex["message"]
        for ex in recording(case)["exchanges"]
        if ex["kind"] == "ws" and (ex["message"].get("data") or {}).get("prompt_id") == prompt_id
    ]


def of_prompt(messages: list[dict[str, Any]], prompt_id: str) -> list[dict[str, Any]]:
    return [m for m in messages if (m.get("data") or {}).get("prompt_id") == prompt_id]


async def test_the_cache_replays_deleted_files_until_free_as_recorded(fake: FakeComfy) -> None:
    posts = [
        ex
        for ex in recording("cache_replay")["exchanges"]
        if ex["kind"] == "http" and ex["request"]["path"] == "/prompt"
    ]
    bodies = [ex["request"]["body"] for ex in posts]
    assert len(bodies) == 5
    client_id = bodies[0]["client_id"]
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, client_id)

        async def run(body: dict[str, Any]) -> dict[str, Any]:
            pid = body["prompt_id"]
            assert (await c.post("/prompt", json=body)).status_code == 200
            messages = of_prompt(await sock.until_done(pid), pid)
            want = recorded_prompt_messages("cache_replay", pid)
            if want[-1]["type"] != "executing":  # the recording ends before the last one
                want.append({"type": "executing", "data": {"node": None, "prompt_id": pid}})
            assert scrub(messages) == scrub(want)
            return (await c.get(f"/history/{pid}")).json()[pid]

        first = await run(bodies[0])
        image = first["outputs"]["2"]["images"][0]
        assert image == {"filename": "cachecase_00001_.png", "subfolder": "", "type": "output"}
        (fake.output_dir / image["filename"]).unlink()

        # The same workflow again: every node cached, the deleted name replayed.
        second = await run(bodies[1])
        assert second["outputs"] == first["outputs"]
        assert (await c.get("/view", params=image)).status_code == 404
        assert not (fake.output_dir / image["filename"]).exists()

        # free_memory on an idle server resets the cache: the next run writes the file.
        assert (await c.post("/free", json={"free_memory": True})).status_code == 200
        await run(bodies[2])
        assert (await c.get("/view", params=image)).status_code == 200

        await run(bodies[3])  # cached again, from run 3
        fifth = await run(bodies[4])  # filename_prefix changed: only SaveImage runs
        assert fifth["outputs"]["2"]["images"][0]["filename"] == "cachecase_b_00001_.png"
        await sock.close()
    executed = {pid: n["executed"] for pid, n in fake.stats["prompts"].items()}
    assert executed == {b["prompt_id"]: 1 for b in bodies}
    assert sorted(p.name for p in fake.output_dir.iterdir()) == [
        "cachecase_00001_.png",
        "cachecase_b_00001_.png",
    ]


async def test_only_consecutive_prompts_share_the_cache(fake: FakeComfy) -> None:
    a, b = workflows.single_image(prefix="a", color=1), workflows.single_image(prefix="b", color=2)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        for pid, prompt in (("a1", a), ("b1", b), ("a2", a), ("a3", a)):
            await post(c, prompt, None, pid)
        await fake.wait_idle(WAIT_S)
        names = {
            pid: (await c.get(f"/history/{pid}")).json()[pid]["outputs"]["2"]["images"][0]
            for pid in ("a1", "a2", "a3")
        }
    # b1 evicted a1's nodes, so a2 ran and wrote a file of its own; a3 replays a2's.
    assert [names[p]["filename"] for p in ("a1", "a2", "a3")] == [
        "a_00001_.png",
        "a_00002_.png",
        "a_00002_.png",
    ]


async def test_free_during_a_prompt_resets_the_cache_after_it(tmp_path: Path) -> None:
    fake = FakeComfy(script=["ok", "hang"], prompt_seconds=NODE_S, output_dir=tmp_path / "out")
    image = workflows.single_image(prefix="x")
    client_id = new_id()
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, client_id)
        await post(c, image, None, "warm")
        await fake.wait_idle(WAIT_S)
        other = workflows.single_image(prefix="y")
        await post(c, other, client_id, "hung")  # the script's `hang`: runs until interrupted
        await sock.until("executing", node="2", prompt_id="hung")
        await c.post("/free", json={"free_memory": True})
        await c.post("/interrupt", json={})
        await sock.until_done("hung")
        await post(c, other, None, "after")
        await fake.wait_idle(WAIT_S)
        await sock.close()
        after = (await c.get("/history/after")).json()["after"]
    cached = [m for m in after["status"]["messages"] if m[0] == "execution_cached"]
    assert cached[0][1]["nodes"] == []  # the hung run's node 1 was cached, then freed


async def test_a_word_acting_at_the_second_node_runs_a_cached_prompt_in_full(
    tmp_path: Path,
) -> None:
    fake = FakeComfy(script=["ok", "error"], prompt_seconds=NODE_S, output_dir=tmp_path / "out")
    image = workflows.single_image(prefix="x")
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        await post(c, image, None, "first")
        await post(c, image, None, "second")
        await fake.wait_idle(WAIT_S)
        second = (await c.get("/history/second")).json()["second"]
    assert second["status"]["status_str"] == "error"


# -- errors as recorded (execution_error.json) ------------------------------------------


async def test_an_alpha_mask_fails_with_the_recorded_index_error(fake: FakeComfy) -> None:
    body = recorded_http("execution_error", label="POST /prompt")["request"]["body"]
    client_id = body["client_id"]
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, client_id)
        other = await Socket.open(url, new_id().replace("-", ""))
        await c.post("/prompt", json=body)
        got = await sock.until_done(body["prompt_id"])
        want = recorded_run("execution_error", client_id)
        # current_outputs lists the real server's cache (the previous prompt's nodes).
        for m in got + want:
            m["data"].pop("current_outputs", None)
        assert scrub(got) == scrub(want)
        await fake.wait_idle(WAIT_S)
        history = (await c.get(f"/history/{body['prompt_id']}")).json()
        recorded_history = recorded_http("execution_error", label="history of failed prompt")
        pid = body["prompt_id"]
        entries = [history[pid], recorded_history["response"]["body"][pid]]
        for entry in entries:
            entry["status"]["messages"][-1][1].pop("current_outputs")
        assert scrub_entry(entries[0]) == scrub_entry(entries[1])
        await sock.close()
        # The other listener saw only the queue sizes, as recorded.
        assert {
            m["type"]
            for m in await other.until("status", status={"exec_info": {"queue_remaining": 0}})
        } == {"status"}
        await other.close()
    assert [r["outcome"] for r in fake.stats["runs"]] == ["error"]


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
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, "me")
        await post(c, workflows.solid_and_inverted(), "me", "e")
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
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, "me")
        await post(c, bad, "me", "nul")
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
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, "me")
        await post(c, workflows.solid_and_inverted(), "me", "o")
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
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, "me")
        await post(c, workflows.solid_and_inverted(), "me", "d")
        with pytest.raises(websockets.ConnectionClosedError) as closed:
            await sock.until_done("d")
        assert closed.value.rcvd is None  # no close frame, as when a process dies
        await fake.wait_idle(WAIT_S)
        entry = (await c.get("/history/d")).json()["d"]
    assert entry["status"]["status_str"] == "success" and list(entry["outputs"]) == ["3", "4"]
    assert fake.stats["prompts"]["d"] == {"posted": 1, "executed": 1}


async def test_hang_waits_for_an_interrupt_that_lands_at_the_second_node(tmp_path: Path) -> None:
    fake = FakeComfy(script=["hang"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, "me")
        await post(c, workflows.blur_chain(), "me", "h")
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
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, "me")
        await post(c, workflows.solid_and_inverted(), "me", "l")
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
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, "me")
        await post(c, workflows.solid_and_inverted(), "me", "quiet")
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
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, "me")
        await post(c, workflows.single_image(), "me", "before")
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


# -- routing (execution_error.json, broadcast_and_missed.json, interrupt_reconnect.json) -


async def test_anonymous_prompt_interrupt_reaches_everyone_but_its_other_events_do_not(
    tmp_path: Path,
) -> None:
    fake = FakeComfy(script=["hang"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        ours = await Socket.open(url, "ours")
        theirs = await Socket.open(url, None)
        assert len(theirs.greeting["data"]["sid"]) == 32  # a fresh uuid4 hex
        await post(c, workflows.blur_chain(), None, "anon")
        # Its progress_state is broadcast: wait until it hangs at node 2.
        await ours.until_match(
            lambda m: m["type"] == "progress_state" and "2" in m["data"]["nodes"]
        )
        await c.post("/interrupt", json={})
        got = await ours.until("execution_interrupted", prompt_id="anon")
        await theirs.until("execution_interrupted", prompt_id="anon")
        await ours.close()
        await theirs.close()
    kinds = {m["type"] for m in got}
    assert kinds <= {"status", "progress_state", "execution_interrupted"}
    assert "execution_start" not in kinds and "executing" not in kinds


async def test_reconnect_with_the_same_client_id_replaces_the_socket(tmp_path: Path) -> None:
    fake = FakeComfy(script=["hang"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        old = await Socket.open(url, "me")
        await post(c, workflows.blur_chain(), "me", "h")
        await old.until("executing", node="2", prompt_id="h")
        new = await Socket.open(url, "me")
        assert new.greeting == {
            "type": "status",
            "data": {"status": {"exec_info": {"queue_remaining": 1}}, "sid": "me"},
        }
        # As recorded: the current node, without prompt_id.
        assert await new.next() == {"type": "executing", "data": {"node": "2"}}
        await c.post("/interrupt", json={"prompt_id": "h"})
        await new.until_done("h")
        await new.close()
    # The server is gone and has closed every socket: the replaced one got nothing more.
    assert [message async for message in old.ws] == []


async def test_duplicate_prompt_id_runs_twice_and_history_keeps_the_second(fake: FakeComfy) -> None:
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        first = (await post(c, workflows.solid_and_inverted(color=1), "me", "dup")).json()
        second = (await post(c, workflows.solid_and_inverted(color=2), "me", "dup")).json()
        await fake.wait_idle(WAIT_S)
        entry = (await c.get("/history/dup")).json()["dup"]
    assert (first["number"], second["number"]) == (0, 1)
    assert entry["prompt"][0] == 1 and entry["prompt"][2]["1"]["inputs"]["color"] == 2
    assert entry["outputs"]["3"]["images"][0]["filename"] == "solid_00002_.png"
    assert fake.stats["prompts"]["dup"] == {"posted": 2, "executed": 2}
    assert [r["number"] for r in fake.stats["runs"]] == [0, 1]


async def test_queue_lists_running_and_pending_as_recorded(tmp_path: Path) -> None:
    fake = FakeComfy(script=["hang"], prompt_seconds=NODE_S, output_dir=tmp_path)
    posts = [
        ex["request"]["body"]
        for ex in recording("three_in_a_row")["exchanges"]
        if ex["kind"] == "http" and ex["request"]["method"] == "POST"
    ]
    client_id = posts[0]["client_id"]
    first, second, third = (body["prompt_id"] for body in posts)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, client_id)
        for body in posts:
            await c.post("/prompt", json=body)
        await sock.until("executing", node="2", prompt_id=first)
        queue = (await c.get("/queue")).json()
        remaining = (await c.get("/prompt")).json()
        deleted = await c.post("/queue", json={"delete": [third, first]})
        after = (await c.get("/queue")).json()
        await c.post("/interrupt")
        await sock.until_done(second)
        await sock.close()
    want = recorded_http("three_in_a_row", label="queue: one running, two pending")["response"]
    assert [item[0] for item in queue["queue_running"] + queue["queue_pending"]] == [0, 1, 2]
    for listing in (queue, want["body"]):
        for item in listing["queue_running"] + listing["queue_pending"]:
            item[0] = "<number>"
    assert scrub(queue) == scrub(want["body"])
    assert remaining == recorded_http("three_in_a_row", label="queue_remaining")["response"]["body"]
    assert (deleted.status_code, deleted.content) == (200, b"")
    # A running prompt is not deleted (interrupt_reconnect.json); the pending one is.
    assert [item[1] for item in after["queue_running"]] == [first]
    assert [item[1] for item in after["queue_pending"]] == [second]
    assert fake.stats["prompts"][third] == {"posted": 1, "executed": 0}


async def test_history_max_items_gives_the_latest_entries(fake: FakeComfy) -> None:
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        for pid in ("h1", "h2", "h3"):
            await post(c, workflows.single_image(), None, pid)
        await fake.wait_idle(WAIT_S)
        assert list((await c.get("/history", params={"max_items": 2})).json()) == ["h2", "h3"]
        assert list((await c.get("/history")).json()) == ["h1", "h2", "h3"]


# -- server lives ------------------------------------------------------------------------


async def test_a_server_stopped_and_started_on_the_same_port_forgets_but_records_remain(
    fake: FakeComfy,
) -> None:
    async with fake.serve() as url:
        port = fake.port
        async with httpx.AsyncClient(base_url=url) as c:
            assert (await post(c, workflows.single_image(), None, "a")).json()["number"] == 0
            await fake.wait_idle(WAIT_S)
    assert fake.port is None
    async with fake.serve(port=port) as url, httpx.AsyncClient(base_url=url) as c:
        assert fake.port == port
        assert (await c.get("/history/a")).json() == {}
        assert (await post(c, workflows.single_image(), None, "b")).json()["number"] == 0
        await fake.wait_idle(WAIT_S)
        item = (await c.get("/history/b")).json()["b"]["outputs"]["2"]["images"][0]
    assert item["filename"] == "still_00002_.png"  # counters come from the files on disk
    assert [r["prompt_id"] for r in fake.stats["runs"]] == ["a", "b"]


async def test_leaving_serve_loses_the_running_prompt(tmp_path: Path) -> None:
    fake = FakeComfy(script=["hang"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, "me")
        await post(c, workflows.blur_chain(), "me", "h")
        await sock.until("executing", node="2", prompt_id="h")
        with pytest.raises(TimeoutError):
            await fake.wait_idle(0.05)
    with pytest.raises(websockets.ConnectionClosed):
        await sock.until_done("h")
    assert [(r["prompt_id"], r["outcome"]) for r in fake.stats["runs"]] == [("h", "lost")]


def test_serve_in_thread_serves_sync_callers(tmp_path: Path) -> None:
    fake = FakeComfy(prompt_seconds=NODE_S, output_dir=tmp_path)
    with fake.serve_in_thread() as url:
        with httpx.Client(base_url=url) as c:
            assert (
                c.post(
                    "/prompt", json={"prompt": workflows.single_image(), "prompt_id": "t"}
                ).status_code
                == 200
            )
            asyncio.run(fake.wait_for_runs(1, WAIT_S))
            stats = c.get("/fake/stats").json()
    assert stats == fake.stats
    assert stats["prompts"] == {"t": {"posted": 1, "executed": 1}}
    assert stats["runs"][0]["outcome"] == "success"
    assert {
        "prompt_id",
        "client_id",
        "number",
        "word",
        "posted",
        "start",
        "last_message",
        "end",
        "outcome",
    } == set(stats["runs"][0])
    assert stats["runs"][0]["word"] == "ok"
    # Not a late prompt: its last message is its end.
    assert stats["runs"][0]["last_message"] == stats["runs"][0]["end"]


async def test_preview_images_are_served_from_the_temp_folder(fake: FakeComfy) -> None:
    prompt = workflows.single_image(width=8, height=6)
    prompt["2"] = {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        await post(c, prompt, None, "pv")
        await fake.wait_idle(WAIT_S)
        (item,) = (await c.get("/history/pv")).json()["pv"]["outputs"]["2"]["images"]
        got = await c.get("/view", params=item)
        as_output = await c.get("/view", params={**item, "type": "output"})
    assert item["type"] == "temp" and item["filename"].startswith("ComfyUI_temp_")
    assert Image.open(io.BytesIO(got.content)).size == (8, 6)
    assert as_output.status_code == 404
    assert list(fake.output_dir.iterdir()) == []


async def test_clearing_the_queue_drops_every_pending_prompt(tmp_path: Path) -> None:
    fake = FakeComfy(script=["hang"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, "me")
        for pid in ("run", "p1", "p2"):
            await post(c, workflows.blur_chain(), "me", pid)
        await sock.until("executing", node="2", prompt_id="run")
        assert (await c.post("/queue", json={"clear": True})).status_code == 200
        assert (await c.get("/queue")).json()["queue_pending"] == []
        await c.post("/interrupt")
        await fake.wait_idle(WAIT_S)
        await sock.until_done("run")
        await sock.close()
    assert [r["prompt_id"] for r in fake.stats["runs"]] == ["run"]


async def test_a_bug_in_the_fake_is_raised_not_swallowed(
    fake: FakeComfy, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(class_type: str, inputs: dict[str, Any], folders: object) -> tuple[Any, ...]:
        raise ZeroDivisionError("fake bug")

    monkeypatch.setattr("fake_comfy.nodes.compute", broken)
    with pytest.raises(RuntimeError, match="executor crashed"):
        async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
            await post(c, workflows.single_image(), None, "x")
            with pytest.raises(RuntimeError, match="executor crashed"):
                await fake.wait_idle(WAIT_S)
    assert [r["outcome"] for r in fake.stats["runs"]] == ["lost"]
