"""Engines on Ray: each engine an actor with its bundle (``gpus_per_engine`` GPUs) in a
PACK placement group, served over rlferry's HTTP :class:`~rlferry.control.EngineServer`
on the node's address with a token the launcher makes. The coordinator drives each as a
:class:`RayEngine`: a :class:`~rlferry.control.RemoteEngine` whose calls also fail the
moment Ray reports the actor dead, naming it and Ray's reason.

Engine ``i`` gets the ``i``-th bundle in (node address, first GPU id, node id) order, so
which GPUs serve which engine does not depend on the order Ray happened to place them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from rlferry.control import (
    Completion,
    EngineError,
    EngineGone,
    EngineStatistics,
    GenerateRequest,
    PauseMode,
    RemoteEngine,
)
from rlferry.errors import RequestError
from rlferry.wire.lowlevel import AsyncResource

from ._actor import EngineActor
from ._actor import probe as probe_where
from ._common import (
    DEATH_GRACE,
    LaunchError,
    actor_name,
    check_job,
    deaths,
    namespace_of,
    ray,
    reason,
    secret,
    taken,
)
from ._placement import READY_TIMEOUT, Placed, place, stop_all

__all__ = ["ENGINE_START_TIMEOUT", "RayEngine", "RayEngines"]

T = TypeVar("T")
ENGINE_START_TIMEOUT = 300.0
"""Seconds an engine actor may take to load its model and answer."""


class RayEngine(AsyncResource):
    """An :class:`~rlferry.control.Engine` served by an engine actor: every call goes over
    HTTP to the actor's server and fails with :class:`~rlferry.control.EngineError` naming
    the actor and Ray's reason as soon as Ray reports the actor dead (a call whose
    connection broke first waits up to ``DEATH_GRACE`` seconds for Ray's reason; for a
    restartable actor, which Ray reports only about 1 s later, it fails at once naming the
    actor as lost).

    :meth:`aclose` (or ``async with``) closes the handle's HTTP client, which belongs to
    the event loop that used it; the handle stays usable (a later call, on any loop, opens
    a new client): the actor is :class:`RayEngines`', which stops it."""

    def __init__(self, name: str, actor_name: str, handle: Any, url: str, token: str,
                 restartable: bool = False) -> None:  # fmt: skip
        self.name = name
        self.actor_name = actor_name
        self.restartable = restartable
        self.url = url
        self._token = token
        self._remote = RemoteEngine(url, token=token, name=name)
        self._key = f"{actor_name}@{url}"  # one life of the actor
        self._end = deaths.watch(self._key, handle)

    async def _guard(self, call: Awaitable[T]) -> T:
        task: asyncio.Future[Any] = asyncio.ensure_future(call)
        end: asyncio.Future[Any] = asyncio.wrap_future(self._end)
        try:
            await asyncio.wait([task, end], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        if not task.done():
            task.cancel()
            raise EngineGone(self.name, f"actor `{self.actor_name}` died: {end.result()}")
        try:
            return task.result()
        except EngineError as e:
            # Ray fails a restartable actor's calls ~1 s after its death: not waited for
            why = await deaths.why(self._key, 0.0 if self.restartable else DEATH_GRACE)
            if why is None and e.gone and self.restartable:
                raise EngineGone(
                    self.name,
                    f"actor `{self.actor_name}` lost: {e.reason} (Ray restarts it: await "
                    "RayEngines.restarted or rejoin)",
                ) from None
            if why is None and e.gone:
                raise EngineGone(
                    self.name,
                    f"actor `{self.actor_name}`: {e.reason} (Ray reported no death within "
                    f"{DEATH_GRACE:g} s)",
                ) from None
            if why is None:
                raise
            raise EngineGone(self.name, f"actor `{self.actor_name}` died: {why}") from None

    async def ended(self, timeout: float) -> str:
        """Why the actor ended (Ray's reason), once it did; at most ``timeout`` seconds.

        Raises:
            TimeoutError: it still serves after ``timeout`` seconds.
        """
        # shielded: a wait given up must not cancel the watch every call of this life shares
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._end)), timeout)

    async def generate(self, request: GenerateRequest) -> Completion:
        return await self._guard(self._remote.generate(request))

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self._guard(self._remote.pause(mode))

    async def resume(self) -> None:
        await self._guard(self._remote.resume())

    async def is_paused(self) -> bool:
        return await self._guard(self._remote.is_paused())

    async def abort_requests(self, ids: Sequence[str] | None = None) -> int:
        return await self._guard(self._remote.abort_requests(ids))

    async def init_weight_transfer(self, group: str, address: str) -> None:
        await self._guard(self._remote.init_weight_transfer(group, address))

    async def start_weight_update(self) -> None:
        await self._guard(self._remote.start_weight_update())

    async def finish_weight_update(self, version: int) -> None:
        await self._guard(self._remote.finish_weight_update(version))

    async def get_weight_version(self) -> int | None:
        return await self._guard(self._remote.get_weight_version())

    async def fingerprint(self) -> str:
        return await self._guard(self._remote.fingerprint())

    async def statistics(self) -> EngineStatistics:
        return await self._guard(self._remote.statistics())

    async def aclose(self) -> None:
        """Close the HTTP client of this event loop (the actor serves on; a later call opens
        a new client); a second call does nothing."""
        closing, self._remote = (
            self._remote,
            RemoteEngine(self.url, token=self._token, name=self.name),
        )
        await closing.aclose()


