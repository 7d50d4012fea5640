"""CPU per HTTP request of the clients a runner could use, on one fake ComfyUI process.

    python bench/http_clients.py                 # 2,000 requests per client and route
    python bench/http_clients.py --requests 4000

Each client sends ``--requests`` requests one after the other over one kept-alive
connection (urllib, as bench/bare_client.py does, opens one per request): ``GET /queue``
(a small JSON answer) and ``POST /prompt`` of a prompt the fake rejects (400, so nothing
runs). The CPU is this process's own (``time.process_time``: the fake is another
process), divided by the requests: ``cpu_us_per_request_<client>_<route>``. Clients:
``httpx`` (``httpx.AsyncClient``, what ``comfy_assets.comfy.client`` uses),
``httpx_aiohttp`` (the same client over the ``httpx-aiohttp`` package's transport: not a
dependency, measured when installed), ``httpcore`` (httpx's own connection pool, without
httpx's request and response models), ``aiohttp`` (``aiohttp.ClientSession``) and
``urllib`` (the standard library, blocking).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fake_processes, scratch_dir

# A prompt the fake refuses (no output node): a 400 with ComfyUI's error body.
REJECTED = json.dumps({"prompt": {"1": {"class_type": "EmptyImage", "inputs": {}}}}).encode()


async def timed(n: int, send: Callable[[], Awaitable[None]]) -> float:
    """Microseconds of this process's CPU per call of ``send`` (after 50 to warm up)."""
    for _ in range(50):
        await send()
    started = time.process_time()
    for _ in range(n):
        await send()
    return (time.process_time() - started) / n * 1e6


async def with_httpx(url: str, n: int) -> dict[str, float]:
    import httpx

    async with httpx.AsyncClient(base_url=url, verify=False) as client:

        async def get() -> None:
            (await client.get("/queue")).json()

        async def post() -> None:
            await client.post("/prompt", content=REJECTED)

        return {"get": await timed(n, get), "post": await timed(n, post)}


async def with_httpx_aiohttp(url: str, n: int) -> dict[str, float]:
    import httpx
    from httpx_aiohttp import AiohttpTransport

    transport = AiohttpTransport(verify=False)
    async with httpx.AsyncClient(base_url=url, transport=transport) as client:

        async def get() -> None:
            (await client.get("/queue")).json()

        async def post() -> None:
            await client.post("/prompt", content=REJECTED)

        return {"get": await timed(n, get), "post": await timed(n, post)}


async def with_httpcore(url: str, n: int) -> dict[str, float]:
    import httpcore

    async with httpcore.AsyncConnectionPool() as pool:

        async def get() -> None:
            json.loads((await pool.request("GET", f"{url}/queue")).content)

        async def post() -> None:
            await pool.request("POST", f"{url}/prompt", content=REJECTED)

        return {"get": await timed(n, get), "post": await timed(n, post)}


async def with_aiohttp(url: str, n: int) -> dict[str, float]:
    import aiohttp

    async with aiohttp.ClientSession(url) as session:

        async def get() -> None:
            async with session.get("/queue") as response:
                await response.json()

        async def post() -> None:
            async with session.post("/prompt", data=REJECTED) as response:
                await response.read()

        return {"get": await timed(n, get), "post": await timed(n, post)}


async def with_urllib(url: str, n: int) -> dict[str, float]:
    async def get() -> None:
        with urllib.request.urlopen(f"{url}/queue") as response:
            json.loads(response.read())

    async def post() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(f"{url}/prompt", data=REJECTED))
        except urllib.error.HTTPError as answer:
            answer.read()

    return {"get": await timed(n, get), "post": await timed(n, post)}


CLIENTS = {
    "httpx": with_httpx,
    "httpx_aiohttp": with_httpx_aiohttp,
    "httpcore": with_httpcore,
    "aiohttp": with_aiohttp,
    "urllib": with_urllib,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="per client and route")
    args = parser.parse_args()
    with fake_processes(1, 0.0, scratch_dir()) as (fake,):
        for name, run in CLIENTS.items():
            try:
                figures = asyncio.run(run(fake.url, args.requests))
            except ModuleNotFoundError as e:  # httpx-aiohttp is not a dependency
                print(f"# {name} not measured: {e}", file=sys.stderr)
                continue
            for route, us in figures.items():
                print(f"cpu_us_per_request_{name}_{route}={us:.1f}")


if __name__ == "__main__":
    main()
