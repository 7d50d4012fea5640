"""`python -m fake_comfy` as a program: listening line, /fake/stats, clean SIGTERM."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from pathlib import Path

import httpx
import websockets

from fake_comfy import workflows

START_S = 30.0  # bound on the interpreter start-up
WAIT_S = 5.0


async def start(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fake_comfy",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_program_prints_its_url_serves_stats_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    out, inputs = tmp_path / "out", tmp_path / "in"
    proc = await start(
        "--port",
        "0",
        "--script",
        "500,ok",
        "--prompt-seconds",
        "0.001",
        "--output-dir",
        str(out),
        "--input-dir",
        str(inputs),
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), START_S)).decode()
        match = re.fullmatch(r"fake_comfy listening on (http://127\.0\.0\.1:(\d+))\n", line)
        assert match, line
        url = match.group(1)
        async with (
            httpx.AsyncClient(base_url=url) as c,
            websockets.connect(url.replace("http://", "ws://") + "/ws?clientId=cli") as ws,
        ):
            await ws.recv()  # the status greeting
            refused = await c.post(
                "/prompt", json={"prompt": workflows.single_image(), "prompt_id": "a"}
            )
            body = {"prompt": workflows.single_image(), "prompt_id": "b", "client_id": "cli"}
            accepted = await c.post("/prompt", json=body)
            while True:
                message = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
                if message["type"] == "executing" and message["data"] == {
                    "node": None,
                    "prompt_id": "b",
                }:
                    break
            uploaded = await c.post(
                "/upload/image", files={"image": ("key.png", b"any bytes", "image/png")}
            )
            stats = (await c.get("/fake/stats")).json()
        assert (refused.status_code, accepted.status_code) == (500, 200)
        assert stats["prompts"] == {
            "a": {"posted": 1, "executed": 0},
            "b": {"posted": 1, "executed": 1},
        }
        (run,) = stats["runs"]
        assert (run["prompt_id"], run["client_id"], run["number"], run["outcome"]) == (
            "b",
            "cli",
            0,
            "success",
        )
        assert run["posted"] <= run["start"] <= run["end"]
        assert [p.name for p in out.iterdir()] == ["still_00001_.png"]
        assert uploaded.json() == {"name": "key.png", "subfolder": "", "type": "input"}
        assert (inputs / "key.png").read_bytes() == b"any bytes"
        assert stats["uploads"] == 1
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), START_S)
    assert code == 0, (await proc.stderr.read()).decode()


async def test_program_refuses_an_unknown_script_word() -> None:
    proc = await start("--port", "0", "--script", "ok,explode")
    code = await asyncio.wait_for(proc.wait(), START_S)
    assert code == 2
    assert "unknown script word 'explode'" in (await proc.stderr.read()).decode()
