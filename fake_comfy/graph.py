"""The order in which ComfyUI v0.8.0 runs a prompt's nodes (comfy_execution.graph).

ExecutionList adds each output node and, depth first through a stack, the nodes it needs;
then it repeatedly picks among the nodes whose inputs are done: an output node first, else
a node feeding an output, else one two steps before an output, else the first added.
For success.json's workflow (outputs 3 and 4) that gives 1, 3, 2, 4 as recorded.
"""

from __future__ import annotations

from typing import Any


def is_link(value: Any) -> bool:
    """A `["node_id", slot]` input (a link from another node's output), as
    comfy_execution.graph_utils.is_link decides."""
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], (int, float))
    )


def execution_order(
    prompt: dict[str, Any], outputs: list[str], output_classes: set[str]
) -> list[str]:
    """Node ids of `prompt` in execution order for `outputs` (ids of output nodes).

    `output_classes` are the class types whose `output_node` is true.
    Raises ValueError on a dependency cycle (validation rejects those first).
    """
    pending: dict[str, None] = {}  # insertion order matters: it breaks ties
    blocking: dict[str, dict[str, None]] = {}  # node -> nodes waiting for it
    block_count: dict[str, int] = {}

    def add_node(start: str) -> None:
        stack = [start]
        links: list[tuple[str, str]] = []
        while stack:
            node_id = stack.pop()
            if node_id in pending:
                continue
            pending[node_id] = None
            block_count[node_id] = 0
            blocking[node_id] = {}
            for value in prompt[node_id]["inputs"].values():
                if is_link(value):
                    stack.append(value[0])
                    links.append((value[0], node_id))
        for src, dst in links:
            if dst not in blocking[src]:
                blocking[src][dst] = None
                block_count[dst] += 1

    for output in outputs:
        add_node(output)

    def is_output(node_id: str) -> bool:
        return prompt[node_id]["class_type"] in output_classes

    order: list[str] = []
    while pending:
        ready = [n for n in pending if block_count[n] == 0]
        if not ready:
            raise ValueError(f"dependency cycle among nodes {sorted(pending)}")
        pick = next((n for n in ready if is_output(n)), None)
        if pick is None:
            pick = next((n for n in ready if any(is_output(b) for b in blocking[n])), None)
        if pick is None:
            pick = next(
                (n for n in ready if any(is_output(c) for b in blocking[n] for c in blocking[b])),
                ready[0],
            )
        order.append(pick)
        del pending[pick]
        for waiting in blocking[pick]:
            block_count[waiting] -= 1
    return order
