"""What a server can run (read from /object_info) and which job a free server takes (the
plan): pure functions, no server."""

from __future__ import annotations

import json
from pathlib import Path

from comfy_assets.comfy.capabilities import Capabilities, Needs, no_server_reason
from comfy_assets.pool.plan import Demand, Plan, held_text, parse_held
from fake_comfy.models import Models

ROOT = Path(__file__).resolve().parents[2]


def checkpoint_job(name: str, extra_class: str | None = None) -> Needs:
    workflow = json.loads((ROOT / "data" / "workflows" / "text_to_image.json").read_text())
    workflow["4"]["inputs"]["ckpt_name"] = name
    if extra_class:
        workflow["99"] = {"class_type": extra_class, "inputs": {}}
    return Needs.of(workflow)


def test_the_model_lists_of_old_and_new_style_nodes_are_read():
    info = Models(["a.safetensors", "loras:ink.safetensors"]).object_info()
    caps = Capabilities.from_object_info("gpu0", info)
    assert caps.lists[("CheckpointLoaderSimple", "ckpt_name")] == {"a.safetensors"}
    assert caps.lists[("LoraLoader", "lora_name")] == {"a.safetensors", "ink.safetensors"}
    assert caps.lists[("UpscaleModelLoader", "model_name")] == {"a.safetensors"}
    assert caps.lacks(checkpoint_job("a.safetensors")) is None
    assert str(caps.lacks(checkpoint_job("b.safetensors"))) == "checkpoint 'b.safetensors'"
    assert str(caps.lacks(checkpoint_job("a.safetensors", "Pack"))) == "node class 'Pack'"


def test_the_reason_names_what_is_missing_and_the_servers_checked():
    caps = Capabilities.from_object_info("gpu0", Models(["a.safetensors"]).object_info())
    missing = caps.lacks(checkpoint_job("sdxl_base.safetensors"))
    assert missing is not None
    assert (
        no_server_reason({"gpu0": missing, "gpu1": missing})
        == "no server has checkpoint 'sdxl_base.safetensors' (gpu0, gpu1 checked)"
    )
    other = caps.lacks(checkpoint_job("a.safetensors", "Pack"))
    assert other is not None
    assert no_server_reason({"gpu0": missing, "gpu1": other}, ["gpu2"]) == (
        "no server has all it needs: gpu0 lacks checkpoint 'sdxl_base.safetensors', "
        "gpu1 lacks node class 'Pack' (gpu0, gpu1 checked; gpu2 unreachable)"
    )


def test_what_a_server_holds_is_kept_as_a_json_list_and_an_old_bare_name_still_reads():
    assert held_text(["b.safetensors", "a.safetensors"]) == '["a.safetensors", "b.safetensors"]'
    assert parse_held(held_text(["a.safetensors"])) == {"a.safetensors"}
    assert parse_held("sdxl.safetensors") == {"sdxl.safetensors"}
    assert parse_held(None) == frozenset() == parse_held(held_text([]))


A, B, C = (checkpoint_job(f"{m}.safetensors") for m in "abc")


def plan_of(servers: list[str], held: dict[str, Needs]) -> Plan:
    plan = Plan(servers, lambda server, needs: True)
    for server, needs in held.items():
        plan.assign(server, needs)
    plan.estimates.record(0.25, loaded=False)
    plan.estimates.record(2.25, loaded=True)  # a load: 2 s
    return plan


def test_a_free_server_takes_the_oldest_job_of_the_model_it_holds():
    plan = plan_of(["gpu0", "gpu1"], {"gpu0": B})
    demand = {A: Demand(5, 1), B: Demand(5, 2)}
    assert plan.choose("gpu0", demand) == B


def test_a_model_nobody_holds_goes_to_a_free_server_first():
    plan = plan_of(["gpu0", "gpu1", "gpu2"], {"gpu1": A})
    demand = {A: Demand(50, 1), B: Demand(3, 2)}
    assert plan.choose("gpu0", demand) == B


def test_a_server_changes_model_only_when_that_shortens_the_batch():
    plan = plan_of(["gpu0", "gpu1"], {"gpu0": C, "gpu1": A})
    # 40 jobs on one server: 10 s; a load and half of them: 2 + 5 s. It switches.
    assert plan.choose("gpu0", {A: Demand(40, 1)}) == A
    # 4 jobs: 1 s on the server holding the model, 2.5 s with a load. It waits.
    assert plan.choose("gpu0", {A: Demand(4, 1)}) is None
    # ... unless the consumer asking has waited in line longer than a load takes.
    assert plan.choose("gpu0", {A: Demand(4, 1)}, waited_s=2.0) == A


def test_a_server_takes_nothing_it_cannot_run():
    plan = Plan(["gpu0", "gpu1"], lambda server, needs: server == "gpu1" or needs != B)
    assert plan.choose("gpu0", {B: Demand(3, 1)}) is None
    assert plan.choose("gpu1", {B: Demand(3, 1)}) == B


def test_a_load_is_expected_only_when_the_server_lacks_a_model_of_the_job():
    plan = Plan(["gpu0"], lambda server, needs: True)
    no_models = Needs(frozenset({"EmptyImage", "SaveImage"}), frozenset())
    assert [plan.assign("gpu0", n) for n in (A, A, no_models, A, B)] == [
        True,
        False,
        False,
        False,
        True,
    ]
    assert plan.holds("gpu0") == {"b.safetensors"}
