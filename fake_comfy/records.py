"""The fake's own records: the ground truth tests assert on.

`snapshot()` (= GET /fake/stats = `FakeComfy.stats`) is
    {"prompts": {prompt_id: {"posted": N, "executed": N}},
     "runs": [{"prompt_id", "client_id", "number", "word", "posted", "start",
               "last_message", "end", "outcome"}],
     "requests": {"GET /queue": N, "GET /history/{prompt_id}": N, ...},
     "uploads": N,
     "uploaded": {name: {"count": N, "first": t, "last": t}},
     "posts": [{"prompt_id", "time"}]}
posted: every POST /prompt carrying that id (also those answered 500 or 400); `posts`
lists the same POSTs in the order they came, each with its time;
executed: executions that started. Times are seconds since the epoch (floats); `end` and
`outcome` are None while the run is under way; `last_message` is when its last socket
message went out (execution_success, say: before `end` for a `late` prompt, whose history
comes later; `end` otherwise); `word` is the script word the prompt was
posted with ("ok" for the prompts of busy=N); outcome is "success", "error",
"interrupted" or "lost" (the server stopped or "restarted" under it). `requests` counts
every HTTP request by method and route (how many probes, downloads, polls a client made).
`uploads` counts the POST /upload/image answered 200; `uploaded` counts them by the name
a prompt gives the file ("subfolder/name", with " [temp]" or " [output]" after it for
those types), with the times of the first and the last.
Records survive restarts and new `serve()` sessions. Thread-safe: tests may read them from
another thread while the server's loop writes.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any


class Records:
    """Counts per prompt_id and the list of runs (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._prompts: dict[str, dict[str, int]] = {}
        self._runs: list[dict[str, Any]] = []
        self._ended = 0
        self._requests: dict[str, int] = {}
        self._uploads = 0
        self._uploaded: dict[str, dict[str, Any]] = {}
        self._posts: list[dict[str, Any]] = []

    def request(self, route: str) -> None:
        """Counts one HTTP request, ``route`` as "METHOD /path/{name}"."""
        with self._lock:
            self._requests[route] = self._requests.get(route, 0) + 1

    def uploaded(self, name: str) -> None:
        """Counts one POST /upload/image answered 200 with the file ``name`` (as a prompt
        names it)."""
        now = time.time()
        with self._lock:
            self._uploads += 1
            entry = self._uploaded.setdefault(name, {"count": 0, "first": now, "last": now})
            entry["count"] += 1
            entry["last"] = now

    def _counts(self, prompt_id: str) -> dict[str, int]:
        counts = self._prompts.get(prompt_id)
        if counts is None:
            counts = self._prompts[prompt_id] = {"posted": 0, "executed": 0}
        return counts

    def posted(self, prompt_id: str) -> None:
        """Counts one POST /prompt for `prompt_id` and lists it with its time."""
        now = time.time()
        with self._lock:
            self._counts(prompt_id)["posted"] += 1
            self._posts.append({"prompt_id": prompt_id, "time": now})

    def known(self, prompt_id: str) -> None:
        """Lists a prompt the fake queued itself (busy=N) with no POST."""
        with self._lock:
            self._counts(prompt_id)

    def start(
        self,
        prompt_id: str,
        client_id: str | None,
        number: float,
        posted: float,
        word: str = "ok",
    ) -> int:
        """Records the start of an execution; returns the run's index for `end`."""
        with self._lock:
            self._counts(prompt_id)["executed"] += 1
            self._runs.append(
                {
                    "prompt_id": prompt_id,
                    "client_id": client_id,
                    "number": number,
                    "word": word,
                    "posted": posted,
                    "start": time.time(),
                    "last_message": None,
                    "end": None,
                    "outcome": None,
                }
            )
            return len(self._runs) - 1

    def last_message(self, prompt_id: str) -> None:
        """Stamps ``last_message`` on the run of ``prompt_id`` under way (if any)."""
        with self._lock:
            for entry in reversed(self._runs):
                if entry["prompt_id"] == prompt_id and entry["outcome"] is None:
                    entry["last_message"] = time.time()
                    return

    def end(self, run: int, outcome: str) -> None:
        """Records how run number `run` ended (once; a second call raises RuntimeError)."""
        with self._lock:
            entry = self._runs[run]
            if entry["outcome"] is not None:
                raise RuntimeError(f"run {run} already ended as {entry['outcome']}")
            entry["end"] = time.time()
            if entry["last_message"] is None:
                entry["last_message"] = entry["end"]
            entry["outcome"] = outcome
            self._ended += 1

    def ended_runs(self) -> int:
        """How many runs have an outcome."""
        with self._lock:
            return self._ended

    def snapshot(self) -> dict[str, Any]:
        """A deep copy of the records in the /fake/stats shape."""
        with self._lock:
            return {
                "prompts": copy.deepcopy(self._prompts),
                "runs": copy.deepcopy(self._runs),
                "requests": dict(self._requests),
                "uploads": self._uploads,
                "uploaded": copy.deepcopy(self._uploaded),
                "posts": copy.deepcopy(self._posts),
            }