class RayEngines(Placed):
    """A job's engines as Ray actors (see the module's docstring). :meth:`close` (also on
    ``with``'s exit) removes the actors and their placement group; a dead driver takes
    them with it. Keep this object while the engines serve: Ray removes an actor whose
    last handle is gone."""

    def __init__(self, job: str, names: list[str], actors: list[Any], places: list[dict[str, Any]],
                 engines: list[RayEngine], pg: Any, token: str) -> None:  # fmt: skip
        super().__init__(names, actors, pg)
        self.job = job
        self.places = places  # per engine: node address, node id, pid, GPU ids, visible GPUs
        self.engines = engines
        self._token = token

    @classmethod
    def start(
        cls,
        job: str,
        model: str,
        *,
        engines: int = 1,
        gpus_per_engine: float = 0,
        cpus_per_engine: float = 1.0,
        engine: str = "hf",
        options: dict[str, Any] | None = None,
        max_restarts: int = 0,
        ready_timeout: float = READY_TIMEOUT,
        namespace: str | None = None,
        bundle: tuple[Any, int] | None = None,
        runtime_env: dict[str, Any] | None = None,
    ) -> RayEngines:
        """Start ``engines`` engine actors of ``model`` (a directory every node can read).

        ``engine``: ``"hf"`` (:class:`~rlferry.engines.hf.HFEngine`) or ``"vllm"``
        (``VLLMEngine``, the ``[vllm]`` extra); ``options``: its keyword arguments
        (``device``, ``max_batch``, ...; an actor sees only its own GPUs, from
        ``cuda:0``). ``max_restarts``: how often Ray restarts a dead engine actor (see
        :meth:`rejoin`). ``gpus_per_engine`` below 1 shares a GPU (Ray's fractional GPUs).

        ``bundle``: ``(placement group, bundle index)`` of a group the caller made and
        removes: every engine goes into that bundle, beside the caller's other actors
        there (a trainer rank that shares the engines' GPU, to push weights by cuda_ipc:
        the engines and the rank then see the same GPU, whatever the node has).

        ``runtime_env``: Ray's runtime environment of the engine actors (e.g.
        ``{"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "4"}}`` for settings vLLM reads from
        the environment).

        Raises:
            LaunchError: the job's engines are running already, the bundles cannot be
                placed within ``ready_timeout`` seconds, or an engine failed to start.
        """
        r = ray()
        check_job(job)
        if engine not in ("hf", "vllm"):
            raise RequestError(f"engine: expected 'hf' or 'vllm', got {engine!r}")
        if type(engines) is not int or engines < 1:
            raise RequestError(f"engines: expected an int >= 1, got {engines!r}")
        g = gpus_per_engine
        if type(g) not in (int, float) or g < 0 or (g > 1 and g != int(g)):
            raise RequestError(
                f"gpus_per_engine: expected 0, a fraction of one GPU or a whole number, got {g!r}"
            )
        if runtime_env is not None and not isinstance(runtime_env, dict):
            raise RequestError(
                f"runtime_env: expected a dict of Ray's runtime environment (e.g. "
                f"{{'env_vars': {{...}}}}) or None, got {type(runtime_env).__name__}"
            )
        ns = namespace_of(namespace)
        names = [actor_name(job, f"engine{i}") for i in range(engines)]
        if taken(names[0], ns):
            raise LaunchError(
                f"job `{job}`: its engines are already running in Ray namespace `{ns}` (actor "
                f"`{names[0]}`): close them, or start these under another job name"
            )
        strategy = r.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        if bundle is not None:  # the caller's group: every engine in its one bundle
            pg, at = bundle
            owned = None
            bundles = [at] * engines
        else:
            one = {"CPU": cpus_per_engine, **({"GPU": gpus_per_engine} if gpus_per_engine else {})}
            pg = owned = place([dict(one) for _ in range(engines)], "PACK",
                               name=actor_name(job, "engines"), what=f"job `{job}`: engines",
                               ready_timeout=ready_timeout)  # fmt: skip
            bundles = list(range(engines))
        token = secret()
        actors: list[Any] = []
        try:
            probe = r.remote(probe_where)
            found = r.get([probe.options(
                num_cpus=0, num_gpus=gpus_per_engine,
                scheduling_strategy=strategy(pg, placement_group_bundle_index=b),
            ).remote() for b in bundles], timeout=ENGINE_START_TIMEOUT)  # fmt: skip
            order = sorted(range(engines), key=lambda i: (
                found[i]["ip"], found[i]["gpus"][:1], found[i]["node"], i))  # fmt: skip
            cls_remote = r.remote(EngineActor)
            for i, b in enumerate(bundles[j] for j in order):
                actors.append(cls_remote.options(
                    name=names[i], namespace=ns, num_cpus=cpus_per_engine,
                    num_gpus=gpus_per_engine, max_restarts=max_restarts, max_concurrency=1000,
                    runtime_env=runtime_env,
                    scheduling_strategy=strategy(pg, placement_group_bundle_index=b),
                ).remote(engine, model, f"engine{i}", token, dict(options or {})))  # fmt: skip
            urls = r.get([a.url.remote() for a in actors], timeout=ENGINE_START_TIMEOUT)
            places = r.get([a.where.remote() for a in actors], timeout=ENGINE_START_TIMEOUT)
        except BaseException as e:
            stop_all(actors, owned)
            if isinstance(e, r.exceptions.RayError):
                raise LaunchError(f"job `{job}`: an engine failed to start: {e}") from None
            raise
        handles = [
            RayEngine(f"engine{i}", names[i], a, url, token, max_restarts != 0)
            for i, (a, url) in enumerate(zip(actors, urls, strict=True))
        ]
        return cls(job, names, actors, places, handles, owned, token)

    async def restarted(self, i: int, *, timeout: float = ENGINE_START_TIMEOUT) -> RayEngine:
        """Engine ``i`` once Ray restarted its actor (``max_restarts``) and it serves again
        (a new port, the checkpoint's weights); it replaces the old one in :attr:`engines`.

        Raises:
            EngineError: it did not serve again within ``timeout`` seconds, or its actor
                is dead for good (its restarts used up).
        """
        r = ray()
        old = self.engines[i]
        try:
            # retried by Ray while the actor restarts; fails once it is dead for good
            ask = self._actors[i].url.options(max_task_retries=-1).remote()
            url = await asyncio.wait_for(_ref(ask), timeout)
        except asyncio.TimeoutError:
            raise EngineGone(
                old.name, f"actor `{old.actor_name}` did not serve again within {timeout:g} s "
                "of its restart"
            ) from None  # fmt: skip
        except r.exceptions.RayActorError as e:
            raise EngineGone(old.name, f"actor `{old.actor_name}` is dead for good: "
                                        f"{reason(e)}") from None  # fmt: skip
        new = RayEngine(old.name, old.actor_name, self._actors[i], url, self._token, True)
        self.engines[i] = new
        await old.aclose()
        return new

    async def rejoin(self, i: int, coordinator: Any, *, weights: tuple[str, str] | None = None,
                     timeout: float = ENGINE_START_TIMEOUT) -> RayEngine:  # fmt: skip
        """:meth:`restarted`, then the new engine replaces the old one in ``coordinator``
        (``remove_engine``, then ``add_engine``) after joining the trainer's weights
        (``weights``: the group and the sender's address); the coordinator's next
        ``update_weights`` brings it to the current version before it serves.

        Raises:
            EngineError: as :meth:`restarted`, or it could not join the weights.
        """
        name = self.engines[i].name
        new = await self.restarted(i, timeout=timeout)
        if weights is not None:
            await new.init_weight_transfer(*weights)
        await coordinator.remove_engine(name)
        coordinator.add_engine(new)
        return new

    def close(self) -> None:
        """Stop every engine and remove the actors and their placement group; a second call
        does nothing."""
        self._stop()

    def __enter__(self) -> RayEngines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _ref(ref: Any) -> Any:
    return await asyncio.wrap_future(ref.future())
