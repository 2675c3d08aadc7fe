"""The SGLang adapter against a server that checks every request against SGLang's own
request classes (their fields, read from SGLang's wheel) and answers as SGLang does.

SGLang itself needs a GPU; its wheel is read, not run. ``.ci/run`` downloads it
(``pip download --no-deps sglang==0.5.23``) and names it in ``RLFERRY_SGLANG_WHEEL``.
"""

import ast
import asyncio
import datetime
import os
import zipfile

import pytest
import torch
from aiohttp import web

from rlferry.control import Coordinator, GenerateRequest, SamplingParams

transformers = pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")
WHEEL = os.environ.get("RLFERRY_SGLANG_WHEEL", "")
pytestmark = pytest.mark.skipif(
    not os.path.isfile(WHEEL),
    reason="needs SGLang's wheel for its request classes (RLFERRY_SGLANG_WHEEL: .ci/run "
    "downloads it with `pip download --no-deps sglang==0.5.23`)",
)
from rlferry.engines.sglang import SGLangEngine, SGLangWeights  # noqa: E402

CLASSES = {
    "sglang/srt/managers/io_struct.py": (
        "GenerateReqInput", "PauseGenerationReqInput", "ContinueGenerationReqInput",
        "AbortReq", "InitWeightsUpdateGroupReqInput", "UpdateWeightsFromDistributedReqInput",
        "BaseReq",
    ),
    "sglang/srt/sampling/sampling_params.py": ("SamplingParams",),
}  # fmt: skip


def sglang_fields() -> dict[str, set[str]]:
    """Each request class's field names, read from the wheel's source (not imported:
    SGLang's modules need its GPU stack)."""
    out: dict[str, set[str]] = {}
    with zipfile.ZipFile(WHEEL) as wheel:
        for path, names in CLASSES.items():
            tree = ast.parse(wheel.read(path).decode())
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name in names:
                    out[node.name] = {
                        s.target.id
                        for s in node.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    }
    for name in CLASSES["sglang/srt/managers/io_struct.py"]:
        out[name] |= out["BaseReq"]  # rid and the like: every request has them
    return out


