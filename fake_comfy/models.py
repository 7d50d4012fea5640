"""Model files of the fake: listed in /object_info, kept loaded, loaded at a cost.

    fake = FakeComfy(models=["a.safetensors", "loras:ink.safetensors"], model_load_s=2.0,
                     resident=1)

What ComfyUI v0.8.0 does, and what the fake keeps of it:

- A loader's model input lists the files of its folder (``folder_paths.get_filename_list``
  in nodes.py: ``ckpt_name`` the files of ``models/checkpoints``, ``lora_name`` of
  ``models/loras``, ...), so a prompt naming a file the server lacks fails validation with
  400 ``value_not_in_list`` (execution.py ``validate_inputs``; the fake's validate.py
  gives that answer from the lists below). A file given as ``FOLDER:NAME`` is listed in
  that folder only (``loras:ink.safetensors``); a bare name is listed in every folder, so
  a fake started with ``--models a.safetensors`` answers to any loader.
- A model used stays loaded (``comfy.model_management.current_loaded_models``) until
  memory is needed for another: the fake keeps the ``resident`` most recently used files
  (never one the running prompt uses) and drops the least recently used. A loader whose
  file is not loaded takes ``load_s`` seconds more to execute; a cached loader does not
  execute at all (the previous prompt loaded the same file).
- Everything is unloaded when the server starts (a new life) and by ``POST /free`` with
  ``unload_models``, or with ``free_memory`` alone (main.py reads ``unload_models`` with
  ``free_memory`` as its default), between two prompts.

``loads()`` (``model_loads`` of ``/fake/stats``) is
``{file: [{"prompt_id", "start", "end"}]}``: every load, per file, times in seconds since
the epoch. Records survive restarts, like the fake's other records; thread-safe.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from fake_comfy import recorded

# Loader inputs that list the files of a model folder: folder -> (class_type, input).
FOLDERS: dict[str, tuple[tuple[str, str], ...]] = {
    "checkpoints": (("CheckpointLoaderSimple", "ckpt_name"),),
    "loras": (("LoraLoader", "lora_name"), ("LoraLoaderModelOnly", "lora_name")),
    "vae": (("VAELoader", "vae_name"),),
    "diffusion_models": (("UNETLoader", "unet_name"),),
    "text_encoders": (("CLIPLoader", "clip_name"),),
    "controlnet": (("ControlNetLoader", "control_net_name"),),
    "upscale_models": (("UpscaleModelLoader", "model_name"),),
}
LOADER_INPUTS: dict[str, str] = {cls: name for pairs in FOLDERS.values() for cls, name in pairs}


def parse_files(specs: Iterable[str]) -> dict[str, list[str]]:
    """``["a.safetensors", "loras:ink.safetensors"]`` as {folder: [files]}: a bare name in
    every folder. Raises ValueError for an empty name or an unknown folder."""
    folders: dict[str, list[str]] = {f: [] for f in FOLDERS}
    for spec in specs:
        folder, sep, name = spec.strip().rpartition(":")
        if not name:
            raise ValueError(f"empty model file name in {spec!r}")
        if sep and folder not in FOLDERS:
            raise ValueError(
                f"unknown model folder {folder!r} in {spec!r} (known: {', '.join(FOLDERS)})"
            )
        for target in [folder] if sep else list(FOLDERS):
            if name not in folders[target]:
                folders[target].append(name)
    return folders


def _set_options(spec: list[Any], files: list[str]) -> list[Any]:
    """A combo input's spec with ``files`` as its options, in its own format: old style
    ``[[...], {...}]`` or V3 ``["COMBO", {"options": [...]}]``."""
    spec = copy.deepcopy(spec)
    if spec and spec[0] == "COMBO":
        spec[1]["options"] = list(files)
    else:
        spec[0] = list(files)
    return spec


class Models:
    """The model files of one fake, which of them are loaded, and every load.

    ``files``: as ``parse_files`` takes them. ``load_s``: seconds a loader takes for a file
    not loaded. ``resident``: how many files stay loaded (>= 1). Raises ValueError for a
    negative ``load_s``, ``resident`` < 1 or a bad file name.
    """

    def __init__(self, files: Iterable[str] = (), load_s: float = 0.0, resident: int = 1) -> None:
        if load_s < 0 or resident < 1:
            raise ValueError(
                f"model_load_s must be >= 0 and resident >= 1, got {load_s}, {resident}"
            )
        self.load_s = float(load_s)
        self.resident = int(resident)
        self._lock = threading.Lock()
        self._loaded: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._loads: dict[str, list[dict[str, Any]]] = {}
        self.unload_requested = False  # POST /free: applied between two prompts
        self.set_files(files)

    def set_files(self, files: Iterable[str]) -> None:
        """List these files from now on (as if copied into, or removed from, the model
        folders; a real ComfyUI rescans its folders at the next /object_info)."""
        self.folders = parse_files(files)
        self._info: dict[str, Any] | None = None

    def object_info(self) -> dict[str, Any]:
        """The recorded /object_info with this fake's files in the loaders' lists.

        Shared and cached until ``set_files``: callers must not mutate it."""
        info = self._info
        if info is None:
            info = dict(recorded.object_info())
            for folder, pairs in FOLDERS.items():
                for class_type, name in pairs:
                    node = copy.deepcopy(info[class_type])
                    for category in ("required", "optional"):
                        if name in node["input"].get(category, {}):
                            spec = node["input"][category][name]
                            node["input"][category][name] = _set_options(spec, self.folders[folder])
                    info[class_type] = node
            self._info = info
        return info

    def loaded(self) -> list[str]:
        """The files loaded now, least recently used first."""
        with self._lock:
            return list(self._loaded)

    def loads(self) -> dict[str, list[dict[str, Any]]]:
        """Every load so far, per file (``model_loads`` of /fake/stats)."""
        with self._lock:
            return copy.deepcopy(self._loads)

    def unload_all(self) -> None:
        """Forget what is loaded (a new server life, ``POST /free``)."""
        with self._lock:
            self._loaded.clear()
        self.unload_requested = False

    @staticmethod
    def used_by(prompt: dict[str, Any]) -> set[str]:
        """The model files the loaders of ``prompt`` name (literal inputs only)."""
        files = set()
        for node in prompt.values():
            name = LOADER_INPUTS.get(node.get("class_type", ""))
            value = node.get("inputs", {}).get(name) if name else None
            if isinstance(value, str):
                files.add(value)
        return files

    async def before_node(
        self, prompt_id: str, prompt: dict[str, Any], class_type: str, inputs: dict[str, Any]
    ) -> None:
        """Called as a node of ``prompt`` starts executing: a loader whose file is not
        loaded takes ``load_s`` seconds, and the load is recorded; then the file is the
        most recently used, and the least recently used files the prompt does not use go
        beyond ``resident``."""
        name = LOADER_INPUTS.get(class_type)
        file = inputs.get(name) if name else None
        if not isinstance(file, str):
            return
        with self._lock:
            loaded = file in self._loaded
        if not loaded:
            start = time.time()
            await asyncio.sleep(self.load_s)
            with self._lock:
                self._loads.setdefault(file, []).append(
                    {"prompt_id": prompt_id, "start": start, "end": time.time()}
                )
        in_use = self.used_by(prompt)
        with self._lock:
            self._loaded[file] = None
            self._loaded.move_to_end(file)
            for old in [f for f in self._loaded if f not in in_use]:
                if len(self._loaded) <= self.resident:
                    break
                del self._loaded[old]
