"""Handing a server over: a prompt's end hands the server to the next consumer in line
(or, when another process waits for it, leaves it to that process for a moment), keeps
its lease for our own next prompt, or gives it back (a part of ``Pool``)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from comfy_assets.pool.lease_keeping import LeaseKeeper
from comfy_assets.pool.models_held import ModelsHeld
from comfy_assets.pool.priority import Priorities
from comfy_assets.pool.server_state import ServerState, ServerStates
from comfy_assets.pool.slot import Slot

log = logging.getLogger("comfy_assets.pool")

FINISHED_KEPT = 4096  # prompt_ids of ours remembered as finished


@dataclass(eq=False)
class Handover:
    """What happens to a held server at a prompt's end. ``line``: the lock consumers
    wait in (locked: a consumer is in line); ``changed``: set whenever a server may have
    become free; ``busy_poll_s``: how long a server is kept or left to another process."""

    states: ServerStates
    keeper: LeaseKeeper
    models: ModelsHeld
    priorities: Priorities
    line: asyncio.Lock
    changed: asyncio.Event
    busy_poll_s: float
    # Prompts of ours that have finished: ComfyUI still lists a prompt in /queue while
    # it writes its history, so a probe right after execution_success sees it; it no
    # longer occupies the GPU and must not keep the server from its next prompt.
    finished: OrderedDict[str, None] = field(default_factory=OrderedDict, init=False, repr=False)
    # A server freed while a consumer waits in line is handed over: the freeing job's
    # downloads wait (briefly) for that next prompt to be posted, so the GPU comes
    # first. One event per hand-over, set by the next dispatch to finish.
    _handovers: deque[asyncio.Event] = field(default_factory=deque, init=False, repr=False)

    def dispatch_done(self) -> None:
        """``Slot.posted``: a dispatch is over; the oldest hand-over waiting is done."""
        if self._handovers:
            self._handovers.popleft().set()

    async def handed_over(self, slot: Slot, max_wait_s: float = 0.25) -> None:
        """Wait (at most ``max_wait_s`` seconds) until the server ``slot`` freed has its
        next prompt posted, when a consumer was waiting for it; else return at once."""
        if slot.handover is None or slot.handover.is_set():
            return
        try:
            async with asyncio.timeout(max_wait_s):
                await slot.handover.wait()
        except TimeoutError:
            pass

    def slot_released(self, slot: Slot) -> None:
        """``Slot.release``: give the server back, or keep it for our next prompt."""
        state = self.states[slot.name]
        if slot.lost is not None:
            # The lease is not ours to give (taken, or the store can't be written): it
            # expires by itself, and the server can be offered again.
            if state.held is slot:
                state.held = None
            self.changed.set()
            return
        state.held = None
        loop = asyncio.get_running_loop()
        if self.line.locked() and self.priorities.others_waiting(state):
            # Another process waits for a server too: leave this one to it for a moment
            # rather than hand it to our own next job (runs that share servers all move).
            state.yielded_until = loop.time() + 3 * self.busy_poll_s
        elif slot.prompt_id is not None and self.line.locked():
            slot.handover = asyncio.Event()  # a consumer is in line: it takes this server
            self._handovers.append(slot.handover)
            self._keep(state)
        elif slot.prompt_id is not None and not self.priorities.others_waiting(state):
            # Nobody in line yet, ours or another process's: our next consumer is most
            # likely finishing its job (downloads, the done record) and comes back within
            # moments. Keeping the lease saves writing it away and back between two of
            # our prompts; unused, it goes back as above.
            self._keep(state)
        if slot.prompt_id is not None:
            state.freed_at = loop.time()
            self.finished[slot.prompt_id] = None
            while len(self.finished) > FINISHED_KEPT:
                self.finished.popitem(last=False)
        self.models.prompt_left(slot)
        if not state.kept:
            self.keeper.release(state, self.models.held_text(slot.name))
        self.changed.set()

    def _keep(self, state: ServerState) -> None:
        """Keep ``state``'s lease; nobody came for it after a while (the batch ended,
        say): give it back."""
        loop = asyncio.get_running_loop()
        kept_at = state.kept_at = loop.time()
        loop.call_later(3 * self.busy_poll_s, self.let_go, state, kept_at)

    def let_go(self, state: ServerState, kept_at: float | None = None) -> None:
        """Release the lease of a kept server (only if kept since ``kept_at``, if given)."""
        if state.kept_at is None or (kept_at is not None and state.kept_at != kept_at):
            return
        state.kept_at = None
        self.keeper.release(state, self.models.held_text(state.name))
        self.changed.set()

    def let_all_go(self) -> None:
        """Release every kept lease."""
        for state in self.states.kept():
            self.let_go(state)

    def slot_abandoned(self, slot: Slot) -> None:
        """``Slot.abandon``: stop renewing; the lease expires by itself."""
        state = self.states[slot.name]
        if state.held is slot:
            state.held = None
        state.lease_until = None
        # Not "just freed": the next prompt may go there only once a probe shows ours gone.
        state.freed_at = None
        log.warning(
            "server %s: our prompt may still be there; its lease will expire in %.0f s",
            slot.name,
            self.keeper.settings.server_lease_s,
        )
