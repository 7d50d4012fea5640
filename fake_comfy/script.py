"""The script: words consumed one per POST /prompt, in arrival order.

Each POST /prompt takes the next word (also POSTs answered 500 or 400); once the script is
used up every prompt is `ok`. Words:

- ok: runs normally.
- 500: answered 500 text/plain (the recorded page), nothing queued.
- invalid: answered 400 prompt_outputs_failed_validation, nothing queued.
- error: runs, then fails at its second node with the recorded IndexError.
- oom: like error, with exception_type torch.OutOfMemoryError and ComfyUI's OOM tips.
- drop: its client's socket is closed abruptly at the second node; the prompt finishes.
- hang: stops at the second node until interrupted, then execution_interrupted.
- wedge: stops at the second node for good, deaf to interrupts and queue deletes (running in
  /queue, nothing more said of it), as a server whose execution thread is stuck inside a
  node after a CUDA hang.
- slow: ten times the per-node time.
- partial: 200 with non-empty node_errors; its first output node is dropped.
- late: history written 300 ms after execution_success; the prompt stays running in /queue
  until then (ComfyUI takes it off the queue and writes its history in one step).
- silent: its client gets nothing about it after the enqueue `status`; it runs all the same.
- restart: at the second node every socket is cut and queue and history are forgotten,
  as after a crash and restart; the run's outcome is `lost`.
- busy=N: N prompts of another client are queued ahead of this one, which then runs ok.
- cuda: like error, with a CUDA fault as PyTorch raises one on a broken GPU
  (``torch.AcceleratorError``, "CUDA error: an illegal memory access was encountered"),
  in the shape of ComfyUI's execution.py (``"{ex}\n{tips}"``, no tips).
- disk: fails in its first saving node with the recorded full disk (full_disk.json:
  ``OSError``, "[Errno 28] No space left on device"), as every prompt that saves a file
  does on a host whose output disk is full.

A script's ``default`` word is taken once the words are used up ("ok" unless given): a
server made with ``default="disk"`` (``--default-word disk``) fails every prompt.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import SupportsIndex, overload

WORDS = frozenset(
    {
        "ok",
        "500",
        "invalid",
        "error",
        "oom",
        "drop",
        "hang",
        "wedge",
        "slow",
        "partial",
        "late",
        "silent",
        "restart",
        "cuda",
        "disk",
    }
)


def check_word(word: str) -> str:
    """Returns the word stripped; raises ValueError for a word the fake does not know."""
    if not isinstance(word, str):
        raise ValueError(f"script words are strings, got {word!r}")
    word = word.strip()
    if word in WORDS:
        return word
    if word.startswith("busy="):
        count = word.removeprefix("busy=")
        if count.isdigit():
            return f"busy={int(count)}"
    raise ValueError(f"unknown script word {word!r}; known: {sorted(WORDS)} and busy=N")


def busy_count(word: str) -> int:
    """N of a `busy=N` word, 0 for any other word."""
    return int(word.removeprefix("busy=")) if word.startswith("busy=") else 0


class Script(list[str]):
    """A plain list of words that refuses unknown words as they are added.

    `take()` pops the next word ("ok" when empty); the server calls it once per POST.
    """

    def __init__(self, words: Iterable[str] = (), default: str = "ok") -> None:
        super().__init__(check_word(w) for w in words)
        self.default = check_word(default)

    def append(self, word: str) -> None:
        super().append(check_word(word))

    def extend(self, words: Iterable[str]) -> None:
        super().extend([check_word(w) for w in words])

    def insert(self, index: SupportsIndex, word: str) -> None:
        super().insert(index, check_word(word))

    def __iadd__(self, words: Iterable[str]) -> Script:  # type: ignore[override]
        self.extend(words)
        return self

    @overload
    def __setitem__(self, index: SupportsIndex, word: str) -> None: ...

    @overload
    def __setitem__(self, index: slice, word: Iterable[str]) -> None: ...

    def __setitem__(self, index: SupportsIndex | slice, word: str | Iterable[str]) -> None:
        if isinstance(index, slice):
            super().__setitem__(index, [check_word(w) for w in word])
        else:
            super().__setitem__(index, check_word(word))  # type: ignore[arg-type]

    def take(self) -> str:
        """The next word, removed from the script; ``default`` once it is used up."""
        try:
            return self.pop(0)
        except IndexError:
            return self.default
