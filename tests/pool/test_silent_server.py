"""A server that takes connections and never answers (a ComfyUI whose event loop is stuck
in a custom node): the batch renders on the others and says why it is not used."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import executed, fake_servers, fast_batch, fast_config, write_jobs


@contextlib.asynccontextmanager
async def silent_server(accepted: list[int]) -> AsyncIterator[str]:
    """A TCP server on 127.0.0.1 that accepts connections and never reads nor answers;
    yields its URL; ``accepted`` gets one item per connection."""
    held: list[asyncio.StreamWriter] = []

    async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        held.append(writer)

    server = await asyncio.start_server(take, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for writer in held:
            writer.close()
        server.close()


async def test_a_server_that_never_answers_is_said_to_give_no_answer(tmp_path, caplog):
    fakes = [FakeComfy(prompt_seconds=0.005), FakeComfy(prompt_seconds=0.005)]
    jf = load_job_file(write_jobs(tmp_path / "jobs", 12))
    store = Store(tmp_path / "store")
    accepted: list[int] = []
    config = fast_config(probe_timeout_s=0.2, unhealthy_wait_s=60.0)
    async with silent_server(accepted) as url, fake_servers(*fakes) as specs:
        servers = [*specs, ServerSpec("silent", url)]
        with caplog.at_level(logging.INFO, logger="comfy_assets.pool"):
            summary = await fast_batch(jf, servers, store, config=config)
    assert summary.done == 12
    assert sum(executed(f, j.prompt_id) for f in fakes for j in jf.jobs) == 12
    assert accepted  # it was asked
    assert "server silent: /object_info not read (no answer in 0.6 s)" in caplog.messages
