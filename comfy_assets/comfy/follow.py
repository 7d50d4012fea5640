"""Following one prompt to its end: the socket for speed, /history for the truth.

The socket must be open before the prompt is posted (events go to the clientId's socket
only and are not replayed), so the shape is::

    async with PromptFollower(client, client_id, poll_s=1.0) as follower:
        post = await client.post_prompt(workflow, prompt_id=pid, client_id=client_id)
        outcome = await follower.wait(pid, post.number, deadline_s=600.0)

Facts it lives with (data/recorded/, README):
- events carry a prompt_id but no run number, and a prompt queued without client_id
  broadcasts its ``execution_interrupted`` to every socket (broadcast_and_missed.json):
  filter by prompt_id, and count a terminal event only after our ``execution_start``;
- a reconnect with the same clientId replays nothing; a finish missed while disconnected
  is only in /history (interrupt_reconnect.json, broadcast_and_missed.json);
- /history keeps the last run of a prompt_id: accept only ``prompt[0] == number``
  (duplicate_prompt_id.json); it may lag ``execution_success`` (README fact 5), but is
  written before ``executing`` with ``node: null``, and the prompt stays in /queue until
  it is (PromptQueue.task_done);
- after a restart the prompt is in neither /queue nor /history: lost (restart.json).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, Self

import websockets
from websockets.asyncio.client import ClientConnection

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import (
    ComfyError,
    ConnectionLost,
    DeadlineExceeded,
    PromptLost,
    PromptStalled,
    RequestTimeout,
    ServerUnreachable,
    UnexpectedAnswer,
)
from comfy_assets.comfy.progress import PROGRESS_KINDS, PromptProgress
from comfy_assets.comfy.types import ExecutionErrorInfo, HistoryEntry, Outcome

_TERMINAL = frozenset({"execution_success", "execution_error", "execution_interrupted"})
_PLAIN_ERRORS = (ServerUnreachable, ConnectionLost, RequestTimeout)  # (message, server=)
_MAX_BUFFERED_PROMPTS = 1024  # prompt ids whose events are kept before anyone waits
_RECONNECT_FIRST_S = 0.05

log = logging.getLogger("comfy_assets.comfy.follow")


@dataclass(frozen=True)
class PromptOutcome:
    """How a prompt ended. ``history`` is the run's /history entry (always there for
    ``success``; None when the socket alone told an error or interrupt). ``reconnects``
    counts socket reconnects during the wait."""

    status: Outcome
    history: HistoryEntry | None
    error: ExecutionErrorInfo | None
    reconnects: int


@dataclass
class _Run:
    """What one ``wait`` knows about its run."""

    prompt_id: str
    number: int
    started: bool = False  # saw our execution_start
    finished: bool = False  # the server is done with it (on_finished called)
    ended_hint: bool = False  # some terminal event for this prompt_id arrived
    last_seen: str = "not yet seen"
    trouble_since: float | None = None  # loop time the server stopped answering


@dataclass(eq=False)
class PromptFollower:
    """One socket (``/ws?clientId=``) kept open, reconnected with the same clientId after
    a drop (capped exponential backoff, ``reconnect_max_s`` seconds), and ``wait`` for one
    prompt at a time or several concurrently. ``poll_s`` (seconds) is the /history poll
    period. ``give_up_s``: a server that answers nothing for this long (seconds) is given
    up on (the recorded restart refused connections for ~11 s: restart.json). Entering
    raises the client's typed errors when the socket cannot be opened.
    """

    client: ComfyClient
    client_id: str
    _: KW_ONLY
    poll_s: float = 1.0
    reconnect_max_s: float = 2.0
    give_up_s: float = 30.0

    def __post_init__(self) -> None:
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._events: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        self._wakers: dict[str, set[asyncio.Event]] = {}
        self._drops = 0
        self._reconnects = 0
        self._last_message_at = 0.0
        self._last_drop = ""
        # Why opening the socket again failed, since its drop (None while open, or
        # before a reopen failed): the server is unreachable for us meanwhile.
        self._reopen_failed: str | None = None
        self._fatal: ComfyError | None = None
        self._fatal_raised = False
        # The server's queue as the socket tells it: `status` goes to every socket on
        # every queue change (README fact 3), with queue_remaining = running + pending.
        self._queue_remaining: int | None = None
        self._ended_since_status: set[str] = set()
        # How far each prompt we wait for (or whose start came first) is: progress.py.
        self._progress: dict[str, PromptProgress] = {}

    def progress(self, prompt_id: str) -> PromptProgress | None:
        """How far ``prompt_id`` is, as the socket told it while someone waits for it
        (``comfy/progress.py``); None when nothing was heard of it."""
        return self._progress.get(prompt_id)

    @property
    def connected(self) -> bool:
        return self._ws is not None

    def lost(self) -> str | None:
        """Why the server can't be reached now, by this socket: it dropped and opening it
        again failed (the last failure's text); None while it is open, and between a
        drop and the first try to reopen it."""
        return None if self._ws is not None else self._reopen_failed

    @property
    def failed(self) -> bool:
        """True once the socket met a permanent error: open a new follower."""
        return self._fatal is not None

    async def close(self) -> None:
        """Close the socket, without raising what it failed with (see ``failed``)."""
        self._fatal_raised = True
        await self.__aexit__(None, None, None)

    def queue_remaining(self) -> int | None:
        """Prompts on the server (running + pending) that have not ended, as the socket
        last told it; None while disconnected or before the first ``status``.

        ``queue_remaining`` of the last ``status`` message, less the prompts whose end
        arrived since: ComfyUI broadcasts ``status`` only after it has written a finished
        prompt's history (success.json), so for a moment the count still holds it.
        """
        if self._ws is None or self._queue_remaining is None:
            return None
        return max(self._queue_remaining - len(self._ended_since_status), 0)

    @property
    def reconnects(self) -> int:
        """Socket reconnects since the follower opened."""
        return self._reconnects

    async def __aenter__(self) -> Self:
        self._ws = await self.client.connect_ws(self.client_id)
        self._last_message_at = asyncio.get_running_loop().time()
        self._reader = asyncio.create_task(self._read_forever(), name=f"ws {self.client_id}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        reader, self._reader = self._reader, None
        ws, self._ws = self._ws, None
        try:
            if reader is not None:
                reader.cancel()
                await asyncio.wait([reader])  # its own outcome is already recorded
        finally:
            if ws is not None:  # also on cancellation: no socket left half-open
                await ws.close()
        if self._fatal is not None and not self._fatal_raised and exc_info[0] is None:
            raise self._fatal  # the socket failed and no wait() has said so yet

    # -- waiting ----------------------------------------------------------------------

    async def wait(
        self,
        prompt_id: str,
        number: int,
        *,
        deadline_s: float = 600.0,
        stall_s: Callable[[], float | None] | None = None,
        on_finished: Callable[[], object] | None = None,
        then: Callable[[], Awaitable[object]] | None = None,
    ) -> PromptOutcome:
        """Wait until run ``number`` of ``prompt_id`` ends; works for a prompt posted
        through this follower's clientId or one found queued/running during catch-up.

        ``on_finished`` is called once, as soon as the server is done with the run (a
        terminal event after our execution_start, or its history entry), before this
        returns. ``then`` is awaited once right after it, before /history is asked for
        the finished run: the server's next prompt (the pool's hand-over) goes first, and
        neither our request nor the server's answer stands in its way. Raises PromptLost
        when the run is in neither /queue nor /history,
        DeadlineExceeded after ``deadline_s`` seconds (interrupt it yourself),
        PromptStalled when the run has started and nothing was heard of it for the
        seconds ``stall_s()`` answers, asked at each look (None: never),
        UnexpectedAnswer (or another permanent ComfyError) for answers not understood.
        Transient server trouble (refused, reset, 5xx) is retried until the deadline.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        run = _Run(prompt_id, number)
        reconnects_at_start = self._reconnects
        waker = asyncio.Event()
        self._wakers.setdefault(prompt_id, set()).add(waker)
        cursor = 0
        check_now = False
        next_poll = loop.time() + self.poll_s
        seen_drops, seen_reconnects = self._drops, self._reconnects
        suspect = False  # the server may have forgotten the prompt: ask /queue
        then_done = then is None
        heard_at = loop.time()  # the last message about our prompt (or the start)

        def finish(
            status: Outcome, history: HistoryEntry | None, error: ExecutionErrorInfo | None
        ) -> PromptOutcome:
            self._mark_finished(run, on_finished)
            return PromptOutcome(status, history, error, self._reconnects - reconnects_at_start)

        try:
            while True:
                waker.clear()
                if self._fatal is not None:
                    self._fatal_raised = True
                    raise self._fatal
                before = cursor
                cursor, decided, written = self._take_events(run, cursor, on_finished)
                if cursor > before:
                    heard_at = loop.time()
                if decided is not None:
                    status, error = decided
                    return finish(status, None, error)
                check_now = check_now or written
                if self._drops != seen_drops or not self.connected:
                    seen_drops = self._drops
                    suspect = True
                if self._reconnects != seen_reconnects:
                    seen_reconnects = self._reconnects
                    check_now = True  # a finish missed while disconnected is only in /history
                if run.finished and not then_done:
                    then_done = True
                    await then()  # type: ignore[misc]
                    continue  # events may have come meanwhile

                now = loop.time()
                if now >= deadline:
                    raise self._deadline(run, deadline_s)
                self._check_stall(run, stall_s, now - heard_at)
                if check_now or now >= next_poll:
                    if now >= next_poll:
                        next_poll = now + self.poll_s
                    check_now = False
                    silent = now - self._last_message_at >= self.poll_s
                    result = await self._check(run, suspect or silent, deadline, deadline_s)
                    if isinstance(result, HistoryEntry):
                        return finish(result.outcome, result, result.error)
                    suspect = result
                    continue
                try:
                    async with asyncio.timeout(min(next_poll, deadline) - now):
                        await waker.wait()
                except TimeoutError:
                    pass  # time to poll (or the deadline): the loop decides
        finally:
            self._forget_waker(prompt_id, waker)

    def _forget_waker(self, prompt_id: str, waker: asyncio.Event) -> None:
        """A ``wait`` for ``prompt_id`` is over: once none is left, its events and
        progress go too."""
        wakers = self._wakers.get(prompt_id)
        if wakers is not None:
            wakers.discard(waker)
            if not wakers:
                del self._wakers[prompt_id]
                self._events.pop(prompt_id, None)
                self._progress.pop(prompt_id, None)

    def _take_events(
        self, run: _Run, cursor: int, on_finished: Callable[[], object] | None
    ) -> tuple[int, tuple[Outcome, ExecutionErrorInfo | None] | None, bool]:
        """Apply the events of ``run``'s prompt from ``cursor`` on: the next cursor, the
        (status, error) once one decides, and whether its history is (about to be)
        written (a terminal event or ``executing``)."""
        events = self._events.get(run.prompt_id, ())
        written = False
        while cursor < len(events):
            kind, data = events[cursor]
            cursor += 1
            decided = self._on_event(run, kind, data, on_finished)
            if decided is not None:
                return cursor, decided, written
            if kind in _TERMINAL or kind == "executing":
                written = True
        return cursor, None, written

    def _check_stall(
        self, run: _Run, stall_s: Callable[[], float | None] | None, silent_s: float
    ) -> None:
        """Raise PromptStalled when ``run`` has started and nothing was heard of it for
        ``silent_s`` seconds, at least what ``stall_s()`` answers (None: never)."""
        running = run.started or run.last_seen == "running"
        stall = stall_s() if stall_s is not None and running else None
        if stall is not None and silent_s >= stall:
            raise PromptStalled(
                f"{self.client.name}: prompt {run.prompt_id} run {run.number} running, and "
                f"nothing heard of it for {silent_s:.0f} s",
                server=self.client.base_url,
            )

    def _on_event(
        self,
        run: _Run,
        kind: str,
        data: dict[str, Any],
        on_finished: Callable[[], object] | None,
    ) -> tuple[Outcome, ExecutionErrorInfo | None] | None:
        """Apply one event of our prompt_id; return (status, error) when it decides."""
        if kind == "execution_start":
            run.started = True
            run.last_seen = "running"
            return None
        if kind not in _TERMINAL:
            return None
        run.ended_hint = True
        if not run.started:
            return None  # maybe another run of this prompt_id: let /history confirm
        if kind == "execution_error":
            return "error", ExecutionErrorInfo.from_json(data)
        if kind == "execution_interrupted":
            return "interrupted", None
        run.last_seen = "finished, waiting for /history"
        self._mark_finished(run, on_finished)
        return None

    @staticmethod
    def _mark_finished(run: _Run, on_finished: Callable[[], object] | None) -> None:
        if not run.finished:
            run.finished = True
            if on_finished is not None:
                on_finished()

    async def _check(
        self, run: _Run, suspect: bool, deadline: float, deadline_s: float
    ) -> HistoryEntry | bool:
        """Poll /history; when suspect, also /queue then /history again (in that order:
        a prompt leaves the queue only once its history is written, so no finish falls
        between the two). A run whose terminal event arrived but whose history did not
        is still in /queue until the history is written (ComfyUI's task_done does both
        at once), so a server that restarted in between is seen to have forgotten it.
        Returns the run's entry, or whether the server is still suspect. Raises
        PromptLost, DeadlineExceeded."""
        try:
            async with asyncio.timeout_at(deadline):
                entry = await self.client.history(run.prompt_id)
                if run.trouble_since is not None:  # it answers again
                    log.warning(
                        "%s: answers again after %.0f s; following prompt %s",
                        self.client.name,
                        asyncio.get_running_loop().time() - run.trouble_since,
                        run.prompt_id,
                    )
                    run.trouble_since = None
                if entry is not None and entry.number == run.number:
                    return entry
                if not suspect:
                    return False  # history may lag the terminal event: keep polling
                queue = await self.client.queue()
                found = queue.find(run.prompt_id, run.number)
                if found is not None:
                    run.last_seen = "running" if found in queue.running else "pending"
                    return False
                entry = await self.client.history(run.prompt_id)
                if entry is not None and entry.number == run.number:
                    return entry
        except TimeoutError:
            raise self._deadline(run, deadline_s) from None
        except ComfyError as exc:
            if not exc.transient:
                raise
            now = asyncio.get_running_loop().time()
            if run.trouble_since is None:
                run.trouble_since = now
                # Said once per outage: a server cut off mid-prompt is otherwise silent.
                log.warning(
                    "%s: no answer while prompt %s is there (%s); still following it, for up "
                    "to %.0f s",
                    self.client.name,
                    run.prompt_id,
                    exc.message,
                    self.give_up_s,
                )
            elif now - run.trouble_since >= self.give_up_s:
                if type(exc) not in _PLAIN_ERRORS:
                    raise
                silent_s = now - run.trouble_since
                raise type(exc)(
                    f"{exc.message}; no answer for {silent_s:.0f} s, given up", server=exc.server
                ) from exc
            run.last_seen = f"server trouble: {exc.message}"
            return True  # ask /queue as soon as it answers again
        other = "" if entry is None else f" (history holds run {entry.number})"
        raise PromptLost(
            f"{self.client.name}: prompt {run.prompt_id} run {run.number} is in neither "
            f"/queue nor /history{other}: the server forgot it",
            server=self.client.base_url,
        )

    def _deadline(self, run: _Run, deadline_s: float) -> DeadlineExceeded:
        socket = "socket open" if self.connected else f"socket down: {self._last_drop}"
        return DeadlineExceeded(
            f"{self.client.name}: prompt {run.prompt_id} run {run.number} not finished "
            f"after {deadline_s:g} s (last seen: {run.last_seen}; {socket})",
            server=self.client.base_url,
        )

    # -- the socket -------------------------------------------------------------------

    async def _read_forever(self) -> None:
        """Read messages; on a drop reconnect with the same clientId until cancelled.
        The backoff resets only once a socket delivered a message (ComfyUI sends
        ``status`` at once), so a server that accepts and drops is not hammered."""
        delay = _RECONNECT_FIRST_S
        while True:
            ws = self._ws
            if ws is None:
                try:
                    ws = await self.client.connect_ws(self.client_id)
                except ComfyError as exc:
                    if not exc.transient:
                        self._fail(exc)
                        return
                    self._reopen_failed = str(exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.reconnect_max_s)
                    continue
                self._ws = ws
                self._reopen_failed = None
                self._reconnects += 1
                self._last_message_at = asyncio.get_running_loop().time()
                self._wake_all()
            received = False
            try:
                async for raw in ws:
                    received = True
                    if not self._on_message(raw):
                        return
                self._last_drop = "closed by the server"
            except websockets.ConnectionClosed as exc:
                self._last_drop = str(exc)
            self._ws = None
            self._queue_remaining = None  # the next socket's first `status` tells again
            self._drops += 1
            self._wake_all()
            if received:
                delay = _RECONNECT_FIRST_S
            else:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.reconnect_max_s)

    def _on_message(self, raw: str | bytes) -> bool:
        """Buffer terminal-ish events by prompt_id. False after a fatal error."""
        self._last_message_at = asyncio.get_running_loop().time()
        if isinstance(raw, bytes):
            return True  # binary preview frames
        try:
            message = json.loads(raw)
            kind = message["type"]
            data = message.get("data") or {}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            # RecursionError: json's decoder stops near 1,000 levels of nesting.
            self._fail(
                UnexpectedAnswer(
                    f"{self.client.name}: WS /ws: message not understood ({exc}): {raw[:200]!r}",
                    server=self.client.base_url,
                )
            )
            return False
        if not isinstance(data, dict):
            return True
        if kind == "status":
            self._on_status(data)
            return True
        prompt_id = data.get("prompt_id")
        if prompt_id is None:
            return True  # executing replayed on reconnect without prompt_id
        if kind in _TERMINAL:
            self._ended_since_status.add(prompt_id)
        if kind in PROGRESS_KINDS:
            self._on_progress(prompt_id, kind, data)
        if kind == "executing":
            if data.get("node") is not None:
                return True  # progress: only node=null (history written) matters
        elif kind != "execution_start" and kind not in _TERMINAL:
            return True
        events = self._events.get(prompt_id)
        if events is None:
            self._evict_unwatched()
            events = self._events[prompt_id] = []
        events.append((kind, data))
        for waker in self._wakers.get(prompt_id, ()):
            waker.set()
        return True

    def _on_progress(self, prompt_id: str, kind: str, data: dict[str, Any]) -> None:
        """Keep how far ``prompt_id`` is, for a prompt someone waits for or that started
        before its wait began (bounded like the events buffer)."""
        tracker = self._progress.get(prompt_id)
        if tracker is None:
            if kind != "execution_start" and prompt_id not in self._wakers:
                return
            tracker = self._progress[prompt_id] = PromptProgress(str(prompt_id))
        tracker.apply(kind, data)

    def _on_status(self, data: dict[str, Any]) -> None:
        """Keep ``status.exec_info.queue_remaining`` (three_in_a_row.json shows it)."""
        info = (data.get("status") or {}).get("exec_info") or {}
        remaining = info.get("queue_remaining")
        if isinstance(remaining, int) and not isinstance(remaining, bool):
            self._queue_remaining = remaining
            self._ended_since_status.clear()

    def forget(self, prompt_id: str) -> None:
        """Drop the buffered events of ``prompt_id``, unless someone waits for them.

        Called before the prompt is posted again: events carry no run number, so the
        ``execution_start`` and terminal event of an earlier run nobody followed to its
        end (removed after a POST whose answer was lost, say) would end the new run's
        ``wait`` at once."""
        if prompt_id not in self._wakers:
            self._events.pop(prompt_id, None)
            self._progress.pop(prompt_id, None)

    def _evict_unwatched(self) -> None:
        """Bound the buffer: forget the oldest prompt ids nobody waits for (foreign
        broadcasts, runs whose wait already returned)."""
        if len(self._events) < _MAX_BUFFERED_PROMPTS:
            return
        for prompt_id in list(self._events)[: _MAX_BUFFERED_PROMPTS // 4]:
            if prompt_id not in self._wakers:
                del self._events[prompt_id]
                self._progress.pop(prompt_id, None)

    def _fail(self, exc: ComfyError) -> None:
        self._fatal = exc
        self._wake_all()

    def _wake_all(self) -> None:
        for wakers in self._wakers.values():
            for waker in wakers:
                waker.set()
