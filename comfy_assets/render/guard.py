"""A job whose handling raises in our own code: that job's failure, never the batch's.

Whatever our code raises while one job is handled (encoding its prompt, writing its row,
a reason, a file name) is the job's: it becomes a dead letter whose reason says so
(``our error while handling this job: UnicodeEncodeError: ...``), with the traceback in
the log for whoever fixes the bug, and the batch goes on to its summary and results.csv.
An attempt that raises so returns a permanent result (``Attempt.run``, its prompt removed
first); a job whose result cannot be recorded is dead-lettered by ``JobGuard._broke``.

Not the job's, and so raised as before (``stops_the_batch``): a cancellation, Ctrl+C and
an exit (not ``Exception``\\ s); the store unreachable or full (``StoreUnavailable``), a
database error that is not about a value (``OperationalError``, ``InterfaceError``),
our disk (an ``OSError`` other than a name the file system refuses), no memory; no
server reachable or able to run the job, a claim lost, a batch that stopped first (the
batch's own ways to stop or hand a job over).
"""

from __future__ import annotations

import errno
import logging
from typing import Any

import sqlalchemy.exc

from comfy_assets.comfy.errors import NoServerCanRun, NoServerReachable
from comfy_assets.comfy.types import excerpt
from comfy_assets.render.outcome import NotPosted
from comfy_assets.render.queue import Item
from comfy_assets.store import ClaimLost, StoreUnavailable

log = logging.getLogger("comfy_assets.render.guard")

# What stops a batch or hands a job over on purpose, whatever job it is raised for.
_NOT_THE_JOBS = (
    StoreUnavailable,
    NoServerReachable,
    NoServerCanRun,
    ClaimLost,
    NotPosted,
    MemoryError,
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
)
# An OSError about the name of one job's file (too long, not encodable, refused): the
# job's. Any other (no space, read-only, no permission, an I/O error) is our disk's.
_NAME_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.EILSEQ, errno.EINVAL})


def stops_the_batch(error: BaseException) -> bool:
    """True when ``error``, raised while one job was handled, is not that job's failure
    (see the module docstring) and must be raised on; False when it is the job's."""
    if not isinstance(error, Exception) or isinstance(error, _NOT_THE_JOBS):
        return True
    return isinstance(error, OSError) and error.errno not in _NAME_ERRNOS


def our_error(error: BaseException) -> str:
    """The reason of a job whose handling raised ``error`` in our code, for people:
    ``our error while handling this job: UnicodeEncodeError: ...``, bounded and with
    anything no store or terminal takes escaped (``comfy.types.excerpt``), so writing it
    cannot fail the way the handling did."""
    return f"our error while handling this job: {type(error).__name__}: {excerpt(str(error))}"


class JobGuard:
    """``_settle_guarded``: an attempt's result recorded, or, when recording it raises
    what is the job's, the job dead-lettered with our error as its reason (a part of
    ``Batch``)."""

    store: Any
    owner: str
    claims: Any
    stop_on_fatal: bool
    stopped: str | None
    _db: Any
    report: Any
    _resolve: Any
    _settle: Any
    _write_dead_letter: Any

    async def _settle_guarded(self, item: Item, attempt_number: int, result: Any) -> None:
        """``_settle(item, attempt_number, result)`` (``render/settle.py``); what it
        raises that is the job's (``stops_the_batch`` False) makes the job a dead letter
        (``_broke``), the rest is raised."""
        try:
            await self._settle(item, attempt_number, result)
        except Exception as e:
            if stops_the_batch(e):
                raise
            await self._broke(item, attempt_number, e)

    async def _broke(self, item: Item, attempt_number: int, error: Exception) -> None:
        """Recording attempt ``attempt_number`` of ``item`` raised ``error``, the job's
        (``stops_the_batch`` is False): the job is a dead letter with ``our_error`` as its
        reason, written alone (no attempt row, nothing of the attempt's result). When even
        that cannot be written (the store answers with something other than an outage),
        the job is resolved as its record stands, said in a line. Raises what
        ``stops_the_batch`` says is not the job's."""
        job_id = item.job.id
        reason = our_error(error)
        log.error("job %s: %s", job_id, reason, exc_info=error)
        self.claims.finishing_now(job_id)
        try:
            await self._write_dead_letter(job_id, reason, attempt=attempt_number)
        except Exception as again:
            if stops_the_batch(again):
                raise
            rec = await self._db(self.store.get, job_id)
            state = rec.state if rec is not None else "missing"
            self.claims.release(job_id)
            self.report(
                f"job {job_id}: {reason}; its dead letter not written either "
                f"({our_error(again)}); left {state}"
            )
            ended = {"failed_fatal": "dead_lettered", "succeeded": "done", "degraded": "degraded"}
            self._resolve(ended.get(state, "not_run"), job_id)
            return
        self.claims.finished(job_id)
        self.report(f"job {job_id}: dead-lettered, {reason}")
        if self.stop_on_fatal and not self.stopped:
            self.stopped = f"stopped after the fatal failure of job {job_id}: {reason}"
            self.report(f"delivery policy: {self.stopped}; no new shots are submitted")
        self._resolve("dead_lettered", job_id)
