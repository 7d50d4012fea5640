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
        hub = fake.hub
        pid = item.prompt_id
        client = item.client_id
        word = item.word
        silent = word == "silent"
        session.interrupt.clear()  # PromptExecutor.execute clears a stale interrupt
        session.client_id = client
        messages: list[list[Any]] = []

        def emit(event: str, data: dict[str, Any]) -> None:
            if not silent:
                hub.send(event, data, client)

        def add_message(event: str, data: dict[str, Any], broadcast: bool) -> None:
            # PromptExecutor.add_message: kept for history; sent to the client, or to
            # everyone when broadcast and there is no client.
            data = {**data, "timestamp": now_ms()}
            messages.append([event, data])
            if client is not None or broadcast:
                emit(event, data)

        add_message("execution_start", {"prompt_id": pid}, False)
        changed = None
        if inputs_mod.needs_fingerprints(item.prompt):
            # IS_CHANGED reads files (the sha256 of an input): off the loop thread.
            changed = await asyncio.to_thread(inputs_mod.fingerprints, item.prompt, fake.folders)
        keys = session.cache.start_prompt(item.prompt, changed)
        full = word in FULL_RUN_WORDS
        cached = [] if full else [n for n in item.prompt if session.cache.get(keys[n])]
        add_message("execution_cached", {"nodes": cached, "prompt_id": pid}, False)

        info = recorded.object_info()
        output_classes = {k for k, v in info.items() if v.get("output_node") is True}
        order = execution_order(item.prompt, item.outputs, output_classes)
        trigger = min(1, len(order) - 1)  # "the second node" of the words below
        node_s = fake.prompt_seconds * (SLOW_FACTOR if word == "slow" else 1)
        ctx = nodes.SaveContext(
            fake.output, fake.temp, item.prompt, item.extra_data.get("extra_pnginfo")
        )
        results: dict[str, tuple[Any, ...]] = {}
        executed: list[str] = []
        ui_outputs: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        progress: dict[str, dict[str, Any]] = {}
        outcome = "success"

        for index, node_id in enumerate(order):
            class_type = item.prompt[node_id]["class_type"]
            steps: int | None = None  # the node reports this many steps (stepping.py)
            hit = None if full else session.cache.get(keys[node_id])
            if hit is not None:
                if hit.ui is None:
                    results[node_id] = hit.results  # read by the nodes that run
                    continue
                ui_outputs[node_id] = hit.ui
                meta[node_id] = _meta(node_id)
                if client is not None:
                    emit(
                        "executed",
                        {
                            "node": node_id,
                            "display_node": node_id,
                            "output": hit.ui,
                            "prompt_id": pid,
                        },
                    )
                progress[node_id] = _progress(pid, node_id, 1, "finished")
                emit("progress_state", {"prompt_id": pid, "nodes": dict(progress)})
                continue
            progress[node_id] = _progress(pid, node_id, 0.0, "running")
            emit("progress_state", {"prompt_id": pid, "nodes": dict(progress)})
            if client is not None:
                if not silent:  # a reconnect of a silent prompt's client learns nothing
                    session.last_node_id = node_id
                emit("executing", {"node": node_id, "display_node": node_id, "prompt_id": pid})
            if index == trigger:
                if word == "restart":
                    self._restart()
                    raise _Restarted
                if word == "drop" and client is not None:
                    hub.cut(client)
                if word == "hang":
                    await session.interrupt.wait()
                if word == "wedge":
                    await asyncio.Event().wait()  # never set: only the server's stop ends it
            if session.interrupt.is_set():
                add_message(
                    "execution_interrupted",
                    {
                        "prompt_id": pid,
                        "node_id": node_id,
                        "node_type": class_type,
                        "executed": list(executed),
                    },
                    True,
                )
                outcome = "interrupted"
                break
            inputs = {
                name: results[v[0]][int(v[1])] if is_link(v) else v
                for name, v in item.prompt[node_id]["inputs"].items()
            }
            try:
                if index == trigger and word in ("error", "oom", "cuda"):
                    raise nodes.word_failure(word)
                if word == "disk" and class_type in output_classes:
                    raise nodes.full_disk_failure()
                # The node's time passes whole: an interrupt lands only between nodes.
                await fake.models.before_node(pid, item.prompt, class_type, inputs)
                steps = stepping.steps_of(class_type, inputs)
                if steps is None:
                    await asyncio.sleep(node_s)
                else:
                    previews = class_type == "SaveImageWebsocket"
                    await stepping.report_steps(
                        emit, hub, client, pid, node_id, steps, node_s, progress, previews
                    )
                if class_type in output_classes:
                    ui = await nodes.save(class_type, inputs, ctx)
                    session.cache.set(keys[node_id], CacheEntry(ui=ui))
                else:
                    computed = sampling.compute(class_type, inputs)
                    if computed is not None:
                        results[node_id] = computed
                    elif nodes.runs_in_thread(class_type, inputs):
                        results[node_id] = await asyncio.to_thread(
                            nodes.compute, class_type, inputs, fake.folders
                        )
                    else:
                        results[node_id] = nodes.compute(class_type, inputs, fake.folders)
                    session.cache.set(keys[node_id], CacheEntry(results=results[node_id]))
            except nodes.NodeFailure as failure:
                add_message(
                    "execution_error",
                    {
                        "prompt_id": pid,
                        "node_id": node_id,
                        "node_type": class_type,
                        "executed": list(executed),
                        "exception_message": failure.exception_message,
                        "exception_type": failure.exception_type,
                        "traceback": failure.traceback,
                        "current_inputs": _current_inputs(item.prompt[node_id]["inputs"]),
                        "current_outputs": list(order),
                    },
                    False,
                )
                outcome = "error"
                break
            if class_type in output_classes and ui:  # SaveImageWebsocket's is empty
                ui_outputs[node_id] = ui
                meta[node_id] = _meta(node_id)
                if client is not None:
                    emit(
                        "executed",
                        {"node": node_id, "display_node": node_id, "output": ui, "prompt_id": pid},
                    )
            executed.append(node_id)
            if steps is not None:
                progress[node_id] = stepping.node_state(pid, node_id, steps, steps, "finished")
            else:
                progress[node_id] = _progress(pid, node_id, 1.0, "finished")
            emit("progress_state", {"prompt_id": pid, "nodes": dict(progress)})
        else:
            add_message("execution_success", {"prompt_id": pid}, False)
        session.last_node_id = None

        entry = {
            "prompt": item.as_list(),
            "outputs": ui_outputs,
            "status": {
                "status_str": "success" if outcome == "success" else "error",
                "completed": outcome == "success",
                "messages": messages,
            },
            "meta": meta,
        }
        if word == "late":
            fake.records.last_message(pid)
            await asyncio.sleep(LATE_HISTORY_S)
        session.write_history(pid, entry)
        return outcome

    def _restart(self) -> None:
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
