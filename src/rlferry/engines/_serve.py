"""``rlferry serve engine``: an engine (``HFEngine`` or ``VLLMEngine``) in its own process,
served over HTTP."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from typing import Any

from rlferry.errors import RequestError

__all__ = ["ENGINES", "serve_engine"]

ENGINES = ("hf", "vllm")


def _vllm_engine(
    model: str, name: str | None, device: Any, max_batch: int, max_model_len: int | None
) -> Any:
    """A ``VLLMEngine`` of ``model`` as the demo and ``serve engine`` run it: token ids in
    and out (no tokenizer), eager, the checkpoint's dtype (float32 on the CPU)."""
    if device is not None and str(device) != "cpu" and not str(device).startswith("cuda"):
        raise RequestError(f"--device: expected cpu or cuda[:N] for vllm, got {device!r}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU
    if device is not None and str(device).startswith("cuda:"):  # vLLM takes the first visible
        os.environ["CUDA_VISIBLE_DEVICES"] = str(device).partition(":")[2]
    from .vllm import VLLMEngine

    args: dict[str, Any] = {"skip_tokenizer_init": True, "enforce_eager": True,
                            "max_num_seqs": max_batch,
                            "max_model_len": max_model_len or 512}  # fmt: skip
    return VLLMEngine(model, name=name, **args)


def _lower_priority(nice: int) -> None:
    """This process's threads, those there now (Linux: each has its own) and those made
    after (they inherit it), ``nice`` lower in CPU priority."""
    value = os.nice(nice)
    tasks = "/proc/self/task"
    for tid in os.listdir(tasks) if os.path.isdir(tasks) else []:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), value)
        except ProcessLookupError:  # the thread ended since the listing: nothing to lower
            continue


def serve_engine(
    model: str,
    *,
    engine: str = "hf",
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    name: str | None = None,
    device: Any = None,
    max_batch: int = 64,
    max_model_len: int | None = None,
    nice: int = 0,
    lora: Any = None,
) -> None:
    """Load ``model`` (a local directory) in ``engine`` (``"hf"``: ``HFEngine``,
    ``"vllm"``: ``VLLMEngine``, the ``[vllm]`` extra), serve it until SIGINT/SIGTERM, print
    ``engine URL NAME`` once it answers. The token is checked before the model loads.
    ``nice``: how much lower this process's CPU priority is (every thread's). ``lora``: a
    :class:`~rlferry.engines.lora.LoraConfig`: ``HFEngine`` serves base + that adapter."""
    from rlferry.control import EngineServer

    if engine not in ENGINES:
        raise RequestError(f"--engine: expected one of {', '.join(ENGINES)}, got {engine!r}")
    if type(nice) is not int or not 0 <= nice <= 19:
        raise RequestError(f"--nice: expected an int in [0, 19], got {nice!r}")
    if lora is not None and engine != "hf":
        raise RequestError(
            "--lora: expected --engine hf (VLLMEngine serves adapters through vLLM's LoRA "
            "support: see the engines guide)"
        )
    if nice:
        _lower_priority(nice)

    async def main() -> None:
        if engine == "vllm":
            e = _vllm_engine(model, name, device, max_batch, max_model_len)
        else:
            from .hf import HFEngine

            e = HFEngine(
                model, name=name, device=device, max_batch=max_batch, max_model_len=max_model_len,
                lora=lora,
            )  # fmt: skip
        try:
            server = EngineServer(e, host, port, token=token)
            url = await server.start()
            gc.freeze()  # the model and the libraries: kept for good, not scanned by the GC
            print(f"engine {url} {e.name}", flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            await server.aclose()
        finally:
            await e.aclose()

    EngineServer.check_bind(host, token)
    asyncio.run(main())
    # the engine's objects freed while the process lives (gc.freeze kept their cycles): what
    # it opened of a trainer's GPU memory (cuda_ipc) is let go of, and the trainer can free it
    gc.unfreeze()
    gc.collect()
