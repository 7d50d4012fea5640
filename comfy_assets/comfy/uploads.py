"""Input files already on each server, so the same bytes are uploaded once per server.

Each ComfyUI server has its own input folder (data/recorded/README.md, fact 12), so an
input must be on the server a prompt runs on before its POST. Callers name a file by its
content (``<sha256><suffix>``): the same bytes get the same name everywhere, and two
files of one base name with other bytes never share one. The server may still answer
another name than the one sent (``key (1).png`` when a file of that name with other
bytes is already there, upload.json): the name it answered is the one a prompt must use,
and the one remembered here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from comfy_assets.comfy.client import ComfyClient

Read = Callable[[], Awaitable[bytes]]


class Uploads:
    """What this process uploaded to each server: ``(server, subfolder, filename)`` → the
    name to put in a prompt (``subfolder/name`` as the server answered it).

    Two callers uploading the same file to the same server at once upload it once: the
    second waits for the first and takes its answer. ``forget`` drops what a server is
    known to have lost (its input folder was cleaned: a prompt naming it failed
    validation), so the next ``ensure`` uploads it again.
    """

    def __init__(self) -> None:
        self._names: dict[tuple[str, str, str], str] = {}
        self._locks: dict[tuple[str, str, str], asyncio.Lock] = {}

    def known(self, server: str, subfolder: str, filename: str) -> str | None:
        """The prompt's name of that file on ``server`` if this process uploaded it."""
        return self._names.get((server, subfolder, filename))

    async def ensure(
        self, client: ComfyClient, server: str, subfolder: str, filename: str, read: Read
    ) -> tuple[str, bool]:
        """``(name for the prompt, uploaded now)``: the file is on ``server`` once this
        returns. ``read`` gives its bytes (only called when an upload is needed). Raises
        what ``read`` raises and the client's errors of ``POST /upload/image``
        (``ComfyClient.upload_input``)."""
        key = (server, subfolder, filename)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            name = self._names.get(key)
            if name is not None:
                return name, False
            data = await read()
            answer = await client.upload_input(data, filename, subfolder=subfolder)
            name = answer.prompt_name
            self._names[key] = name
            return name, True

    def forget(self, server: str, names: set[str]) -> None:
        """Drop the files of ``server`` whose prompt names are in ``names``."""
        for key, name in list(self._names.items()):
            if key[0] == server and name in names:
                del self._names[key]
