"""TransferQueue's API across local processes, without Ray: a StreamingDataLoader's worker
processes (forked or spawned) read the queue that ``tq.init()`` made in their parent, which
serves it to them over rlferry's wire."""

import subprocess
import sys

import pytest

pytest.importorskip("tensordict", reason="the [tq] extra (tensordict) is missing")
pytest.importorskip("omegaconf", reason="the [tq] extra (omegaconf) is missing")

pytestmark = pytest.mark.slow  # processes of their own, some killed on purpose

LOADER = """
import sys, torch
import rlferry.compat.transferqueue as tq
from tensordict import TensorDict

def main(context):
    tq.init({"controller": {"get_meta_timeout": 5, "polling_mode": True}})
    n = 48
    data = TensorDict({
        "x": torch.arange(n),
        "ids": torch.nested.as_nested_tensor([torch.arange(i % 5 + 1) for i in range(n)],
                                             layout=torch.jagged),
        "prompt": [f"q{i}" for i in range(n)],
    }, batch_size=n)
    tq.get_client().put(data, partition_id="p")
    ds = tq.StreamingDataset(None, batch_size=4, micro_batch_size=2,
                             data_fields=["x", "ids", "prompt"], partition_id="p",
                             task_name="train", dp_rank=0, should_check_consumption_status=True)
    seen = []
    for td, meta in tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context=context):
        for x, ids, prompt in zip(td["x"].tolist(), td["ids"].unbind(), td["prompt"]):
            assert ids.tolist() == list(range(x % 5 + 1)) and prompt == f"q{x}", (x, ids, prompt)
        seen += td["x"].tolist()
    print(sorted(seen) == list(range(n)), len(seen), len(set(seen)))
    tq.close()

if __name__ == "__main__":
    main(sys.argv[1])
"""


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_streaming_dataloader_with_two_workers_gives_every_sample_once(context, tmp_path):
    script = tmp_path / "loader.py"
    script.write_text(LOADER)
    out = subprocess.run(
        [sys.executable, str(script), context], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True 48 48"


FORKED = """
import os, torch
import rlferry.compat.transferqueue as tq
from tensordict import TensorDict
tq.init()
client = tq.get_client()
client.put(TensorDict({"x": torch.ones(2)}, batch_size=2), partition_id="p")
pid = os.fork()
if pid == 0:
    try:
        client.get_partition_list()
        print("no error")
    except RuntimeError as e:
        print(str(e).replace(str(os.getpid()), "CHILD").replace(str(os.getppid()), "PARENT"))
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_a_forked_child_of_an_embedded_queue_that_serves_nobody_is_refused():
    out = subprocess.run(
        [sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == (
        "process CHILD: expected the process that called tq.init() (PARENT) or a child that "
        "can reach its queue, got a forked child of an embedded queue that serves no other "
        "process (a StreamingDataLoader with num_workers > 0 serves its workers; for other "
        "processes run the queue on Ray: ray.init() before tq.init())"
    )


GONE = """
import os, signal, torch
import rlferry.compat.transferqueue as tq
from rlferry.compat.transferqueue import _interface
from tensordict import TensorDict

tq.init({"controller": {"get_meta_timeout": 60}})
_interface.serve_workers()
service = _interface.current_backend().service
reader = os.fork()
if reader == 0:
    tq.get_client().get_meta(["x"], 2, "p", task_name="t")  # parked at the parent
    os._exit(0)
assert service.wait_parked(1, 60), "the reader's get_meta never reached the service"
os.kill(reader, signal.SIGKILL)
os.waitpid(reader, 0)
assert service.wait_parked(0, 60), "the dead reader's get_meta is still parked"
client = tq.get_client()
client.put(TensorDict({"x": torch.tensor([7, 8])}, batch_size=2), partition_id="p")
meta = client.get_meta(["x"], 2, "p", task_name="t")
print(client.get_data(meta)["x"].tolist())
tq.close()
"""


def test_a_reader_that_dies_while_its_get_meta_waits_consumes_nothing():
    out = subprocess.run([sys.executable, "-c", GONE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[7, 8]"


class Opaque:
    """A value of a type the wire does not carry."""


def test_a_value_the_wire_does_not_carry_is_refused_naming_its_field():
    import torch
    from tensordict import TensorDict

    import rlferry.compat.transferqueue as tq
    from rlferry.compat.transferqueue import _interface
    from rlferry.compat.transferqueue._backend import remote

    tq.init()
    try:
        other = remote(_interface.serve_workers())  # as another process reaches it
        client = tq.TransferQueueClient("other")
        client._backend = other
        data = TensorDict({"x": torch.ones(2), "obj": [Opaque(), Opaque()]}, batch_size=2)
        with pytest.raises(TypeError) as e:
            client.put(data, partition_id="p")
        assert str(e.value) == (
            "field `obj`: expected values the wire carries (tensors, numpy arrays, str, bytes, "
            "numbers, None, lists, dicts with str keys), got a type "
            "test_compat_tq_procs.Opaque (convert it: across processes nothing is pickled; "
            "nothing was stored)"
        )
        assert tq.get_client().get_production_status(["obj"], "p") == (None, None)
        other.close()
    finally:
        tq.close()
