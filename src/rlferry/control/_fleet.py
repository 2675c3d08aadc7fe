"""The coordinator's engines: who is in the fleet, who serves, and why the others do not.

Membership is explicit. An engine joins with ``add`` and is asked once, by ``settle``,
for its name, version and limits (``statistics()``); it leaves with ``remove``. Each
member is in one state:

- ``new``: added, not asked yet (no rollouts);
- ``serving``: gets rollouts: it answers, holds a whole version, and lags the fleet's
  by at most ``max_staleness`` versions;
- ``behind``: answers but gets no rollouts until an update reaches it: it lags too
  much (an engine re-added after a restart), failed a step of the last update, or
  holds a mix of versions (a push that failed after it loaded part of it);
- ``broken``: gone (unreachable, dead, closed) or failed a request: no rollouts and no
  updates; ``add`` it again once it is back.

Request faults (``RequestError``) never change a member's state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from rlferry.errors import RequestError
from rlferry.wire import SecurityError

from ._engine import Engine, EngineStatistics
from ._errors import EngineError
from ._remote import RemoteEngine

__all__ = ["CHECK_TIMEOUT", "Call", "Fleet", "Member", "Moved", "State"]

CHECK_TIMEOUT = 30.0
"""Seconds a new engine has to answer ``statistics()`` before it is marked broken."""

State = Literal["new", "serving", "behind", "broken"]
Moved = Literal["continue", "restart"]


@dataclass(eq=False)
class Call:
    """A request in flight on a member: the sample's task that awaits the engine's
    ``generate`` (no task of its own: one per request costs the driver's CPU at hundreds
    of samples a step), and ``returned``, done once that await ended however it did.
    ``remove_engine`` marks it ``taken`` before it cancels the task: the sample then
    goes on elsewhere."""

    task: asyncio.Task[object]
    returned: asyncio.Future[None]
    taken: bool = False


@dataclass(eq=False)
class Member:
    engine: Engine
    state: State = "new"
    why: str | None = None  # why it gets no rollouts
    own: str | None = None  # the name the engine gives itself (its weight receiver's)
    version: int | None = None  # the whole version it serves, as last heard
    vocab_size: int | None = None
    max_model_len: int | None = None
    loads_between_steps: bool = False  # a push stops its steps by itself (no pause needed)
    running: int = 0
    calls: dict[str, Call] = field(default_factory=dict)  # requests in flight, by id
    removed: Moved | None = None  # what its requests do now that it left
    owned: bool = False  # made here from a URL: closed with the coordinator

    @property
    def name(self) -> str:
        return self.engine.name


class Fleet:
    """The members, by name, and the engines that left (by name: why)."""

    def __init__(self) -> None:
        self.members: dict[str, Member] = {}
        self.left: dict[str, str] = {}
        self._lock = asyncio.Lock()

    def add(self, engine: Engine | str) -> Member:
        owned = isinstance(engine, str)
        if isinstance(engine, str):
            engine = RemoteEngine(engine)
        if not isinstance(engine, Engine):
            raise TypeError(
                f"engine: expected an rlferry.control.Engine (HFEngine, RemoteEngine, ...) or "
                f"the URL of `rlferry serve engine`, got {type(engine).__name__}"
            )
        old = self.members.get(engine.name)
        if old is not None and old.state != "broken":
            raise RequestError(
                f"engine `{engine.name}`: expected a name not in the fleet, got one that is "
                f"({old.state}); a coordinator's engines need unique names (remove_engine it "
                "first to replace it)"
            )
        member = Member(engine, owned=owned)
        self.members[engine.name] = member  # a broken one of that name is replaced
        self.left.pop(engine.name, None)
        return member

    def remove(self, name: str, moved: Moved) -> Member:
        member = self.members.pop(name, None)
        if member is None:
            raise RequestError(
                f"remove_engine: expected the name of an engine in the fleet "
                f"({', '.join(map(repr, self.members)) or 'none'}), got {name!r}"
            )
        member.removed = moved
        self.left[name] = "removed by remove_engine"
        return member

    def __iter__(self) -> Iterator[Member]:
        return iter(list(self.members.values()))

    def pick(self) -> Member | None:
        """The serving member with the fewest requests in flight."""
        serving = [m for m in self.members.values() if m.state == "serving"]
        return min(serving, key=lambda m: m.running) if serving else None

    def serving(self) -> int:
        return sum(m.state == "serving" for m in self.members.values())

    def describe(self) -> str:
        """``1 of 2 engines serving: `b`: broken: ...`` (the members that do not serve, and
        the engines that left, each with why)."""
        out = [
            f"`{m.name}`: {m.state}: {m.why or 'not asked for its state yet'}"
            for m in self.members.values()
            if m.state != "serving"
        ]
        out += [f"`{name}`: {why}" for name, why in self.left.items()]
        head = f"{self.serving()} of {len(self.members)} engines serving"
        return head + (": " + "; ".join(out) if out else "")

    def mark(self, member: Member, state: State, why: str | None) -> None:
        if member.removed is None:
            member.state, member.why = state, why

    def place(self, member: Member, version: int, max_staleness: int) -> None:
        """Serving or behind by how much ``member`` lags the fleet's ``version``."""
        got = member.version
        if got is None or version - got <= max_staleness:
            self.mark(member, "serving", None)
        else:
            self.mark(
                member, "behind",
                f"at version {got}, the fleet at {version} (max_staleness {max_staleness}): it "
                "serves once an update_weights reaches it (join it to the trainer's sender)",
            )  # fmt: skip

    def limits(self) -> tuple[tuple[int, str] | None, tuple[int, str] | None]:
        """The smallest vocabulary and context any member announces, with its name: a
        request is routed to any of them."""
        vocab = [(m.vocab_size, m.name) for m in self if m.vocab_size is not None]
        length = [(m.max_model_len, m.name) for m in self if m.max_model_len is not None]
        return (min(vocab) if vocab else None), (min(length) if length else None)

    def check_prompt(self, prompt: list[int], max_tokens: int) -> None:
        """Refuse a prompt that a member would refuse, before it is queued."""
        vocab, length = self.limits()
        if vocab is not None:
            bad = next((i for i, t in enumerate(prompt) if t >= vocab[0]), None)
            if bad is not None:
                raise RequestError(
                    f"prompt_ids[{bad}]: expected a token id below {vocab[0]} (the vocab_size "
                    f"of engine `{vocab[1]}`), got {prompt[bad]} (nothing was submitted)"
                )
        total = len(prompt) + max_tokens
        if length is not None and total > length[0]:
            raise RequestError(
                f"prompt_ids, max_tokens: expected len(prompt_ids) + max_tokens <= {length[0]} "
                f"(the max_model_len of engine `{length[1]}`), got {len(prompt)} + "
                f"{max_tokens} = {total} (shorten the prompt or lower max_tokens; nothing "
                "was submitted)"
            )

    async def settle(self, version: int, max_staleness: int) -> None:
        """Ask every new member for its state, at once (one at a time across callers)."""
        async with self._lock:
            new = [m for m in self if m.state == "new"]
            await asyncio.gather(*(self._ask(m, version, max_staleness) for m in new))

    async def _ask(self, member: Member, version: int, max_staleness: int) -> None:
        try:
            stats: EngineStatistics = await asyncio.wait_for(
                member.engine.statistics(), CHECK_TIMEOUT
            )
        except asyncio.TimeoutError:
            self.mark(member, "broken", f"statistics() did not answer within {CHECK_TIMEOUT:g} s")
            return
        except (EngineError, SecurityError) as e:
            self.mark(member, "broken", f"statistics() failed: {_reason(e)}")
            return
        member.own, member.version = stats.name, stats.version
        member.vocab_size, member.max_model_len = stats.vocab_size, stats.max_model_len
        member.loads_between_steps = stats.loads_between_steps
        self.place(member, version, max_staleness)


def _reason(e: BaseException) -> str:
    return e.reason if isinstance(e, EngineError) else f"{type(e).__name__}: {e}"
