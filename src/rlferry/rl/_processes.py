"""The demo's child processes: engines (``rlferry serve engine``) and trainer ranks, each
started with a bound, all stopped together (also on Ctrl-C); or, with ``--launcher ray``,
the same as Ray actors (:class:`RayProcesses`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from rlferry.errors import RequestError

from .trainer import lora_config, trainer_main

__all__ = ["REPLY_TIMEOUT", "START_TIMEOUT", "Processes", "RayProcesses", "answer", "call",
           "free_port", "start_engine", "start_trainers"]  # fmt: skip

START_TIMEOUT = 300.0  # seconds a process may take to start (it imports torch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Processes:
    """The run's child processes; :meth:`stop` ends them all, also on Ctrl-C."""

    def __init__(self) -> None:
        self.trainers: list[tuple[Any, Connection]] = []
        self.engines: list[subprocess.Popen[str]] = []
        self.engine_of: dict[int, subprocess.Popen[str]] = {}  # the last process of each slot
        self._lock = threading.Lock()
        self._stopped = False

    def add_engine(self, proc: subprocess.Popen[str]) -> None:
        """Keep ``proc`` to stop it; one that starts after :meth:`stop` is stopped at once
        (engines start on threads while the run may already be failing)."""
        with self._lock:
            self.engines.append(proc)
            if self._stopped:
                proc.terminate()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        # the engines first: an engine reads the weights a trainer exports (cuda_ipc) until
        # it exits, and a trainer that exits while its memory is still opened elsewhere
        # cannot free it (torch warns at its exit)
        for proc in self.engines:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 5
        for proc in self.engines:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for _, conn in self.trainers:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop",))
        deadline = time.monotonic() + 2  # a trainer between steps stops at once; else:
        for proc, _ in self.trainers:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def call(conn: Connection, *cmd: Any) -> dict[str, Any]:
    conn.send(cmd)
    return answer(conn)


def answer(conn: Connection) -> dict[str, Any]:
    status, value = conn.recv()
    if status != "ok":
        raise RuntimeError(str(value))
    return dict(value)


def start_trainers(procs: Processes, settings: dict[str, Any]) -> list[str] | None:
    """Start the trainer ranks; the rank 0's sender addresses (None without weight sync).
    The ranks meet at ``settings["port"]``, chosen free beforehand: another process may take
    it before rank 0 listens there, and then the ranks start again on another (twice at
    most)."""
    for attempt in range(3):
        try:
            return _start_trainers(procs, settings)
        except RuntimeError as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
            for proc, conn in procs.trainers:
                proc.terminate()
                proc.join(10)
                conn.close()
            procs.trainers.clear()
            settings["port"] = free_port()
    raise AssertionError("unreachable")


def _start_trainers(procs: Processes, settings: dict[str, Any]) -> list[str] | None:
    ctx = mp.get_context("spawn")
    for rank in range(settings["dp"]):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=trainer_main, args=(rank, child, settings), name=f"rlferry-trainer-{rank}",
            daemon=True,
        )  # fmt: skip
        proc.start()
        child.close()
        procs.trainers.append((proc, parent))
    sender = None
    for rank, (proc, conn) in enumerate(procs.trainers):
        if not conn.poll(START_TIMEOUT):
            raise RuntimeError(f"trainer rank {rank} did not start within {START_TIMEOUT:g} s")
        try:
            status, info = conn.recv()
        except EOFError:
            raise RuntimeError(
                f"trainer rank {rank} died at start (exit code {proc.exitcode})"
            ) from None
        if status != "ready":
            raise RuntimeError(str(info))
        sender = sender or info["sender"]
    return sender


ONE_THREAD = 1
"""The torch (OpenMP) threads of each of a run's processes on the host: the driver, the
engines and the trainer ranks (on Ray, see the demo). Their CPU work is small tensor
operations (scoring, the queue's columns, a batch's padding, sampling's inputs); with a
pool per process as wide as the machine, the pools' waiting threads took the cores from
each other: on one H200 with 16 cores the asynchronous step took 0.156 s with the default
pools and 0.139 with one thread each (the trainer's step 89 against 79 ms beside
generation), and the synchronous one 0.223 against 0.202."""

ENGINE_NICE = 10
"""How much lower an engine process's CPU priority is on the CPU, where the run's processes
share the cores: the trainers' steps and the driver's work between them wait for no
engine's timeslice (on the 2-core VM a default step took 125 ms instead of 135)."""


