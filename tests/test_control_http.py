"""Engines in their own processes, driven over HTTP: completions pushed, deaths noticed."""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgspec
import pytest

from rlferry import errors
from rlferry.control import (
    Coordinator,
    EngineClosed,
    EngineError,
    EngineServer,
    GenerateRequest,
    RemoteEngine,
    RequestError,
    SamplingParams,
)
from rlferry.wire import SecurityError

transformers = pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")
from rlferry.engines.hf import HFEngine  # noqa: E402
from rlferry.weights import WeightSender  # noqa: E402
from test_control import perturbed, tiny_model  # noqa: E402

TOKEN = "a token of the whole job, 32 B.."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tiny_model(0).save_pretrained(path)
    return str(path)


def serve(model_dir: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "rlferry.cli", "serve", "engine", "--model", model_dir, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("engine http://127.0.0.1:"), line
    return proc, line.split()[1]


@contextlib.asynccontextmanager
async def in_process_server(name: str, token: str | None = None):
    """An HFEngine of the tiny model served by an EngineServer in this process: its URL."""
    engine = HFEngine(tiny_model(0), name=name)
    server = EngineServer(engine, "127.0.0.1", 0, token=token)
    try:
        yield await server.start()
    finally:
        await server.aclose()
        engine.close()


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    proc.wait(30)


def test_a_remote_engine_generates_what_the_same_engine_does_in_process(model_dir):
    proc, url = serve(model_dir, "--name", "far")

    async def main():
        remote = RemoteEngine(url)
        local = HFEngine(tiny_model(0), name="near")
        params = SamplingParams(max_tokens=8, temperature=0.0)
        try:
            request = GenerateRequest(request_id="a", prompt_ids=[3, 1, 4, 1, 5], params=params)
            far, near = await asyncio.gather(remote.generate(request), local.generate(request))
            assert far.token_ids == near.token_ids and far.engine == "far"
            assert far.versions == [0] * 8 and len(far.logprobs) == 8
            await remote.pause("keep")
            assert await remote.is_paused()
            await remote.resume()
            assert not await remote.is_paused()
            stats = await remote.statistics()
            assert stats.name == "far" and stats.finished == 1
        finally:
            await remote.aclose()
            local.close()

    try:
        asyncio.run(main())
    finally:
        stop(proc)


def test_a_control_call_answers_while_more_generates_wait_than_a_connection_pool_holds():
    async def main():
        async with in_process_server("busy") as url:
            remote = RemoteEngine(url)
            try:
                await remote.pause("keep")
                params = SamplingParams(max_tokens=2, temperature=0.0)
                parked = [
                    asyncio.ensure_future(remote.generate(
                        GenerateRequest(request_id=f"r{i}", prompt_ids=[1, 2, 3], params=params)
                    ))
                    for i in range(150)
                ]  # fmt: skip
                # behind 150 parked generates (aiohttp's default pool holds 100 connections)
                assert await asyncio.wait_for(remote.is_paused(), 10)
                await asyncio.wait_for(remote.resume(), 10)
                done = await asyncio.wait_for(asyncio.gather(*parked), 60)
                assert len({c.request_id for c in done}) == 150
                assert all(len(c.token_ids) == 2 for c in done)
            finally:
                await remote.aclose()

    asyncio.run(main())


@pytest.mark.slow
def test_an_engine_process_killed_mid_update_is_named_and_the_others_move_on(model_dir):
    proc, url = serve(model_dir, "--name", "doomed")

    async def main():
        trainer = tiny_model(0)
        remote = RemoteEngine(url)  # named by its URL here, "doomed" in its process
        local = HFEngine(tiny_model(0), name="local")
        sender = WeightSender(group="kill", transport="shm", receivers=2)
        await asyncio.gather(
            local.init_weight_transfer("kill", sender.address),
            remote.init_weight_transfer("kill", sender.address),
        )
        coord = Coordinator([local, remote], batch_size=2, max_staleness=1)
        state = perturbed(trainer, 1)

        def push(seconds: float):
            os.kill(proc.pid, signal.SIGKILL)  # between pause and push: mid-update
            proc.wait(10)
            return sender.push(state.items(), version=2, timeout=seconds)

        try:
            await coord.update_weights(  # both engines take the first version
                lambda t: sender.push(state.items(), version=1, timeout=t), version=1, timeout=10
            )
            assert await remote.get_weight_version() == 1
            state = perturbed(trainer, 2)
            with pytest.raises(EngineError) as e:
                await coord.update_weights(push, version=2, timeout=10)
            assert e.value.engine == url and list(e.value.failures) == [url]
            assert "did not finish in time" not in str(e.value)  # seen, not waited out
            assert await local.get_weight_version() == 2
            group = await (await coord.submit([1, 2], SamplingParams(max_tokens=2), n=2))
            assert {c.engine for c in group.completions} == {"local"}
        finally:
            await coord.aclose()
            await remote.aclose()
            local.close()
            sender.close()

    try:
        asyncio.run(main())
    finally:
        if proc.poll() is None:
            stop(proc)


@pytest.mark.slow
def test_a_generate_in_flight_on_an_engine_that_dies_fails_at_once(model_dir):
    proc, url = serve(model_dir)

    async def main():
        remote = RemoteEngine(url, name="dies")
        await remote.pause("keep")  # the request waits in the engine
        request = GenerateRequest(request_id="x", prompt_ids=[1, 2], params=SamplingParams())
        waiting = asyncio.ensure_future(remote.generate(request))
        await asyncio.sleep(0.2)  # the request reaches the engine and waits there (paused)
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(EngineError) as e:
            await asyncio.wait_for(waiting, 10)
        # at once, as the connection closes (or, on a slow machine where the request had
        # not reached it yet, is refused): never a timeout
        message = str(e.value)
        assert message.startswith("engine `dies`: /generate_many: ")
        assert "went away" in message or "unreachable" in message
        await remote.aclose()

    try:
        asyncio.run(main())
    finally:
        proc.wait(10)


def test_serve_engine_off_loopback_needs_a_token(model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "rlferry.cli", "serve", "engine", "--model", model_dir,
         "--host", "0.0.0.0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.startswith(
        "rlferry serve engine: SecurityError: bind '0.0.0.0': an engine server off loopback "
        "needs a token"
    )


def test_serve_engine_nice_lowers_its_priority_and_a_bad_one_is_refused(model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "rlferry.cli", "serve", "engine", "--model", model_dir,
         "--nice", "25"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr == (
        "rlferry serve engine: RequestError: --nice: expected an int in [0, 19], got 25\n"
    )
    proc, _ = serve(model_dir, "--nice", "5")
    try:  # every thread of the engine, made after the nice, has it
        tasks = os.listdir(f"/proc/{proc.pid}/task")
        stats = [Path(f"/proc/{proc.pid}/task/{t}/stat").read_text() for t in tasks]
        nices = {int(st.rsplit(")", 1)[1].split()[16]) for st in stats}  # field 19: nice
        assert nices == {os.getpriority(os.PRIO_PROCESS, 0) + 5}
    finally:
        stop(proc)


def test_requests_of_one_turn_travel_together_each_answered_as_it_ends_a_bad_one_alone():
    async def main():
        async with in_process_server("many") as url:
            remote = RemoteEngine(url, name="many")
            sent: list[str] = []

            async def on_request(session, context, params):  # what went over HTTP
                sent.append(params.url.path)

            try:
                await remote.pause("keep")  # all start together when it resumes
                trace = aiohttp.TraceConfig()
                trace.on_request_start.append(on_request)
                remote._client()._trace_configs.append(trace)
                trace.freeze()

                def request(rid: str, n: int, prompt: list[int]) -> GenerateRequest:
                    params = SamplingParams(max_tokens=n, temperature=0.0)
                    return GenerateRequest(request_id=rid, prompt_ids=prompt, params=params)

                long = asyncio.ensure_future(remote.generate(request("long", 120, [1, 2])))
                short = [asyncio.ensure_future(remote.generate(request(f"s{i}", 1, [3, i])))
                         for i in range(4)]  # fmt: skip
                bad = asyncio.ensure_future(remote.generate(request("bad", 1, [10**6])))
                await asyncio.sleep(0.2)
                assert sent == ["/generate_many"]  # six requests, one exchange
                await remote.resume()
                with pytest.raises(RequestError) as e:  # the refused request fails alone
                    await asyncio.wait_for(bad, 30)
                assert "token id" in str(e.value) and e.value.engine == "many"
                finished = await asyncio.wait_for(asyncio.gather(*short), 30)
                assert [c.request_id for c in finished] == ["s0", "s1", "s2", "s3"]
                # each was answered as it ended, not with the exchange: the long one still runs
                assert await remote.abort_requests(["long"]) == 1
                assert (await asyncio.wait_for(long, 60)).finish_reason == "abort"
            finally:
                await remote.aclose()

    asyncio.run(main())


def test_a_client_that_goes_away_mid_exchange_leaves_the_server_serving(caplog):
    async def main():
        async with in_process_server("left") as url:
            leaving = RemoteEngine(url)
            await leaving.pause("keep")
            params = SamplingParams(max_tokens=4, temperature=0.0)
            orphans = [asyncio.ensure_future(leaving.generate(
                GenerateRequest(request_id=f"o{i}", prompt_ids=[1, 2], params=params)))
                for i in range(3)]  # fmt: skip
            await asyncio.sleep(0.2)  # the exchange is open, its requests wait in the engine
            await leaving.aclose()  # gone before any frame
            for o in orphans:  # their callers are told at once, never left waiting
                with pytest.raises(EngineError, match="this RemoteEngine was closed"):
                    await asyncio.wait_for(o, 10)
            staying = RemoteEngine(url)
            await staying.resume()
            done = await asyncio.wait_for(staying.generate(
                GenerateRequest(request_id="s", prompt_ids=[3], params=params)), 30)  # fmt: skip
            assert len(done.token_ids) == 4
            stats = await staying.statistics()  # the orphans ended (aborted, or ran out)
            assert stats.finished + stats.aborted == 4 and stats.running == 0
            await staying.aclose()

    with caplog.at_level("ERROR"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


def test_a_server_with_a_token_refuses_requests_without_it():
    async def main():
        async with in_process_server("guarded", token=TOKEN) as url:
            stranger = RemoteEngine(url, name="guarded")
            with pytest.raises(SecurityError) as e:
                await stranger.is_paused()
            await stranger.aclose()
            assert str(e.value) == (
                "engine `guarded`: /is_paused: the server needs a token and this client has "
                "none (pass token= the server's --token)"
            )
            wrong = RemoteEngine(url, name="guarded", token="another token of 32 bytes......")
            with pytest.raises(SecurityError) as e:
                await wrong.generate(GenerateRequest(request_id="a", prompt_ids=[1]))
            await wrong.aclose()
            assert str(e.value) == (
                "engine `guarded`: /generate_many: the server refused this client's token (pass "
                "token= the one the server was started with, its --token)"
            )
            good = RemoteEngine(url, token=TOKEN)
            assert await good.is_paused() is False
            await good.aclose()

    asyncio.run(main())
    with pytest.raises(SecurityError) as e:
        EngineServer.check_bind("127.0.0.1", "short")
    assert str(e.value).startswith("token: expected at least 16 bytes, got 5")


def test_a_remote_engine_after_aclose_raises_closed_and_close_is_deprecated():
    async def main():
        engine = HFEngine(tiny_model(0), name="served")
        async with EngineServer(engine) as server:  # started on entry
            async with RemoteEngine(server.url, name="far") as remote:
                assert await remote.is_paused() is False
            await remote.aclose()  # a second close does nothing
            for call in (remote.is_paused(), remote.generate(GenerateRequest(
                    request_id="late", prompt_ids=[1]))):  # fmt: skip
                with pytest.raises(EngineClosed) as e:
                    await call
                assert isinstance(e.value, errors.Closed) and e.value.gone
            assert str(e.value) == (
                "engine `far`: /generate_many: this RemoteEngine was closed (aclose())"
            )
            old = RemoteEngine(server.url)
            with pytest.warns(
                DeprecationWarning,
                match=r"RemoteEngine.close\(\) is deprecated",
            ):
                await old.close()
        with pytest.raises(EngineClosed, match=r"EngineServer\.start after aclose"):
            await server.start()
        assert (await engine.statistics()).name == "served"  # the engine is the caller's
        await engine.aclose()

    asyncio.run(main())


def test_engine_server_close_is_a_deprecated_alias_of_aclose():
    async def main():
        async with HFEngine(tiny_model(0), name="e") as engine:
            server = EngineServer(engine)
            await server.start()
            with pytest.warns(
                DeprecationWarning,
                match=r"EngineServer.close\(\) is deprecated",
            ):
                await server.close()
            async with aiohttp.ClientSession() as session:
                with pytest.raises(aiohttp.ClientConnectorError):
                    await session.get(server.url + "/is_paused")

    asyncio.run(main())


def test_a_generate_many_stream_read_in_any_cuts_gives_every_frame_once_in_order():
    from rlferry.control._engine import Completion
    from rlferry.control._http import LENGTH, Frame, split_frames

    done = Completion(
        request_id="a", prompt_ids=[1], token_ids=list(range(300)), logprobs=[0.0] * 300,
        versions=[3] * 300, finish_reason="length", engine="e",
    )  # fmt: skip
    frames = [
        Frame(at=0, done_ns=1, completion=done),
        Frame(at=2, done_ns=2, kind="RequestError", message="bad prompt"),
        Frame(at=1, done_ns=3, kind="EngineError", message="lost", gone=True),
    ]
    encoded = [msgspec.msgpack.encode(f) for f in frames]
    stream = b"".join(LENGTH.pack(len(b)) + b for b in encoded)
    for cut in (1, 3, 4, 5, 64, len(stream)):  # inside a length, a body, between frames
        buf, got = bytearray(), []
        for start in range(0, len(stream), cut):
            buf += stream[start : start + cut]
            whole, used = split_frames(buf)
            del buf[:used]
            got += whole
        assert got == frames and not buf, cut
