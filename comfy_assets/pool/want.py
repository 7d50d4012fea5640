"""What a consumer in line wants of a server (``Want``), and a consumer's say on each free
server (``Chooser``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from comfy_assets.comfy.capabilities import Needs

# A consumer's say on a free server (name, seconds it has waited in line): None, take
# nothing there now; else a rank, lower first (0: its own job's group).
Chooser = Callable[[str, float], int | None]


@dataclass
class Want:
    """What a consumer in line wants of a server (``Pool.acquire``'s or
    ``Pool.acquire_until``'s arguments), and since when free servers have been declined
    for it."""

    prefer: str | None = None
    models: tuple[str, ...] = ()
    only: str | None = None
    allow_prompt: str | None = None
    needs: Needs | None = None
    choose: Chooser | None = None
    check: Callable[[], str | None] | None = None
    gone: Callable[[], bool] | None = None
    declined_since: float | None = None  # loop time a free server was first declined
