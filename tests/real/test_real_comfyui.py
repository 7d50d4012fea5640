"""Faults on a real ComfyUI v0.8.0 (only when ``COMFYUI_URL`` is set).

The server's output folder must be readable and writable from here, to delete files as a
cleanup job would: ``COMFYUI_OUTPUT_DIR`` (default: the folder of
``../shared/real-comfyui/start.sh``, ``~/.cache/real-comfyui/out``).

The server killed mid-prompt needs ``COMFYUI_RESTART_CMD``: a shell command that kills
the server at ``COMFYUI_URL`` with SIGKILL and starts it again (it may return before the
server answers). With ``../shared/real-comfyui/start.sh``, wait until the killed process
is gone (or a zombie) and remove its pid file first: start.sh starts nothing while the pid
it wrote still answers ``kill -0``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import subprocess
import uuid
from pathlib import Path

import pytest

from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.run import run_batch
from comfy_assets.store import Store
from tests.support import fast_config, wait_until

pytestmark = [pytest.mark.real_comfyui, pytest.mark.timeout(300)]

URL = os.environ.get("COMFYUI_URL", "")
OUTPUT_DIR = Path(
    os.environ.get("COMFYUI_OUTPUT_DIR") or Path.home() / ".cache" / "real-comfyui" / "out"
)


@pytest.fixture
def real_url() -> str:
    if not URL:
        pytest.skip("COMFYUI_URL is not set")
    if not OUTPUT_DIR.is_dir():
        pytest.skip(f"the server's output folder {OUTPUT_DIR} is not here (COMFYUI_OUTPUT_DIR)")
    return URL


def one_job_file(folder: Path, *, slow: bool = False) -> Path:
    """A one-job file whose SaveImage prefix and colour are new, so its names are ours;
    ``slow``: two 1024-pixel blurs first, a few seconds on a CPU."""
    folder.mkdir(parents=True, exist_ok=True)
    prefix = f"ca_cache_{uuid.uuid4().hex[:8]}"
    size = 1024 if slow else 64
    workflow = {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": size, "height": size, "batch_size": 1, "color": 1},
        },
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": prefix}},
    }
    if slow:
        blur = {"blur_radius": 31, "sigma": 5.0}
        workflow["3"] = {"class_type": "ImageBlur", "inputs": {"image": ["1", 0], **blur}}
        workflow["4"] = {"class_type": "ImageBlur", "inputs": {"image": ["3", 0], **blur}}
        workflow["2"]["inputs"]["images"] = ["4", 0]
    (folder / "w.json").write_text(json.dumps(workflow))
    line = {
        "id": str(uuid.uuid4()),
        "workflow": "w.json",
        "set": {"1.color": random.randrange(1 << 24)},
    }
    (folder / "jobs.jsonl").write_text(json.dumps(line) + "\n")
    return folder / "jobs.jsonl"


async def test_deleted_outputs_replayed_by_the_cache_are_rendered_anew(real_url, tmp_path):
    # README fact 11: the same prompt into a new store is fully cached and replays the
    # deleted names; the runner frees the cache and renders again.
    jf = load_job_file(one_job_file(tmp_path / "jobs"))
    job = jf.jobs[0]
    servers = [ServerSpec("real", real_url)]
    config = fast_config(poll_s=0.2, timeout_s=120.0)
    first = Store(tmp_path / "a")
    summary = await run_batch(jf, partition="p", servers=servers, store=first, config=config)
    assert summary.done == 1
    names = [Path(f.path).name for f in first.files(job.id)]
    for name in names:
        (OUTPUT_DIR / name).unlink()

    second = Store(tmp_path / "b")
    lines: list[str] = []
    summary = await run_batch(
        jf, partition="p", servers=servers, store=second, config=config, on_line=lines.append
    )
    assert summary.done == 1, lines
    files = second.files(job.id)
    assert [Path(f.path).name for f in files] == names
    for f in files:
        on_server = (OUTPUT_DIR / Path(f.path).name).read_bytes()
        assert hashlib.sha256(on_server).hexdigest() == f.sha256
    details = [e.detail or "" for e in second.events(job.id)]
    assert any("outputs missing" in d and "404" in d for d in details), details
    assert any("ComfyUI's cache freed" in d for d in details), details


async def test_a_server_killed_mid_prompt_gets_the_prompt_again_and_says_why(real_url, tmp_path):
    restart = os.environ.get("COMFYUI_RESTART_CMD")
    if not restart:
        pytest.skip("COMFYUI_RESTART_CMD is not set")
    jf = load_job_file(one_job_file(tmp_path / "jobs", slow=True))
    job = jf.jobs[0]
    store = Store(tmp_path / "store")
    lines: list[str] = []
    config = fast_config(poll_s=0.2, timeout_s=240.0, unhealthy_wait_s=1.0)
    batch = asyncio.create_task(
        run_batch(
            jf,
            partition="p",
            servers=[ServerSpec("real", real_url)],
            store=store,
            config=config,
            on_line=lines.append,
        )
    )

    def rendering() -> bool:
        record = store.get(job.id)
        return record is not None and record.state == "rendering"

    await wait_until(rendering, 60.0, "the prompt to render")
    killed = await asyncio.to_thread(
        subprocess.run, ["bash", "-c", restart], capture_output=True, text=True
    )
    assert killed.returncode == 0, killed.stderr
    summary = await asyncio.wait_for(batch, 240.0)

    assert summary.done == 1, lines
    details = [e.detail or "" for e in store.events(job.id)]
    assert any("prompt lost" in d and "the server forgot it" in d for d in details), details
    assert any("may render twice" in d for d in details), details
    for f in store.files(job.id):
        on_server = (OUTPUT_DIR / Path(f.path).name).read_bytes()
        assert hashlib.sha256(on_server).hexdigest() == f.sha256
