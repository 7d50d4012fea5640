"""The fake ComfyUI against the recordings of the real one (data/recorded/*.json).

Talks to the fake with httpx and websockets only. Asserts on what a client sees (bodies,
messages, bytes) and on the fake's own records (posted / executed counts, run outcomes).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path
from typing import Any

import av
import httpx
import pytest
from PIL import Image

from fake_comfy import FakeComfy, workflows
from tests.fake_comfy.recordings import (
    FAKE_DATA,
    NODE_S,
    RECORDED,
    WAIT_S,
    Socket,
    new_id,
    post,
    recorded_http,
    recorded_run,
    recording,
    scrub,
    scrub_entry,
)

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


# The muxer stamps its own version ("Lavf62.12.102" in the recording) in the file: it is the
# installed FFmpeg's (PyAV's wheel), not the fake's or ComfyUI's.
LAVF = re.compile(rb"Lavf\d+\.\d+\.\d+")


def with_muxer_of(data: bytes, recorded: bytes) -> bytes:
    """`data` with its muxer version tag replaced by the one in `recorded` (same length)."""
    tag = LAVF.search(recorded)
    assert tag is not None and len(LAVF.findall(data)) == 1
    return LAVF.sub(tag.group(), data)


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
        recorded = (RECORDED / "files" / "video-shot_00001_.mp4").read_bytes()
        assert hashlib.sha256(recorded).hexdigest() == want["response"]["body"]["sha256"]
        assert with_muxer_of(got.content, recorded) == recorded

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
