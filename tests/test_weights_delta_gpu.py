"""Delta pushes on the device machine: the CUDA diff (one host read of every tensor's count
per push), cuda_ipc on one GPU, NCCL broadcast on two, a base in pinned host memory.

Skipped on CPU (with the reason); run there with
`python -m pytest -q tests/test_weights_delta_gpu.py`.
"""

import multiprocessing as mp
import os

import pytest
import torch

from conftest import requires_cuda
from rlferry.weights import ParamLoader, WeightReceiver, WeightSender, fingerprint
from rlferry.weights.delta import Delta
from rlferry.weights.delta._base import KeptBase
from test_weights_delta_kernel import SMALL, check

pytestmark = [requires_cuda, pytest.mark.gpu]

requires_2_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs (runs on nvidia-h200-x2)",
)
BF16 = torch.bfloat16
SHAPES = {f"layers.{i}.w": (512, 1024 + i) for i in range(6)}
SHAPES.update({"embed": (4096, 1024), "norm": (1024,), "odd": (3, 7)})


class Trainer:
    """fp32 masters on ``device`` (std 0.02, norms 1), stepped by AdamW with random
    gradients."""

    def __init__(self, device="cuda:0", lr=1e-5):
        g = torch.Generator(device=device).manual_seed(0)
        self.params = {}
        for n, s in SHAPES.items():
            p = torch.ones(s, device=device) if n == "norm" else torch.empty(s, device=device)
            if n != "norm":
                p.normal_(0, 0.02, generator=g)
            self.params[n] = torch.nn.Parameter(p)
        self.opt = torch.optim.AdamW(self.params.values(), lr=lr)
        self.g = g

    def step(self):
        for p in self.params.values():
            p.grad = torch.empty_like(p).normal_(generator=self.g)
        self.opt.step()

    def items(self):
        return [(n, p.detach()) for n, p in self.params.items()]

    def serving(self):
        return [(n, p.detach().to(BF16)) for n, p in self.params.items()]


def _engine(address, device, deltas, conn):
    torch.cuda.set_device(device)
    params = {n: torch.zeros(s, dtype=BF16, device=device) for n, s in SHAPES.items()}
    loader = ParamLoader(params)

    def load(items):
        if deltas == "in_place":
            loader(items)
        else:  # whole tensors rebuilt from the receiver's host copy
            for n, t in items:
                assert not isinstance(t, Delta)
                params[n].copy_(t)

    def on_commit(version):
        torch.cuda.synchronize()
        conn.send(("commit", version, fingerprint(params.items())))

    r = WeightReceiver(group="d", address=address, load=load, on_commit=on_commit,
                       device=device, deltas=deltas, name="engine")  # fmt: skip
    r.start(timeout=120)
    conn.send("ready")
    conn.recv()
    r.close()


def spawn(address, device, deltas="in_place"):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_engine, args=(address, device, deltas, child), daemon=True)
    p.start()
    assert parent.poll(180) and parent.recv() == "ready"
    return p, parent


def run_pushes(sender, conn, pushes=4):
    trainer = Trainer()
    kinds = []
    for v in range(1, pushes + 1):
        trainer.step()
        report = sender.push(trainer.items(), version=v, dtype=BF16, timeout=120)
        kinds.append(report.kind)
        assert conn.recv() == ("commit", v, fingerprint(trainer.serving()))
    return kinds, report


@pytest.mark.parametrize("where", ["device", "host"])
def test_cuda_ipc_delta_pushes_are_bit_identical_to_full_pushes(where):
    s = WeightSender(group="d", transport="cuda_ipc", delta_budget=1 << 30, delta_base=where,
                     delta_policy="always")  # fmt: skip
    proc, conn = spawn(s.address, "cuda:0")
    kinds, report = run_pushes(s, conn)
    assert kinds == ["full", "delta", "delta", "delta"]
    assert 0 < report.changed < 0.5 and report.sent_bytes < report.full_bytes / 2
    conn.send("stop")
    proc.join(60)
    s.close()


