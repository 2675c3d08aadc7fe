"""The JSON client of the server adapters (SGLang, vLLM server): a control call answers
while more requests wait than a connection pool holds; failures name the engine."""

import asyncio

import pytest
from aiohttp import web

from rlferry.control import EngineError
from rlferry.engines._http import JsonClient


async def _server(release: asyncio.Event) -> tuple[web.AppRunner, str]:
    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"done": True})

    async def fast(request: web.Request) -> web.Response:
        return web.json_response({"paused": True})

    async def broken(request: web.Request) -> web.Response:
        return web.json_response({"error": "no"}, status=500)

    app = web.Application()
    app.add_routes([web.post("/slow", slow), web.get("/fast", fast), web.get("/broken", broken)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def test_a_control_call_answers_behind_150_requests_in_flight_and_errors_name_the_engine():
    async def main():
        release = asyncio.Event()
        runner, url = await _server(release)
        client = JsonClient("server0", url)
        try:
            parked = [asyncio.ensure_future(client.call("POST", "/slow", {}, timeout=60))
                      for _ in range(150)]  # fmt: skip
            assert await asyncio.wait_for(client.call("GET", "/fast", timeout=10), 10) == {
                "paused": True
            }
            release.set()
            assert all(r == {"done": True} for r in await asyncio.gather(*parked))
            with pytest.raises(EngineError) as e:
                await client.call("GET", "/broken", timeout=10)
            assert str(e.value).startswith("engine `server0`: /broken: HTTP 500: ")
            nobody = JsonClient("server0", "http://127.0.0.1:9")  # nothing listens on port 9
            with pytest.raises(EngineError, match=r"engine `server0`: /fast: unreachable"):
                await nobody.call("GET", "/fast", timeout=5)
            await nobody.aclose()
        finally:
            await client.aclose()
            await runner.cleanup()

    asyncio.run(main())
