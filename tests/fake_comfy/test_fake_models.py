"""The fake's model files: listed by the loaders, validated like ComfyUI v0.8.0, kept
loaded (least recently used goes), loaded at a cost that /fake/stats counts; the default
text-to-image workflow runs and its picture follows its inputs."""

from __future__ import annotations

import asyncio
import io
import json
import re
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

from fake_comfy import FakeComfy

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 10.0


def text_to_image(
    ckpt: str = "a.safetensors",
    *,
    seed: int = 1,
    text: str = "a glass bottle",
    width: int = 64,
    height: int = 64,
    lora: str | None = None,
) -> dict[str, Any]:
    """data/workflows/text_to_image.json (ComfyUI's default workflow, API format), or
    its LoRA variant, with these inputs."""
    name = "text_to_image_lora.json" if lora else "text_to_image.json"
    wf = json.loads((ROOT / "data" / "workflows" / name).read_text())
    wf["4"]["inputs"]["ckpt_name"] = ckpt
    wf["3"]["inputs"]["seed"] = seed
    wf["6"]["inputs"]["text"] = text
    wf["5"]["inputs"].update(width=width, height=height)
    if lora:
        wf["10"]["inputs"]["lora_name"] = lora
    return wf


async def render(c: httpx.AsyncClient, fake: FakeComfy, prompt: dict[str, Any]) -> bytes:
    """Post ``prompt``, wait for its run to end, return the bytes of its one output."""
    pid = str(uuid.uuid4())
    ended = fake.records.ended_runs()
    answer = await c.post("/prompt", json={"prompt": prompt, "prompt_id": pid})
    assert answer.status_code == 200, answer.text
    await fake.wait_for_runs(ended + 1, WAIT_S)
    entry = (await c.get(f"/history/{pid}")).json()[pid]
    assert entry["status"]["status_str"] == "success"
    (image,) = next(iter(entry["outputs"].values()))["images"]
    return (await c.get("/view", params=image)).content


def loads(fake: FakeComfy) -> dict[str, int]:
    return {name: len(times) for name, times in fake.stats["model_loads"].items()}


async def test_the_program_lists_its_models_for_every_loader_and_refuses_others() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fake_comfy",
        "--port",
        "0",
        "--models",
        "a.safetensors,b.safetensors",
        "--model-load-s",
        "2",
        "--resident",
        "1",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        url = re.fullmatch(r"fake_comfy listening on (\S+)\n", line).group(1)
        async with httpx.AsyncClient(base_url=url) as c:
            info = (await c.get("/object_info")).json()
            refused = await c.post(
                "/prompt", json={"prompt": text_to_image("sdxl_base.safetensors")}
            )
            stats = (await c.get("/fake/stats")).json()
    finally:
        proc.terminate()
        await proc.wait()
    files = ["a.safetensors", "b.safetensors"]
    assert info["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"][0] == files
    assert info["LoraLoader"]["input"]["required"]["lora_name"][0] == files
    assert info["UpscaleModelLoader"]["input"]["required"]["model_name"][1]["options"] == files
    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "prompt_outputs_failed_validation"
    (error,) = refused.json()["node_errors"]["4"]["errors"]
    assert error == {
        "type": "value_not_in_list",
        "message": "Value not in list",
        "details": "ckpt_name: 'sdxl_base.safetensors' not in ['a.safetensors', 'b.safetensors']",
        "extra_info": {
            "input_name": "ckpt_name",
            "input_config": [files, {"tooltip": "The name of the checkpoint (model) to load."}],
            "received_value": "sdxl_base.safetensors",
        },
    }
    assert stats["model_loads"] == {}


async def test_a_folder_prefix_lists_a_file_in_that_folder_only() -> None:
    fake = FakeComfy(models=["checkpoints:a.safetensors", "loras:ink.safetensors"])
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        info = (await c.get("/object_info")).json()
        one = (await c.get("/object_info/LoraLoader")).json()
    assert info["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"][0] == ["a.safetensors"]
    assert one["LoraLoader"]["input"]["required"]["lora_name"][0] == ["ink.safetensors"]
    assert info["VAELoader"]["input"]["required"]["vae_name"][0] == []


async def test_the_least_recently_used_model_goes_and_is_loaded_again(tmp_path: Path) -> None:
    fake = FakeComfy(
        models=["a.safetensors", "b.safetensors"],
        model_load_s=0.01,
        resident=1,
        prompt_seconds=0.001,
        output_dir=tmp_path,
    )
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        for seed, ckpt in enumerate(["a", "a", "b", "a", "a"]):
            await render(c, fake, text_to_image(f"{ckpt}.safetensors", seed=seed))
        assert loads(fake) == {"a.safetensors": 2, "b.safetensors": 1}
        assert fake.models.loaded() == ["a.safetensors"]
    for times in fake.stats["model_loads"].values():
        for load in times:
            assert load["end"] - load["start"] >= 0.01


async def test_two_resident_models_are_each_loaded_once() -> None:
    fake = FakeComfy(models=["a.safetensors", "b.safetensors"], resident=2, prompt_seconds=0.001)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        for seed, ckpt in enumerate(["a", "b", "a", "b"]):
            await render(c, fake, text_to_image(f"{ckpt}.safetensors", seed=seed))
    assert loads(fake) == {"a.safetensors": 1, "b.safetensors": 1}


async def test_a_checkpoint_and_its_lora_stay_loaded_together() -> None:
    fake = FakeComfy(models=["a.safetensors", "ink.safetensors"], resident=1, prompt_seconds=0.001)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        for seed in range(3):
            await render(c, fake, text_to_image(seed=seed, lora="ink.safetensors"))
    assert loads(fake) == {"a.safetensors": 1, "ink.safetensors": 1}


async def test_a_restart_or_free_unloads_the_models() -> None:
    fake = FakeComfy(models=["a.safetensors"], prompt_seconds=0.001)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        await render(c, fake, text_to_image(seed=1))
        await c.post("/free", json={"free_memory": True})  # unload_models defaults to it
        await render(c, fake, text_to_image(seed=2))
        await c.post("/free", json={"unload_models": False, "free_memory": False})
        await render(c, fake, text_to_image(seed=3))
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        await render(c, fake, text_to_image(seed=4))
    assert loads(fake) == {"a.safetensors": 3}


async def test_the_picture_follows_seed_prompt_text_and_size() -> None:
    fake = FakeComfy(models=["a.safetensors", "b.safetensors"], prompt_seconds=0.001)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        base = await render(c, fake, text_to_image(seed=7))
        again = await render(c, fake, text_to_image(seed=7))
        others = [
            await render(c, fake, text_to_image(seed=8)),
            await render(c, fake, text_to_image(seed=7, text="a paper boat")),
            await render(c, fake, text_to_image("b.safetensors", seed=7)),
            await render(c, fake, text_to_image(seed=7, lora="a.safetensors")),
        ]
        wide = await render(c, fake, text_to_image(seed=7, width=128, height=72))

    def pixel(data: bytes) -> tuple[int, ...]:
        return Image.open(io.BytesIO(data)).convert("RGB").getpixel((0, 0))

    assert pixel(again) == pixel(base)
    assert len({pixel(base), *(pixel(o) for o in others)}) == 5
    assert Image.open(io.BytesIO(base)).size == (64, 64)
    assert Image.open(io.BytesIO(wide)).size == (128, 72)
