"""How long a pool waits for its servers, and that its lines say so: a server that
answered once and went away is waited for ``unreachable_timeout_s`` (its first line names
the option); servers that never answered, ``NEVER_ANSWERED_S`` at most."""

from __future__ import annotations

import asyncio

import pytest

from comfy_assets.comfy.errors import NoServerReachable
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.pool import probing
from comfy_assets.pool.pool import Pool
from comfy_assets.pool.settings import PoolSettings
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import free_port


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "comfy_assets.pool"]


async def test_a_server_that_went_away_is_waited_for_as_its_first_line_says(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    settings = PoolSettings(unreachable_timeout_s=0.3, unhealthy_wait_s=0.05)
    servers = [ServerSpec("gpu0", f"http://127.0.0.1:{port}")]
    async with Pool(servers, Store(tmp_path / "s"), owner="me", settings=settings) as pool:
        async with FakeComfy().serve(port=port):
            (await pool.acquire()).release()  # it answered
        with pytest.raises(NoServerReachable) as stopped:
            await pool.acquire()
    assert "no server reachable for " in str(stopped.value)
    went, *then = [line for line in warnings(caplog) if line.startswith("server gpu0 unreachable")]
    patience = "; the batch waits up to 0.3 s for a server to answer (--unreachable-timeout-s)"
    assert went.endswith(patience)
    assert not any(patience in line for line in then)  # a new reason is not a new absence


async def test_servers_that_never_answered_are_given_up_on_sooner_naming_each(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(probing, "NEVER_ANSWERED_S", 0.2)
    settings = PoolSettings(unreachable_timeout_s=3600, unhealthy_wait_s=0.05)
    servers = [ServerSpec(f"gpu{i}", f"http://127.0.0.1:{free_port()}") for i in range(2)]
    async with Pool(servers, Store(tmp_path / "s"), owner="me", settings=settings) as pool:
        with pytest.raises(NoServerReachable) as stopped:
            await pool.acquire()
    assert set(stopped.value.reasons) == {"gpu0", "gpu1"}
    for spec in servers:
        assert f"{spec.name} unreachable: " in str(stopped.value)
        assert f"connection refused ({spec.url})" in str(stopped.value)
    assert str(stopped.value).endswith("; none has answered in the 0.2 s since the batch started")
    assert len([line for line in warnings(caplog) if "no server has answered yet" in line]) == 2


async def test_a_pool_without_patience_says_nothing_of_it(tmp_path, caplog) -> None:
    # The worker waits for its servers for ever: its lines promise no end.
    port = free_port()
    settings = PoolSettings(unreachable_timeout_s=None, unhealthy_wait_s=0.05)
    servers = [ServerSpec("gpu0", f"http://127.0.0.1:{port}")]
    async with Pool(servers, Store(tmp_path / "s"), owner="me", settings=settings) as pool:
        with pytest.raises(TimeoutError):  # it would wait for ever
            await asyncio.wait_for(pool.acquire(), 0.5)
    assert warnings(caplog) == [
        f"server gpu0 unreachable: ServerUnreachable: gpu0: GET /system_stats: connection "
        f"refused (http://127.0.0.1:{port})"
    ]