def start_engine(
    procs: Processes, model_dir: str, i: int, device: str, engine: str, max_batch: int,
    max_model_len: int, lora: int | None = None,
) -> str:  # fmt: skip
    """Start engine ``i``; its URL once it answers. Its stderr and any other output (vLLM
    logs to stdout) go to ``model_dir/engine{i}.log``, read to the end by a thread, so a
    chatty engine never blocks on a full pipe. ``lora``: it serves an adapter of that rank
    (``trainer.lora_config``)."""
    cmd = [sys.executable, "-m", "rlferry.cli", "serve", "engine", "--model", model_dir,
           "--engine", engine, "--name", f"engine{i}", "--device", device,
           "--max-batch", str(max_batch), "--max-model-len", str(max_model_len)]  # fmt: skip
    if lora:
        cfg = lora_config(lora)
        cmd += ["--lora", str(cfg.rank), "--lora-alpha", str(cfg.alpha),
                "--lora-targets", ",".join(cfg.target_modules)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(ONE_THREAD), MKL_NUM_THREADS=str(ONE_THREAD))
    if device == "cpu":  # the driver's and trainers' work comes first: engines generate in
        cmd += ["--nice", str(ENGINE_NICE)]  # the rest
    log_path = os.path.join(model_dir, f"engine{i}.log")
    log = open(log_path, "w")  # noqa: SIM115 - closed by the reader at the engine's end
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    procs.add_engine(proc)
    procs.engine_of[i] = proc
    url: concurrent.futures.Future[str] = concurrent.futures.Future()

    def read(out: Any = proc.stdout) -> None:
        with log:
            for line in out:  # ends at the engine's exit
                if line.startswith("engine ") and not url.done():
                    url.set_result(line.split()[1])
                else:
                    log.write(line)
                    log.flush()
        if not url.done():
            url.set_exception(EOFError())

    threading.Thread(target=read, name=f"rlferry-engine{i}-output", daemon=True).start()
    try:
        return url.result(START_TIMEOUT)  # the engine prints its URL once it answers
    except (EOFError, concurrent.futures.TimeoutError):
        why = "exited" if proc.poll() is not None else f"did not answer in {START_TIMEOUT:g} s"
        with open(log_path) as f:
            tail = f.read()[-2000:]
        raise RuntimeError(f"engine {i} {why}; the end of its log:\n{tail}") from None


# -- on Ray (``rlferry demo --launcher ray``) ---------------------------------------------
REPLY_TIMEOUT = 600.0  # seconds a trainer actor may take to answer a command (a step, a push)


class TrainerActor:
    """A trainer rank as a Ray actor: :func:`trainer_main` on a thread, fed through a pipe
    inside the actor; the driver sends commands and reads answers by actor calls (each in
    its own concurrency group, so they keep their order and a pending read never blocks
    a send). The pipe carries commands only: rollouts come from the queue, weights go
    through the trainer's ``WeightSender``."""

    def __init__(self, rank: int, settings: dict[str, Any]) -> None:
        self._conn, child = mp.Pipe()
        self._ended = threading.Event()

        def main() -> None:
            try:
                trainer_main(rank, child, settings)
            finally:
                self._ended.set()

        threading.Thread(target=main, name=f"rlferry-trainer-{rank}", daemon=True).start()

    def send(self, cmd: tuple[Any, ...]) -> None:
        self._conn.send(cmd)

    def recv(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"the trainer did not answer within {timeout:g} s")
        return self._conn.recv()

    def until_closed(self) -> None:
        """Returns when the trainer's thread ended; Ray fails it when the actor dies."""
        self._ended.wait()


class ActorConn:
    """The driver's end of a :class:`TrainerActor`, with a pipe's ``send`` and ``recv``."""

    def __init__(self, actor: Any) -> None:
        import ray

        self._ray = ray
        self.actor = actor

    def send(self, cmd: tuple[Any, ...]) -> None:
        ref = self.actor.send.options(concurrency_group="send").remote(cmd)
        self._ray.get(ref, timeout=START_TIMEOUT)

    def recv(self, timeout: float = REPLY_TIMEOUT) -> Any:
        ref = self.actor.recv.options(concurrency_group="recv").remote(timeout)
        return self._ray.get(ref, timeout=timeout + START_TIMEOUT)


RAY_CONNECT_TIMEOUT = 5.0
"""How long a Ray head's address may take to accept a connection (Ray itself waits for a
GCS that is not there for minutes)."""


def check_ray_address(address: str) -> None:
    """Raise ``ValueError`` unless ``address`` (``host:port`` or ``ray://host:port``; ``auto``
    is Ray's to find) accepts a TCP connection within :data:`RAY_CONNECT_TIMEOUT`."""
    if address == "auto":
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RequestError(
            f"ray_address: expected HOST:PORT of a running Ray head (as `ray start --head` "
            f"prints it), ray://HOST:PORT or auto, got {address!r}"
        )
    try:
        socket.create_connection((host, int(port)), timeout=RAY_CONNECT_TIMEOUT).close()
    except OSError as e:
        raise RequestError(
            f"ray_address: expected a running Ray head at {address!r}, got no connection "
            f"within {RAY_CONNECT_TIMEOUT:.0f} s ({e}); start one with `ray start --head`, "
            "or drop --ray-address for a local Ray"
        ) from None


