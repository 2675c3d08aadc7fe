"""HFEngine joins a group of ShardedSenders by one address: rank 0 describes the group.

Two trainer ranks (threads of this process, each a real ShardedSender over shm) own
half the rows of every tensor; the engine is told rank 0's address only, as
``init_weight_transfer(group, address)`` tells every engine, and ends with the
trainer's weights bit for bit, each rank having sent only its own rows.
"""

import asyncio

import pytest
import torch

from rlferry.control import EngineError
from rlferry.weights import (
    SenderGone,
    ShardedSender,
    WeightSender,
    WeightSyncError,
    describe_group,
    fingerprint,
    fsdp_layout,
    specs_of,
    tp_layout,
)
from rlferry.weights.planning import EngineLayout

pytest.importorskip("transformers", reason="needs transformers (the [hf] extra)")
from rlferry.engines.hf import HFEngine
from test_engine_hf import tiny_model


def _shards(state, layout, rank):
    """Rank ``rank``'s local rows of every tensor, as FSDP2 holds them."""
    out = {}
    for name, box in layout.owned[rank].items():
        t = state[name]
        out[name] = t[tuple(slice(a, b) for a, b in box)].clone() if box else t.clone()
    return out


def _senders(state, group, ranks):
    specs = specs_of(state.items())
    trainer = fsdp_layout(specs, ranks)
    engine = EngineLayout.whole(specs)
    senders = [
        ShardedSender(group=group, rank=r, trainer=trainer, engine=engine, transport="shm")
        for r in range(ranks)
    ]
    senders[0].describe_group([s.address for s in senders])
    return trainer, senders


async def _push_all(senders, shards, version):
    return await asyncio.gather(*(
        asyncio.to_thread(s.push, shards[s.rank], version=version, timeout=30) for s in senders
    ))  # fmt: skip


def test_an_engine_told_rank_0s_address_takes_every_ranks_shards_bit_for_bit():
    trainer_state = tiny_model(1).state_dict()

    async def main():
        layout, senders = _senders(trainer_state, "g", 2)
        engine = HFEngine(tiny_model(0), name="e")
        try:
            found = describe_group("g", senders[0].address)
            assert found.addresses == tuple(s.address for s in senders)
            assert found.trainer is not None and found.trainer.fingerprint == layout.fingerprint
            await engine.init_weight_transfer("g", senders[0].address)
            shards = [_shards(trainer_state, layout, r) for r in range(2)]
            for version in (1, 2):
                await engine.pause("keep")
                await engine.start_weight_update()
                reports = await _push_all(senders, shards, version)
                await engine.finish_weight_update(version)
                await engine.resume()
                assert await engine.get_weight_version() == version
                # each rank sent its own rows, never the whole model
                assert [r.bytes for r in reports] == [layout.owned_bytes(r) for r in range(2)]
            assert await engine.fingerprint() == fingerprint(trainer_state.items())
            # a rank whose push fails leaves the engine refusing the version, by name
            bad = dict(shards[1])
            name = next(iter(bad))
            bad[name] = bad[name][:1]
            await engine.pause("keep")
            await engine.start_weight_update()
            ok, failed = await asyncio.gather(
                asyncio.to_thread(senders[0].push, shards[0], version=3, timeout=30),
                asyncio.to_thread(senders[1].push, bad, version=3, timeout=30),
                return_exceptions=True,
            )
            assert ok.bytes == layout.owned_bytes(0)
            assert isinstance(failed, WeightSyncError) and "trainer rank 1" in str(failed)
            with pytest.raises(EngineError, match="expected version 3 committed whole"):
                await engine.finish_weight_update(3)
            # the next whole update is served
            await _push_all(senders, shards, 4)
            await engine.finish_weight_update(4)
            await engine.resume()
            assert await engine.get_weight_version() == 4
        finally:
            engine.close()
            for s in senders:
                s.close()

    asyncio.run(main())


