"""Sessions at the router: the fields are checked (errors name them), reach the workers, and a
session's next turn goes back to the workers its last turn ran on while the session lives
(an injectable clock), unless they are busier than the affinity is worth."""

from __future__ import annotations

import pytest

from engine.block_pool import KVEvent
from engine.errors import InvalidRequestError
from kvtransfer.worker_api import Role, WorkerStats
from router.kv_index import KVIndex
from router.policy import DecodeLoad, WorkerLoad, choose_decode, choose_prefill
from router.router import Router
from router.sessions import (
    AFFINITY_TOKENS,
    SESSION_TTL_S,
    SessionBook,
    SessionFieldError,
    SessionHint,
    SessionPlace,
    session_hint,
)
from tests.router.fake_workers import FakeDecode, FakePrefill

PARAMS = {"max_tokens": 1, "temperature": 0.0}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recording(FakeDecode):
    """A decode worker that streams its one token at once and keeps the requests it got."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = []

    def stats(self) -> WorkerStats:
        return WorkerStats("d", Role.DECODE, free_blocks=100, num_blocks=100)  # all finished

    def reserve(self, request, *args):
        self.requests.append(request)
        reservation = super().reserve(request, *args)
        self.release[request.request_id].set()
        return reservation

    def local_generate(self, request) -> None:
        self.requests.append(request)
        super().local_generate(request)
        self.release[request.request_id].set()


def test_the_fields_are_checked_and_errors_name_them():
    assert session_hint(None, None) is None
    assert session_hint("chat-1", None) == SessionHint("chat-1")
    with pytest.raises(SessionFieldError, match="retention_seconds needs a session_id") as e:
        session_hint(None, 30.0)
    assert e.value.field == "retention_seconds"
    SessionHint("chat-1", 600.0).check(600.0)
    cases = [
        (SessionHint("", None), "session_id", "session_id='' is invalid"),
        (SessionHint("x" * 257, None), "session_id", "a string of 1 to 256 characters"),
        (SessionHint("s", 0.0), "retention_seconds", "retention_seconds=0.0 is invalid"),
        (SessionHint("s", 601.0), "retention_seconds", "at most max_retention_seconds=600"),
    ]
    for hint, field, message in cases:
        with pytest.raises(SessionFieldError, match=message) as e:
            hint.check(600.0)
        assert e.value.field == field and isinstance(e.value, InvalidRequestError)


def test_the_book_forgets_a_session_when_its_retention_ends():
    clock = Clock()
    book = SessionBook(clock, max_sessions=2)
    book.remember(SessionHint("a", 30.0), "p0", "d0")
    book.remember(SessionHint("b"), None, "d1")  # no retention: remembered SESSION_TTL_S
    assert book.place("a") == SessionPlace("p0", "d0", 1030.0)
    assert book.affinity(SessionHint("a"), 100) == {"p0": 100, "d0": 100}
    assert book.affinity(SessionHint("b"), 100) == {"d1": 100}  # its decode worker prefilled
    assert book.affinity(None, 100) == {} and book.affinity(SessionHint("zz"), 100) == {}
    clock.now = 1029.9
    assert book.place("a") is not None
    clock.now = 1030.0
    assert book.place("a") is None and len(book) == 1  # expired: forgotten
    assert book.place("b") == SessionPlace(None, "d1", 1000.0 + SESSION_TTL_S)
    book.remember(SessionHint("c", 5.0), "p1", "d1")
    book.remember(SessionHint("d", 5.0), "p1", "d1")  # past max_sessions: "b" goes first
    assert (book.place("b"), len(book)) == (None, 2)
    book.remember(SessionHint("c", 50.0), "p0", "d0")  # a later turn moves and extends it
    assert book.place("c") == SessionPlace("p0", "d0", 1080.0)


def test_affinity_is_a_preference_in_the_cost_not_a_pin():
    index = KVIndex()
    for w in ("p0", "p1", "d0", "d1"):
        index.add_worker(w)
        index.apply(w, [KVEvent("stored", (1, 2))])  # the shared system prompt, everywhere
    prompt = [1, 2, 3, 4]
    near = {"p1": AFFINITY_TOKENS, "d1": AFFINITY_TOKENS}

    def prefill(loads, affinity=None) -> str:
        return choose_prefill(
            "cache_aware", prompt, 16, loads, index, num_prompt_tokens=70, affinity=affinity
        ).worker_id

    loads = [WorkerLoad("p0"), WorkerLoad("p1")]
    assert prefill(loads) == "p0"  # a tie: the lower id
    assert prefill(loads, near) == "p1"
    busy = [WorkerLoad("p0"), WorkerLoad("p1", AFFINITY_TOKENS - 1)]
    assert prefill(busy, near) == "p1"
    busy = [WorkerLoad("p0"), WorkerLoad("p1", AFFINITY_TOKENS + 1)]
    assert prefill(busy, near) == "p0"  # busier than the affinity is worth
    decode = [DecodeLoad("d0", 100), DecodeLoad("d1", 100, running_requests=5)]
    assert choose_decode(prompt, 70, 16, decode, index).worker_id == "d0"
    assert choose_decode(prompt, 70, 16, decode, index, affinity=near).worker_id == "d1"
    full = [DecodeLoad("d0", 100), DecodeLoad("d1", 2)]  # d1 has no room for 5 blocks
    assert choose_decode(prompt, 70, 16, full, index, affinity=near).worker_id == "d0"


def test_a_session_goes_back_to_its_workers_until_it_expires():
    clock = Clock()
    book = SessionBook(clock)
    p = {"p0": FakePrefill(), "p1": FakePrefill()}
    d = {"d0": Recording(), "d1": Recording()}
    router = Router(p, d, block_size=4, hash_seed="t", sessions=book, max_retention_seconds=60)

    def turn(rid: str, session: SessionHint | None) -> tuple[str, str]:
        last = list(router.generate(rid, [1, 2, 3, 4, 5], PARAMS, session=session))[-1]
        return last["prefill_worker"], last["decode_worker"]

    assert turn("r0", None) == ("p0", "d0")
    book.remember(SessionHint("s", 30.0), "p1", "d1")  # where the session's last turn ran
    assert turn("r1", SessionHint("s", 30.0)) == ("p1", "d1")
    sent = d["d1"].requests[-1]
    assert (sent.session_id, sent.retention_seconds) == ("s", 30.0)  # the workers keep it
    assert book.place("s") == SessionPlace("p1", "d1", 1030.0)  # remembered again at the end
    assert turn("r2", None) == ("p0", "d0")  # without hints: as before
    assert (d["d0"].requests[-1].session_id, d["d0"].requests[-1].retention_seconds) == (
        None,
        None,
    )
    clock.now = 1030.0
    assert turn("r3", SessionHint("s", 30.0)) == ("p0", "d0")  # expired: chosen afresh
    assert book.place("s") == SessionPlace("p0", "d0", 1060.0)
    with pytest.raises(SessionFieldError, match="at most max_retention_seconds=60"):
        list(router.generate("r4", [1, 2, 3, 4, 5], PARAMS, session=SessionHint("s", 61.0)))
