"""Faults on a real ComfyUI v0.8.0 (only when ``COMFYUI_URL`` is set).

The server's output folder must be readable and writable from here, to delete files as a
cleanup job would: ``COMFYUI_OUTPUT_DIR`` (default: the folder of
``../shared/real-comfyui/start.sh``, ``~/.cache/real-comfyui/out``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import uuid
from pathlib import Path

import pytest

from comfy_assets.batch import run_batch
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobfile import load_job_file
from comfy_assets.store import Store
from tests.support import fast_config

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


def one_job_file(folder: Path) -> Path:
    """A one-job file whose SaveImage prefix and colour are new, so its names are ours."""
    folder.mkdir(parents=True, exist_ok=True)
    prefix = f"ca_cache_{uuid.uuid4().hex[:8]}"
    workflow = {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 1},
        },
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": prefix}},
    }
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
