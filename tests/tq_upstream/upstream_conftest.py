"""Our fixtures for TransferQueue's own tests, run on rlferry's shim.

Installs the shim as `transfer_queue` before their modules import it, and supplies the
fixtures that in their suite start Ray or reach into the controller actor: their KV module runs
on a local Ray (the shim's service actor), the others embedded, and cleanup goes through the
public API.
"""

import pytest

import rlferry.compat.transferqueue as shim

shim.install()


@pytest.fixture(scope="module")
def ray_init():
    """Their KV module's Ray: a local one, so that the shim runs there as it does under
    TransferQueue's users, as a named actor that the module's Ray tasks reach. Each worker
    installs the shim first (their tasks `import transfer_queue`)."""
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"worker_process_setup_hook": "rlferry.compat.transferqueue.install"},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster():
    yield


@pytest.fixture
def controller(tq_system):
    """Their tests take it to read the controller actor; the tests that do are left out."""
    yield None


@pytest.fixture(autouse=True)
def cleanup_partition(request):
    """After each test, drop every partition (their own fixture did so through the actor)."""
    yield
    import transfer_queue as tq

    if "tq_system" in request.fixturenames or "e2e_client" in request.fixturenames:
        client = tq.get_client()
        for partition_id in client.get_partition_list():
            client.clear_partition(partition_id)
