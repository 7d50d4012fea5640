"""ComfyUI's node output cache, as v0.8.0 keeps it by default (the "classic" cache).

What it does (comfy_execution/caching.py, execution.py; recorded in cache_replay.json,
data/recorded/README.md fact 11):

- a node's key is its input signature: its class, its IS_CHANGED value when it has one,
  its literal inputs, and the signatures of the nodes its links come from
  (CacheKeySetInputSignature); prompt_id and node ids play no part, so the same workflow
  posted again under a new prompt_id hits the cache. IS_CHANGED is read once per prompt,
  at its start: LoadImage's is the sha256 of its file, so the same name with new bytes
  misses and everything downstream runs again (upload.json; fake_comfy.inputs);
- at the start of every prompt the cache keeps only the keys that prompt uses
  (``clean_unused``), so only what the previous prompts share with this one survives;
- a cached node does not run: a cached output node replays its ``executed`` message
  with the previous run's UI output (the old file names, written or not);
- ``POST /free`` with ``free_memory`` resets it (PromptExecutor.reset), read by the worker
  between two prompts: at once when the server is idle.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fake_comfy.graph import is_link


@dataclass(frozen=True)
class CacheEntry:
    """A node's cached outputs: ``results`` (one per output slot) and, for an output
    node, its UI output (``{"images": [{"filename", "subfolder", "type"}]}``)."""

    results: tuple[Any, ...] = ()
    ui: dict[str, Any] | None = None


class NodeCache:
    """Cached node outputs by input signature (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[str, CacheEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def reset(self) -> None:
        """Forget everything (POST /free with free_memory, a new server life)."""
        self._entries.clear()

    def start_prompt(
        self, prompt: dict[str, Any], is_changed: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """The signature of every node of ``prompt``, by node id; entries no node of this
        prompt uses are dropped (ComfyUI's ``clean_unused`` at each prompt's start).
        ``is_changed`` holds the IS_CHANGED value (text) of the nodes that have one, by
        node id."""
        keys: dict[str, str] = {}
        for node_id in prompt:
            _signature(prompt, node_id, keys, (), is_changed or {})
        used = set(keys.values())
        for key in [k for k in self._entries if k not in used]:
            del self._entries[key]
        return keys

    def get(self, key: str) -> CacheEntry | None:
        return self._entries.get(key)

    def set(self, key: str, entry: CacheEntry) -> None:
        self._entries[key] = entry


def _signature(
    prompt: dict[str, Any],
    node_id: str,
    keys: dict[str, str],
    path: tuple[str, ...],
    is_changed: Mapping[str, str],
) -> str:
    """The input signature of ``node_id``, memoized in ``keys``. A link into a node that
    is missing or in a cycle gets a key of its own (validation rejects such prompts)."""
    if node_id in keys:
        return keys[node_id]
    node = prompt.get(node_id)
    if not isinstance(node, dict) or node_id in path:
        return json.dumps(["unknown", node_id])
    inputs: dict[str, Any] = {}
    for name, value in sorted((node.get("inputs") or {}).items()):
        if is_link(value):
            upstream = _signature(prompt, str(value[0]), keys, (*path, node_id), is_changed)
            inputs[name] = ["link", upstream, int(value[1])]
        else:
            inputs[name] = value
    signature: list[Any] = [node.get("class_type"), inputs]
    if node_id in is_changed:
        signature.append(is_changed[node_id])
    key = json.dumps(signature, sort_keys=True, default=str)
    keys[node_id] = key
    return key
