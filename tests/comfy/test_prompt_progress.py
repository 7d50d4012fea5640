"""How far a prompt is: the fake sends the recorded progress messages (progress.json) for
its stepping nodes, in the recorded order, and the follower turns them into
``node 3/7 KSampler, step 14/20``."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import websockets

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.follow import PromptFollower
from comfy_assets.comfy.progress import PromptProgress
from fake_comfy import FakeComfy
from tests.fake_comfy.test_fake_models import text_to_image

pytestmark = pytest.mark.timeout(60)

RECORDED = Path(__file__).resolve().parents[2] / "data" / "recorded" / "progress.json"


def recorded() -> tuple[dict[str, Any], list[Any]]:
    """The recorded prompt and its socket messages after the POST (text as dicts,
    binary frames as ``("binary", event type, image format)``)."""
    data = json.loads(RECORDED.read_text())
    prompt = data["exchanges"][0]["request"]["body"]["prompt"]
    messages: list[Any] = []
    for e in data["exchanges"][1:]:
        if e["kind"] == "ws":
            messages.append(e["message"])
        elif e["kind"] == "ws_binary":
            messages.append(("binary", e["event_type"], e["image_format"]))
    return prompt, messages


def shape(messages: list[Any], skip_node: str) -> list[Any]:
    """The messages as (type, what they say of progress), ``skip_node`` (a node the
    recording had cached and the fake runs) and ``status`` left out."""
    out: list[Any] = []
    for m in messages:
        if isinstance(m, tuple):
            out.append(m)
            continue
        kind, data = m["type"], m["data"]
        if kind == "status":
            continue
        if kind == "progress_state":
            nodes = {
                k: (float(v["value"]), float(v["max"]), v["state"], sorted(v))
                for k, v in data["nodes"].items()
                if k != skip_node
            }
            if nodes:
                out.append((kind, nodes))
        elif kind == "executing":
            if data["node"] != skip_node:
                out.append((kind, data["node"], sorted(data)))
        elif kind == "progress":
            out.append((kind, data["value"], data["max"], data["node"], sorted(data)))
        elif kind in ("execution_start", "execution_success"):
            out.append((kind,))
        elif kind == "execution_cached":
            out.append((kind,))  # which nodes differs: the recording had run node 1 before
        else:
            out.append((kind, data.get("node")))
    # The recording's node 1 was cached: the fake, which runs it, sends a finished
    # progress_state for node 2 both before and after node 2 runs; dedupe repeats.
    deduped: list[Any] = []
    for item in out:
        if not deduped or deduped[-1] != item:
            deduped.append(item)
    return deduped


async def capture(url: str, prompt: dict[str, Any]) -> list[Any]:
    """Post ``prompt`` with our socket open; every message until ``executing`` null."""
    client_id = uuid.uuid4().hex
    messages: list[Any] = []
    ws_url = url.replace("http://", "ws://") + f"/ws?clientId={client_id}"
    async with websockets.connect(ws_url) as ws, ComfyClient(url) as client:
        await ws.recv()  # the greeting status
        await client.post_prompt(prompt, prompt_id=str(uuid.uuid4()), client_id=client_id)
        async for raw in ws:
            if isinstance(raw, bytes):
                event_type = int.from_bytes(raw[:4], "big")
                image_format = int.from_bytes(raw[4:8], "big")
                assert raw[8:12] == b"\x89PNG"
                messages.append(("binary", event_type, image_format))
                continue
            m = json.loads(raw)
            messages.append(m)
            if m["type"] == "executing" and m["data"]["node"] is None:
                return messages
    raise AssertionError("socket closed before the prompt ended")


async def test_the_fake_sends_save_image_websocket_progress_as_recorded():
    prompt, want = recorded()
    fake = FakeComfy(prompt_seconds=0.001)
    async with fake.serve(port=0) as url:
        got = await capture(url, prompt)
        async with ComfyClient(url) as client:
            queue = await client.queue()
    assert shape(got, skip_node="1") == shape(want, skip_node="1")
    assert not queue.running and not queue.pending


async def test_the_fake_sampler_reports_each_step_as_a_comfyui_sampler_does():
    fake = FakeComfy(prompt_seconds=0.001, models=["a.safetensors"], model_load_s=0.0)
    workflow = text_to_image()
    workflow["3"]["inputs"]["steps"] = 4
    async with fake.serve(port=0) as url:
        got = await capture(url, workflow)
    steps = [(m["data"]["value"], m["data"]["max"]) for m in got if _kind(m) == "progress"]
    assert steps == [(1, 4), (2, 4), (3, 4), (4, 4)]  # step + 1 of steps, as latent_preview
    states = [
        m["data"]["nodes"]["3"]
        for m in got
        if _kind(m) == "progress_state" and "3" in m["data"]["nodes"]
    ]
    assert states[-1]["state"] == "finished" and (states[-1]["value"], states[-1]["max"]) == (4, 4)


def _kind(m: Any) -> str | None:
    return None if isinstance(m, tuple) else m["type"]


def test_the_recorded_messages_read_as_node_and_step():
    prompt, messages = recorded()
    progress = PromptProgress("8bb0cfcf-2f64-43a9-a5dd-f44226d9f2b9")
    seen = [progress.describe(prompt)]
    for m in messages:
        if isinstance(m, dict) and m["type"] != "status":
            progress.apply(m["type"], m["data"])
            seen.append(progress.describe(prompt))
    assert seen[0] == "queued"
    assert "node 2/3 ImageInvert" in seen
    assert "node 3/3 SaveImageWebsocket, step 2/3" in seen
    assert seen[-1] == "finishing"


def test_hostile_progress_fields_give_a_line_not_an_exception():
    progress = PromptProgress("p")
    for kind, data in [
        ("execution_start", {}),
        ("progress", {"value": float("inf"), "max": "x", "node": ["a"]}),
        ("progress_state", {"nodes": ["not", "a", "map"]}),
        ("execution_cached", {"nodes": 5}),
        ("executing", {"node": 7}),
    ]:
        progress.apply(kind, data)
    assert progress.describe({"7": {"class_type": "KSampler"}}) == "node 1/1 KSampler"


async def test_the_follower_tells_how_far_a_sampler_is_while_it_runs(monkeypatch):
    fake = FakeComfy(prompt_seconds=0.001, models=["a.safetensors"], model_load_s=0.0)
    workflow = text_to_image()
    workflow["3"]["inputs"]["steps"] = 5
    lines: list[str] = []
    apply = PromptProgress.apply

    def noted(self: PromptProgress, kind: str, data: Any) -> None:
        apply(self, kind, data)
        lines.append(self.describe(workflow))

    monkeypatch.setattr(PromptProgress, "apply", noted)
    pid = str(uuid.uuid4())
    async with fake.serve(port=0) as url, ComfyClient(url) as client:
        async with PromptFollower(client, uuid.uuid4().hex, poll_s=0.05) as follower:
            post = await client.post_prompt(workflow, prompt_id=pid, client_id=follower.client_id)
            outcome = await follower.wait(pid, post.number, deadline_s=30.0)
            assert follower.progress(pid) is None  # forgotten once the wait is over
    assert outcome.status == "success"
    stepping = list(dict.fromkeys(line for line in lines if "step" in line))
    assert stepping == [f"node 5/7 KSampler, step {s}/5" for s in range(1, 6)]
    assert lines[-1] == "finishing"


@pytest.mark.skipif(not os.environ.get("COMFYUI_URL"), reason="needs a real ComfyUI (COMFYUI_URL)")
async def test_a_real_comfyui_save_image_websocket_prompt_reports_its_steps():
    prompt, _ = recorded()
    prompt["1"]["inputs"]["color"] = uuid.uuid4().int % 0xFFFFFF  # not cached
    url = os.environ["COMFYUI_URL"].rstrip("/")
    lines: list[str] = []
    pid = str(uuid.uuid4())
    async with ComfyClient(url) as client:
        async with PromptFollower(client, uuid.uuid4().hex, poll_s=0.5) as follower:
            post = await client.post_prompt(prompt, prompt_id=pid, client_id=follower.client_id)
            apply = PromptProgress.apply

            def noted(self: PromptProgress, kind: str, data: Any) -> None:
                apply(self, kind, data)
                lines.append(self.describe(prompt))

            PromptProgress.apply = noted  # type: ignore[method-assign]
            try:
                outcome = await follower.wait(pid, post.number, deadline_s=120.0)
            finally:
                PromptProgress.apply = apply  # type: ignore[method-assign]
    assert outcome.status == "success"
    for step in (0, 1, 2):
        assert f"node 3/3 SaveImageWebsocket, step {step}/3" in lines
