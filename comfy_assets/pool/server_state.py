"""All the pool knows of one server, in one record (``ServerState``): its lease and hold,
its hand-over, its socket, its last probe and report, its /object_info and its orphans.
The pool's parts read and write the records they are given; none keeps a map by name."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the commands that read the store load no socket code
    from comfy_assets.comfy.capabilities import Capabilities, Missing, Needs
    from comfy_assets.comfy.client import ComfyClient
    from comfy_assets.comfy.follow import PromptFollower
    from comfy_assets.comfy.servers import ServerSpec
    from comfy_assets.pool.slot import ServerProbe, Slot

HEALTHY = "healthy"  # what ``ServerState.reported`` says of a server that answers


@dataclass(eq=False)
class ServerState:
    """One server of the pool. Times are the event loop's unless said otherwise."""

    spec: ServerSpec
    client: ComfyClient
    # The lease: held for a prompt of ours, or kept (since then) for our next prompt.
    held: Slot | None = None
    kept_at: float | None = None
    lease_until: float | None = None  # ours for sure until then (the store confirmed it)
    freed_at: float | None = None  # our last prompt left it
    yielded_until: float = 0.0  # left to another waiting process until then
    # Its socket, kept open across prompts.
    follower: PromptFollower | None = None
    opening: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Probes: the one under way, the last healthy one, the last /system_stats.
    probing: asyncio.Future[ServerProbe] | None = None
    probed: tuple[float, ServerProbe] | None = None
    stats_at: float | None = None
    # Reports: what the log last said (HEALTHY or "unreachable: ..."), when, since when away.
    reported: str = HEALTHY
    reported_at: float | None = None  # monotonic time
    away_since: float | None = None  # monotonic time
    answered: bool = False  # answered a probe since the pool started
    unreachable_since: float | None = None
    # What it can run: its /object_info, read again once stale.
    capabilities: Capabilities | None = None
    lacking: dict[Needs, Missing | None] = field(default_factory=dict)  # by its capabilities
    stale: bool = False
    reading: asyncio.Future[None] | None = None
    read: bool = False  # read at least once (``read_mark`` says of which socket)
    read_mark: tuple[int, int] | None = None  # (id of its follower, its reconnects)
    # Health: what the log last said of why it takes no job.
    said_blocked: str | None = None
    # Prompts of ours nobody follows: first seen then; their removal under way.
    orphans_since: float | None = None
    sweep: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kept(self) -> bool:
        return self.kept_at is not None


class ServerStates:
    """The pool's records, in configuration order (the last tie-break)."""

    def __init__(self, states: list[ServerState]) -> None:
        self.all = states
        self.by_name = {s.name: s for s in states}

    def __getitem__(self, name: str) -> ServerState:
        return self.by_name[name]

    def get(self, name: str) -> ServerState | None:
        return self.by_name.get(name)

    def held(self) -> list[ServerState]:
        return [s for s in self.all if s.held is not None]

    def kept(self) -> list[ServerState]:
        return [s for s in self.all if s.kept_at is not None]
