"""``Spool``: the bytes of one output while they are read and hashed, in memory up to a
size, then in a local temporary file; removed when closed."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from comfy_assets.comfy.download import OutputNotWritten


class Spool:
    """Collects written bytes (``write``), their ``size`` and (``finish``) SHA-256: in ``data``
    while they are at most ``memory_max`` bytes, past that in the file ``path`` (in
    ``folder``, default the system's temporary folder; ``path`` stays None until then).
    A context manager: the file is deleted at its end. ``write`` raises OutputNotWritten (an
    OSError naming the file) for the local disk's refusal."""

    def __init__(self, memory_max: int, folder: Path | None = None) -> None:
        self.memory_max = memory_max
        self.folder = folder
        self.size = 0
        self.data = bytearray()
        self.path: Path | None = None
        self._file: BinaryIO | None = None
        self._digest = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        try:
            self._write(chunk)
        except OSError as e:
            raise _not_written(e, self.path) from e

    def _write(self, chunk: bytes) -> None:
        self._digest.update(chunk)
        self.size += len(chunk)
        if self._file is None and self.size > self.memory_max:
            fd, name = tempfile.mkstemp(prefix=".comfy-assets-", suffix=".part", dir=self.folder)
            self.path = Path(name)
            self._file = os.fdopen(fd, "wb")
            self._file.write(self.data)
            self.data = bytearray()
        if self._file is None:
            self.data += chunk
        else:
            self._file.write(chunk)

    def finish(self) -> str:
        """The hex SHA-256 of all the bytes written, the file (if any) complete on disk.
        Raises OutputNotWritten when the disk refuses the last of them."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError as e:
                raise _not_written(e, self.path) from e
        return self._digest.hexdigest()

    def __enter__(self) -> Spool:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._file is not None:
            self._file.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def _not_written(error: OSError, path: Path | None) -> OutputNotWritten:
    where = path or Path(tempfile.gettempdir())
    not_written = OutputNotWritten(error.errno, error.strerror, str(where))
    not_written.what = "spool file"
    return not_written
