"""API-format workflows: read once per file (``WorkflowCache``), checked to be API format
(not a UI export), and the model files they name (for the pool's affinity)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comfy_assets.jobs.model import canonical_json
from comfy_assets.jobs.regular_file import NotARegularFile, read_regular_file
from comfy_assets.jobs.strict_json import (
    FINITE_HINT,
    NonFinite,
    first_non_finite,
    first_untakeable,
    kind_of,
    loads_bounded,
    parse_float,
)

# Loader inputs that name a model file; "clip_name1" (DualCLIPLoader) counts as clip_name.
MODEL_INPUTS = frozenset(
    {
        "ckpt_name",
        "unet_name",
        "lora_name",
        "vae_name",
        "clip_name",
        "control_net_name",
        "model_name",
    }
)


UI_MESSAGE = "is a UI workflow, not API format (export it with 'Export (API)')"


@dataclass(frozen=True)
class _Workflow:
    """A validated API-format workflow: its canonical text (for cheap deep copies) and
    that text parsed, shared by every job that reads it (never to be changed)."""

    text: str
    parsed: dict[str, Any]


# Non-finite numbers are kept as NonFinite markers, so that they can be reported; a
# repeated key keeps its last value, as json.loads does.
_DECODER = json.JSONDecoder(parse_float=parse_float, parse_constant=NonFinite)


class WorkflowCache:
    """Workflow files read once: 10,000 jobs sharing a file parse it once, and so do
    5,000 job files loaded with the same cache. It never looks at a file again: keep
    one only as long as the files can be taken as unchanged (one sensor tick)."""

    def __init__(self) -> None:
        # Keyed by the raw string: building a Path per line costs more than the rest.
        self._by_spec: dict[tuple[Path, str], _Workflow | str] = {}

    def get(self, base_dir: Path, spec: str) -> _Workflow | str:
        """The workflow at ``base_dir / spec`` or an error message."""
        key = (base_dir, spec)
        found = self._by_spec.get(key)
        if found is None:
            found = self._by_spec[key] = self._load(base_dir / spec)
        return found

    def specs(self) -> list[tuple[Path, str]]:
        """The ``(base_dir, spec)`` of every workflow asked for so far, read or not."""
        return list(self._by_spec)

    def longest_text(self) -> int:
        """The most characters any workflow read takes as compact ASCII JSON (its
        canonical text); 0 when none was read."""
        return max(
            (len(w.text) for w in self._by_spec.values() if isinstance(w, _Workflow)), default=0
        )

    @staticmethod
    def _load(path: Path) -> _Workflow | str:
        try:
            raw = read_regular_file(path, MAX_WORKFLOW_BYTES).decode("utf-8-sig")
        except FileNotFoundError:
            return f"workflow file not found: {path}"
        except (OSError, UnicodeDecodeError) as e:
            return f"cannot read workflow file {path}: {e}"
        except ValueError as e:  # a NUL in the path: no file can have that name
            return f"cannot read workflow file {str(path)!r}: {e}"
        except NotARegularFile as e:
            return f"workflow file {path} {e}"
        try:
            obj = loads_bounded(_DECODER.decode, raw)
        except json.JSONDecodeError as e:
            return f"workflow file {path} is not JSON: {e.msg} at line {e.lineno}"
        except ValueError as e:  # an integer of more than 4300 digits, TooDeep
            return f"workflow file {path} is not usable JSON: {e}"
        text = first_non_finite(obj)
        if text is not None:
            nodes = obj.items() if isinstance(obj, dict) else ()
            node = next((f" node {k!r}" for k, v in nodes if first_non_finite(v)), "")
            return f"workflow file {path}{node} holds {text}; {FINITE_HINT}"
        problem = api_format_problem(obj) or first_untakeable(obj)
        if problem:
            return f"workflow file {path} {problem}"
        text = canonical_json(obj)
        return _Workflow(text, json.loads(text))


# The most a workflow file may hold (bytes): API-format workflows are kilobytes, and
# anything read is held whole in memory, so a path to a huge file or a device (/dev/zero)
# must not be read to its end.
MAX_WORKFLOW_BYTES = 16 * 1024**2


def api_format_problem(obj: Any) -> str | None:
    """Why ``obj`` is not an API-format workflow, or None if it is."""
    if not isinstance(obj, dict):
        return f"is not API format: expected a JSON object of nodes, got {kind_of(obj)}"
    if "nodes" in obj and "links" in obj:
        return UI_MESSAGE
    if not obj:
        return "is not API format: it has no nodes"
    for node_id, node in obj.items():
        if not isinstance(node, dict):
            return f"is not API format: node {node_id!r} is {kind_of(node)}, not an object"
        if not isinstance(node.get("class_type"), str):
            return f"is not API format: node {node_id!r} has no class_type"
        if not isinstance(node.get("inputs"), dict):
            return f"is not API format: node {node_id!r} has no inputs object"
    return None


def model_names(workflow: Mapping[str, Any]) -> tuple[str, ...]:
    names: set[str] = set()
    for node in workflow.values():
        for name, value in node["inputs"].items():
            if isinstance(value, str) and name.rstrip("0123456789") in MODEL_INPUTS:
                names.add(value)
    return tuple(sorted(names))
