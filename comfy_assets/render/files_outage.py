"""How long the store's files have been failing to store outputs (``FilesOutage``): a
batch waits out an object store that is down, slow or throttling for ``files_wait_s``
(``BatchConfig``), then stops with the store's failure.

Why the batch waits, not the S3 client: the client's retries are short (seconds, for a
503 SlowDown or a dropped connection) so that one request never holds an attempt for
minutes. An outage longer than that ends the attempt as the store's failure
(``AttemptResult.file_store_fault``); its job goes back in line with backoff and, its
prompt having succeeded, takes the outputs from its server's /history when it comes back:
nothing is posted again and no GPU time is spent twice. While the store refuses
connections the servers go on rendering other jobs, whose outputs wait on the servers
likewise; a store that accepts connections and never answers holds each attempt's
download until the client's request timeout (``s3.REQUEST_TIMEOUT_S``), so a server's
consumers (``CONSUMERS_PER_SERVER``) each hold one rendered prompt meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from comfy_assets.store.files import FileStoreUnavailable


@dataclass(eq=False)
class FilesOutage:
    """Since when the store's files have failed every attempt to store a job's outputs
    (none stored and confirmed since), on ``clock`` (seconds); ``wait_s``: how long that
    may last."""

    wait_s: float
    clock: Callable[[], float] = time.monotonic
    since: float | None = field(default=None, init=False)

    def failed(self, location: str, reason: str) -> None:
        """An attempt's outputs were not stored (``reason``, for people). Raises
        FileStoreUnavailable naming ``location`` once the files have been failing for
        ``wait_s`` seconds or more."""
        now = self.clock()
        if self.since is None:
            self.since = now
        waited = now - self.since
        if waited >= self.wait_s:
            raise FileStoreUnavailable(
                f"the store's files {location} failed to store outputs for {waited:.0f} s "
                f"(files_wait_s {self.wait_s:g}); last: {reason}"
            )

    def stored(self) -> None:
        """A job's outputs were stored and confirmed: the files work again."""
        self.since = None
