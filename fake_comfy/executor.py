"""The one-at-a-time prompt worker and the script words that act while a prompt runs.

Per prompt, as recorded (success.json, execution_error.json, interrupt_reconnect.json):
status (dequeued) → execution_start → execution_cached (nodes: the cached ones) → per
node that runs: progress_state (running) → executing → [interrupt check] → executed
(output nodes) → progress_state (finished) → execution_success | execution_error |
execution_interrupted → history written → status → executing with node null.

A cached node does not run (fake_comfy.cache, cache_replay.json): a cached output node
sends only `executed` with the previous run's UI output and a finished progress_state, and
writes nothing. A prompt posted with a word that acts at its second node (error, oom,
hang, drop, restart) runs in full whatever the cache holds, so the word always fires.

Routing (README fact 3, broadcast_and_missed.json): with a client_id every event goes to
that client only; without one, only progress_state and execution_interrupted are sent, to
every socket. `status` always goes to every socket.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from fake_comfy import inputs as inputs_mod
from fake_comfy import nodes, recorded, sampling, stepping
from fake_comfy.cache import CacheEntry
from fake_comfy.graph import execution_order, is_link
from fake_comfy.state import QueueItem

if TYPE_CHECKING:
    from fake_comfy.fake import FakeComfy

log = logging.getLogger(__name__)

# The `late` word: history written this long after execution_success. The prompt stays
# running in /queue meanwhile, as in ComfyUI, whose worker thread writes the history and
# takes the prompt off the queue in one step (PromptQueue.task_done) after the message.
LATE_HISTORY_S = 0.3
SLOW_FACTOR = 10  # the `slow` word: per-node time multiplier
# Words that act at a prompt's second node: such a prompt runs every node, cache or not.
FULL_RUN_WORDS = frozenset({"error", "oom", "hang", "wedge", "drop", "restart", "cuda", "disk"})

# A small workflow for the prompts of busy=N (another client's backlog).
BUSY_PROMPT: dict[str, Any] = {
    "1": {
        "class_type": "EmptyImage",
        "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 8421504},
    },
    "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "busy"}},
}


def now_ms() -> int:
    """ComfyUI's timestamps: milliseconds since the epoch."""
    return int(time.time() * 1000)


class _Restarted(Exception):
    """The `restart` word fired: the run is lost and the session was replaced."""


