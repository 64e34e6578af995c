"""Request migration across real worker processes (CPU, gloo) under an in-process Router: a
decode worker SIGKILLed or SIGSTOPped mid-stream, or a prefill worker killed before its KV
arrived, and the client's stream goes on with exactly the unfaulted run's tokens; past
migration_limit (or with no worker left) the request fails with UNAVAILABLE naming the workers.
Every surviving worker's block pool is intact and holds no blocks of finished requests."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import LLM, SamplingParams
from engine.options import EngineOptions
from kvtransfer.control import RpcClient
from kvtransfer.worker_client import client
from router.errors import UNAVAILABLE, classify
from router.router import Router
from router.worker_failures import MigrationLimitExceeded
from tests.disagg.cluster import WorkerProcess, pair, start_worker
from tests.helpers import random_prompts

TRANSFER = {"timeout_seconds": 5.0, "lease_seconds": 4.0}
NUM_BLOCKS = 256
HASH_SEED = EngineOptions().hash_seed


def engine_options(model: str) -> dict:
    return dict(
        model=model,
        skip_tokenizer_init=True,
        block_size=4,
        num_kv_blocks=NUM_BLOCKS,
        chunk_size=16,
        max_num_batched_tokens=64,
    )


class Cluster:
    """Worker processes, all prefill workers paired with all decode workers, and a Router
    whose RPC clients time out after rpc_timeout_s (a hung worker's poll fails then)."""

    def __init__(self, model: str, prefill: list[str], decode: list[str], opts: dict | None = None):
        opts = opts or engine_options(model)
        specs = [("prefill", w) for w in prefill] + [("decode", w) for w in decode]
        with ThreadPoolExecutor(len(specs)) as pool:
            started = list(pool.map(lambda s: start_worker(s[0], s[1], opts, TRANSFER), specs))
        self.workers: dict[str, WorkerProcess] = {w.worker_id: w for w in started}
        self.num_blocks, self.block_size = opts["num_kv_blocks"], opts["block_size"]
        for p in prefill:
            for d in decode:
                pair(self.workers[p], self.workers[d])
        self.dead: set[str] = set()

    def router(self, rpc_timeout_s: float = 30.0, **kwargs) -> Router:
        def rpc(worker_id: str):
            w = self.workers[worker_id]
            return client(w.role, RpcClient(w.address, default_timeout=rpc_timeout_s))

        prefill = {w: rpc(w) for w, p in self.workers.items() if p.role == "prefill"}
        decode = {w: rpc(w) for w, p in self.workers.items() if p.role == "decode"}
        return Router(
            prefill, decode, block_size=self.block_size, hash_seed=HASH_SEED, timeout=60, **kwargs
        )

    def kill(self, worker_id: str) -> None:
        self.workers[worker_id].kill()
        self.dead.add(worker_id)

    def check_clean(self) -> None:
        """Surviving workers: pool accounting adds up, every block is free (cached or not)."""
        alive = [w for wid, w in self.workers.items() if wid not in self.dead]
        deadline = time.monotonic() + 10  # acks release prefill blocks a moment later
        while time.monotonic() < deadline and any(
            w.client.stats().free_blocks != self.num_blocks for w in alive
        ):
            time.sleep(0.1)
        for w in alive:
            w.client.check_integrity()
            stats = w.client.stats()
            assert (stats.free_blocks, stats.num_requests) == (self.num_blocks, 0), stats

    def stop(self) -> None:
        for worker_id, w in self.workers.items():
            if worker_id not in self.dead:
                os.kill(w.process.pid, signal.SIGCONT)
                w.stop()


@pytest.fixture
def cluster_of(tiny_llama):
    made: list[Cluster] = []

    def make(prefill: list[str], decode: list[str], opts: dict | None = None) -> Cluster:
        made.append(Cluster(tiny_llama, prefill, decode, opts))
        return made[-1]

    yield make
    for c in made:
        c.stop()


def expected_tokens(model: str, prompt: list[int], params: dict, opts: dict | None = None):
    llm = LLM(model, **{k: v for k, v in (opts or engine_options(model)).items() if k != "model"})
    return llm.generate(prompt, SamplingParams(**params))[0].token_ids


def serving(router: Router, request_id: str, pool: dict) -> str:
    """The worker of `pool` the request runs on now."""
    prefill, (decode_id, _) = router.placement(request_id)
    return decode_id if pool is router.decode else prefill[0]


def stream_with_fault(router: Router, request_id: str, prompt, params, fault) -> list[dict]:
    """Run the request; call fault(request id) once its first tokens reached the client."""
    outs = []
    for out in router.generate(request_id, prompt, params):
        outs.append(out)
        if len(outs) == 1:
            assert not out["finished"], "the request ended before the fault"
            fault(request_id)
    return outs


def tokens(outs: list[dict]) -> list[int]:
    return [t for o in outs for t in o["token_ids"]]


@pytest.mark.parametrize("sampled", [False, True])
def test_killed_decode_worker_continues_on_another(cluster_of, tiny_llama, sampled):
    c = cluster_of(["p0"], ["d0", "d1"])
    router = c.router()
    prompt = random_prompts([30], seed=7)[0]
    params = dict(max_tokens=200, ignore_eos=True, temperature=1.0 if sampled else 0.0, seed=42)
    want = expected_tokens(tiny_llama, prompt, params)
    killed = []

    def kill_decode(rid: str) -> None:
        killed.append(serving(router, rid, router.decode))
        c.kill(killed[0])

    outs = stream_with_fault(router, f"kill-{sampled}", prompt, params, kill_decode)
    last = outs[-1]
    assert tokens(outs) == want  # no token lost or repeated, the same draws
    assert (last["finish_reason"], last["num_migrations"]) == ("length", 1), last
    assert last["prompt_tokens"] == len(prompt)
    assert last["decode_worker"] != killed[0]
    assert router.pools.health()[killed[0]] is False
    assert router.num_migrations == 1
    c.check_clean()


def test_hung_decode_worker_times_out_and_moves(cluster_of, tiny_llama):
    c = cluster_of(["p0"], ["d0", "d1"])
    router = c.router(rpc_timeout_s=3.0)
    prompt = random_prompts([25], seed=8)[0]
    params = dict(max_tokens=300, ignore_eos=True, temperature=0.0)
    want = expected_tokens(tiny_llama, prompt, params)
    stopped = []

    def stop_decode(rid: str) -> None:
        stopped.append(serving(router, rid, router.decode))
        os.kill(c.workers[stopped[0]].process.pid, signal.SIGSTOP)

    start = time.monotonic()
    try:
        outs = stream_with_fault(router, "hung", prompt, params, stop_decode)
    finally:
        for w in stopped:
            os.kill(c.workers[w].process.pid, signal.SIGCONT)
    assert time.monotonic() - start < 30
    assert tokens(outs) == want
    assert outs[-1]["num_migrations"] == 1 and outs[-1]["decode_worker"] != stopped[0]
    c.workers[stopped[0]].client.abort("hung")  # it may have run on while nobody polled
    c.check_clean()


LONG_PARAMS = dict(max_tokens=8, ignore_eos=True, temperature=0.0)


def long_prefill_options(model: str) -> dict:
    """A long prompt in small steps: a fault lands while it is prefilling."""
    return dict(engine_options(model), block_size=16, num_kv_blocks=1024, max_num_batched_tokens=32)


def prefilling(router: Router, request_id: str, prompt) -> tuple[threading.Thread, dict, str]:
    """Run the request (LONG_PARAMS) on a thread; once the router placed it: (the thread, the
    dict its outputs go to under "outs", the prefill worker it runs on)."""
    result: dict = {}
    thread = threading.Thread(
        target=lambda: result.update(outs=list(router.generate(request_id, prompt, LONG_PARAMS)))
    )
    thread.start()
    deadline = time.monotonic() + 30
    while router.placement(request_id) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return thread, result, serving(router, request_id, router.prefill)


def test_prefill_worker_killed_before_kv_arrived_is_retried(cluster_of, tiny_llama):
    opts = long_prefill_options(tiny_llama)
    c = cluster_of(["p0", "p1"], ["d0"], opts)
    router = c.router()
    prompt = random_prompts([1500], seed=9)[0]
    want = expected_tokens(tiny_llama, prompt, LONG_PARAMS, opts)
    thread, result, victim = prefilling(router, "pk", prompt)
    c.kill(victim)
    thread.join(120)
    outs = result["outs"]
    assert tokens(outs) == want
    assert outs[-1]["num_migrations"] == 1
    assert outs[-1]["prefill_worker"] not in (victim, None)
    c.check_clean()


def test_frozen_prefill_worker_lets_the_lease_lapse_and_the_request_moves(cluster_of, tiny_llama):
    """A prefill worker frozen (SIGSTOP) mid-prefill stops renewing the decode worker's
    reservation: within about a lease the request moves to the other prefill worker, long
    before the router's call to the frozen one would time out (its RPC timeout is 60 s)."""
    opts = long_prefill_options(tiny_llama)
    c = cluster_of(["p0", "p1"], ["d0"], opts)
    router = c.router(rpc_timeout_s=60.0)
    prompt = random_prompts([1500], seed=19)[0]
    want = expected_tokens(tiny_llama, prompt, LONG_PARAMS, opts)
    thread, result, victim = prefilling(router, "frozen", prompt)
    frozen_at = time.monotonic()
    os.kill(c.workers[victim].process.pid, signal.SIGSTOP)
    try:
        thread.join(60)
        moved_after = time.monotonic() - frozen_at
    finally:
        os.kill(c.workers[victim].process.pid, signal.SIGCONT)
    outs = result["outs"]
    assert tokens(outs) == want
    assert outs[-1]["num_migrations"] == 1 and outs[-1]["prefill_worker"] == "p1"
    assert moved_after < 40, moved_after  # lease 4 s + the move, not the 60 s call timeout
    c.check_clean()


@pytest.mark.parametrize("limit", [0, 3])
def test_no_migration_left_is_unavailable_naming_the_workers(cluster_of, limit):
    c = cluster_of(["p0"], ["d0", "d1"])
    router = c.router(migration_limit=limit)
    prompt = random_prompts([20], seed=10)[0]
    params = dict(max_tokens=400, ignore_eos=True, temperature=0.0)

    def kill_all_decode(rid: str) -> None:
        first = serving(router, rid, router.decode)
        c.kill(first)
        if limit:  # the one it would move to dies too
            c.kill(next(w for w in router.decode if w != first))

    start = time.monotonic()
    with pytest.raises(MigrationLimitExceeded) as err:
        stream_with_fault(router, f"dead-{limit}", prompt, params, kill_all_decode)
    assert time.monotonic() - start < 30
    assert classify(err.value) is UNAVAILABLE
    for w in c.dead:
        assert w in str(err.value)
    if not limit:
        assert "migration_limit=0" in str(err.value)
    c.check_clean()


def test_aggregated_request_moves_to_another_decode_worker(cluster_of, tiny_llama):
    c = cluster_of([], ["d0", "d1"])  # no prefill pool: every request is prefilled locally
    router = c.router(aggregated=True)
    prompt = random_prompts([18], seed=11)[0]
    params = dict(max_tokens=200, ignore_eos=True, temperature=0.8, seed=3)
    want = expected_tokens(tiny_llama, prompt, params)
    outs = stream_with_fault(
        router, "agg", prompt, params, lambda rid: c.kill(serving(router, rid, router.decode))
    )
    assert tokens(outs) == want
    assert outs[-1]["num_migrations"] == 1 and outs[-1]["decode_worker"] not in c.dead
    c.check_clean()
