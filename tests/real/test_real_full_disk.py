"""A real ComfyUI v0.8.0 whose output disk is full beside a healthy one (only when both
``COMFYUI_URL`` and ``COMFYUI_FULL_DISK_URL`` are set; docs/health.md says how to start
the second on a small full tmpfs): the full one fails its first prompt, is quarantined,
and every job renders on the healthy one."""

from __future__ import annotations

import json
import os
import random
import uuid
from pathlib import Path

import pytest

from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.store import Store
from tests.support import fast_batch, fast_config

pytestmark = [pytest.mark.real_comfyui, pytest.mark.timeout(300)]

URL = os.environ.get("COMFYUI_URL", "")
FULL_URL = os.environ.get("COMFYUI_FULL_DISK_URL", "")


def job_file(folder: Path, count: int) -> Path:
    """``count`` one-node-and-a-save jobs of a fresh prefix and colours (not cached)."""
    folder.mkdir(parents=True, exist_ok=True)
    prefix = f"ca_full_{uuid.uuid4().hex[:8]}"
    workflow = {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "color": 1}},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": prefix}},
    }
    workflow["1"]["inputs"]["batch_size"] = 1
    (folder / "w.json").write_text(json.dumps(workflow))
    lines = [
        json.dumps(
            {
                "id": str(uuid.uuid4()),
                "workflow": "w.json",
                "set": {"1.color": random.randrange(1 << 24)},
            }
        )
        for _ in range(count)
    ]
    (folder / "jobs.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "jobs.jsonl"


async def test_a_real_server_with_a_full_output_disk_is_quarantined_and_its_jobs_render_elsewhere(
    tmp_path,
):
    if not URL or not FULL_URL:
        pytest.skip("COMFYUI_URL and COMFYUI_FULL_DISK_URL are not both set")
    jobs = load_job_file(job_file(tmp_path / "jobs", 4))
    # The full one first: configuration order gives it the first job.
    servers = [ServerSpec("full", FULL_URL), ServerSpec("real", URL)]
    store = Store(tmp_path / "store")
    lines: list[str] = []
    summary = await fast_batch(
        jobs, servers, store, config=fast_config(poll_s=0.2, timeout_s=120.0), on_line=lines.append
    )
    assert summary.done == 4, lines
    assert all(store.get(j.id).server == "real" for j in jobs.jobs)
    health = store.server_health()["full"]
    assert health.state == "quarantined", lines
    assert "No space left on device" in (health.reason or "")
    assert "output disk full" in (health.reason or "")
    failed = store.failed_on("p")
    assert list(failed.values()) == [("full",)], failed  # one prompt went there, no more
