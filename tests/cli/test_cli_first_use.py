"""What a new user meets first on the command line: each command's ``--help`` says what
it does before its options; a run whose servers never answer ends soon, naming each."""

from __future__ import annotations

from pathlib import Path

import pytest

from comfy_assets.cli.main import COMMANDS, build_parser, main
from comfy_assets.pool import probing
from tests.support import free_port, write_jobs


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_commands_help_opens_with_what_it_does(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (listed,) = [
        action.help
        for sub in build_parser()._subparsers._group_actions  # type: ignore[union-attr]
        for action in sub._choices_actions
        if action.dest == command
    ]
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    usage, first = text.split("\n\n")[:2]
    assert usage.startswith(f"usage: comfy-assets {command} ")
    said = " ".join(first.split())
    assert said == f"{listed[0].upper()}{listed[1:]}."


def test_a_run_whose_servers_never_answered_stops_naming_each_and_why(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The patience for servers that never answered, shortened so the test is quick; the
    # run keeps its default --unreachable-timeout-s (600 s).
    monkeypatch.setattr(probing, "NEVER_ANSWERED_S", 0.2)
    jobs = write_jobs(tmp_path / "jobs", 2)
    ports = [free_port(), free_port()]
    code = main(
        [
            "run",
            "--jobs",
            str(jobs),
            "--server",
            f"gpu0=http://127.0.0.1:{ports[0]}",
            "--server",
            f"gpu1=http://127.0.0.1:{ports[1]}",
            "--store",
            str(tmp_path / "store"),
            "--unhealthy-wait-s",
            "0.05",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1
    (stopped,) = [line for line in out.splitlines() if line.startswith("stopped: ")]
    for name, port in zip(("gpu0", "gpu1"), ports, strict=True):
        assert f"{name} unreachable: " in stopped
        assert f"connection refused (http://127.0.0.1:{port})" in stopped
    assert "; none has answered in the 0.2 s since the batch started" in stopped
    first = [r.getMessage() for r in caplog.records if "gpu0 unreachable" in r.getMessage()][0]
    assert first.endswith("; no server has answered yet: the batch stops in 0.2 s unless one does")