class Executor:
    """Runs queued prompts of `fake.session` one at a time (see the module docstring)."""

    def __init__(self, fake: FakeComfy) -> None:
        self.fake = fake
        self.busy_client_id = uuid.uuid4().hex

    # -- queueing -----------------------------------------------------------------

    def enqueue(self, item: QueueItem) -> None:
        """Queues a validated prompt and broadcasts the queue size (PromptQueue.put)."""
        session = self.fake.session
        session.push(item)
        self.fake.hub.status(session.remaining())
        self.fake.notify()

    def enqueue_busy(self, count: int) -> None:
        """Queues `count` prompts of another client (the busy=N word and option)."""
        session = self.fake.session
        for _ in range(count):
            prompt_id = str(uuid.uuid4())
            self.fake.records.known(prompt_id)
            extra = {"client_id": self.busy_client_id, "create_time": now_ms()}
            prompt = {
                k: {"class_type": v["class_type"], "inputs": dict(v["inputs"])}
                for k, v in BUSY_PROMPT.items()
            }
            item = session.item(
                session.take_number({}),
                prompt_id=prompt_id,
                prompt=prompt,
                extra_data=extra,
                outputs=["2"],
                posted=time.time(),
            )
            self.enqueue(item)

    # -- the worker loop ----------------------------------------------------------

    async def run(self) -> None:
        """Runs prompts until cancelled. A run cancelled mid-way is recorded as `lost`."""
        while True:
            await self.fake.started.wait()  # FakeComfy.pause() holds the next prompt
            session = self.fake.session
            item = session.pop()
            if item is None:
                await session.work.wait()
                continue
            await self._run_one(item)
            self.apply_free()

    def request_free(self, free_memory: bool = True, unload_models: bool = True) -> None:
        """POST /free: reset the cache (``free_memory``) and unload the models
        (``unload_models``) between two prompts (main.py prompt_worker reads the flags
        after each prompt, or at once when it is idle)."""
        session = self.fake.session
        session.free_requested = session.free_requested or free_memory
        self.fake.models.unload_requested = self.fake.models.unload_requested or unload_models
        if session.running is None and not session.queue:
            self.apply_free()

    def apply_free(self) -> None:
        session = self.fake.session
        if self.fake.models.unload_requested:
            self.fake.models.unload_all()
        if session.free_requested:
            session.free_requested = False
            session.cache.reset()

    async def _run_one(self, item: QueueItem) -> None:
        fake = self.fake
        session = fake.session
        silent = item.word == "silent"
        client = item.client_id
        fake.hub.status(session.remaining(), exclude=client if silent else None)
        run = fake.records.start(item.prompt_id, client, item.number, item.posted, item.word)
        fake.notify()
        try:
            outcome = await self._execute(item)
        except _Restarted:
            fake.records.end(run, "lost")
            fake.notify()
            return
        except (asyncio.CancelledError, Exception):
            # Stopped with the server (or a bug of the fake, re-raised): never finished.
            fake.records.end(run, "lost")
            fake.notify()
            raise
        fake.records.end(run, outcome)
        session.running = None
        fake.hub.status(session.remaining(), exclude=client if silent else None)
        if client is not None and not silent:
            fake.hub.send("executing", {"node": None, "prompt_id": item.prompt_id}, client)
        fake.notify()

    async def _execute(self, item: QueueItem) -> str:
        """Runs the nodes of `item`; returns "success", "error" or "interrupted" after
        writing the history entry (`late`: LATE_HISTORY_S after the last message, the
        prompt still running meanwhile). Raises _Restarted."""
        fake = self.fake
        session = fake.session
        session.interrupt.clear()  # PromptExecutor.execute clears a stale interrupt
        session.client_id = item.client_id
        run = _PromptRun(self, item)
        run.add_message("execution_start", {"prompt_id": item.prompt_id}, False)
        await run.start()
        outcome = await run.run_nodes()
        session.last_node_id = None
        if item.word == "late":
            fake.records.last_message(item.prompt_id)
            await asyncio.sleep(LATE_HISTORY_S)
        session.write_history(item.prompt_id, run.history_entry(outcome))
        return outcome

    def restart(self) -> None:
        """The `restart` word: cut every socket, forget queue, history and numbers."""
        log.info("fake_comfy: script word restart: cutting sockets, forgetting queue and history")
        self.fake.hub.cut(None)
        self.fake.new_session()

    async def stop(self, task: asyncio.Task[None]) -> None:
        """Cancels the worker `task` (a running prompt ends as `lost`).

        A crash of the task is not raised here: FakeComfy.serve raises it once the server
        is shut down."""
        task.cancel()
        await asyncio.wait([task])


