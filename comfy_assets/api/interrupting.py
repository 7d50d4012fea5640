"""A cancelled job's prompt stopped on its server: removed from the queue and
interrupted (``POST /queue {"delete"}``, ``POST /interrupt {"prompt_id"}``).

The cancel itself is the store's (``ApiLedger.cancel``): the job is a dead letter before
anything is asked of the server, so the worker whose attempt ends interrupted finds its
claim gone and leaves the job as it is (nothing retries it). The server is asked only
when it is one of the API's ``--server``s (it knows no other URL); otherwise the prompt
runs to its end and its result is not recorded. Both calls are harmless when the prompt
is elsewhere or over: ComfyUI answers 200 and does nothing (data/recorded/README.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import ComfyError
from comfy_assets.comfy.servers import ServerSpec


async def interrupt_prompt(
    servers: Sequence[ServerSpec], server: str | None, prompt_id: str, timeout_s: float = 5.0
) -> str:
    """Stop ``prompt_id`` on the server named ``server``; returns what was done, for
    the job's events (a server that fails to answer is said, not raised)."""
    if server is None:
        return "cancel: the job was on no server"
    spec = next((s for s in servers if s.name == server), None)
    if spec is None:
        return (
            f"cancel: {server} is not a --server of the API; its prompt {prompt_id} runs to "
            "its end, and its result is not recorded"
        )
    client = ComfyClient(
        spec.url, credentials=spec.credentials, name=spec.name, timeout_s=timeout_s
    )
    try:
        await client.delete_from_queue([prompt_id])
        await client.interrupt(prompt_id)
    except (ComfyError, OSError, TimeoutError) as e:
        return f"cancel: could not interrupt prompt {prompt_id} on {server}: {e}"
    finally:
        await client.aclose()
    return f"cancel: prompt {prompt_id} removed from the queue and interrupted on {server}"
