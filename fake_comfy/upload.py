"""POST /upload/image, as ComfyUI v0.8.0's server.py ``image_upload`` answers it
(data/recorded/upload.json, README fact 12).

Multipart fields: ``image`` (the file), ``type`` (input, temp or output; input when
absent), ``subfolder`` (joined to that folder), ``overwrite`` ("true" or "1" replaces).

- 200 ``{"name", "subfolder", "type"}``: ``subfolder`` as sent, ``name`` the name the file
  is stored under. A file of that name with the same bytes (sha256) is not written again
  and its name comes back; one with other bytes makes the new file ``key (1).png``, then
  ``key (2).png`` ...; with overwrite the file is replaced in place.
- 400, empty body: no ``image`` field, an empty file name, or a path (subfolder joined with
  the file name) that leaves the folder. A ``../`` in the file name is joined to the
  subfolder before that check, so ``../evil.png`` in a subfolder is stored one level up
  and answered as ``../evil.png``.
- 500 text/plain (aiohttp's page for an unhandled exception): an unknown ``type`` (even
  without an image), an ``image`` field that is not a file, an existing folder in the
  file's place.

Any bytes are stored under any name: nothing is checked until a node loads the file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from typing import IO, Any

from aiohttp.web_request import FileField
from multidict import MultiDictProxy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UploadAnswer:
    """What to answer: ``status`` 200 with ``body``, 400 with an empty body, or 500."""

    status: int
    body: dict[str, str] | None = None

    @property
    def prompt_name(self) -> str:
        """How a prompt names the stored file: "subfolder/name", then " [temp]" or
        " [output]" for those types (folder_paths.annotated_filepath)."""
        assert self.body is not None
        name = self.body["name"]
        path = f"{self.body['subfolder']}/{name}" if self.body["subfolder"] else name
        kind = self.body["type"]
        return path if kind == "input" else f"{path} [{kind}]"


def _same_bytes(path: str, upload: IO[bytes]) -> bool:
    """compare_image_hash: whether the file at ``path`` has the sha256 of ``upload``."""
    with open(path, "rb") as f:
        on_disk = hashlib.file_digest(f, "sha256").hexdigest()
    upload.seek(0)
    sent = hashlib.file_digest(upload, "sha256").hexdigest()
    upload.seek(0)
    return on_disk == sent


def store_upload(post: MultiDictProxy[Any], folders: dict[str, str]) -> UploadAnswer:
    """Stores the file of a POST /upload/image form (see the module docstring) in one of
    ``folders`` (type name → absolute folder). Blocking: run it in a thread, one at a
    time. Raises what ComfyUI's handler raises where it answers 500 (ValueError for an
    unknown type; OSError, AttributeError, TypeError for the rest)."""
    image = post.get("image")
    overwrite = post.get("overwrite")
    kind = post.get("type")
    if kind is None:
        kind = "input"
    if not isinstance(kind, str) or kind not in folders:
        # get_dir_by_type leaves its folder unbound: an UnboundLocalError, a 500.
        what = f'"{kind[:40]}"' if isinstance(kind, str) else "given as a file"
        raise ValueError(f"upload type {what} is none of {', '.join(folders)}")
    upload_dir = folders[kind]
    if not image:
        return UploadAnswer(400)
    if not isinstance(image, FileField):
        raise AttributeError("the image field is not a file (it has no .file)")
    filename = image.filename
    if not filename:
        return UploadAnswer(400)
    subfolder = post.get("subfolder", "")
    if not isinstance(subfolder, str):
        raise TypeError("the subfolder field is a file, not text")
    full_folder = os.path.join(upload_dir, os.path.normpath(subfolder))
    filepath = os.path.abspath(os.path.join(full_folder, filename))
    if os.path.commonpath((upload_dir, filepath)) != upload_dir:
        return UploadAnswer(400)
    if not os.path.exists(full_folder):
        os.makedirs(full_folder)
    stem, ext = os.path.splitext(filename)
    duplicate = False
    if overwrite not in ("true", "1"):
        i = 1
        while os.path.exists(filepath):
            if _same_bytes(filepath, image.file):
                duplicate = True
                break
            filename = f"{stem} ({i}){ext}"
            filepath = os.path.join(full_folder, filename)
            i += 1
    if not duplicate:
        image.file.seek(0)
        with open(filepath, "wb") as out:
            shutil.copyfileobj(image.file, out)
    return UploadAnswer(200, {"name": filename, "subfolder": subfolder, "type": kind})
