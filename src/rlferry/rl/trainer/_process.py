"""A trainer process of the demo: one data-parallel rank.

Each rank loads the warm-started model, joins a ``torch.distributed`` group with the
other ranks (gloo on the CPU, NCCL on CUDA) and shards the model with FSDP2
(``fully_shard`` per decoder layer, then the whole model): each of ``dp`` ranks holds a
``1/dp`` of every parameter, gradients are reduce-scattered (a single rank, as in the
split GPU layout on 2 GPUs, keeps the plain model). It takes commands from the driver on
a pipe:

- ``("train", step, held)``: get this rank's share of partition ``train_{step}`` from the
  queue (whole GRPO groups, ``GrpoGroups``), one optimizer step on the GRPO loss
  (``_step.TrainStep``: a CUDA graph on one GPU), ack; answer with the loss and its
  stats. ``held``: an update is in flight (its push runs on the rank's thread): the batch
  is got meanwhile, and the step waits for the driver's ``("go",)`` (``_pushing.Pushes``);
- ``("push", version, seconds)`` (every rank, on a thread, one push at a time; the
  answer comes from it): every rank pushes its own shards
  through its ``ShardedSender`` (``settings["sharded"]``: shm on the CPU; on CUDA NCCL
  broadcast to the engines, or cuda_ipc for rank 0 beside them; ``settings["p2p"]``: a
  link per engine, for engines sharing GPU 0) and answers once the engines loaded its
  part; nothing is gathered, no rank sends a byte it does not own. Rank 0's sender
  describes the group (every rank's address, the layout) to the engines, which are
  told its address only (point to point: its link to each). Without ``sharded`` (one
  rank on one GPU, vLLM engines) the shards are gathered
  a bucket at a time (``_gather.gathered``: one collective per bucket; the full state
  dict never exists at once) and rank 0 pushes them through its ``WeightSender``, the
  others taking part in the gathers. Each answers the bytes it sent;
  With ``settings["lora"]`` (a rank) each rank trains a LoRA adapter of that rank on the
  frozen base, whole on every rank (``_lora.TrainedAdapter``: the ranks average its
  gradients), and rank 0 pushes the adapter alone through its ``WeightSender``;
- ``("save", directory)`` (every rank): this rank's part of a job checkpoint
  (``_trainer_state``); ``settings["resume"]``, a checkpoint's directory, is read back
  before the rank reports ready;
- ``("fingerprint",)`` (both ranks): the digest of the full weights (rank 0 answers it;
  with an adapter: the base, then the adapter, as the engines hold them);
- ``("figures",)``: each step's time (:class:`TrainStep`'s call, from the batch in
  hand to its figures read) and the step's roofline estimate (``_roofline``);
- ``("stop",)``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["trainer_main"]


def trainer_main(rank: int, conn: Connection, settings: dict[str, Any]) -> None:
    """The process's entry point; reports ``("ready", info)`` or ``("error", text)``.
    Ctrl-C is the driver's to handle: it stops this process."""
    if threading.current_thread() is threading.main_thread():  # a process (not a Ray actor)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _serve(rank, conn, settings)
    except Exception as e:  # the driver prints it: a rank that fails says why
        conn.send(("error", f"trainer rank {rank}: {type(e).__name__}: {e}\n"
                            f"{traceback.format_exc(limit=6)}"))  # fmt: skip


