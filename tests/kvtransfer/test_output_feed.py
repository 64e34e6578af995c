"""The output feed (kvtransfer/output_feed.py) behind DecodeClient.poll: concurrent requests
read through one client get exactly the tokens of their own polls, with one poll_many call per
round instead of a call per request; unknown requests raise KeyError; a failed call reaches
every reader after the outputs before it; a new reader wakes the poll in flight; the loop
thread ends with its last reader."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from decode_worker.worker import DecodeWorker
from kvtransfer.output_feed import OutputFeed
from kvtransfer.worker_api import PromptRequest, TokenOutput
from kvtransfer.worker_client import DecodeClient
from tests.helpers import random_prompts

GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "seed": 0}


class DirectTransport:
    """A worker's methods called in this process, counted by name."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.calls: Counter[str] = Counter()

    def call(self, method, *args, timeout=None, **kwargs):
        self.calls[method] += 1
        return getattr(self.worker, method)(*args, **kwargs)


def read_all(poll, request_id: str) -> tuple[list[int], int]:
    """(the request's tokens, how many outputs carried them) read through poll()."""
    tokens: list[int] = []
    outputs = 0
    while True:
        for out in poll(request_id, 5.0):
            tokens += out.token_ids
            outputs += 1
            if out.finished:
                return tokens, outputs


@pytest.fixture(autouse=True)
def no_feed_loop_left():
    """Every feed's loop thread ends with the test: one left polling a fake that answers at
    once would spin, holding the GIL, for the rest of the test session."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    left = [t for t in threading.enumerate() if t not in before and t.name == "output-feed"]
    for thread in left:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert [t.name for t in left if t.is_alive()] == []


@pytest.fixture
def worker(tiny_llama):
    options = dict(model=tiny_llama, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256)
    w = DecodeWorker("d0", options)
    yield w
    w.shutdown()


def run_requests(worker, poll, prompts, prefix: str) -> list[tuple[list[int], int]]:
    for i, prompt in enumerate(prompts):
        worker.local_generate(PromptRequest(f"{prefix}{i}", tuple(prompt), GREEDY))
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda i: read_all(poll, f"{prefix}{i}"), range(len(prompts))))


def test_requests_read_through_one_feed_get_their_own_tokens_with_one_call_a_round(worker):
    prompts = random_prompts([9, 17, 5, 30, 12, 21], seed=3)
    alone = run_requests(worker, worker.poll, prompts, "direct-")
    transport = DirectTransport(worker)
    client = DecodeClient(transport)
    steps_before = worker.loop.num_steps
    fed = run_requests(worker, client.poll, prompts, "fed-")
    steps = worker.loop.num_steps - steps_before
    assert [tokens for tokens, _ in fed] == [tokens for tokens, _ in alone]
    assert all(len(tokens) == 12 for tokens, _ in fed)
    outputs = sum(n for _, n in fed)
    assert transport.calls["poll"] == 0
    # a round's call returns once any request has outputs: at most a call per step (and the
    # wakes of requests that joined while one was in flight), not a call per output
    assert transport.calls["poll_many"] <= steps + transport.calls["wake_polls"] + 2
    assert transport.calls["poll_many"] < outputs
    assert client.feed.num_readers() == 0
    with pytest.raises(KeyError, match="unknown request 'nobody'"):
        client.poll("nobody", 1.0)


def test_a_failed_call_reaches_every_reader_after_the_outputs_before_it():
    rounds = iter(
        [
            ([TokenOutput("a", (1,), "", False, None, 0)], []),
            ConnectionResetError("worker gone"),
        ]
    )
    asked: list[list[str]] = []
    both_asked = threading.Event()

    def poll_many(ids, timeout):
        asked.append(sorted(ids))
        if len(ids) < 2:  # wait until b reads too: both are in the failing round
            both_asked.wait(5.0)
        step = next(rounds)
        if isinstance(step, BaseException):
            raise step
        return step

    def wake():
        both_asked.set()

    feed = OutputFeed(poll_many, wake, wait_s=0.01)
    reader_a = threading.Thread(target=feed.poll, args=("a", 0.0))
    reader_a.start()
    reader_a.join()
    # b joins while a's round is in flight and wakes it; on a loaded machine both rounds may
    # end before b's first take, which then raises at once
    try:
        b_first = feed.poll("b", 0.0)
    except ConnectionResetError:
        b_first = None
    assert feed.poll("a", 5.0)[0].token_ids == (1,)  # the output came before the error
    for rid in ("a", "b") if b_first is not None else ("a",):
        assert b_first in ([], None)
        with pytest.raises(ConnectionResetError, match="worker gone"):
            feed.poll(rid, 5.0)
    assert asked[-1] == ["a", "b"]
    assert feed.num_readers() == 0


def test_a_new_reader_wakes_the_poll_in_flight_and_the_loop_ends_with_the_last_reader():
    woken = threading.Event()
    calls: list[list[str]] = []

    def poll_many(ids, timeout):
        calls.append(sorted(ids))
        if ids == ["a"]:
            assert woken.wait(5.0)  # without the wake this round would wait out its timeout
            return [], []
        return [TokenOutput(rid, (7,), "", True, "length", 0) for rid in ids], []

    feed = OutputFeed(poll_many, woken.set, wait_s=60.0)
    first = threading.Thread(target=feed.poll, args=("a", 0.0))
    first.start()
    first.join()
    while not calls:  # a's round is in flight
        threading.Event().wait(0.01)
    outs = feed.poll("b", 5.0)
    assert [o.request_id for o in outs] == ["b"] and outs[0].finished
    assert [o.token_ids for o in feed.poll("a", 5.0)] == [(7,)]
    assert calls == [["a"], ["a", "b"]]
    assert feed.num_readers() == 0
    thread = feed._thread
    if thread is not None:
        thread.join(5.0)
    assert feed._thread is None


def test_a_wake_that_hangs_does_not_hold_up_the_reader():
    """A frozen worker: its poll and its wake_polls never answer; a new reader's poll still
    returns after its own timeout."""
    frozen = threading.Event()
    calls: list[list[str]] = []

    def poll_many(ids, timeout):
        calls.append(list(ids))
        if not frozen.wait(10.0):
            return [], []
        return [], list(ids)  # back, and it knows neither request: their reads end

    feed = OutputFeed(poll_many, lambda: frozen.wait(10.0), wait_s=60.0)
    assert feed.poll("a", 0.0) == []
    while not calls:
        threading.Event().wait(0.01)
    start = time.monotonic()
    assert feed.poll("b", 0.05) == []
    assert time.monotonic() - start < 2.0
    frozen.set()
    for rid in ("a", "b"):
        with pytest.raises(KeyError, match=f"unknown request '{rid}'"):
            feed.poll(rid, 5.0)


def test_reset_drops_what_an_earlier_attempt_left_unread():
    """The router's next attempt on the same worker reuses the request id: the first
    attempt's unread last output (an abort, here) must not end the second one."""
    rounds = [
        [TokenOutput("a", (), "", True, "abort", 0)],
        [TokenOutput("a", (5,), "", True, "length", 0)],
    ]

    def poll_many(ids, timeout):
        return (rounds.pop(0) if rounds else []), []

    feed = OutputFeed(poll_many, lambda: None, wait_s=0.01)
    feed.poll("a", 0.0)  # the first attempt starts reading, then leaves
    while len(rounds) == 2:
        threading.Event().wait(0.01)
    feed.reset("a")
    outs = feed.poll("a", 5.0)
    assert [o.token_ids for o in outs] == [(5,)]
