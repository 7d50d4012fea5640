"""The progress of a batch as log lines: the first, one every few seconds, the last."""

from __future__ import annotations

from comfy_assets.render.progress import Progress, log_every


def test_progress_is_logged_first_then_every_five_seconds_and_last() -> None:
    now = [100.0]
    lines: list[str] = []
    on_progress = log_every(lines.append, 5.0, clock=lambda: now[0])

    for ended in range(1, 21):  # one job ends every second; the 7th is a dead letter
        dead = 1 if ended >= 7 else 0
        on_progress(Progress(total=20, done=ended - dead, dead_lettered=dead))
        now[0] += 1.0

    assert lines == [
        "1/20 done, 19 left",
        "6/20 done, 14 left",
        "10/20 done, 1 dead-lettered, 9 left",
        "15/20 done, 1 dead-lettered, 4 left",
        "19/20 done, 1 dead-lettered, 0 left",
    ]