def test_cuda_ipc_pushes_full_under_the_measured_policy_and_keeps_no_base():
    s = WeightSender(group="d", transport="cuda_ipc", delta_budget=1 << 30)
    proc, conn = spawn(s.address, "cuda:0")
    kinds, _ = run_pushes(s, conn, 3)
    assert kinds == ["full", "full", "full"]
    assert s.statistics().delta_bytes == 0
    conn.send("stop")
    proc.join(60)
    s.close()


def test_cuda_ipc_a_whole_receiver_rebuilds_every_tensor_from_its_host_copy():
    s = WeightSender(group="d", transport="cuda_ipc", delta_budget=1 << 30,
                     delta_policy="always")  # fmt: skip
    proc, conn = spawn(s.address, "cuda:0", deltas="whole")
    kinds, _ = run_pushes(s, conn, 3)
    assert kinds == ["full", "delta", "delta"]
    conn.send("stop")
    proc.join(60)
    s.close()


@requires_2_gpus
def test_nccl_delta_pushes_to_another_gpu_are_bit_identical_and_keep_the_group():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    s = WeightSender(group="d", transport="broadcast", delta_budget=1 << 30,
                     delta_policy="always")  # fmt: skip
    proc, conn = spawn(s.address, "cuda:1")
    kinds, _ = run_pushes(s, conn)
    assert kinds == ["full", "delta", "delta", "delta"]
    assert s.statistics().groups_formed == 1
    conn.send("stop")
    proc.join(60)
    s.close()


@pytest.mark.parametrize("where", ["device", "host"])
def test_the_cuda_diff_encodes_the_same_bytes_as_the_cpu_diff(where):
    trainer = Trainer()
    old = trainer.serving()
    trainer.step()
    new = trainer.serving()
    encoded = {}
    for dev in ("cuda", "cpu"):
        base = KeptBase(1 << 30, where)
        base.refresh([(n, t.to(dev)) for n, t in old], 1)
        enc = base.encode([(n, t.to(dev)) for n, t in new], 2)
        for (n, t), kept in zip(new, base.kept, strict=True):
            assert torch.equal(kept.cpu().view(torch.int16), t.cpu().view(torch.int16)), n
        encoded[dev] = (enc.sparse, [(n, t.cpu()) for n, t in enc.pushed], enc.changed)
    (s1, p1, c1), (s2, p2, c2) = encoded["cuda"], encoded["cpu"]
    assert s1 == s2 and c1 == c2 and [n for n, _ in p1] == [n for n, _ in p2]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for (_, a), (_, b) in zip(p1, p2, strict=True))  # fmt: skip


def test_delta_apply_on_cuda_takes_parts_from_either_device():
    t = torch.zeros(600, device="cuda")
    d = Delta(torch.tensor([2, 0, 1], dtype=torch.int16), torch.tensor([3, 255, 80],
              dtype=torch.uint8), torch.tensor([1.0, 2.0, 3.0]), (600,), torch.float32)  # fmt: skip
    d.apply_(t)
    assert t.nonzero().squeeze(1).tolist() == [3, 255, 592]
    back = torch.zeros(600)
    d.to("cuda").apply_(back)
    assert torch.equal(back, t.cpu())


LARGE = [((3, (1 << 20) + 5), BF16, 0.01), ((4096, 300), torch.float32, 0.04),
         ((2, 3000), torch.float8_e4m3fn, 0.25), ((70000,), torch.float64, 0.001),
         ((1 << 21,), BF16, 0.0), ((1024, 1024), BF16, 0.9),
         ((5, 7), torch.float16, 0.5)]  # fmt: skip


@pytest.mark.parametrize("host_base", [False, True])
def test_the_diff_kernels_make_the_cpu_diffs_bytes_across_chunks_and_dtypes(host_base):
    check(SMALL + LARGE, "cuda", host_base=host_base)


def test_the_torch_path_without_triton_makes_the_cpu_diffs_bytes(monkeypatch):
    from rlferry.weights.delta import _device_diff

    monkeypatch.setattr(_device_diff, "kernels", lambda device: False)
    check(SMALL + LARGE, "cuda", encoder=_device_diff.encode_on_device)