class RayProcesses:
    """The run's actors on Ray: the queue's services, the engines, the trainer ranks (one
    STRICT_PACK group: one node, as the ranks' gloo group and the shm weights need; on
    CUDA see :meth:`place_gpus`).
    Joins the Ray cluster at ``address`` (None: the one this process is connected to, else
    a local Ray it starts and stops). :meth:`stop` removes everything, also on Ctrl-C."""

    def __init__(self, address: str | None, job: str) -> None:
        import ray

        self._ray = ray
        self.job = job
        if address:  # also when this process is connected already: it is told, not ignored
            check_ray_address(address)
        self.started = not ray.is_initialized()
        if self.started:  # a local Ray: logical CPUs for every actor, whatever the cores
            opts = {"address": address} if address else {"num_cpus": 16}
            ray.init(include_dashboard=False, log_to_driver=False, **opts)
        self.trainers: list[tuple[Any, ActorConn]] = []
        self._closing: list[Any] = []
        self._pg: Any = None
        self._share = 0.0
        self.engine_actors: Any = None  # the RayEngines, once started

    def start_queue(self) -> Any:
        from rlferry.ray import RayQueue

        q = RayQueue.start(self.job, storage_units=1, cpus_per_unit=0.25)
        self._closing.append(q)
        return q

    def place_gpus(self, dp: int, engines: int) -> None:
        """On CUDA: one GPU bundle per trainer rank, on one node (STRICT_PACK: the ranks'
        NCCL group meets on the loopback); the engines share rank 0's GPU (bundle 0), as
        the colocated layout has them, so that its weights reach them by cuda_ipc
        whichever GPU Ray gives that bundle."""
        from rlferry.ray import place

        self._share = 1 / (engines + 1)  # of bundle 0's GPU: each engine and rank 0
        cpus = 0.25 * (engines + 1)
        bundles = [{"GPU": 1.0, "CPU": cpus}] + [{"GPU": 1.0, "CPU": 0.25}] * (dp - 1)
        self._pg = place(bundles, "STRICT_PACK", name=f"rlferry/{self.job}/gpus",
                         what=f"job `{self.job}`: GPUs", ready_timeout=60.0)  # fmt: skip

    def start_engines(self, model_dir: str, n: int, device: str, engine: str,
                      max_batch: int, max_model_len: int, lora: int | None = None,
                      max_restarts: int = 0) -> list[Any]:  # fmt: skip
        from rlferry.ray import RayEngines

        options: dict[str, Any] = {"max_batch": max_batch, "max_model_len": max_model_len}
        if lora:
            options["lora"] = lora_config(lora)
        if engine == "hf":
            options["device"] = "cuda:0" if device == "cuda" else device  # its own GPU
        else:  # VLLMEngine as serve engine makes it: token ids in and out, eager
            options.update(skip_tokenizer_init=True, enforce_eager=True, max_num_seqs=max_batch)
            del options["max_batch"]
        gpu: dict[str, Any] = {}
        if device == "cuda":
            gpu = {"gpus_per_engine": self._share, "bundle": (self._pg, 0)}
        engines = RayEngines.start(self.job, model_dir, engines=n, engine=engine,
                                   cpus_per_engine=0.25, options=options,
                                   max_restarts=max_restarts, **gpu)  # fmt: skip
        self._closing.append(engines)
        self.engine_actors = engines
        return list(engines.engines)

    def start_trainers(self, settings: dict[str, Any]) -> list[str] | None:
        from rlferry.ray import place

        r = self._ray
        dp = settings["dp"]
        cuda = settings["device"] == "cuda"
        if not cuda:
            self._pg = place([{"CPU": 0.25}] * dp, "STRICT_PACK",
                             name=f"rlferry/{self.job}/trainers",
                             what=f"job `{self.job}`: trainers", ready_timeout=60.0)  # fmt: skip
        strategy = r.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        cls = r.remote(concurrency_groups={"send": 1, "recv": 1, "watch": 1})(TrainerActor)
        for rank in range(dp):
            gpus = (self._share if rank == 0 else 1.0) if cuda else 0
            actor = cls.options(
                name=f"rlferry/{self.job}/trainer{rank}",
                num_cpus=0.25,
                num_gpus=gpus,
                scheduling_strategy=strategy(self._pg, placement_group_bundle_index=rank),
            ).remote(rank, settings)
            self.trainers.append((actor, ActorConn(actor)))
        sender = None
        for _, conn in self.trainers:
            status, info = conn.recv(START_TIMEOUT)
            if status != "ready":
                raise RuntimeError(str(info))
            sender = sender or info["sender"]
        return sender

    def stop(self) -> None:
        r = self._ray
        try:
            for _, conn in self.trainers:
                with contextlib.suppress(r.exceptions.RayError):
                    conn.send(("stop",))
            for closing in reversed(self._closing):
                closing.close()
            if self.trainers or self._pg is not None:
                from rlferry.ray import stop_all

                stop_all([a for a, _ in self.trainers], self._pg)
        finally:
            if self.started:
                r.shutdown()
