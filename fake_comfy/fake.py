"""FakeComfy: the in-process API of the fake ComfyUI v0.8.0 server.

    fake = FakeComfy(script=["ok", "500"], prompt_seconds=0.01, busy=0, output_dir=None,
                     input_dir=None, models=["a.safetensors"], model_load_s=2.0, resident=1)
    async with fake.serve(port=0) as url:      # "http://127.0.0.1:PORT"
        await fake.wait_idle(5.0)
    fake.stats                                 # == GET /fake/stats
    with fake.serve_in_thread(port=0) as url:  # own loop in a daemon thread
        ...

Each `serve()` is one server life: it starts with an empty queue and history, numbers from
0 (plus `busy` prompts of another client queued first) and forgets them when it ends, as a
stopped ComfyUI does; a prompt still running then is recorded as `lost`. The script,
records, input and output files carry over, so a test can stop a server and start it
again on the same port.

Each FakeComfy has its own input folder (`input_dir`), filled by POST /upload/image and
read by LoadImage and LoadVideo, as each real server has its own (upload.json).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from aiohttp import web

from fake_comfy.executor import Executor
from fake_comfy.hub import Hub
from fake_comfy.inputs import Folders
from fake_comfy.media import OutputFolder
from fake_comfy.models import Models
from fake_comfy.records import Records
from fake_comfy.script import Script
from fake_comfy.server import build_app
from fake_comfy.state import Session
from fake_comfy.threads import serve_in_thread

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 1.0  # a socket that does not answer our close frame is cut after this


class FakeComfy:
    """A fake ComfyUI v0.8.0 server (see the module docstring).

    script: words consumed one per POST /prompt (fake_comfy.script); `self.script` is a
        list that may be appended to while serving; unknown words raise ValueError.
    prompt_seconds: time each node of a prompt takes, in seconds (the `slow` word: x10).
    busy: prompts of another client queued when a server life starts.
    output_dir: where outputs are written (a temporary folder, removed with the object,
        when None).
    input_dir: the input folder, where uploads go and LoadImage / LoadVideo read (a
        temporary folder beside the temporary output folder, removed with the object,
        when None).
    models: model files its loaders list (fake_comfy.models: ``FOLDER:NAME`` or a bare
        name); ``fake.models.set_files([...])`` changes them, as files copied to a server.
    model_load_s: seconds a loader takes for a file not loaded; resident: how many files
        stay loaded (least recently used goes). ValueError for bad values.
    default_word: the word of every POST once the script is used up (``"disk"``: a
        server whose output disk is full fails every prompt).
    """

    def __init__(
        self,
        script: Iterable[str] = (),
        prompt_seconds: float = 0.01,
        busy: int = 0,
        output_dir: str | os.PathLike[str] | None = None,
        input_dir: str | os.PathLike[str] | None = None,
        models: Iterable[str] = (),
        model_load_s: float = 0.0,
        resident: int = 1,
        default_word: str = "ok",
    ) -> None:
        if prompt_seconds < 0 or busy < 0:
            raise ValueError(f"prompt_seconds and busy must be >= 0, got {prompt_seconds}, {busy}")
        self.script = Script(script, default_word)
        self.prompt_seconds = float(prompt_seconds)
        self.busy = int(busy)
        self.records = Records()
        self.models = Models(models, model_load_s, resident)
        self._root = Path(tempfile.mkdtemp(prefix="fake_comfy_"))
        weakref.finalize(self, shutil.rmtree, self._root, ignore_errors=True)
        self.output_dir = Path(output_dir) if output_dir is not None else self._root / "output"
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self._root / "temp").mkdir()
        self.input_dir = Path(input_dir) if input_dir is not None else self._root / "input"
        self.input_dir.mkdir(parents=True, exist_ok=True)
        self._folders()
        self.port: int | None = None
        self.url: str | None = None
        self.executor = Executor(self)
        self.hub = Hub()
        self.session = Session()  # replaced for each server life by new_session()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._crash: BaseException | None = None
        self.started = asyncio.Event()  # made anew by each serve(); see pause()

    def _folders(self) -> None:
        # A new server life rescans the folders for counters, as the real one does.
        self.output = OutputFolder(self.output_dir, "output")
        self.temp = OutputFolder(self._root / "temp", "temp")
        self.input = OutputFolder(self.input_dir, "input")
        self.folders = Folders(self.input.root, self.output.root, self.temp.root)
        # ComfyUI's upload handler runs whole on its event loop: one upload at a time.
        self.upload_lock = asyncio.Lock()

    @property
    def stats(self) -> dict[str, Any]:
        """{"prompts": {prompt_id: {"posted", "executed"}}, "runs": [...], "requests": {...},
        "uploads": N, "uploaded": {name: {"count", "first", "last"}}, "posts": [...]}
        (fake_comfy.records) and "model_loads": {file: [{"prompt_id", "start", "end"}]}
        (fake_comfy.models)."""
        return {**self.records.snapshot(), "model_loads": self.models.loads()}

    def new_session(self) -> None:
        """Forgets queue, history, numbers and loaded models (a server start or the
        `restart` word)."""
        self.models.unload_all()
        self.session = Session()
        self.notify()

    def pause(self) -> None:
        """Start no new prompt (the one running goes on) until ``resume()``; prompts
        posted meanwhile wait in the queue. Safe from any thread."""
        self._on_loop(lambda: self.started.clear())

    def resume(self) -> None:
        """Start prompts again after ``pause()``. Safe from any thread."""
        self._on_loop(lambda: self.started.set())

    def _on_loop(self, call: Callable[[], object]) -> None:
        loop = self._loop
        if loop is None:
            raise RuntimeError("FakeComfy is not serving")
        loop.call_soon_threadsafe(call)

    def notify(self) -> None:
        """Wakes the waiters of wait_idle / wait_for_runs (call after any state change)."""
        changed = self._changed
        if changed is not None:
            self._changed = asyncio.Event()
            changed.set()

    # -- serving --------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serve(self, port: int = 0, host: str = "127.0.0.1") -> AsyncIterator[str]:
        """Serves on `host`:`port` (0 = a free port) and yields "http://host:port".

        Raises RuntimeError if already serving, OSError if the port cannot be bound, and,
        on exit, RuntimeError if the executor crashed (a bug of the fake).
        """
        if self._loop is not None:
            raise RuntimeError("FakeComfy is already serving")
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._crash = None
        self.started = asyncio.Event()  # cleared by pause(): no new prompt starts
        self.started.set()
        self._folders()
        self.new_session()
        self.hub = Hub()
        runner = web.AppRunner(
            build_app(self),
            access_log=None,
            handle_signals=False,
            shutdown_timeout=_CLOSE_TIMEOUT_S,
        )
        worker: asyncio.Task[None] | None = None
        try:
            await runner.setup()
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                raise
            site = web.SockSite(runner, sock)
            await site.start()
            self.port = sock.getsockname()[1]
            self.url = f"http://{host}:{self.port}"
            self.hub.start()
            worker = asyncio.create_task(self.executor.run(), name="fake_comfy executor")
            worker.add_done_callback(self._worker_done)
            self.executor.enqueue_busy(self.busy)
            log.info("fake_comfy: serving on %s", self.url)
            yield self.url
        finally:
            if worker is not None:
                await self.executor.stop(worker)
            await self.hub.close_all(_CLOSE_TIMEOUT_S)
            await self.hub.stop()
            await runner.cleanup()
            self.port = None
            self.url = None
            self._loop = None
            self.notify()
            self._changed = None
        if self._crash is not None:
            raise RuntimeError("fake_comfy: the executor crashed") from self._crash

    def _worker_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("fake_comfy: the executor crashed", exc_info=exc)
            self._crash = exc
            self.notify()

    def serve_in_thread(
        self, port: int = 0, host: str = "127.0.0.1"
    ) -> AbstractContextManager[str]:
        """`serve()` on its own event loop in a daemon thread, for synchronous callers.

        Yields the URL once the server listens; on exit stops it and joins the thread.
        Raises what `serve()` raised (in the caller's thread).
        """
        return serve_in_thread(self.serve, "fake_comfy", port, host)

    # -- waiting (tests never sleep) ----------------------------------------------

    async def wait_idle(self, timeout_s: float) -> None:
        """Waits until the queue is empty and nothing runs. Raises TimeoutError after `timeout_s` seconds, RuntimeError if not serving
        or if the executor crashed. May be awaited from another event loop."""

        def idle() -> bool:
            s = self.session
            return not s.queue and s.running is None

        await self._wait(idle, timeout_s, "idle (empty queue, nothing running)")

    async def wait_for_runs(self, n: int, timeout_s: float) -> list[dict[str, Any]]:
        """Waits until at least `n` runs have ended (have an outcome); returns all runs.
        Raises TimeoutError after `timeout_s` seconds, RuntimeError if not serving or if
        the executor crashed. May be awaited from another event loop."""
        await self._wait(lambda: self.records.ended_runs() >= n, timeout_s, f"{n} ended runs")
        return self.records.snapshot()["runs"]

    async def _wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        loop = self._loop
        if loop is None:
            raise RuntimeError("FakeComfy is not serving")
        if asyncio.get_running_loop() is not loop:
            future = asyncio.run_coroutine_threadsafe(self._wait(done, timeout_s, what), loop)
            await asyncio.wrap_future(future)
            return
        deadline = loop.time() + timeout_s
        while True:
            if self._crash is not None:
                raise RuntimeError("fake_comfy: the executor crashed") from self._crash
            changed = self._changed
            if done():
                return
            if changed is None:
                raise RuntimeError(f"fake_comfy stopped serving before {what}")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"fake_comfy: not {what} within {timeout_s} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)
