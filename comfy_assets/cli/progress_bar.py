"""The progress bar ``comfy-assets run`` shows on a terminal (tqdm): jobs ended of the
batch, done and dead-lettered, the estimate of the time left (``render/eta.py``), why
the jobs left wait and how far the running prompts are (``node 3/7 KSampler, step
14/20``), refreshed every few seconds; the batch's lines print above it. Output that is
not a terminal gets the lines alone."""

from __future__ import annotations

from typing import TextIO

from tqdm import tqdm

from comfy_assets.render.eta import format_left
from comfy_assets.render.progress import Progress

BAR_FORMAT = "{n_fmt}/{total_fmt} jobs |{bar}| {desc} [{elapsed}, {rate_fmt}]"


class ProgressBar:
    """A bar of ``total`` jobs on ``stream`` (a terminal). ``line`` prints a line above the
    bar, ``update`` takes the batch's Progress (from any thread: tqdm locks), ``close``
    leaves the final bar on its own line."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.stream = stream
        self.bar = tqdm(
            total=total,
            unit="job",
            file=stream,
            bar_format=BAR_FORMAT,
            dynamic_ncols=True,
            desc="0 done",
        )

    def line(self, text: str) -> None:
        """Print ``text`` above the bar."""
        self.bar.write(text, file=self.stream)

    def update(self, progress: Progress) -> None:
        """Show ``progress``: ended jobs fill the bar; done and dead letters are counted,
        then the estimate, the reasons and the running prompts (``Progress.lines``)."""
        text = f"{progress.done} done"
        if progress.dead_lettered:
            text += f", {progress.dead_lettered} dead-lettered"
        if progress.not_run:
            text += f", {progress.not_run} not run"
        if progress.remaining and progress.estimate_s is not None:
            text += ", " + format_left(progress.estimate_s)
        waiting = progress.waiting_line()
        if waiting:
            text += "; " + waiting
        if progress.running:  # the first running prompt: the bar is one line
            more = len(progress.running) - 1
            text += "; " + progress.running[0] + (f" (+{more} more)" if more else "")
        self.bar.set_description_str(text, refresh=False)
        self.bar.update(progress.ended - self.bar.n)
        self.bar.refresh()

    def close(self) -> None:
        """End the bar (it stays on screen, above the summary)."""
        self.bar.close()
