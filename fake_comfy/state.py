"""What a ComfyUI process keeps in memory, lost when it crashes: queue, history, numbers,
the node output cache.

The queue is a heap ordered by `number` (README fact 1); /queue lists it in heap order as
`[number, prompt_id, prompt, extra_data, outputs_to_execute]` (three_in_a_row.json).
History maps prompt_id to the entry of the LAST run under that id; an id keeps the place
of its first run in the mapping, as a Python dict does (duplicate_prompt_id.json).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

from fake_comfy.cache import NodeCache

MAXIMUM_HISTORY_SIZE = 10000  # execution.py: the oldest entry goes beyond this


@dataclass(order=True)
class QueueItem:
    """One queued prompt. Ordered by (number, arrival) like ComfyUI's heap."""

    number: float
    seq: int
    prompt_id: str = field(compare=False)
    prompt: dict[str, Any] = field(compare=False)
    extra_data: dict[str, Any] = field(compare=False)  # {"client_id"?, "create_time": ms, ...}
    outputs: list[str] = field(compare=False)  # outputs_to_execute
    word: str = field(compare=False, default="ok")  # the script word it was posted with
    posted: float = field(compare=False, default=0.0)  # seconds since the epoch

    @property
    def client_id(self) -> str | None:
        """The client_id it was posted with (None: its events go nowhere or everywhere)."""
        return self.extra_data.get("client_id")

    def as_list(self) -> list[Any]:
        """ComfyUI's tuple: [number, prompt_id, prompt, extra_data, outputs_to_execute]."""
        return [self.number, self.prompt_id, self.prompt, self.extra_data, self.outputs]


class Session:
    """Queue, running prompt, history and counters of one server life."""

    def __init__(self) -> None:
        self.number = 0  # next number for a POST without "number"
        self._seq = itertools.count()
        self.queue: list[QueueItem] = []
        self.running: QueueItem | None = None
        self.history: dict[str, dict[str, Any]] = {}
        self.client_id: str | None = None  # client of the last prompt started
        self.last_node_id: str | None = None  # node being executed (for reconnects)
        self.interrupt = asyncio.Event()  # set by /interrupt; checked before each node
        self.work = asyncio.Event()  # set when the queue may have an item
        self.cache = NodeCache()  # node outputs shared by consecutive prompts
        self.free_requested = False  # POST /free free_memory, applied between prompts

    def take_number(self, body: dict[str, Any]) -> float:
        """The number of a POST /prompt body: its "number" if given, else the next counter
        value (negated when "front" is true), as server.py post_prompt does."""
        if "number" in body:
            return float(body["number"])
        number: float = self.number
        if body.get("front"):
            number = -number
        self.number += 1
        return number

    def item(self, number: float, **fields: Any) -> QueueItem:
        """A QueueItem with the next arrival sequence (ties between equal numbers)."""
        return QueueItem(number, next(self._seq), **fields)

    def remaining(self) -> int:
        """`queue_remaining`: pending plus running."""
        return len(self.queue) + (1 if self.running is not None else 0)

    def push(self, item: QueueItem) -> None:
        heapq.heappush(self.queue, item)
        self.work.set()

    def pop(self) -> QueueItem | None:
        """The next prompt to run, marked running; None if the queue is empty."""
        if not self.queue:
            self.work.clear()
            return None
        self.running = heapq.heappop(self.queue)
        return self.running

    def delete(self, prompt_id: str) -> bool:
        """Removes the first pending item with `prompt_id` (not a running one)."""
        for index, item in enumerate(self.queue):
            if item.prompt_id == prompt_id:
                self.queue.pop(index)
                heapq.heapify(self.queue)
                return True
        return False

    def write_history(self, prompt_id: str, entry: dict[str, Any]) -> None:
        if prompt_id not in self.history and len(self.history) > MAXIMUM_HISTORY_SIZE:
            self.history.pop(next(iter(self.history)))
        self.history[prompt_id] = entry

    def history_page(self, max_items: int | None, offset: int) -> dict[str, Any]:
        """PromptQueue.get_history without an id: `max_items` entries from `offset`
        (offset < 0 with max_items: the last max_items)."""
        if offset < 0 and max_items is not None:
            offset = len(self.history) - max_items
        out: dict[str, Any] = {}
        for index, (key, entry) in enumerate(self.history.items()):
            if index >= offset:
                out[key] = entry
                if max_items is not None and len(out) >= max_items:
                    break
        return out
