"""A job whose handling raises in our own code: that job's failure, never the batch's.

Whatever our code raises while one job is handled (encoding its prompt, writing its row,
a reason, a file name) is the job's: it becomes a dead letter whose reason says so
(``our error while handling this job: UnicodeEncodeError: ...``), with the traceback in
the log for whoever fixes the bug, and the batch goes on to its summary and results.csv.
An attempt that raises so returns a permanent result (``Attempt.run``, its prompt removed
first); a job whose result cannot be recorded is dead-lettered by ``Settler.settle``
(``render/settle.py``).

Not the job's, and so raised as before (``stops_the_batch``): a cancellation, Ctrl+C and
an exit (not ``Exception``\\ s); the store unreachable or full (``StoreUnavailable``,
its files' ``FileStoreUnavailable`` and ``FileStoreFull``), a
database error that is not about a value (``OperationalError``, ``InterfaceError``),
our disk (an ``OSError`` other than a name the file system refuses), no memory; no
server reachable or able to run the job, a claim lost, a batch that stopped first (the
batch's own ways to stop or hand a job over).
"""

from __future__ import annotations

import errno

import sqlalchemy.exc

from comfy_assets.comfy.errors import NoServerCanRun, NoServerReachable
from comfy_assets.comfy.types import excerpt
from comfy_assets.render.outcome import NotPosted
from comfy_assets.store import ClaimLost, StoreUnavailable
from comfy_assets.store.files import FileStoreFull, FileStoreUnavailable

# What stops a batch or hands a job over on purpose, whatever job it is raised for.
_NOT_THE_JOBS = (
    StoreUnavailable,
    FileStoreUnavailable,
    FileStoreFull,
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
