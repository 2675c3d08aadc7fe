"""One error grammar: every plane's classes are of their plane's base and of a family."""

from __future__ import annotations

import pickle
import warnings

import pytest

import rlferry.compat.transferqueue as tq
import rlferry.control as control
import rlferry.queue as queue
import rlferry.weights as weights
import rlferry.wire as wire
from rlferry import errors
from rlferry.engines.lora import LoraMismatch
from rlferry.ray import LaunchError

FAMILIES = {
    # class: (its plane's base, its family)
    wire.ChannelClosed: (wire.WireError, errors.Closed),
    wire.PeerGone: (wire.WireError, errors.Gone),
    wire.RequestTimeout: (wire.WireError, errors.Timeout),
    queue.QueueClosed: (queue.QueueError, errors.Closed),
    queue.ServiceGone: (queue.QueueError, errors.Gone),
    queue.GetTimeout: (queue.QueueError, errors.Timeout),
    queue.PutTimeout: (queue.QueueError, errors.Timeout),
    queue.SchemaError: (queue.QueueError, errors.RequestError),
    queue.UnknownTask: (queue.QueueError, errors.RequestError),
    queue.UnknownPartition: (queue.QueueError, errors.RequestError),
    weights.SenderClosed: (weights.WeightSyncError, errors.Closed),
    weights.ReceiverClosed: (weights.WeightSyncError, errors.Closed),
    weights.SenderGone: (weights.WeightSyncError, errors.Gone),
    weights.PushTimeout: (weights.WeightSyncError, errors.Timeout),
    control.EngineGone: (control.EngineError, errors.Gone),
    LoraMismatch: (weights.WeightSyncError, errors.RequestError),
    tq.ClientClosed: (queue.QueueError, errors.Closed),
    tq.ServiceGone: (queue.QueueError, errors.Gone),
}


@pytest.mark.parametrize("cls", list(FAMILIES), ids=lambda c: c.__name__)
def test_each_class_is_of_its_planes_base_and_of_its_family(cls):
    base, family = FAMILIES[cls]
    assert issubclass(cls, base)
    assert issubclass(cls, family)
    assert issubclass(cls, errors.RlferryError)


def test_the_families_are_also_the_builtin_errors_code_already_catches():
    assert issubclass(errors.Timeout, TimeoutError)
    assert issubclass(errors.RequestError, ValueError)
    assert issubclass(weights.PushTimeout, TimeoutError)
    assert issubclass(queue.UnknownTask, KeyError)
    # TransferQueue's own types, for code written against TransferQueue
    assert issubclass(tq.GetMetaTimeout, RuntimeError)
    assert not issubclass(tq.GetMetaTimeout, OSError)  # TimeoutError is one
    assert issubclass(tq.ClientClosed, RuntimeError)
    assert issubclass(tq.ServiceGone, RuntimeError)
    assert issubclass(tq.StorageKeyNotFoundError, KeyError)
    assert issubclass(LaunchError, RuntimeError)


def test_one_class_for_each_shared_idea():
    assert wire.RemoteError is errors.RemoteError
    assert wire.SecurityError is errors.SecurityError
    assert control.RequestError is errors.RequestError


def test_the_queues_remote_error_is_the_one_class_for_one_release():
    with pytest.warns(DeprecationWarning, match="import it from rlferry.errors"):
        assert queue.RemoteError is errors.RemoteError


def test_a_remote_error_names_the_remote_class_and_survives_pickling():
    e = errors.RemoteError("KeyError", "no such key")
    assert str(e) == "KeyError: no such key"
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), back.kind, back.message) == (errors.RemoteError, "KeyError", "no such key")


def test_an_engine_request_error_names_the_engine_that_refused_it():
    e = errors.RequestError("prompt: token id 99 is outside the vocabulary (< 13)", "engine0")
    assert (str(e), e.engine) == ("prompt: token id 99 is outside the vocabulary (< 13)", "engine0")


def test_a_gone_engine_is_an_engine_gone_and_says_so():
    e = control.EngineGone("engine0", "unreachable")
    assert str(e) == "engine `engine0`: unreachable"
    assert e.gone and not control.EngineError("engine0", "refused").gone


def test_engine_error_with_gone_still_makes_an_engine_gone_for_one_release():
    with pytest.warns(DeprecationWarning, match=r"raise EngineGone\(\.\.\.\)"):
        e = control.EngineError("engine0", "dead", gone=True)
    assert type(e) is control.EngineGone and e.gone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert type(control.EngineError("engine0", "refused", gone=False)) is control.EngineError


def test_one_except_clause_catches_every_planes_timeout():
    for cls in (wire.RequestTimeout, queue.GetTimeout, weights.PushTimeout):
        with pytest.raises(errors.Timeout):
            raise cls("waited 1 s")