def _serve(rank: int, conn: Connection, s: dict[str, Any]) -> None:
    import transformers

    from rlferry.queue import GrpoGroups, Queue
    from rlferry.weights import WeightSender, fingerprint

    from ..checkpoints import load_rank, save_rank
    from ..grpo import GrpoBatch
    from ._profiling import traced
    from ._pushing import Pushes
    from ._roofline import Peaks, step_roofline
    from ._step import TrainStep

    torch.manual_seed(s["seed"] + rank)
    if s["threads"]:
        torch.set_num_threads(s["threads"])  # the processes of a run share the cores
    dp = s["dp"]
    # a Ray actor sees only the GPU Ray gave it, as cuda:0
    gpu = 0 if s.get("ray_job") else s["first_gpu"] + rank
    device = torch.device("cpu" if s["device"] == "cpu" else f"cuda:{gpu}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{s['port']}", rank=rank, world_size=dp
    )
    # float32 master weights; the engines serve the checkpoint's dtype (bfloat16 for
    # qwen3-0.6b on CUDA): the forward then runs under autocast to it, pushes are cast
    serve = getattr(torch, s["dtype"])
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        s["model_dir"], local_files_only=True, dtype=torch.float32
    )
    adapter: Any = None
    if s.get("lora"):  # an adapter on the frozen base, whole on every rank
        from ._lora import TrainedAdapter

        adapter = TrainedAdapter(model.to(device), s["lora"], s["seed"])
        model, params = adapter.model, adapter.params
    else:
        model = _sharded(model.to(device)) if dp > 1 else model.to(device)
        params = list(model.parameters())
    model.train()
    # on a GPU one fused kernel steps every parameter (the loop of per-tensor kernels is
    # launch-bound on a small model); one rank replays its step as a CUDA graph
    graphed = device.type == "cuda" and dp == 1 and adapter is None
    optimizer = torch.optim.AdamW(params, lr=s["lr"], weight_decay=0.0,
                                  fused=device.type == "cuda", capturable=graphed)  # fmt: skip
    if s.get("resume"):  # a job checkpoint's parameters, optimizer state and RNG
        load_rank(s["resume"], rank, params, optimizer)
    sender: Any = None
    if s["sync"] and s["sharded"]:
        sender = _sharded_sender(model, rank, s, serve, device)
    elif rank == 0 and s["sync"]:
        sender = WeightSender(group="demo", transport=s["transport"], receivers=s["engines"])
    if s.get("ray_job"):  # on Ray: the job's queue, found by name
        from rlferry.ray import queue

        client = queue(s["ray_job"])
    else:
        client = Queue.connect(s["queue"]).client()
    gc.freeze()  # torch, transformers, the model: kept for good, no longer scanned by the GC
    # what each engine is told to join: rank 0's address (point to point: its link to it)
    told = None
    if sender is not None and rank == 0:
        n = s["engines"]
        told = [sender.addresses[e] for e in range(n)] if s.get("p2p") else [sender.address] * n
    groups_per_rank = s["groups_per_step"] // dp
    low = serve != torch.float32
    # the rates the driver measured on the device before the run (an engine starting beside
    # this rank would slow a measurement here)
    roofline = step_roofline(model, groups_per_rank * s["group_size"], s["width"], low=low,
                             peaks=Peaks(**s["peaks"]))  # fmt: skip
    step_seconds: list[float] = []  # each step's TrainStep call
    # made before the rank is ready (a CUDA graph: compiled and captured while the
    # engines start), so that no step of the run waits for it
    train = TrainStep(
        model, params, optimizer, rows=groups_per_rank * s["group_size"], width=s["width"],
        clip=s["clip"], autocast=serve if low else None, graphed=graphed,
        adapter=adapter,
    )  # fmt: skip
    conn.send(("ready", {"sender": told, "pid": os.getpid()}))

    def push(version: int, seconds: float) -> int:
        with traced(rank, "push", version):
            return _push(sender, model, adapter, s, serve, version, seconds, train.served)

    pushes = Pushes(rank, conn, push, device)
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "push":  # on a thread: the next command (a step's train) comes meanwhile
                pushes.start(cmd[1], cmd[2])
                continue
            hold = cmd[0] == "train" and len(cmd) > 2 and cmd[2]
            if not hold:  # a step held for the update in flight gets its batch meanwhile
                pushes.join()
            if cmd[0] == "stop":
                break
            if cmd[0] == "fingerprint":
                # every rank gathers, rank 0 answers; tensor by tensor with DTensor's own
                # gather, apart from the pushes' bucketed one: a check of it too
                digest = fingerprint(
                    adapter.served(serve) if adapter is not None else (
                        (n, (t.full_tensor() if hasattr(t, "full_tensor") else t).to(serve))
                        for n, t in model.state_dict().items()
                    )
                )  # fmt: skip
                pushes.send(("ok", {"fingerprint": digest}))
                continue
            if cmd[0] == "figures":  # the steps' times beside their roofline
                pushes.send(("ok", {"step_seconds": step_seconds, "replayed": train.replayed,
                                    "roofline": dataclasses.asdict(roofline)}))  # fmt: skip
                continue
            if cmd[0] == "save":  # this rank's part of a job checkpoint, into the directory
                pushes.send(("ok", save_rank(cmd[1], rank, params, optimizer)))
                continue
            step = cmd[1]
            t0 = time.perf_counter()
            batch = client.get(
                f"train_{step}", task="train", batch_size=groups_per_rank * s["group_size"],
                fields=["prompt_ids", "response_ids", "logprobs", "advantages"],
                dp_rank=rank, dp_size=dp, sampler=GrpoGroups(group_size=s["group_size"]),
                timeout=600,
            )  # fmt: skip
            got = time.perf_counter()
            # held: the update in flight ends before this step changes the weights it pushes
            if hold and not pushes.hold():
                break
            held = time.perf_counter() - got
            with traced(rank, "train", step):
                d = batch.data
                t_step = time.perf_counter()
                stats = train(
                    GrpoBatch(d["prompt_ids"], d["response_ids"], d["logprobs"], d["advantages"])
                )  # fmt: skip
                step_seconds.append(time.perf_counter() - t_step)
            client.ack(batch)
            pushes.send(("ok", {
                **dataclasses.asdict(stats), "train_seconds": time.perf_counter() - got - held,
                "get_seconds": got - t0, "step_seconds": step_seconds[-1], "held_seconds": held,
            }))  # fmt: skip
    finally:  # a push answers before the rank's last word
        pushes.wait()
    client.close()
    if sender is not None:
        sender.close()
    dist.destroy_process_group()


