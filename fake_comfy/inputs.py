"""Input files as ComfyUI v0.8.0 finds, lists, validates and fingerprints them.

- A node input naming a file ("keyframes/key.png", "x.png [output]") is resolved like
  folder_paths.get_annotated_filepath: a trailing " [output]", " [input]" or " [temp]"
  picks the folder, else the input folder; the rest is joined to it as is (a `..` in it
  is not refused there: only /upload/image checks paths).
- LoadImage and LoadVideo check that the file exists at validation (their
  VALIDATE_INPUTS / validate_inputs): "Invalid image file: NAME" as a
  `custom_validation_failed` node error (upload.json); such an input skips the combo check.
- The cache keys them on their IS_CHANGED / fingerprint_inputs (comfy_execution.caching
  puts it in the node's signature): LoadImage the sha256 of the file (nodes.py),
  LoadVideo its modification time (comfy_extras/nodes_video.py).
- /object_info lists the files at the top of the input folder whose MIME type is an
  image (LoadImage) or a video (LoadVideo), sorted (upload.json: files in subfolders are
  not listed).
"""

from __future__ import annotations

import hashlib
import mimetypes
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Folders:
    """The server's three folders, absolute."""

    input: Path
    output: Path
    temp: Path

    def annotated_path(self, name: str) -> str:
        """folder_paths.get_annotated_filepath: the path a node input's file name stands for."""
        base = str(self.input)
        for tag, folder in (
            ("[output]", self.output),
            ("[input]", self.input),
            ("[temp]", self.temp),
        ):
            if name.endswith(tag):
                name, base = name[: -len(tag) - 1], str(folder)
                break
        return os.path.join(base, name)


# class_type -> (input name, message of a missing file) of the nodes that check their file.
CUSTOM_VALIDATION: dict[str, tuple[str, str]] = {
    "LoadImage": ("image", "Invalid image file: {}"),
    "LoadVideo": ("file", "Invalid video file: {}"),
}

# class_type -> (input name, content type listed in its /object_info options).
LISTED_FILES: dict[str, tuple[str, str]] = {
    "LoadImage": ("image", "image"),
    "LoadVideo": ("file", "video"),
}


def custom_errors(
    class_type: str, inputs: dict[str, Any], folders: Folders
) -> list[dict[str, Any]]:
    """The `custom_validation_failed` errors of a node that checks its file (execution.py
    validate_inputs; the recorded shape of upload.json); [] for any other node."""
    checked = CUSTOM_VALIDATION.get(class_type)
    if checked is None:
        return []
    name, message = checked
    value = inputs.get(name)
    if isinstance(value, str) and os.path.exists(folders.annotated_path(value)):
        return []
    return [
        {
            "type": "custom_validation_failed",
            "message": "Custom validation failed for node",
            "details": f"{name} - {message.format(value)}",
            "extra_info": {"input_name": name},
        }
    ]


def fingerprint(class_type: str, inputs: dict[str, Any], folders: Folders) -> str | None:
    """The IS_CHANGED value of a node that has one, as text, else None. A file that cannot
    be read gets a value of its own, so nothing cached matches it (ComfyUI's NaN)."""
    checked = CUSTOM_VALIDATION.get(class_type)
    if checked is None:
        return None
    value = inputs.get(checked[0])
    try:
        path = folders.annotated_path(str(value))
        if class_type == "LoadVideo":
            return repr(os.path.getmtime(path))
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return f"unreadable {uuid.uuid4()}"


def fingerprints(prompt: dict[str, Any], folders: Folders) -> dict[str, str]:
    """The IS_CHANGED value of each node of ``prompt`` that has one, by node id (reads
    files: blocking)."""
    found = {}
    for node_id, node in prompt.items():
        value = fingerprint(str(node.get("class_type")), node.get("inputs") or {}, folders)
        if value is not None:
            found[node_id] = value
    return found


def needs_fingerprints(prompt: dict[str, Any]) -> bool:
    """Whether a node of ``prompt`` has an IS_CHANGED of the fake's."""
    return any(node.get("class_type") in CUSTOM_VALIDATION for node in prompt.values())


def listed_files(folder: Path, content_type: str) -> list[str]:
    """Sorted names of the files at the top of ``folder`` whose MIME type (by extension)
    is of ``content_type`` ("image", "video"): folder_paths.filter_files_content_types."""
    try:
        names = [n for n in os.listdir(folder) if os.path.isfile(folder / n)]
    except FileNotFoundError:
        return []
    kept = []
    for name in names:
        mime = mimetypes.guess_type(name, strict=False)[0]
        if mime is not None and mime.split("/")[0] == content_type:
            kept.append(name)
    return sorted(kept)


def with_listed_files(class_type: str, info: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``info`` (one /object_info entry) with its file combo listing ``folder``'s files,
    a new dict when it changes (the recorded entries are shared)."""
    listed = LISTED_FILES.get(class_type)
    if listed is None:
        return info
    name, content_type = listed
    files = listed_files(folder, content_type)
    spec = info["input"]["required"][name]
    if isinstance(spec[0], list):  # V1 combo: [[options], {...}]
        new_spec = [files, *spec[1:]]
    else:  # V3 combo: ["COMBO", {"options": [...], ...}]
        new_spec = [spec[0], {**spec[1], "options": files}]
    required = {**info["input"]["required"], name: new_spec}
    return {**info, "input": {**info["input"], "required": required}}
