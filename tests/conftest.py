import os
import shutil
import tempfile

import pytest
import torch

# vLLM's processes make their ZeroMQ sockets under VLLM_RPC_BASE_PATH (default: the system's
# temporary directory) and leave some there when they end: the tests' vLLM engines (in this
# process, in a server process, in Ray actors started after this) make theirs in a directory
# of this session's, removed when it ends.
_VLLM_SOCKETS = tempfile.mkdtemp(prefix="rlferry-tests-vllm-")
os.environ.setdefault("VLLM_RPC_BASE_PATH", _VLLM_SOCKETS)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_VLLM_SOCKETS)


requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every Ray test: a head and a second node, 4 CPUs and 2
    fake GPUs each (placement and CUDA_VISIBLE_DEVICES without a GPU); shut down at the
    end of the session."""
    ray = pytest.importorskip("ray", reason="the Ray tests need the [ray] extra")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "num_gpus": 2, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=4, num_gpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