class _PromptRun:
    """One prompt's run: the state its nodes share (results, progress, UI outputs) and the
    messages it sends, routed as the module docstring says."""

    def __init__(self, executor: Executor, item: QueueItem) -> None:
        fake = executor.fake
        self.executor = executor
        self.fake = fake
        self.session = fake.session
        self.hub = fake.hub
        self.item = item
        self.pid = item.prompt_id
        self.client = item.client_id
        self.word = item.word
        self.silent = item.word == "silent"
        self.full = item.word in FULL_RUN_WORDS
        info = recorded.object_info()
        self.output_classes = {k for k, v in info.items() if v.get("output_node") is True}
        self.order = execution_order(item.prompt, item.outputs, self.output_classes)
        self.trigger = min(1, len(self.order) - 1)  # "the second node" of the words
        self.node_s = fake.prompt_seconds * (SLOW_FACTOR if item.word == "slow" else 1)
        self.ctx = nodes.SaveContext(
            fake.output, fake.temp, item.prompt, item.extra_data.get("extra_pnginfo")
        )
        self.keys: dict[str, str] = {}
        self.messages: list[list[Any]] = []
        self.results: dict[str, tuple[Any, ...]] = {}
        self.executed: list[str] = []
        self.ui_outputs: dict[str, Any] = {}
        self.meta: dict[str, Any] = {}
        self.progress: dict[str, dict[str, Any]] = {}

    # -- messages -----------------------------------------------------------------

    def emit(self, event: str, data: dict[str, Any]) -> None:
        """Sends ``event`` to the prompt's client (to every socket without one); a
        silent prompt sends nothing."""
        if not self.silent:
            self.hub.send(event, data, self.client)

    def add_message(self, event: str, data: dict[str, Any], broadcast: bool) -> None:
        """Keeps ``event`` for the history entry and sends it as the routing says."""
        # PromptExecutor.add_message: kept for history; sent to the client, or to
        # everyone when broadcast and there is no client.
        data = {**data, "timestamp": now_ms()}
        self.messages.append([event, data])
        if self.client is not None or broadcast:
            self.emit(event, data)

    def _set_progress(self, node_id: str, state: dict[str, Any]) -> None:
        self.progress[node_id] = state
        self.emit("progress_state", {"prompt_id": self.pid, "nodes": dict(self.progress)})

    def _send_executed(self, node_id: str, ui: dict[str, Any]) -> None:
        """Keeps an output node's UI output for the history and tells the client."""
        self.ui_outputs[node_id] = ui
        self.meta[node_id] = _meta(node_id)
        if self.client is not None:
            self.emit(
                "executed",
                {"node": node_id, "display_node": node_id, "output": ui, "prompt_id": self.pid},
            )

    # -- the run ------------------------------------------------------------------

    async def start(self) -> None:
        """Reads the nodes' cache keys and sends execution_cached."""
        prompt = self.item.prompt
        changed = None
        if inputs_mod.needs_fingerprints(prompt):
            # IS_CHANGED reads files (the sha256 of an input): off the loop thread.
            changed = await asyncio.to_thread(inputs_mod.fingerprints, prompt, self.fake.folders)
        cache = self.session.cache
        self.keys = cache.start_prompt(prompt, changed)
        cached = [] if self.full else [n for n in prompt if cache.get(self.keys[n])]
        self.add_message("execution_cached", {"nodes": cached, "prompt_id": self.pid}, False)

    async def run_nodes(self) -> str:
        """Runs the nodes in order; returns "success", "error" or "interrupted"."""
        for index, node_id in enumerate(self.order):
            hit = None if self.full else self.session.cache.get(self.keys[node_id])
            if hit is not None:
                self._replay(node_id, hit)
                continue
            outcome = await self._run_node(index, node_id)
            if outcome is not None:
                return outcome
        self.add_message("execution_success", {"prompt_id": self.pid}, False)
        return "success"

    def _replay(self, node_id: str, hit: CacheEntry) -> None:
        """A cached node: its results feed the nodes that run; an output node sends its
        previous UI output and a finished progress_state (cache_replay.json)."""
        if hit.ui is None:
            self.results[node_id] = hit.results  # read by the nodes that run
            return
        self._send_executed(node_id, hit.ui)
        self._set_progress(node_id, _progress(self.pid, node_id, 1, "finished"))

    async def _run_node(self, index: int, node_id: str) -> str | None:
        """Runs one node; returns the prompt's outcome when the node ends it, else None."""
        node = self.item.prompt[node_id]
        class_type = node["class_type"]
        self._set_progress(node_id, _progress(self.pid, node_id, 0.0, "running"))
        if self.client is not None:
            if not self.silent:  # a reconnect of a silent prompt's client learns nothing
                self.session.last_node_id = node_id
            self.emit(
                "executing", {"node": node_id, "display_node": node_id, "prompt_id": self.pid}
            )
        if index == self.trigger:
            await self._act_on_word()
        if self.session.interrupt.is_set():
            self.add_message("execution_interrupted", self._failed_at(node_id, class_type), True)
            return "interrupted"
        inputs = {
            name: self.results[v[0]][int(v[1])] if is_link(v) else v
            for name, v in node["inputs"].items()
        }
        try:
            steps, ui = await self._compute(index, node_id, class_type, inputs)
        except nodes.NodeFailure as failure:
            self.add_message("execution_error", self._error(node_id, class_type, failure), False)
            return "error"
        if ui:  # output nodes only; SaveImageWebsocket's is empty
            self._send_executed(node_id, ui)
        self.executed.append(node_id)
        if steps is not None:
            state = stepping.node_state(self.pid, node_id, steps, steps, "finished")
        else:
            state = _progress(self.pid, node_id, 1.0, "finished")
        self._set_progress(node_id, state)
        return None

    async def _act_on_word(self) -> None:
        """The script words that act at the prompt's second node. Raises _Restarted."""
        word = self.word
        if word == "restart":
            self.executor.restart()
            raise _Restarted
        if word == "drop" and self.client is not None:
            self.hub.cut(self.client)
        if word == "hang":
            await self.session.interrupt.wait()
        if word == "wedge":
            await asyncio.Event().wait()  # never set: only the server's stop ends it

    async def _compute(
        self, index: int, node_id: str, class_type: str, inputs: dict[str, Any]
    ) -> tuple[int | None, dict[str, Any] | None]:
        """Runs one node's work: (the steps it reported or None, its UI output if it is an
        output node). Raises nodes.NodeFailure."""
        word = self.word
        if index == self.trigger and word in ("error", "oom", "cuda"):
            raise nodes.word_failure(word)
        if word == "disk" and class_type in self.output_classes:
            raise nodes.full_disk_failure()
        # The node's time passes whole: an interrupt lands only between nodes.
        await self.fake.models.before_node(self.pid, self.item.prompt, class_type, inputs)
        steps = stepping.steps_of(class_type, inputs)
        if steps is None:
            await asyncio.sleep(self.node_s)
        else:
            previews = class_type == "SaveImageWebsocket"
            await stepping.report_steps(
                self.emit,
                self.hub,
                self.client,
                self.pid,
                node_id,
                steps,
                self.node_s,
                self.progress,
                previews,
            )
        cache = self.session.cache
        if class_type in self.output_classes:
            ui = await nodes.save(class_type, inputs, self.ctx)
            cache.set(self.keys[node_id], CacheEntry(ui=ui))
            return steps, ui
        self.results[node_id] = await self._outputs(class_type, inputs)
        cache.set(self.keys[node_id], CacheEntry(results=self.results[node_id]))
        return steps, None

    async def _outputs(self, class_type: str, inputs: dict[str, Any]) -> tuple[Any, ...]:
        """A non-output node's outputs: sampled, or computed (in a thread if it may block)."""
        computed = sampling.compute(class_type, inputs)
        if computed is not None:
            return computed
        folders = self.fake.folders
        if nodes.runs_in_thread(class_type, inputs):
            return await asyncio.to_thread(nodes.compute, class_type, inputs, folders)
        return nodes.compute(class_type, inputs, folders)

    def _failed_at(self, node_id: str, class_type: str) -> dict[str, Any]:
        """The fields an interrupt and an error share: where the prompt stopped."""
        return {
            "prompt_id": self.pid,
            "node_id": node_id,
            "node_type": class_type,
            "executed": list(self.executed),
        }

    def _error(self, node_id: str, class_type: str, failure: nodes.NodeFailure) -> dict[str, Any]:
        """An execution_error's data (execution_error.json)."""
        return {
            **self._failed_at(node_id, class_type),
            "exception_message": failure.exception_message,
            "exception_type": failure.exception_type,
            "traceback": failure.traceback,
            "current_inputs": _current_inputs(self.item.prompt[node_id]["inputs"]),
            "current_outputs": list(self.order),
        }

    def history_entry(self, outcome: str) -> dict[str, Any]:
        """The prompt's /history entry (success.json, execution_error.json)."""
        return {
            "prompt": self.item.as_list(),
            "outputs": self.ui_outputs,
            "status": {
                "status_str": "success" if outcome == "success" else "error",
                "completed": outcome == "success",
                "messages": self.messages,
            },
            "meta": self.meta,
        }


def _meta(node_id: str) -> dict[str, Any]:
    """A history entry's `meta` of an output node (success.json)."""
    return {
        "node_id": node_id,
        "display_node": node_id,
        "parent_node": None,
        "real_node_id": node_id,
    }


def _progress(prompt_id: str, node_id: str, value: float, state: str) -> dict[str, Any]:
    """A progress_state node entry; a cached node's is `value: 1, max: 1` as integers
    (cache_replay.json), a node that ran has floats (success.json)."""
    return {
        "value": value,
        "max": 1.0 if isinstance(value, float) else 1,
        "state": state,
        "node_id": node_id,
        "prompt_id": prompt_id,
        "display_node_id": node_id,
        "parent_node_id": None,
        "real_node_id": node_id,
    }


def _current_inputs(inputs: dict[str, Any]) -> dict[str, list[Any]]:
    """`current_inputs` of an execution_error: each input as a one-item list, a linked
    IMAGE printed as a tensor (execution_error.json)."""
    return {name: [recorded.tensor_repr() if is_link(v) else v] for name, v in inputs.items()}
