"""Which errors move a request (router/worker_failures.py), and what a continuation looks like
(router/request_life.py)."""

from __future__ import annotations

import pytest

from engine.errors import CapacityError, InvalidRequestError, NoFreeBlocksError
from kvtransfer.control import PeerUnavailable, RemoteError
from kvtransfer.errors import PeerLost, TransferRejected
from router.errors import UNAVAILABLE, classify
from router.request_life import Progress, watch
from router.worker_failures import (
    MigrationLimitExceeded,
    WorkerFailed,
    is_worker_failure,
    kv_never_arrived,
)


class RayActorError(Exception):  # stands in for ray.exceptions.RayActorError (matched by name)
    pass


class ActorDiedError(RayActorError):
    pass


@pytest.mark.parametrize(
    "exc",
    [PeerUnavailable("gone"), TimeoutError("poll"), EOFError(), PeerLost("x"), ActorDiedError()],
)
def test_worker_failures(exc):
    assert is_worker_failure(exc)


@pytest.mark.parametrize(
    "exc",
    [
        InvalidRequestError("bad"),
        CapacityError("never fits"),
        NoFreeBlocksError("not now"),
        TransferRejected("refused"),
        RemoteError("ValueError", "bug"),
        KeyError("unknown request"),
    ],
)
def test_request_errors_do_not_move(exc):
    assert not is_worker_failure(exc)


def test_watch_blames_the_decode_worker_or_the_named_one():
    def raises():
        yield {"token_ids": [1]}
        raise PeerUnavailable("connection reset")

    with pytest.raises(WorkerFailed) as err:
        list(watch(raises(), "d0"))
    assert err.value.worker_id == "d0"
    marked = [{"token_ids": [], "failed_worker": "p1", "error": "prefill worker p1 failed"}]
    with pytest.raises(WorkerFailed) as err:
        list(watch(iter(marked), "d0"))
    assert err.value.worker_id == "p1"
    with pytest.raises(InvalidRequestError):
        list(watch((_ for _ in ()).throw(InvalidRequestError("bad")), "d0"))


def test_kv_that_never_arrived_blames_the_prefill_worker():
    out = {"finish_reason": "error", "token_ids": [], "error": "KV from prefill worker p0 did"}
    assert kv_never_arrived(out, "p0")
    assert not kv_never_arrived(out, "p1")
    assert not kv_never_arrived({**out, "token_ids": [3]}, "p0")


def test_continuation_and_limit():
    progress = Progress([1, 2, 3], {"max_tokens": 10}, limit=1)
    seed = progress.params["seed"]  # fixed once: every attempt draws the same stream
    assert progress.attempt() == ([1, 2, 3], {"max_tokens": 10, "seed": seed})
    first = {"token_ids": [7, 8], "finished": False, "num_cached_tokens": 0}
    list(progress.track(o for o in [first]))
    progress.failed(WorkerFailed("d0", "gone"))
    prompt, params = progress.attempt()
    assert prompt == [1, 2, 3, 7, 8]
    assert params == {"max_tokens": 10, "seed": seed, "num_prior_output_tokens": 2}
    with pytest.raises(MigrationLimitExceeded, match="d0, d1.*migration_limit=1") as err:
        progress.failed(WorkerFailed("d1", "gone"))
    assert classify(err.value) is UNAVAILABLE
