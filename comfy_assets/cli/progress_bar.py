"""The progress bar ``comfy-assets run`` shows on a terminal (tqdm): jobs ended of the
batch, done and dead-lettered, the rate and the time left; the batch's lines print above
it. Output that is not a terminal gets the lines alone."""

from __future__ import annotations

from typing import TextIO

from tqdm import tqdm

from comfy_assets.render.progress import Progress

BAR_FORMAT = "{n_fmt}/{total_fmt} jobs |{bar}| {desc} [{elapsed}<{remaining}, {rate_fmt}]"


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
        """Show ``progress``: ended jobs fill the bar; done and dead letters are counted."""
        counts = f"{progress.done} done"
        if progress.dead_lettered:
            counts += f", {progress.dead_lettered} dead-lettered"
        if progress.not_run:
            counts += f", {progress.not_run} not run"
        self.bar.set_description_str(counts, refresh=False)
        self.bar.update(progress.ended - self.bar.n)

    def close(self) -> None:
        """End the bar (it stays on screen, above the summary)."""
        self.bar.close()
