"""What a ComfyUI server can run, from its ``GET /object_info``: node classes and model files.

ComfyUI v0.8.0 answers ``/object_info`` with every node class it has, each input with its
spec; a loader's model input is a list (a combo) of the files of its model folder
(nodes.py ``folder_paths.get_filename_list``: ``ckpt_name`` the files of
``models/checkpoints``, ``lora_name`` of ``models/loras``, ...; a V3 node's combo is
``["COMBO", {"options": [...]}]``). A prompt whose node class the server lacks is refused
with 400 ``invalid_prompt``, one naming a file not listed with 400 ``value_not_in_list``
(execution.py ``validate_inputs``, data/recorded/validation_errors.json): so a job runs
only on a server that has every class it uses and lists every model file it names.

Only model inputs are checked against the lists (``MODEL_KINDS``, by input name, digits
at the end ignored: ``clip_name1``): other lists, the input images of ``LoadImage`` say,
change with uploads and are the job's own business.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from comfy_assets.comfy.types import excerpt

# Inputs that name a model file, and what a person calls that file.
MODEL_KINDS: dict[str, str] = {
    "ckpt_name": "checkpoint",
    "lora_name": "LoRA",
    "unet_name": "diffusion model",
    "vae_name": "VAE",
    "clip_name": "text encoder",
    "control_net_name": "ControlNet",
    "model_name": "model",
}


def model_kind(input_name: str) -> str | None:
    """What kind of model file ``input_name`` names ("checkpoint"), or None."""
    return MODEL_KINDS.get(input_name.rstrip("0123456789"))


@dataclass(frozen=True)
class Needs:
    """What a workflow needs of a server: its node classes and, per loader input, the
    model file it names (``(class_type, input_name, file)``)."""

    classes: frozenset[str]
    files: frozenset[tuple[str, str, str]]

    @classmethod
    def of(cls, workflow: Mapping[str, Any]) -> Needs:
        """The needs of an API-format workflow (``{node_id: {"class_type", "inputs"}}``);
        a model input fed by a link is left to validation."""
        classes: set[str] = set()
        files: set[tuple[str, str, str]] = set()
        for node in workflow.values():
            class_type = node["class_type"]
            classes.add(class_type)
            for name, value in node["inputs"].items():
                if isinstance(value, str) and model_kind(name) is not None:
                    files.add((class_type, name, value))
        return cls(frozenset(classes), frozenset(files))


@dataclass(frozen=True)
class Missing:
    """The first thing a server lacks for a job: "checkpoint 'sdxl.safetensors'"."""

    what: str

    def __str__(self) -> str:
        return self.what


@dataclass(frozen=True)
class Capabilities:
    """What server ``server`` can run: its node classes, and the files each model input
    lists (``lists[(class_type, input_name)]``)."""

    server: str
    classes: frozenset[str]
    lists: Mapping[tuple[str, str], frozenset[str]]

    @classmethod
    def from_object_info(cls, server: str, info: Mapping[str, Any]) -> Capabilities:
        """Read a ``/object_info`` body. Raises ValueError (or KeyError, TypeError) for
        a body that is not ``{class_type: {"input": {...}}}``."""
        if not isinstance(info, Mapping):
            raise ValueError(f"expected an object of node classes, got {type(info).__name__}")
        lists: dict[tuple[str, str], frozenset[str]] = {}
        for class_type, node in info.items():
            inputs = node.get("input", {}) if isinstance(node, Mapping) else {}
            for category in ("required", "optional"):
                for name, spec in (inputs.get(category) or {}).items():
                    if model_kind(name) is None:
                        continue
                    options = _options(spec)
                    if options is not None:
                        lists[(class_type, name)] = frozenset(str(o) for o in options)
        return cls(server, frozenset(info), lists)

    def lacks(self, needs: Needs) -> Missing | None:
        """The first thing (sorted, so every server names the same one) this server lacks
        for ``needs``, or None when it can run it."""
        for class_type in sorted(needs.classes - self.classes):
            return Missing(f"node class '{excerpt(class_type)}'")
        for class_type, name, file in sorted(needs.files):
            listed = self.lists.get((class_type, name))
            if listed is not None and file not in listed:
                return Missing(f"{model_kind(name)} '{excerpt(file)}'")
        return None


def _options(spec: Any) -> Sequence[Any] | None:
    """A combo input's options: old style ``[[...], {...}]``, V3 ``["COMBO", {"options":
    [...]}]``; None for any other input."""
    if not isinstance(spec, list | tuple) or not spec:
        return None
    if isinstance(spec[0], list | tuple):
        return spec[0]
    if spec[0] == "COMBO" and len(spec) > 1 and isinstance(spec[1], Mapping):
        options = spec[1].get("options", [])
        return options if isinstance(options, list | tuple) else None
    return None


def no_server_reason(lacking: Mapping[str, Missing], unreachable: Sequence[str] = ()) -> str:
    """Why no server of the pool can run a job: ``lacking`` (every server checked, and
    what it lacks), ``unreachable`` (servers given up on). For instance
    ``no server has checkpoint 'sdxl.safetensors' (gpu0, gpu1 checked)``."""
    checked = ", ".join(lacking)
    gone = f"; {', '.join(unreachable)} unreachable" if unreachable else ""
    kinds = {str(m) for m in lacking.values()}
    if len(kinds) == 1:
        return f"no server has {kinds.pop()} ({checked} checked{gone})"
    each = ", ".join(f"{name} lacks {m}" for name, m in lacking.items())
    return f"no server has all it needs: {each} ({checked} checked{gone})"
