"""One attempt of one job on the pool, and how its failure is classified.

An attempt catches up first (our prompt_id already succeeded in /history on the server
where we posted it → download, don't post; still in that server's /queue → follow it),
else holds a server, posts, follows and downloads. It returns an ``AttemptResult`` and
never raises for anything a server does; only cancellation propagates.

Classification: POST 400 → permanent; 5xx, refused, reset, timeout, lost → transient;
``execution_error`` of out-of-memory type → transient (``POST /free`` first); an
infrastructure error (``comfy/infra.py``) → transient, the server's; any other
``execution_error`` → permanent, unless ``render/blame.py`` finds it may be the
server's (a deadline and a lost prompt carry a ``Failure`` for it too); our prompt interrupted by someone else → transient; 200
with ``node_errors`` → permanent (outputs were dropped,
data/recorded/validation_errors.json); a deadline → interrupt, delete from the queue, wait
until it is gone, transient; an output that /history lists and /view answers 404 for →
transient, and the next attempt renders anew after freeing ComfyUI's cache (an identical
prompt would replay the missing names: README fact 11, cache_replay.json).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.download import MAX_OUTPUT_BYTES, OutputSink, download_outputs
from comfy_assets.comfy.errors import (
    ComfyError,
    DeadlineExceeded,
    OutputMissing,
    PromptLost,
    PromptRejected,
    PromptStalled,
    ServerError,
)
from comfy_assets.comfy.follow import PromptFollower
from comfy_assets.comfy.infra import infra_cause, prompt_strings
from comfy_assets.comfy.types import HistoryEntry, excerpt
from comfy_assets.jobs.model import Job
from comfy_assets.pool.pool import Pool
from comfy_assets.pool.slot import Slot
from comfy_assets.render.catch_up import CatchUp, dropped_outputs
from comfy_assets.render.guard import our_error, stops_the_batch
from comfy_assets.render.inputs import (
    InputProblem,
    Locate,
    Staged,
    UploadFailed,
    UpstreamFile,
    inputs_of_nodes,
    stage,
)
from comfy_assets.render.outcome import (
    AttemptHooks,
    AttemptResult,
    Failure,
    Kind,
    NotPosted,
    Run,
    describe_error,
)
from comfy_assets.render.removal import Removal
from comfy_assets.store.files import FileStoreUnavailable

log = logging.getLogger("comfy_assets.render.attempt")


@dataclass(eq=False, repr=False)  # identity, and no repr of a whole prompt in logs
class Attempt:
    """One attempt of ``job`` over ``pool``; its outputs go to ``sink`` (the store's
    files of the job: ``render/outputs.py``).

    ``slot``: a server already held for it (else one is acquired). ``prev_server``: where
    the prompt was last posted (from the store), for catch-up; ``prev_number``: the run
    number that post got (when it was accepted); ``prev_unsettled``: the attempt that
    posted there never ended (its process died), so its POST may have been accepted
    without a number on record. ``deadline_s``: the
    attempt's deadline (seconds, from the catch-up or, after a catch-up that waited for
    an unreachable server, from the post); ``stall_s``: how long a running prompt may go
    unheard of before it is stopped as at its deadline, asked as it runs (None: never);
    ``wedge_s``: a prompt
    still running this long after its interrupt and delete means a wedged server;
    ``poll_s``: how often to look at /queue while
    removing a prompt; ``evict_timeout_s``: how long that may take. ``catch_up_s``: how
    long to keep asking an unreachable ``prev_server`` before posting elsewhere (which
    may render the job twice). ``fresh``: the last run's outputs are gone from the
    server: skip the catch-up and free ComfyUI's cache before posting.
    ``max_output_bytes``: the most one output file may have (bytes). ``locate``: where
    the file an input takes from an upstream job is (``render/inputs.py``). ``subdir``:
    the folder under the job's the outputs go to ("" for the job's first take).
    """

    job: Job
    pool: Pool
    sink: OutputSink
    _: KW_ONLY
    slot: Slot | None = None
    prev_server: str | None = None
    prev_number: int | None = None
    prev_unsettled: bool = False
    deadline_s: float = 600.0
    stall_s: Callable[[], float | None] | None = None
    wedge_s: float | None = None
    poll_s: float = 1.0
    evict_timeout_s: float = 120.0
    catch_up_s: float = 60.0
    fresh: bool = False
    hooks: AttemptHooks = field(default_factory=AttemptHooks)
    label: str = ""
    max_output_bytes: int | None = MAX_OUTPUT_BYTES
    locate: Locate | None = None
    subdir: str = ""

    def __post_init__(self) -> None:
        self.label = self.label or f"job {self.job.id[:8]}"
        self.on_server: tuple[ComfyClient, str] | None = None  # (client, server) while ours runs
        self.started = time.monotonic()
        self.deadline_from = self.started  # the deadline counts from here
        self.twice: str | None = None  # why posting now may render the job a second time
        # Why the batch stopped this attempt from outside (a lost server lease or claim);
        # ``claim_lost``: the job is no longer ours to record.
        self.aborted: str | None = None
        self.claim_lost = False
        # A store write about this attempt that failed while it ran (the deferred
        # rendering move), for the batch to handle as if the attempt had raised it.
        self.store_failed: BaseException | None = None
        self.posted = False  # a POST /prompt of this attempt may have reached the server
        # While a catch-up waits for the server of its last POST to answer: (that server,
        # the time.monotonic() it gives up at), for ``comfy-assets status``.
        self.catching_up: tuple[str, float] | None = None
        self.staged: Staged | None = None  # the job's inputs on the server posted to
        # Its parts: looking where the prompt was last posted, removing it from a server.
        self.catch_up = CatchUp(self)
        self.removal = Removal(
            self.job.prompt_id,
            label=self.label,
            evict_timeout_s=self.evict_timeout_s,
            poll_s=self.poll_s,
            lease_s=self.pool.settings.server_lease_s,
        )

    def aborted_result(self, cleanup: str) -> AttemptResult:
        """The transient result of an attempt the batch stopped (``aborted``), once
        ``cancel_cleanup`` has said what became of its prompt (``cleanup``)."""
        server = self.slot.name if self.slot is not None else self.prev_server
        return self.result(
            "transient", f"{self.aborted}; {cleanup}", server=server, posted=self.posted
        )

    def result(self, kind: Kind, reason: str = "", **kw: Any) -> AttemptResult:
        """An ``AttemptResult`` of this attempt (its prompt and seconds so far), with
        ``kw``: the result's other fields."""
        return AttemptResult(
            kind,
            reason,
            prompt_id=self.job.prompt_id,
            seconds=time.monotonic() - self.started,
            **kw,
        )

    async def run(self) -> AttemptResult:
        """Run the attempt; returns the classified result. Never raises a ComfyError.
        Anything else our code raises meanwhile that is the job's (``render/guard.py``:
        a prompt that cannot be encoded, say) ends it permanent, its prompt removed from
        the server first; the rest (a cancellation, the store away, ...) is raised."""
        try:
            return await self._run()
        except Exception as e:
            if stops_the_batch(e):
                raise
            # The traceback is for whoever fixes our code; the job's reason says it in words.
            log.error("%s: %s; the attempt ends permanent", self.label, our_error(e), exc_info=e)
            server = self.slot.name if self.slot is not None else self.prev_server
            try:
                what = await self.cancel_cleanup()
            except Exception as cleanup:
                if stops_the_batch(cleanup):
                    raise
                what = f"its prompt's removal failed too ({our_error(cleanup)})"
            reason = f"{our_error(e)}; {what}"
            return self.result("permanent", reason, server=server, posted=self.posted)

    async def _run(self) -> AttemptResult:
        if self.fresh:
            self.twice = "outputs missing on the server: ComfyUI's cache freed, rendering anew"
        else:
            caught = await self.catch_up.run()
            if caught is not None:
                return caught
        if self.slot is None:
            self.slot = await self._acquire_for_post()
        return await self._post_and_follow(self.slot)

    async def _acquire_for_post(self) -> Slot:
        """A server to post on: its previous one first (its models may be loaded), but
        not one whose catch-up gave up while another comes free within ``catch_up_s``:
        that server's answers are not read, and the earlier run may be there."""
        avoid = self.catch_up.gave_up
        if avoid is None:
            return await self.pool.acquire(prefer=self.prev_server, models=self.job.models)
        models, patience = frozenset(self.job.models), self.catch_up_s

        def choose(name: str, waited_s: float) -> int | None:
            if name == avoid and waited_s < patience:
                return None
            return 0 if models <= self.pool.plan.holds(name) else 1

        slot = await self.pool.acquire_until(None, choose=choose)
        assert slot is not None, "acquire_until without a stop event or gone returns a slot"
        return slot

    # -- catch-up ------------------------------------------------------------------------

    # -- post and follow -----------------------------------------------------------------

    async def _post_and_follow(self, slot: Slot) -> AttemptResult:
        client, name, pid = slot.client, slot.name, self.job.prompt_id
        try:
            # The server's socket is open before we post (events are not replayed).
            follower = await self.pool.follower(name)
        except ComfyError as e:  # nothing was posted
            slot.release()
            return self.server_failed(
                describe_error(e, "GET /ws"), server=name, outputs_missing=self.fresh
            )
        if self.fresh:
            try:
                # An identical prompt is fully cached and replays the missing names
                # (README fact 11); free_memory resets the cache before our prompt runs.
                # It unloads the models too: main.py reads unload_models with free_memory
                # as its default, so a fresh render may load its model again.
                await client.free(unload_models=False, free_memory=True)
            except ComfyError as e:
                slot.release()  # nothing posted
                return self.server_failed(
                    describe_error(e, "POST /free"), server=name, outputs_missing=True
                )
        stop = self.hooks.stopped()
        if stop is not None:
            slot.release()
            raise NotPosted(stop)
        try:
            # Every server has its own input folder: the job's inputs go to this one.
            self.staged = await stage(
                self.job, client, name, self.pool.uploads, self.locate or _no_upstream
            )
        except InputProblem as e:
            slot.release()  # nothing posted
            return self.result("permanent", str(e), server=name)
        except UploadFailed as e:
            slot.release()  # nothing posted
            what = describe_error(e.error, f"POST /upload/image of {e.label}")
            if e.error.transient:
                return self.server_failed(what, server=name)
            return self.result("permanent", what, server=name)
        await self.hooks.submitted(name, self.twice)
        # The last moment to find out, nothing posted yet (the job is submitted now).
        stop = slot.lost or self.hooks.stopped() or await self.hooks.unsure()
        if stop is not None:
            slot.release()
            return self.result("transient", f"not posted: {stop}", server=name)
        self.on_server = (client, name)
        slot.prompt_id = pid
        self.posted = True
        follower.forget(pid)  # what the socket said of earlier runs is not about this one
        try:
            post = await client.post_prompt(
                self.staged.workflow, prompt_id=pid, client_id=follower.client_id
            )
        except (ServerError, PromptRejected) as e:
            self.on_server = None
            slot.release()  # answered 5xx/400: nothing of ours is queued there
            if isinstance(e, PromptRejected):
                return self._rejected(e, name)
            return self.server_failed(describe_error(e, "POST /prompt"), server=name, posted=True)
        except ComfyError as e:
            # Reset or timeout: the server may have queued it all the same. Look before
            # deciding: a prompt that runs or ran is followed or taken, not posted again.
            return await self._after_unanswered_post(follower, slot, e)
        slot.dispatched()
        log.info("%s on %s: POST /prompt 200, number %s", self.label, name, post.number)
        await self.hooks.rendering(name, post.number)
        if post.node_errors:
            reason = "POST /prompt 200 with node_errors, outputs dropped: " + ", ".join(
                f"node {n}" for n in sorted(post.node_errors)
            )
            fed = inputs_of_nodes(self.job, list(post.node_errors))
            if fed:
                reason += f" (fed by {fed})"
            gone = await self.removal.evict(slot, post.number)
            self.on_server = None
            if not gone.confirmed:
                reason += f"; could not remove it from {name} ({gone.problem})"
            return self.result(
                "permanent",
                reason,
                server=name,
                number=post.number,
                posted=True,
                failure=Failure.of("rejected", reason),
            )
        return await self._wait(follower, slot, Run(post.number, posted=True))

    def _rejected(self, e: PromptRejected, name: str) -> AttemptResult:
        """The result of a POST /prompt answered 400. A node that loads one of the job's
        inputs is named; when such an input was uploaded by an earlier attempt (not this
        one), the server may have lost it (its input folder cleaned): it is forgotten and
        uploaded again by a retry, instead of a dead letter."""
        reason = describe_error(e, "POST /prompt")
        nodes = list(e.node_errors)
        fed = inputs_of_nodes(self.job, nodes)
        if not fed:
            return self._refused(reason, name)
        staged = self.staged
        stale = {
            staged.names[i.key]
            for i in self.job.inputs
            if staged is not None
            and i.node_id in nodes
            and i.key in staged.names
            and i.key not in staged.fresh
        }
        if stale:
            self.pool.uploads.forget(name, stale)
            reason += f" (fed by {fed}, uploaded earlier: uploading again)"
            return self.result("transient", reason, server=name, posted=True)
        return self._refused(f"{reason} (fed by {fed})", name)

    def _refused(self, reason: str, name: str) -> AttemptResult:
        """The result of a prompt ``name`` refused (POST 400): the job's if another
        server refuses it so too (``render/blame.py``)."""
        failure = Failure.of("rejected", reason)
        return self.result("permanent", reason, server=name, posted=True, failure=failure)

    def server_failed(self, reason: str, *, server: str, **kw: Any) -> AttemptResult:
        """The transient result of a failure the server may own (5xx, refused, reset, timed
        out): the next attempt goes to another server while one can run the job."""
        failure = Failure.of("server", reason)
        return self.result("transient", reason, server=server, failure=failure, **kw)

    async def _after_unanswered_post(
        self, follower: PromptFollower, slot: Slot, error: ComfyError
    ) -> AttemptResult:
        """POST /prompt got no answer (reset, timeout): the prompt may be queued, running
        or even finished. /queue then /history (a prompt leaves the queue only once its
        history is written, so no run falls between the two): followed if there, taken
        if it succeeded, else nothing of ours is on the server and the attempt failed.
        A server that can't be asked gets the eviction (or its lease left to expire)."""
        client, name, pid = slot.client, slot.name, self.job.prompt_id
        reason = describe_error(error, "POST /prompt")
        try:
            async with asyncio.timeout(self.pool.settings.probe_timeout_s):
                queue = await client.queue()
                entry = await client.history(pid)
        except (ComfyError, TimeoutError):
            gone = await self.removal.evict(slot, number=-1)
            self.on_server = None
            entry = gone.history
            if entry is not None and entry.status_str == "success":
                # It ran to its end before the removal could land: taken, not posted again
                # (a restart before the next attempt's catch-up would render it twice).
                log.info("%s on %s: %s, but the prompt ran: taking it", self.label, name, reason)
                run = Run(entry.number, posted=True, verify=True)
                return await self.download(client, name, entry, run)
            if not gone.confirmed:
                reason += f"; could not remove it from {name} ({gone.problem})"
            return self.server_failed(reason, server=name, posted=True)
        found = queue.find(pid)
        if found is not None:
            slot.dispatched()
            log.info(
                "%s on %s: %s, but the prompt is queued as #%s",
                self.label,
                name,
                reason,
                found.number,
            )
            await self.hooks.rendering(name, found.number)
            return await self._wait(follower, slot, Run(found.number, posted=True, verify=True))
        self.on_server = None
        slot.release()  # nothing of ours queued or running there
        if entry is not None and entry.status_str == "success":
            log.info(
                "%s on %s: %s, but the prompt ran: taking its outputs", self.label, name, reason
            )
            run = Run(entry.number, posted=True, verify=True)
            return await self.download(client, name, entry, run)
        if error.transient:
            return self.server_failed(reason, server=name, posted=True)
        failure = Failure.of("garbled", reason)
        return self.result("permanent", reason, server=name, posted=True, failure=failure)

    async def follow(self, slot: Slot, number: int, *, posted: bool) -> AttemptResult:
        try:
            follower = await self.pool.follower(slot.name)
        except ComfyError as e:
            reason = describe_error(e, "GET /ws") + "; " + await self._remove(slot, number)
            return self.server_failed(reason, server=slot.name, number=number)
        self.on_server = (slot.client, slot.name)
        return await self._wait(follower, slot, Run(number, posted=posted, verify=True))

    async def _wait(self, follower: PromptFollower, slot: Slot, run: Run) -> AttemptResult:
        """Follow ``run`` to its end and classify it (``Run.verify``: the POST's answer
        was not seen, so the run is checked to have kept every output node)."""
        client, name, pid, number = slot.client, slot.name, self.job.prompt_id, run.number
        remaining = max(self.deadline_s - (time.monotonic() - self.deadline_from), 0.1)
        try:
            outcome = await follower.wait(
                pid,
                number,
                deadline_s=remaining,
                stall_s=self.stall_s,
                on_finished=slot.release,
                # The freed GPU gets its next prompt before we ask /history or download.
                then=lambda: self.pool.handed_over(slot),
            )
        except DeadlineExceeded as e:
            return await self._timed_out(e, slot, run)
        except PromptLost as e:
            slot.release()  # neither in /queue nor in /history: it is not on the server
            failure = Failure("lost", "lost", "prompt lost")
            return self.result(
                "transient", f"prompt lost: {e}", failure=failure, **run.recorded(name)
            )
        except ComfyError as e:
            # Our prompt may still run there: removed, so that nothing of ours is left on
            # the server that nobody follows (its lease is left to expire if it can't be).
            lost = describe_error(e, "following")
            reason = lost + "; " + await self._remove(slot, number)
            failure = Failure("lost", "lost", lost)
            return self.result("transient", reason, failure=failure, **run.recorded(name))
        # Not in a `finally`: on cancellation `on_server` must stay set, so the cancel
        # cleanup knows to interrupt and remove our prompt on that server.
        self.on_server = None
        slot.release()  # already done by on_finished; idempotent
        if outcome.status == "success" and outcome.history is not None:
            return await self.download(client, name, outcome.history, run)
        common = run.recorded(name, outcome.history)
        if outcome.status == "interrupted":
            return self.result("transient", "interrupted by someone else", **common)
        err = outcome.error
        if err is None:
            return self.result("permanent", f"prompt ended with status {outcome.status}", **common)
        # The first line: ComfyUI appends pages of tips to an OOM message.
        first = excerpt((err.exception_message.strip().splitlines() or [""])[0])
        reason = f"execution_error in node {err.node_id} ({err.node_type}): "
        reason += f"{err.exception_type}: {first}"
        fed = inputs_of_nodes(self.job, [err.node_id])
        if fed:
            reason += f" (node {err.node_id} loads {fed})"
        if err.is_oom:
            failure = Failure.execution_error("oom", err.node_id, err.exception_type, first, reason)
            try:
                await client.free()
                reason += "; POST /free sent"
            except ComfyError as e:
                reason += f"; POST /free failed: {e}"
            return self.result("transient", reason, failure=failure, **common)
        sent = self.staged.workflow if self.staged is not None else self.job.workflow
        cause = infra_cause(err.exception_type, err.exception_message, prompt_strings(sent))
        if cause is not None:
            # The server's at first sight: another server takes the job at once.
            reason = f"{reason} (infrastructure: {cause.name})"
            failure = Failure.execution_error(
                "infrastructure", err.node_id, err.exception_type, first, reason
            )
            return self.result("transient", reason, failure=failure, **common)
        failure = Failure.execution_error(
            "execution_error", err.node_id, err.exception_type, first, reason
        )
        return self.result("permanent", reason, failure=failure, **common)

    async def _timed_out(self, e: DeadlineExceeded, slot: Slot, run: Run) -> AttemptResult:
        """``run`` ran past its deadline or stalled (``e``): removed from ``slot``'s
        server, the result says what came of it (taken after all if it finished
        meanwhile; a wedged server if it stays running)."""
        client, name = slot.client, slot.name
        gone = await self.removal.evict(slot, run.number, wedge_s=self.wedge_s)
        if gone.won is not None:  # it finished while we interrupted it: take the result
            return await self.download(client, name, gone.won, run)
        if isinstance(e, PromptStalled):
            why = f"stalled: {e.message.removeprefix(f'{name}: ')}"
            failure = Failure("stalled", "stalled", why)
        else:
            why = f"deadline of {self.deadline_s:g} s exceeded"
            failure = Failure("deadline", "deadline", why)
        if gone.wedged:
            failure = Failure("wedged", "wedged", f"{why}; prompt {gone.problem}")
            what = f"prompt {gone.problem}; it may still render there"
        elif not gone.confirmed:
            what = f"could not remove it from {name} ({gone.problem})"
        elif gone.was_there:
            what = "prompt interrupted and removed from the queue"
        else:
            what = f"prompt lost: in neither /queue nor /history of {name} (the server forgot it)"
        return self.result("transient", f"{why}; {what}", failure=failure, **run.recorded(name))

    async def download(
        self, client: ComfyClient, name: str, entry: HistoryEntry, run: Run
    ) -> AttemptResult:
        """Download the outputs of ``run``, a success (``entry``: its /history entry);
        ``Run.verify``: first check it rendered every output node of the workflow (its
        POST's answer, which would say, was not seen)."""
        common = run.recorded(name, entry)
        try:
            dropped = (
                await dropped_outputs(client, self.job.workflow, entry.outputs_to_execute)
                if run.verify
                else ""
            )
            if dropped:  # the server's, may be: judged on another server
                where = f" (run {entry.number} on {name})"
                failure = Failure.of("rejected", dropped)
                return self.result("permanent", dropped + where, failure=failure, **common)
            files = await download_outputs(
                client, entry, self.sink, max_bytes=self.max_output_bytes, under=self.subdir
            )
        except OutputMissing as e:
            return self.result(
                "transient",
                f"outputs missing: {e.message} (listed in /history, gone from the server); "
                "the next attempt renders anew",
                outputs_missing=True,
                **common,
            )
        except ComfyError as e:
            if e.transient:  # the server's, may be: a proxy's page, a reset
                return self.server_failed(describe_error(e, "download"), **common)
            return self.result("permanent", describe_error(e, "download"), **common)
        except FileStoreUnavailable as e:
            return self.result(
                "transient",
                f"outputs not stored: {e}; the store's failure, not the job's",
                file_store_fault=True,
                **common,
            )
        if not files:
            return self.result(
                "permanent", "the prompt succeeded but listed no output files", **common
            )
        return self.result("success", files=files, **common)

    # -- removing a prompt of ours from a server ----------------------------------------

    async def _remove(self, slot: Slot, number: int) -> str:
        """``Removal.remove`` of our run ``number`` from ``slot``'s server; what came of
        it, for people."""
        what = await self.removal.remove(slot, number)
        self.on_server = None
        return what

    async def cancel_cleanup(self) -> str:
        """On cancellation: interrupt and remove our prompt, then free the slot. Returns
        what happened, for people ("prompt interrupted and removed from gpu0", "could not
        remove prompt ... from gpu0 (...)", "nothing on a server").

        Bounded by ``evict_timeout_s``; used by the batch's cancellation path."""
        if self.slot is None or self.slot.released:
            return "nothing on a server"
        if self.on_server is None:
            self.slot.release()
            return "nothing on a server"
        return await self._remove(self.slot, number=-1)


async def _no_upstream(inp: object) -> UpstreamFile:
    raise LookupError("no store to take an upstream job's file from")
