"""checkpoint-engine 0.4.2's broadcast update of the Qwen3-8B shapes, timed (a weights baseline).

What it measures: ``ParameterServer.update(name, req_func)`` with ``ranks`` unset (its
broadcast path, the fastest it has), one ParameterServer rank per GPU under torchrun.
Each rank registers half of the state dict (the benchmark's Qwen3 shapes, random bf16,
split by tensor count as checkpoint-engine's ``examples/update.py`` splits a checkpoint)
with ``register_checkpoint(named_tensors=...)``, which copies it into pinned CPU memory.
An update then copies each rank's part host-to-device, broadcasts every bucket from its
owner over NCCL into a CUDA IPC buffer, and hands the bucket to the engine on each GPU
over ZMQ; the update returns after every engine has loaded every bucket.

The engine is a separate process on each GPU (as an inference engine is) with the
whole model's parameters preallocated (zeros); it serves ``checkpoint_engine.worker.
update_weights_from_ipc`` and loads each bucket with one ``torch._foreach_copy_`` into
its parameters, as the weights benchmark's engines do. After the timed updates each
engine's parameters are checked against the full state dict (exact checksum).

Timed (median, best and every run of ``--repeat`` updates after one warm-up):

- ``kept group``: ``ParameterServer(auto_pg=False)`` with one process group made
  before the updates (what an update costs when the NCCL group is kept);
- ``auto_pg``: the library's default and its example's path (``auto_pg=True``): each
  update makes its own NCCL group and destroys it at the end.

Also: the host-to-device copy of one rank's half from pinned memory, both GPUs at
once (the floor of this path's H2D stage). Run on two GPUs, NVLink multicast off::

    NCCL_NVLS_ENABLE=0 python3 -m torch.distributed.run --nproc-per-node 2 \\
        benchmarks/checkpoint_engine_baseline.py [--repeat 5] [--scale 1]

It needs checkpoint-engine 0.4.2 and its dependencies importable, and rlferry's ``src``
(RESULTS.md lists the wheels carried to the GPU machine). The raw NCCL limit and
rlferry's row come from ``benchmarks/weights.py --transport broadcast`` in the same
device call.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _weights_engine import fingerprint, make_state, model_shapes

NAME = "qwen3-8b"


def engine_main(rank: int, uuid: str, shapes: list, cmds: mp.Queue, out: mp.Queue) -> None:
    """The fake engine on GPU ``rank``: preallocated parameters, loaded from IPC buckets."""
    import zmq
    from checkpoint_engine.worker import update_weights_from_ipc

    torch.cuda.set_device(rank)
    params = {n: torch.zeros(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes}
    ctx = zmq.Context()

    def load(weights: list[tuple[str, torch.Tensor]]) -> None:
        torch._foreach_copy_([params[n] for n, _ in weights], [t for _, t in weights])

    out.put("ready")
    while (cmd := cmds.get()) is not None:
        if cmd[0] == "update":  # from the server's req_func: [(device uuid, zmq address)]
            update_weights_from_ipc(ctx, dict(cmd[1])[uuid], device_id=rank, run=load)
        elif cmd[0] == "zero":
            for p in params.values():
                p.zero_()
            torch.cuda.synchronize()
            out.put("zeroed")
        elif cmd[0] == "fingerprint":
            out.put(fingerprint(list(params.values())))


class StoreBarrier:
    """A barrier over a TCPStore of its own, for the updates that run with no process group
    (the server's ``store_based_barrier`` waits only the first time it is called)."""

    def __init__(self, rank: int, world: int) -> None:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 2
        self.store = dist.TCPStore(addr, port, world, is_master=rank == 0)
        self.world, self.n = world, 0

    def __call__(self) -> None:
        self.n += 1
        if self.store.add(f"b{self.n}", 1) == self.world:
            self.store.set(f"b{self.n}/all", "1")
        self.store.wait([f"b{self.n}/all"])


def timed(fn, repeat: int, sync) -> list[float]:
    """One warm-up, then ``repeat`` runs each after ``sync()``; their seconds, sorted."""
    times = []
    for i in range(repeat + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return sorted(times)


def h2d_seconds(nbytes: int, repeat: int) -> list[float]:
    """The floor of the H2D stage: ``nbytes`` from pinned memory to this GPU, all ranks at once."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        dist.barrier()

    return timed(h2d, repeat, dist.barrier)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--scale", type=int, default=1, help="divide every width (a quick check)")
    a = p.parse_args()

    import checkpoint_engine
    import checkpoint_engine.ps as ce_ps
    from checkpoint_engine import ParameterServer

    try:  # its host address: a UDP connect to 8.8.8.8, then the host name
        ce_ps.get_ip()
    except OSError:  # a machine with neither (no network, unresolvable name)
        ce_ps.get_ip = lambda: "127.0.0.1"

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ps = ParameterServer(auto_pg=False)  # sets this rank's GPU; its store on MASTER_PORT + 1
    barrier = StoreBarrier(rank, world)
    uuid = ce_ps._get_physical_gpu_id(ps.device_manager, rank)
    shapes = model_shapes(NAME, a.scale)
    ctx = mp.get_context("spawn")
    cmds, out = ctx.Queue(), ctx.Queue()
    engine = ctx.Process(target=engine_main, args=(rank, uuid, shapes, cmds, out), daemon=True)
    engine.start()
    assert out.get(timeout=300) == "ready"

    # The whole state on this GPU (same seed on every rank), its checksum, this rank's half to host.
    state = make_state(shapes, "cuda")
    want = fingerprint(list(state.values()))
    nbytes = sum(t.nbytes for t in state.values())
    per = -(-len(shapes) // world)
    mine = {n: state[n].cpu() for n, _ in shapes[rank * per : (rank + 1) * per]}
    half = sum(t.nbytes for t in mine.values())
    del state
    torch.cuda.empty_cache()

    t0 = time.perf_counter()
    ps.register_checkpoint(NAME, named_tensors=mine)
    t_register = time.perf_counter() - t0
    del mine
    ps.init_process_group()
    t0 = time.perf_counter()
    ps.gather_metas(NAME)
    t_gather = time.perf_counter() - t0

    h2d = h2d_seconds(half, a.repeat)
    torch.cuda.empty_cache()

    def update() -> None:
        ps.update(NAME, lambda paths: cmds.put(("update", paths)))

    def check(what: str) -> None:
        cmds.put(("fingerprint",))
        if out.get(timeout=300) != want:
            raise RuntimeError(f"{what}: the engine's parameters differ from the full state")
        cmds.put(("zero",))
        assert out.get(timeout=300) == "zeroed"

    cmds.put(("zero",))
    assert out.get(timeout=300) == "zeroed"
    kept = timed(update, a.repeat, dist.barrier)
    check("kept group")

    # The default: every update makes and destroys its own process group.
    dist.barrier()
    dist.destroy_process_group()
    ps._auto_pg = True  # ParameterServer(auto_pg=True), the same registered checkpoint

    def settle() -> None:
        time.sleep(1)  # its tests wait for the last group's teardown between updates
        barrier()

    auto = timed(update, a.repeat, settle)
    check("auto_pg")
    cmds.put(None)
    engine.join(60)

    if rank == 0:
        gb = nbytes / 1e9
        rows = [
            (f"H2D of one rank's half ({half / 1e9:.2f} GB), both GPUs at once", h2d),
            ("checkpoint-engine update, kept group (auto_pg=False)", kept),
            ("checkpoint-engine update, auto_pg=True (new NCCL group per update)", auto),
        ]
        print(f"\n{NAME} (scale {a.scale}): {len(shapes)} tensors, {gb:.2f} GB bf16, "
              f"{world} ranks; checkpoint-engine {checkpoint_engine.__version__}, "
              f"torch {torch.__version__}, {torch.cuda.get_device_name()}; median of "
              f"{a.repeat} after a warm-up; engines checked (exact checksum)")  # fmt: skip
        print(f"register_checkpoint {t_register:.2f} s, gather_metas {t_gather:.3f} s\n")
        print("| path | ms (median) | best | GB/s | every run, ms |\n|---|---|---|---|---|")
        for what, times in rows:
            med, size = statistics.median(times), half / 1e9 if what.startswith("H2D") else gb
            each = " ".join(f"{t * 1e3:.0f}" for t in times)
            ms = f"{med * 1e3:.1f} | {times[0] * 1e3:.1f}"
            print(f"| {what} | {ms} | {size / med:.1f} | {each} |")
    ps.unregister_checkpoint(NAME)


if __name__ == "__main__":
    main()
