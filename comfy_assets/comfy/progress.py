"""How far a running prompt is, from what ComfyUI sends on its socket.

What a real ComfyUI v0.8.0 sends (data/recorded/progress.json, README fact 13):

- ``execution_start`` ``{prompt_id}``, then ``execution_cached`` ``{nodes: [...]}`` with the
  nodes it will not run;
- per node it runs: ``progress_state`` (the node ``running``), ``executing``
  ``{node, display_node, prompt_id}``, for a node that reports steps a ``progress_state``
  and a ``progress`` ``{value, max, prompt_id, node}`` per ProgressBar update (a
  sampler's callback gives step + 1 of its steps: ``latent_preview.py``), and a last
  ``progress_state`` with the node ``finished``;
- ``progress_state`` ``{prompt_id, nodes: {id: {value, max, state, ...}}}`` lists every
  node seen so far each time;
- ``executing`` with ``node: null`` once the prompt is over.

``PromptProgress`` keeps what those say; ``describe`` turns it into
``node 3/7 KSampler, step 14/20`` with the prompt's workflow (the class names).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

# The socket messages the follower gives ``PromptProgress``: ``progress_state`` says
# nothing that ``executing`` and ``execution_cached`` have not (a node is done once the
# next one starts), and is the most frequent of them, so the follower leaves it out.
PROGRESS_KINDS = frozenset({"execution_start", "execution_cached", "executing", "progress"})


@dataclass
class PromptProgress:
    """What the socket said of one prompt so far. ``node``: the node executing now (None
    before the first and after the last); ``value``/``max``: its last ``progress``
    (steps), when it reports any; ``done``: nodes finished or cached; ``ended``: the
    ``executing`` with ``node: null`` came. ``updated_at``: ``time.monotonic()`` of the
    last message (seconds)."""

    prompt_id: str
    started: bool = False
    node: str | None = None
    value: int | None = None
    max: int | None = None
    done: set[str] = field(default_factory=set)
    ended: bool = False
    updated_at: float = 0.0

    def apply(self, kind: str, data: Mapping[str, Any]) -> None:
        """Take one socket message of this prompt (``kind`` in ``PROGRESS_KINDS``, or
        ``progress_state``).
        Fields of the wrong type are ignored: a hostile or broken server can make the
        line wrong, never make it raise."""
        self.updated_at = time.monotonic()
        if kind == "execution_start":
            self.started = True
        elif kind == "execution_cached":
            nodes = data.get("nodes")
            if isinstance(nodes, list):
                self.done.update(str(n) for n in nodes)
        elif kind == "executing":
            node = data.get("node")
            if node is None:
                self.ended, self.node = True, None
            elif node != self.node:
                if self.node is not None:
                    self.done.add(self.node)
                self.node, self.value, self.max = str(node), None, None
        elif kind == "progress":
            self._step(data)
        elif kind == "progress_state":
            self._finished_nodes(data.get("nodes"))

    def _step(self, data: Mapping[str, Any]) -> None:
        """A ``progress`` message: the node it names (when another than the last) and
        its step."""
        value, top = data.get("value"), data.get("max")
        node = data.get("node")
        if node is not None and str(node) != self.node:
            if self.node is not None:
                self.done.add(self.node)
            self.node = str(node)
        if _number(value) and _number(top):
            self.value, self.max = int(value), int(top)

    def _finished_nodes(self, nodes: object) -> None:
        """A ``progress_state`` message's ``nodes``: those in state ``finished`` are done."""
        if isinstance(nodes, Mapping):
            for node_id, state in nodes.items():
                if isinstance(state, Mapping) and state.get("state") == "finished":
                    self.done.add(str(node_id))

    def describe(self, workflow: Mapping[str, Any] | None = None) -> str:
        """``node 3/7 KSampler, step 14/20`` (``workflow``: the API-format prompt, for the
        node count and class names; without it, the node id), ``queued`` before its
        ``execution_start``, ``finishing`` after its last node."""
        if self.ended:
            return "finishing"
        if not self.started:
            return "queued"
        total = len(workflow) if workflow else None
        at = len(self.done - {self.node}) + (1 if self.node is not None else 0)
        if total is not None:
            at = min(max(at, 1), total)
        text = f"node {at}/{total}" if total is not None else f"node {at}"
        if self.node is not None:
            spec = workflow.get(self.node) if workflow else None
            name = spec.get("class_type") if isinstance(spec, Mapping) else None
            text += f" {name}" if isinstance(name, str) else f" #{self.node}"
        if self.max is not None and self.max > 1 and self.value is not None:
            text += f", step {self.value}/{self.max}"
        return text


def _number(value: object) -> TypeGuard[int | float]:
    # NaN and infinities are numbers json reads but no step count.
    return isinstance(value, int | float) and not isinstance(value, bool) and abs(value) < 1e12
