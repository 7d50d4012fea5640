"""A job goes only to the server whose model folder holds its checkpoint, with a real
ComfyUI v0.8.0 (only when ``COMFYUI_URL`` is set).

The server's model folder must be writable from here, to put in a checkpoint file the
other server (a fake) lacks: ``COMFYUI_MODELS_DIR`` (default: the folder of
``../shared/real-comfyui/start.sh``, ``~/.cache/real-comfyui/ComfyUI/models``). The file
is empty, so no model weights are needed: the real server lists it, so the prompt passes
its validation, and fails when its loader reads the file (a dead letter, after it ran
there and nowhere else). The file is removed afterwards.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import httpx
import pytest

from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import ROOT, fast_batch, fast_config, posted

pytestmark = [pytest.mark.real_comfyui, pytest.mark.timeout(300)]

URL = os.environ.get("COMFYUI_URL", "")
MODELS_DIR = Path(
    os.environ.get("COMFYUI_MODELS_DIR")
    or Path.home() / ".cache" / "real-comfyui" / "ComfyUI" / "models"
)


@pytest.fixture
def real_url() -> str:
    if not URL:
        pytest.skip("COMFYUI_URL is not set")
    if not (MODELS_DIR / "checkpoints").is_dir():
        pytest.skip(f"the server's model folder {MODELS_DIR} is not here (COMFYUI_MODELS_DIR)")
    return URL


async def test_a_checkpoint_only_the_real_server_lists_is_posted_only_there(real_url, tmp_path):
    name = f"ca_only_here_{uuid.uuid4().hex[:8]}.safetensors"
    checkpoint = MODELS_DIR / "checkpoints" / name
    checkpoint.write_bytes(b"")
    try:
        workflow = json.loads((ROOT / "data" / "workflows" / "text_to_image.json").read_text())
        (tmp_path / "t2i.json").write_text(json.dumps(workflow))
        line = {
            "id": str(uuid.uuid4()),
            "workflow": "t2i.json",
            "set": {"4.ckpt_name": name, "5.width": 64, "5.height": 64},
        }
        (tmp_path / "jobs.jsonl").write_text(json.dumps(line) + "\n")
        (job,) = load_job_file(tmp_path / "jobs.jsonl").jobs
        fake = FakeComfy(models=["other.safetensors"], prompt_seconds=0.001)
        async with fake.serve(port=0) as fake_url:
            servers = [ServerSpec("gpu0", fake_url), ServerSpec("gpu1", real_url)]
            summary = await fast_batch(
                load_job_file(tmp_path / "jobs.jsonl"),
                servers,
                Store(tmp_path / "store"),
                config=fast_config(attempts=1, timeout_s=120.0),
            )
        async with httpx.AsyncClient(base_url=real_url) as c:
            entry = (await c.get(f"/history/{job.prompt_id}")).json()[job.prompt_id]
    finally:
        checkpoint.unlink(missing_ok=True)
    assert posted(fake, job.prompt_id) == 0
    # Validated on the real server (its list has the file), then its loader failed.
    errors = [m for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert [e[1]["node_type"] for e in errors] == ["CheckpointLoaderSimple"]
    (dead,) = summary.dead_letters
    assert dead[0] == job.id and "CheckpointLoaderSimple" in dead[1]


async def test_a_checkpoint_neither_server_lists_is_a_dead_letter_posted_nowhere(
    real_url, tmp_path
):
    name = f"ca_nowhere_{uuid.uuid4().hex[:8]}.safetensors"
    (tmp_path / "t2i.json").write_text(
        (ROOT / "data" / "workflows" / "text_to_image.json").read_text()
    )
    line = {"id": str(uuid.uuid4()), "workflow": "t2i.json", "set": {"4.ckpt_name": name}}
    (tmp_path / "jobs.jsonl").write_text(json.dumps(line) + "\n")
    job_file = load_job_file(tmp_path / "jobs.jsonl")
    (job,) = job_file.jobs
    fake = FakeComfy(models=["other.safetensors"], prompt_seconds=0.001)
    async with fake.serve(port=0) as fake_url:
        servers = [ServerSpec("gpu0", fake_url), ServerSpec("gpu1", real_url)]
        summary = await fast_batch(job_file, servers, Store(tmp_path / "store"))
    async with httpx.AsyncClient(base_url=real_url) as c:
        history = (await c.get(f"/history/{job.prompt_id}")).json()
    reason = f"no server has checkpoint '{name}' (gpu0, gpu1 checked)"
    assert summary.dead_letters == [(job.id, reason)]
    assert (posted(fake, job.prompt_id), history) == (0, {})