def _sharded_sender(
    model: Any, rank: int, s: dict[str, Any], serve: torch.dtype, device: torch.device
) -> Any:
    """This rank's ``ShardedSender``: the layout read from the model's DTensors (FSDP2:
    rows of every parameter; a plain model on one rank: all of it), the engines' needs
    every tensor whole in the serving dtype. Rank 0's also describes the group: every
    rank's address (point to point: its address per engine), gathered over the ranks'
    group as bytes (JSON, no pickle). Point to point (``s["p2p"]``: engines sharing GPU 0
    cannot be in one NCCL group) each rank has a link per engine: a group of two over
    NCCL, or cuda_ipc from rank 0 beside them."""
    from rlferry.weights import ShardedSender
    from rlferry.weights.planning import EngineLayout, dtensor_layout

    named = list(model.state_dict().items())
    trainer = dtensor_layout(named, s["dp"])
    engine = EngineLayout.whole(trainer.specs, receivers=s["engines"], dtype=serve)
    transport = s["transport"]
    if transport == "cuda_ipc" and rank > 0:  # colocated: only rank 0 shares the engine's GPU
        transport = "broadcast"
    p2p = bool(s.get("p2p"))
    sender = ShardedSender(
        group="demo", rank=rank, trainer=trainer, engine=engine, transport=transport,
        point_to_point=p2p,
    )  # fmt: skip
    try:
        mine = json.dumps(sender.addresses) if p2p else sender.address
        every = _every_address(mine, device)
        addresses: list[Any] = (
            [{int(e): a for e, a in json.loads(x).items()} for x in every] if p2p else every
        )
        if rank == 0:
            sender.describe_group(addresses)
    except BaseException:
        sender.close()
        raise
    return sender


def _every_address(address: str, device: torch.device) -> list[str]:
    """Every rank's ``address`` (a str), by rank: two all-gathers (lengths, then the bytes)."""
    world = dist.get_world_size()
    if world == 1:
        return [address]
    raw = torch.tensor(list(address.encode()), dtype=torch.uint8, device=device)
    n = torch.tensor([raw.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    longest = max(int(x) for x in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: raw.numel()] = raw
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return [bytes(b[: int(k)].tolist()).decode() for b, k in zip(every, sizes, strict=True)]


def _sharded(model: Any) -> Any:
    """FSDP2: each decoder layer its own unit (its parameters gathered for its forward
    and backward only), then the rest of the model. The mesh is on the model's device
    type: FSDP2's default is CUDA wherever a GPU is visible, also for a CPU run over gloo."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    kind = next(model.parameters()).device.type
    mesh = init_device_mesh(kind, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _push(
    sender: Any, model: Any, adapter: Any, s: dict[str, Any], serve: torch.dtype, version: int,
    seconds: float, served: list[tuple[str, torch.Tensor]] | None,
) -> int:  # fmt: skip
    """This rank's part of an update (see the module's ``push``); the bytes it sent."""
    from ._gather import gathered

    if adapter is not None:  # the adapter alone, from rank 0
        if sender is None:
            return 0
        named = adapter.named(serve)
        return sender.push(named, version=version, timeout=seconds).bytes
    if s["sharded"]:  # this rank's shards, as they are (cast to the engines' dtype)
        return sender.push(model.state_dict(), version=version, timeout=seconds).bytes
    if sender is not None and s["dp"] == 1:  # one rank: its weights at fixed addresses
        # the graph's bf16 copy (its step casts the weights), else the weights as they are
        # (a float32 model: no graph keeps a copy)
        named = served if served is not None else list(model.state_dict().items())
        return sender.push(named, version=version, timeout=seconds).bytes
    if sender is not None:
        layout = [  # global shapes, the engines' dtype
            (n, torch.empty(t.shape, dtype=serve, device="meta"))
            for n, t in model.state_dict().items()
        ]
        report = sender.push(
            gathered(model, serve), version=version, timeout=seconds, layout=layout
        )
        return report.bytes
    for _ in gathered(model, serve):  # other ranks: their part of every gather
        pass
    return 0