def tiny_model(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


class FakeSGLang:
    """Answers SGLang's routes for a tiny transformers model, after checking each request
    body against the fields of SGLang's class for it. Greedy generation only."""

    def __init__(self, fields: dict[str, set[str]]) -> None:
        self.fields = fields
        self.model = tiny_model(0)
        self.version = "default"
        self.paused = asyncio.Event()
        self.paused.set()  # set: running
        self.pg = None
        self.requests: list[tuple[str, dict]] = []

    def check(self, cls: str, body: dict) -> None:
        unknown = set(body) - self.fields[cls]
        assert not unknown, f"{cls}: fields SGLang does not have: {sorted(unknown)}"

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.check("GenerateReqInput", body)
        self.check("SamplingParams", body["sampling_params"])
        self.requests.append(("generate", body))
        sp = body["sampling_params"]
        ids, logprobs, versions = list(body["input_ids"]), [], []
        for _ in range(sp["max_new_tokens"]):
            await self.paused.wait()  # in_place: the request stays and goes on after continue
            with torch.no_grad():
                logits = self.model(torch.tensor([ids])).logits[0, -1]
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            versions.append(self.version)
            ids.append(token)
            if token in (sp.get("stop_token_ids") or []):
                break
            await asyncio.sleep(0)  # a step boundary: control requests get their turn
        out = ids[len(body["input_ids"]) :]
        spans = []
        for i, v in enumerate(versions):
            if spans and spans[-1]["version"] == v:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": v, "start": i, "end": i + 1})
        meta = {
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, out, strict=True)],
            "finish_reason": {"type": "length" if len(out) == sp["max_new_tokens"] else "stop"},
            "weight_version": self.version, "weight_versions": spans,
        }  # fmt: skip
        return web.json_response({"output_ids": out, "meta_info": meta})

    async def pause(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.check("PauseGenerationReqInput", body)
        assert body["mode"] in ("in_place", "abort"), body
        self.requests.append(("pause", body))
        self.paused.clear()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.check("ContinueGenerationReqInput", body)
        self.paused.set()
        return web.json_response({"status": "ok"})

    async def abort(self, request: web.Request) -> web.Response:
        self.check("AbortReq", await request.json())
        return web.Response()

    async def init_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.check("InitWeightsUpdateGroupReqInput", body)
        self.requests.append(("init", body))
        await asyncio.to_thread(self._join, body)
        return web.json_response({"success": True, "message": "ok"})

    def _join(self, b: dict) -> None:
        """Rank ``rank_offset`` of the group, on the store keys SGLang's
        ``init_custom_process_group`` uses (its group-name prefix, then torch's
        ``_new_process_group_helper`` prefixes, ``NAME/`` and the device's). A plain gloo
        group: this test's process already holds the trainer's group of that name."""
        import torch.distributed as dist

        store = dist.TCPStore(b["master_address"], b["master_port"], b["world_size"], False,
                              timeout=datetime.timedelta(seconds=60))  # fmt: skip
        name = b["group_name"]
        keys = dist.PrefixStore("cpu/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        options._timeout = datetime.timedelta(seconds=60)
        self.pg = dist.ProcessGroupGloo(keys, b["rank_offset"], b["world_size"], options)

    async def update(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.check("UpdateWeightsFromDistributedReqInput", body)
        self.requests.append(("update", body))
        await asyncio.to_thread(self._receive, body)
        self.version = body["weight_version"]
        return web.json_response({"success": True, "message": "ok"})

    def _receive(self, b: dict) -> None:
        import torch.distributed as dist

        params = dict(self.model.state_dict())
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        for name, dtype, shape in zip(b["names"], b["dtypes"], b["shapes"], strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            self.pg.broadcast([t], options).wait()
            with torch.no_grad():
                params[name].copy_(t)

    async def start(self) -> str:
        app = web.Application()
        app.add_routes([
            web.post("/generate", self.generate), web.post("/pause_generation", self.pause),
            web.post("/continue_generation", self.resume), web.post("/abort_request", self.abort),
            web.post("/init_weights_update_group", self.init_group),
            web.post("/update_weights_from_distributed", self.update),
        ])  # fmt: skip
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def close(self) -> None:
        await self.runner.cleanup()


@pytest.fixture(scope="module")
def fields():
    return sglang_fields()


def greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_generate_sends_sglangs_fields_and_reads_its_answer(fields):
    async def main():
        server = FakeSGLang(fields)
        engine = SGLangEngine(await server.start(), name="sgl")
        try:
            params = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(31,), seed=3)
            done = await engine.generate(
                GenerateRequest(request_id="r1", prompt_ids=[1, 2, 3], params=params)
            )
            assert done.token_ids == greedy(server.model, [1, 2, 3], 6)[: len(done.token_ids)]
            assert done.versions == [0] * len(done.token_ids) and done.engine == "sgl"
            sent = server.requests[0][1]
            assert sent["rid"] == "r1" and sent["return_logprob"] is True
            assert sent["sampling_params"]["max_new_tokens"] == 6
            assert sent["sampling_params"]["sampling_seed"] == 3
        finally:
            await engine.aclose()
            await server.close()

    asyncio.run(main())


def test_pause_modes_map_to_sglangs_and_wait_drains_first(fields):
    async def main():
        server = FakeSGLang(fields)
        engine = SGLangEngine(await server.start())
        try:
            await engine.pause("keep")
            await engine.resume()
            await engine.pause("abort")
            await engine.resume()
            running = asyncio.ensure_future(engine.generate(GenerateRequest(
                request_id="w", prompt_ids=[4], params=SamplingParams(max_tokens=20)
            )))  # fmt: skip
            await asyncio.sleep(0.05)  # it is under way
            await engine.pause("wait")  # returns once it has ended, then pauses in place
            assert running.done() and len(running.result().token_ids) == 20
            assert await engine.is_paused()
            modes = [b["mode"] for kind, b in server.requests if kind == "pause"]
            assert modes == ["in_place", "abort", "in_place"]
            await engine.resume()
        finally:
            await engine.aclose()
            await server.close()

    asyncio.run(main())


def test_weights_broadcast_to_the_server_and_its_answers_carry_the_version(fields):
    async def main():
        server = FakeSGLang(fields)
        engine = SGLangEngine(await server.start(), name="sgl")
        trainer = tiny_model(1)
        weights = SGLangWeights([engine], backend="gloo")
        coord = Coordinator([engine], batch_size=2, max_staleness=1)
        try:
            assert await weights.start() is weights
            init = next(b for kind, b in server.requests if kind == "init")
            assert init["rank_offset"] == 1 and init["world_size"] == 2

            async def push(seconds: float) -> None:
                await weights.push(trainer.state_dict().items(), version=1)

            await coord.update_weights(push, version=1, timeout=60)
            for name, t in trainer.state_dict().items():  # bit for bit
                assert torch.equal(server.model.state_dict()[name], t)
            group = await (await coord.submit([1, 2, 3], SamplingParams(max_tokens=4)))
            assert group.completions[0].versions == [1, 1, 1, 1]
            update = next(b for kind, b in server.requests if kind == "update")
            assert update["weight_version"] == "1" and update["group_name"] == "rlferry"
            assert update["names"] == list(trainer.state_dict())
        finally:
            await coord.aclose()
            weights.close()
            await engine.aclose()
            await server.close()

    asyncio.run(main())


def test_the_sglang_engine_refuses_a_weight_sender_and_says_why():
    async def main():
        engine = SGLangEngine("http://127.0.0.1:9", name="sgl")
        with pytest.raises(Exception) as e:
            await engine.init_weight_transfer("g", "ipc:///tmp/x.sock")
        assert "not from a WeightSender: use SGLangWeights" in str(e.value)

    asyncio.run(main())


def test_sglang_weights_init_is_a_deprecated_alias_of_start():
    async def main():
        with SGLangWeights([], backend="gloo", group_name="alone") as weights:  # trainer alone
            with pytest.warns(DeprecationWarning, match=r"weights\.start\(\)"):
                await weights.init()
            await weights.push([("w", torch.zeros(2))], version=1)
        weights.close()  # a second close does nothing

    asyncio.run(main())


def test_a_push_before_start_raises_not_started():
    from rlferry import errors
    from rlferry.engines import NotStarted

    async def main():
        with pytest.raises(NotStarted) as e:
            await SGLangWeights([], backend="gloo").push([], version=1)
        assert isinstance(e.value, errors.Closed) and isinstance(e.value, RuntimeError)
        assert str(e.value) == "SGLangWeights.push: call start() first (the group is not formed)"

    asyncio.run(main())
