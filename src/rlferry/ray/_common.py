"""What every part of the Ray launcher shares: Ray itself (imported lazily, an error naming
the extra without it), actor names in the job's namespace, and deaths as Ray reports them.

A death is learnt from Ray, not by polling: each watched actor runs ``until_closed``, a
call that returns only when the actor is closed on purpose; when the actor dies, Ray
fails that call at once with its reason (``ray.kill``, an OOM, a node removed, ...).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import secrets
import threading
from typing import Any

from rlferry.errors import RequestError, RlferryError

__all__ = ["DEATH_GRACE", "Deaths", "LaunchError", "Watched", "actor_name", "ask", "deaths",
           "node_address", "ray", "secret", "where"]  # fmt: skip

DEATH_GRACE = 1.0
"""Seconds a failed call waits for Ray to report its actor's death (it comes in
milliseconds; a connection lost to a live actor is reported as such after this)."""


class LaunchError(RlferryError, RuntimeError):
    """A job could not start on Ray (a name taken, a placement that cannot fit, an actor
    that failed to start); the message says what was asked, what Ray had, and the fix."""


def ray() -> Any:
    """The ``ray`` module, or an error naming the extra."""
    try:
        import ray as ray_module
    except ImportError:
        raise ImportError("rlferry.ray needs Ray: pip install 'rlferry[ray]'") from None
    return ray_module


def actor_name(job: str, role: str) -> str:
    """The Ray name of a job's actor: ``rlferry/JOB/ROLE``."""
    return f"rlferry/{job}/{role}"


def check_job(job: Any) -> str:
    if not isinstance(job, str) or not job or "/" in job:
        raise RequestError(
            f"job: expected a non-empty name without '/', got {job!r} (e.g. job='grpo-run-7')"
        )
    return job


def namespace_of(namespace: str | None) -> str:
    """``namespace``, or the namespace of the calling job (its driver's)."""
    return namespace if namespace is not None else str(ray().get_runtime_context().namespace)


def taken(name: str, namespace: str) -> bool:
    try:
        ray().get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


def ask(job: str, role: str, method: str, namespace: str | None, *, start_with: str,
        timeout: float = 60.0) -> Any:  # fmt: skip
    """The answer of ``method`` of the job's actor ``role``, found by name.

    Raises:
        LaunchError: no such actor in the namespace (``start_with`` says what starts it),
            or no answer within ``timeout`` seconds.
    """
    r = ray()
    check_job(job)
    ns = namespace_of(namespace)
    name = actor_name(job, role)
    try:
        handle = r.get_actor(name, namespace=ns)
    except ValueError:
        raise LaunchError(
            f"job `{job}`: no actor `{name}` in Ray namespace `{ns}` (start it with "
            f"{start_with}, or pass the job's namespace=)"
        ) from None
    try:
        return r.get(getattr(handle, method).remote(), timeout=timeout)
    except r.exceptions.GetTimeoutError:
        raise LaunchError(f"job `{job}`: actor `{name}` did not answer in {timeout:g} s") from None


def secret() -> str:
    """A fresh secret for a job's services (64 hex digits)."""
    return secrets.token_hex(32)


def node_address() -> str:
    """The address Ray knows this node by (where other nodes reach it)."""
    return str(ray().util.get_node_ip_address())


class Watched:
    """The base of the launcher's actors: ``until_closed`` (see the module's docstring) and
    ``where`` (the node and GPUs the actor runs on)."""

    def __init__(self) -> None:
        self._closed = asyncio.Event()

    async def until_closed(self) -> None:
        """Returns when this actor is closed on purpose; Ray fails it when the actor dies."""
        await self._closed.wait()

    def where(self) -> dict[str, Any]:
        return where()


def where() -> dict[str, Any]:
    """Where the calling actor or task runs: node address, node id, process id, Ray's GPU
    ids and the ``CUDA_VISIBLE_DEVICES`` Ray set for them."""
    r = ray()
    ctx = r.get_runtime_context()
    gpus = sorted(int(g) for g in r.get_gpu_ids())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {"ip": node_address(), "node": ctx.get_node_id(), "pid": os.getpid(), "gpus": gpus,
            "visible": visible}  # fmt: skip


def reason(error: BaseException) -> str:
    """Ray's reason of an actor's death: the last line of its error
    (``The actor is dead because it was killed by `ray.kill`.``)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


class Deaths:
    """The deaths of watched actors, as Ray reports them (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ends: dict[str, concurrent.futures.Future[str]] = {}
        self._refs: list[Any] = []

    def watch(self, name: str, handle: Any) -> concurrent.futures.Future[str]:
        """Learn when the actor ``name`` (``handle``, which has ``until_closed``) ends: the
        future's result is why. ``name`` keys one life of the actor (a restarted actor is
        watched under a new key)."""
        with self._lock:
            if name in self._ends:
                return self._ends[name]
            end: concurrent.futures.Future[str] = concurrent.futures.Future()
            self._ends[name] = end
        ref = handle.until_closed.remote()
        self._refs.append(ref)

        def done(fut: concurrent.futures.Future[Any]) -> None:
            exc = fut.exception()
            end.set_result("it was closed by its job" if exc is None else reason(exc))

        ref.future().add_done_callback(done)
        return end

    def ended(self, name: str) -> bool:
        """True once Ray reported that the watched actor ``name`` ended (no waiting)."""
        end = self._ends.get(name)
        return end is not None and end.done()

    async def why(self, name: str, grace: float = DEATH_GRACE) -> str | None:
        """Why ``name`` ended, waiting up to ``grace`` seconds for Ray to say (None: alive)."""
        end = self._ends.get(name)
        if end is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(end)), grace)
        except asyncio.TimeoutError:
            return None


deaths = Deaths()
"""This process's watches."""
