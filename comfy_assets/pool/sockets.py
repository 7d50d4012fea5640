"""One socket per server, kept open across prompts (a part of ``Pool``): ours run one at
a time per server, and a socket opened per prompt costs a handshake while the GPU waits."""

from __future__ import annotations

from dataclasses import dataclass

from comfy_assets.comfy.follow import PromptFollower
from comfy_assets.pool.server_state import ServerStates
from comfy_assets.pool.slot import new_client_id


@dataclass(eq=False)
class Sockets:
    """The servers' open sockets (``/ws`` with a client_id of ours); ``poll_s``: the
    followers' /history poll period."""

    states: ServerStates
    poll_s: float

    async def follower(self, name: str) -> PromptFollower:
        """The open socket of server ``name``, opened on first use and again after a
        fatal failure; it reconnects by itself after a drop. Raises the client's typed
        errors when it cannot be opened."""
        state = self.states[name]
        follower = state.follower
        if follower is not None and not follower.failed:
            return follower
        async with state.opening:
            follower = state.follower
            if follower is not None and not follower.failed:
                return follower
            if follower is not None:
                state.follower = None
                await follower.close()
            follower = PromptFollower(state.client, new_client_id(), poll_s=self.poll_s)
            await follower.__aenter__()
            state.follower = follower
            return follower

    def open_follower(self, name: str) -> PromptFollower | None:
        """The socket of server ``name`` if one is open now (for reading progress)."""
        state = self.states.get(name)
        return None if state is None else state.follower

    def mark(self, name: str) -> tuple[int, int] | None:
        """Which socket server ``name`` has and how often it reconnected (None: none):
        a mark that changes when the server may have started again."""
        follower = self.states[name].follower
        return None if follower is None else (id(follower), follower.reconnects)

    async def close(self) -> None:
        """Close every socket."""
        for state in self.states.all:
            if state.follower is not None:
                follower, state.follower = state.follower, None
                await follower.__aexit__(None, None, None)
