"""``comfy-assets health`` and the server list it reads."""

from __future__ import annotations

import asyncio
import re

import pytest
from aiohttp import web

from comfy_assets.cli.main import main
from comfy_assets.comfy.health import probe
from comfy_assets.comfy.servers import ServerSpec, parse_servers
from fake_comfy import FakeComfy
from tests.comfy.test_client import answering, free_port, raw_server

# -- parse_servers -----------------------------------------------------------------------


def test_named_items_and_comma_separated_strings_give_the_same_servers():
    expected = [
        ServerSpec("gpu0", "http://127.0.0.1:8188"),
        ServerSpec("big", "http://10.0.0.2:8188"),
    ]
    assert parse_servers(["gpu0=http://127.0.0.1:8188", "big=http://10.0.0.2:8188/"]) == expected
    assert parse_servers("gpu0=http://127.0.0.1:8188, big=http://10.0.0.2:8188") == expected
    assert parse_servers(["gpu0=http://127.0.0.1:8188,big=http://10.0.0.2:8188"]) == expected


def test_a_bare_url_is_named_after_its_position():
    assert parse_servers("http://a:1,x=http://b:2,http://c:3") == [
        ServerSpec("gpu0", "http://a:1"),
        ServerSpec("x", "http://b:2"),
        ServerSpec("gpu2", "http://c:3"),
    ]


@pytest.mark.parametrize(
    ("items", "named"),
    [
        (["a=http://h:1", "a=http://h:2"], "a=http://h:2"),
        (["a=http://h:1", "b=http://h:1"], "b=http://h:1"),
        (["a=ftp://h:1"], "a=ftp://h:1"),
        (["a=http://h:port"], "a=http://h:port"),
        (["a=localhost:8188"], "a=localhost:8188"),
        (["a=http://h:1/api"], "a=http://h:1/api"),
        (["bad name=http://h:1"], "bad name=http://h:1"),
    ],
)
def test_bad_items_raise_value_error_naming_the_item(items, named):
    with pytest.raises(ValueError) as info:
        parse_servers(items)
    assert named in str(info.value)


def test_no_server_at_all_is_an_error():
    with pytest.raises(ValueError, match="no server"):
        parse_servers(" , ")


# -- probe -------------------------------------------------------------------------------


async def test_probe_of_a_fake_server_reads_device_memory_and_queue():
    fake = FakeComfy(prompt_seconds=0.01)
    async with fake.serve(port=0) as url:
        health = await asyncio.to_thread(probe, ServerSpec("gpu0", url), timeout_s=3)
    assert health.healthy
    assert health.stats is not None and health.stats.devices
    assert health.queue_length == 0
    assert re.fullmatch(r"gpu0 healthy device=\S+ free_vram_mib=\d+ queue=0", health.line())


async def test_probe_of_a_silent_server_says_it_timed_out():
    async with raw_server("silent") as url:
        health = await asyncio.to_thread(probe, ServerSpec("gpu3", url), timeout_s=0.3)
    assert not health.healthy
    assert health.line() == f"gpu3 unreachable: no answer within 0.3 s ({url})"


# -- the command -------------------------------------------------------------------------


def test_health_prints_one_line_per_server_and_exits_0_when_one_is_healthy(capsys):
    dead = f"http://127.0.0.1:{free_port()}"
    with FakeComfy().serve_in_thread(port=0) as url:
        code = main(["health", "--server", f"gpu0={url}", "--server", f"gpu1={dead}"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert len(lines) == 2
    assert re.fullmatch(r"gpu0 healthy device=cpu free_vram_mib=\d+ queue=0", lines[0])
    assert lines[1] == f"gpu1 unreachable: connection refused ({dead})"


def test_health_exits_1_when_no_server_is_healthy(capsys):
    dead = f"http://127.0.0.1:{free_port()}"
    code = main(["health", "--server", f"gpu1={dead}", "--timeout-s", "1"])
    assert code == 1
    assert capsys.readouterr().out == f"gpu1 unreachable: connection refused ({dead})\n"


def test_a_name_that_does_not_resolve_is_not_called_a_refused_connection(capsys):
    url = "http://no-such-host.invalid:8188"  # .invalid never resolves (RFC 6761)
    code = main(["health", "--server", f"gpu1={url}", "--timeout-s", "2"])
    out = capsys.readouterr().out
    assert code == 1
    assert out == f"gpu1 unreachable: host not found: no-such-host.invalid ({url})\n"


def test_health_exits_2_for_a_bad_server_list(capsys):
    code = main(["health", "--server", "gpu0=nonsense"])
    assert code == 2
    assert "gpu0=nonsense" in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("part", ["head", "body"])
async def test_a_server_that_drips_its_answer_times_out_like_a_silent_one(part):
    async with raw_server(f"drip-{part}") as url:
        health = await asyncio.to_thread(probe, ServerSpec("gpu3", url), timeout_s=0.3)
    assert health.line() == f"gpu3 unreachable: no answer within 0.3 s ({url})"


async def test_a_refusal_with_a_page_of_html_is_one_line(capsys):
    async def handle(request: web.Request) -> web.Response:
        page = "<html>\n<body>\n<h1>Forbidden</h1>\n</body>\n</html>\n"
        return web.Response(status=403, text=page, content_type="text/html")

    async with answering(handle) as url:
        code = await asyncio.to_thread(main, ["health", "--server", f"gpu0={url}"])
    out = capsys.readouterr().out
    assert code == 1
    assert out == (
        "gpu0 unhealthy: unexpected answer: gpu0: GET /system_stats: status 403 "
        f"<html> <body> <h1>Forbidden</h1> </body> </html> ({url})\n"
    )