def test_a_single_sender_describes_itself_and_a_wrong_group_is_named():
    sender = WeightSender(group="one", transport="shm")
    _, senders = _senders(tiny_model(0).state_dict(), "many", 2)
    try:
        alone = describe_group("one", sender.address)
        assert alone.addresses is None and alone.trainer is None and not alone.sharded
        with pytest.raises(WeightSyncError, match=r"group: expected 'one' \(this sender's\), got"):
            describe_group("other", sender.address)
        # rank 0 answers for the group and for its own link; rank 1 for its link only
        assert describe_group("many", senders[0].address).sharded
        with pytest.raises(WeightSyncError, match=r"expected 'many/trainer1'"):
            describe_group("many", senders[1].address)
        with pytest.raises(ValueError, match=r"describe_group.addresses: expected this rank's"):
            senders[1].describe_group(["ipc:///nowhere", "ipc:///elsewhere"])
    finally:
        sender.close()
        for s in senders:
            s.close()
    with pytest.raises(SenderGone, match="cannot reach the sender of group 'one'"):
        describe_group("one", sender.address, timeout=5)


def test_an_engine_whose_tensors_differ_from_the_trainer_layout_is_refused_at_join():
    state = tiny_model(0).state_dict()
    state = {**state, "extra.weight": torch.zeros(4, 4)}
    _, senders = _senders(state, "g2", 2)
    engine = HFEngine(tiny_model(0), name="e")
    try:
        with pytest.raises(ValueError, match=r"params\['extra.weight'\]: expected"):
            asyncio.run(engine.init_weight_transfer("g2", senders[0].address))
    finally:
        engine.close()
        for s in senders:
            s.close()


def test_point_to_point_each_engine_told_its_link_learns_its_rank_and_takes_every_rank():
    # Engines that share a GPU cannot be in one NCCL group: each trainer rank then runs a
    # link per engine (here shm; NCCL groups of two across GPUs). Rank 0 describes each
    # of its links: the engine told it learns its rank and every rank's link to it.
    trainer_state = tiny_model(1).state_dict()
    specs = specs_of(trainer_state.items())
    layout = fsdp_layout(specs, 2)
    whole = EngineLayout.whole(specs, receivers=2)
    senders = [
        ShardedSender(group="p", rank=r, trainer=layout, engine=whole, transport="shm",
                      point_to_point=True)
        for r in range(2)
    ]  # fmt: skip
    engines = [HFEngine(tiny_model(0), name=f"e{i}") for i in range(2)]

    async def main():
        for s in senders:
            assert sorted(s.addresses) == [0, 1] and s.address == ""
        senders[0].describe_group([s.addresses for s in senders])
        found = describe_group("p", senders[0].addresses[1])
        assert (found.engine_rank, found.engines) == (1, 2)
        assert found.addresses == (senders[0].addresses[1], senders[1].addresses[1])
        await asyncio.gather(*(
            e.init_weight_transfer("p", senders[0].addresses[i]) for i, e in enumerate(engines)
        ))  # fmt: skip
        shards = [_shards(trainer_state, layout, r) for r in range(2)]
        for version in (1, 2):
            for e in engines:
                await e.pause("keep")
                await e.start_weight_update()
            reports = await _push_all(senders, shards, version)
            for e in engines:
                await e.finish_weight_update(version)
                await e.resume()
            # each rank sent its rows once to each engine, never the whole model
            assert [r.bytes for r in reports] == [2 * layout.owned_bytes(r) for r in range(2)]
        for e in engines:
            assert await e.get_weight_version() == 2
            assert await e.fingerprint() == fingerprint(trainer_state.items())

    try:
        asyncio.run(main())
    finally:
        for e in engines:
            e.close()
        for s in senders:
            s.close()


def test_point_to_point_links_are_described_only_for_engines_of_whole_tensors():
    state = tiny_model(0).state_dict()
    specs = specs_of(state.items())
    layout = fsdp_layout(specs, 2)
    sliced = tp_layout(specs, 2)
    s = ShardedSender(group="q", rank=0, trainer=layout, engine=sliced, transport="shm",
                      point_to_point=True)  # fmt: skip
    try:
        with pytest.raises(ValueError) as e:
            s.describe_group([s.addresses, {0: "ipc:///a", 1: "ipc:///b"}])
        assert str(e.value).startswith(
            "describe_group: point to point, engine ranks learn only the trainer layout and "
            "need every tensor whole; parameter `"
        )
        with pytest.raises(ValueError, match=r"expected every rank's addresses by engine rank"):
            s.describe_group(["ipc:///a", "ipc:///b"])
    finally:
        s.close()
