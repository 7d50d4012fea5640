"""The nodes of the fake that report steps, with the messages a real ComfyUI v0.8.0 sends
for them (progress.json, README fact 13).

A node with a ComfyUI ProgressBar sends, after its ``executing``: per update a
``progress_state`` (the node ``running`` at ``value`` of ``max``) and a ``progress``
``{value, max, prompt_id, node}``; ``SaveImageWebsocket`` follows each with a binary
preview frame (4-byte big-endian event type 1, 4-byte image format 2 = PNG, the image).
Its last ``progress_state`` has the node ``finished`` at ``max`` of ``max`` (integers).

- ``KSampler``: one update per step, after the step, with step + 1 of ``steps``
  (``latent_preview.py``'s callback);
- ``SaveImageWebsocket`` (custom_nodes/websocket_image_save.py): one update per image,
  before it is sent, with 0, 1, ... of the batch size.

The node's time (``node_s`` seconds) is spread over its steps.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fake_comfy import nodes

if TYPE_CHECKING:
    from fake_comfy.hub import Hub

# A 1x1 PNG: what the fake sends as each preview image.
_PNG_1X1 = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de"
    "0000000c4944415408d763f8ffff3f0005fe02fea7d6a4ff0000000049454e44ae426082"
)
PREVIEW_IMAGE, PNG = 1, 2


def steps_of(class_type: str, inputs: dict[str, Any]) -> int | None:
    """How many progress updates the node sends, or None for a node without a
    ProgressBar."""
    if class_type == "KSampler":
        steps = inputs.get("steps")
        return steps if isinstance(steps, int) and steps > 0 else None
    if class_type == "SaveImageWebsocket":
        return max(nodes.image_batch(inputs.get("images")), 1)
    return None


def node_state(
    prompt_id: str, node_id: str, value: int, top: int | None = None, state: str = "running"
) -> dict[str, Any]:
    """A ``progress_state`` node entry at ``value`` of ``top`` steps (integers)."""
    return {
        "value": value,
        "max": value if top is None else top,
        "state": state,
        "node_id": node_id,
        "prompt_id": prompt_id,
        "display_node_id": node_id,
        "parent_node_id": None,
        "real_node_id": node_id,
    }


async def report_steps(
    emit: Callable[[str, dict[str, Any]], None],
    hub: Hub,
    client: str | None,
    prompt_id: str,
    node_id: str,
    steps: int,
    node_s: float,
    seen: dict[str, dict[str, Any]],
    previews: bool = False,
) -> None:
    """Send the node's updates, ``node_s`` seconds in all. ``emit``: the executor's
    (it knows the prompt's routing); ``seen``: the ``progress_state`` entries of the
    nodes seen so far (this node's is updated). A sampler's values are 1..steps,
    SaveImageWebsocket's 0..steps-1 with a preview frame after each (``previews``)."""
    first = 0 if previews else 1
    for value in range(first, first + steps):
        if not previews:
            await asyncio.sleep(node_s / steps)
        seen[node_id] = node_state(prompt_id, node_id, value, steps)
        emit("progress_state", {"prompt_id": prompt_id, "nodes": dict(seen)})
        emit(
            "progress",
            {"value": value, "max": steps, "prompt_id": prompt_id, "node": node_id},
        )
        if previews:
            hub.send_bytes(struct.pack(">II", PREVIEW_IMAGE, PNG) + _PNG_1X1, client)
            await asyncio.sleep(node_s / steps)
