"""One request's life in the router, top to bottom: attempts until one ends it.

    RequestLife.run   the client's stream, observed as it passes (TTFT, ITL, E2E, finish)
      _attempt        choose the workers (router/worker_choice.py), record where the request
                      runs (router/pools.py), hand it off (router/handoff.py: decode.reserve
                      -> prefill -> the decode worker streams; or the decode worker prefills
                      it locally), every output watched for a worker failure (watch)
        again         nothing was streamed and the request goes again: the pools changed
                      while choosing, the pair is not re-paired yet (PairNotReady), or the
                      decode worker's blocks went to other requests before the reservation
      _move           a worker failed (router/worker_failures.py): it is marked unhealthy,
                      the attempt aborted on its workers, and the next attempt continues
                      elsewhere; past migration_limit moves, MigrationLimitExceeded
      finish          the last output carries the request's totals and its workers

A continuation (Progress) is prompt + the tokens already streamed, with the same request id
and seed and params["num_prior_output_tokens"] = how many were streamed: the engine counts
them towards max_tokens and primes its detokenizer with them (text and stop strings continue
across the move), and seeded draws depend on a token's absolute position, so they continue
exactly. The client's stream goes on as if nothing happened.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Generator, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TypeVar

from engine.block_hash import hash_prompt_blocks
from engine.errors import NoFreeBlocksError
from kvtransfer.worker_api import PrefillAPI
from router.handoff import generate_disaggregated, generate_local, pull_prefix
from router.metrics import RouterMetrics, tap
from router.policy import NoWorkerAvailable
from router.pools import WorkerPools
from router.sessions import SessionHint
from router.worker_choice import CAPACITY_POLL_S, Choice, PullOrder, WorkerChooser
from router.worker_failures import (
    MigrationLimitExceeded,
    PairNotReady,
    WorkerFailed,
    ask,
    is_worker_failure,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RequestRules:
    """What a request lives by, fixed when it arrives (Router.configure sets new ones)."""

    timeout: float = 600.0  # an attempt's stream is aborted after this many seconds
    # How long a request waits for a usable worker in each pool and for free decode KV
    # blocks, counted from its arrival and again from each move.
    wait_for_workers_s: float = 0.0
    migration_limit: int = 3  # moves to other workers after a worker failed
    pull_timeout: float = 30.0  # a pull decode -> prefill before the prefill (then recompute)


@dataclass(frozen=True, slots=True)
class RouterParts:
    """What every request of one router shares."""

    pools: WorkerPools
    chooser: WorkerChooser
    metrics: RouterMetrics
    tally: Tally
    calls: Executor  # aborts on a failed worker run here (its calls may hang)


class RequestLife:
    """One request; run() yields the output dicts its client gets. The last one carries
    prefill_worker, decode_worker, prompt_tokens (the client's prompt) and num_migrations."""

    def __init__(
        self,
        parts: RouterParts,
        rules: RequestRules,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict,
        cache_salt: str | None = None,
        session: SessionHint | None = None,
    ) -> None:
        self.parts = parts
        self.rules = rules
        self.request_id = request_id
        self.cache_salt = cache_salt
        self.session = session
        self.progress = Progress(prompt_token_ids, params, rules.migration_limit)
        # Workers this request failed on -> the health reports seen then: it goes back to one
        # only after a later report found it healthy again.
        self.failed_at: dict[str, int] = {}
        self.deadline = time.monotonic() + rules.wait_for_workers_s

    def run(self) -> Iterator[dict]:
        """The request's outputs, across as many attempts as it takes."""
        timer = self.parts.metrics.start()
        progress = self.progress
        while True:
            prompt, params = progress.attempt()
            try:
                again = yield from timer.track(progress.track(self._attempt(prompt, params)))
            except NoWorkerAvailable as exc:
                if progress.failures:  # the workers it could move to are gone too
                    raise progress.no_worker_left(exc) from exc
                raise
            except WorkerFailed as exc:
                self._move(exc)
                continue
            if not again:
                return

    def _attempt(self, prompt: list[int], params: dict) -> Generator[dict, None, bool]:
        """One attempt; returns True (having streamed nothing) when the request must go
        again, raises WorkerFailed when a worker failed under it."""
        pools, n = self.parts.pools, len(prompt)
        hashes = hash_prompt_blocks(prompt, pools.block_size, pools.hash_seed, self.cache_salt)
        choice = self.parts.chooser.choose(hashes, n, self.failed_at, self.deadline, self.session)
        if not pools.register(self.request_id, (choice.prefill, choice.decode)):
            return True  # a chosen worker left the pools meanwhile: choose among the new ones
        self.parts.metrics.decided(choice.policy, choice.local)
        if choice.pull_decision is not None:
            self.parts.metrics.pull_decided(choice.pull_decision)
        if choice.prefill is not None:  # a prefill worker's load counts from dispatch
            pools.load.dispatched(choice.prefill[0], choice.uncached_tokens)
        prefilled = False  # the first output came
        try:
            for out in watch(self._handoff(choice, prompt, params), choice.decode[0]):
                if not prefilled:
                    prefilled = True
                    self._prefilled(choice, n, out["num_cached_tokens"])
                if out["finished"]:
                    out.update(
                        prefill_worker=(choice.prefill or choice.decode)[0],
                        decode_worker=choice.decode[0],
                        prompt_tokens=n,
                    )
                    if self.session is not None and out["finish_reason"] != "error":
                        self.parts.chooser.sessions.remember(
                            self.session, choice.prefill and choice.prefill[0], choice.decode[0]
                        )
                yield out
            return False
        except WorkerFailed as exc:
            self._abort(exc, choice)
            raise
        except PairNotReady as exc:
            logger.warning(
                "request %s: %s; waiting for the controller to pair them", self.request_id, exc
            )
            pools.mark_unhealthy(exc.prefill_id, exc.decode_id)
            return True
        except NoFreeBlocksError:
            # The decode worker's reservation was refused for now: wait for blocks to come
            # free if they can before the deadline (a local prefill reports it at once).
            if (
                prefilled
                or choice.local
                or not choice.can_fit_later
                or time.monotonic() + CAPACITY_POLL_S >= self.deadline
            ):
                raise
        finally:
            pools.finish(self.request_id)
            if not prefilled and choice.prefill is not None:
                pools.load.prefilled(choice.prefill[0], choice.uncached_tokens)
        time.sleep(CAPACITY_POLL_S)
        return True

    def _handoff(self, choice: Choice, prompt: list[int], params: dict) -> Iterator[dict]:
        """The attempt's calls to its workers (router/handoff.py)."""
        decode_id, decode = choice.decode
        if choice.prefill is None:
            return generate_local(
                decode,
                self.request_id,
                prompt,
                params,
                cache_salt=self.cache_salt,
                timeout=self.rules.timeout,
                session=self.session,
            )
        prefill_id, prefill = choice.prefill
        outputs = generate_disaggregated(
            prefill,
            decode,
            self.request_id,
            prompt,
            params,
            prefill_id=prefill_id,
            decode_id=decode_id,
            cache_salt=self.cache_salt,
            timeout=self.rules.timeout,
            session=self.session,
        )
        if choice.pull is None:
            return outputs
        return itertools.chain(self._pull(prefill_id, prefill, choice.pull, prompt), outputs)

    def _pull(
        self, prefill_id: str, prefill: PrefillAPI, order: PullOrder, prompt: list[int]
    ) -> Iterator[dict]:
        """Before the prefill (as the attempt's first step; yields nothing): the prefill worker
        pulls the blocks it lacks of the prompt's prefix from the decode worker holding it.
        What moved feeds the pair's bandwidth; a failed pull leaves the prefill to compute."""
        tokens = prompt[: order.num_blocks * self.parts.pools.block_size]
        result = pull_prefix(
            prefill, order.source, tokens, self.cache_salt, self.rules.pull_timeout
        )
        if result is not None:
            self.parts.chooser.costs.observe_pull(prefill_id, order.source, result)
        yield from ()

    def _prefilled(self, choice: Choice, prompt_tokens: int, cached_tokens: int) -> None:
        """The prompt was prefilled: off its prefill worker's queue, into the hit rate (by
        medium: the device hits the index expected first, the rest from the tier it expected,
        else the device: pulled blocks are in the prefill worker's KV cache)."""
        if choice.prefill is not None:
            self.parts.pools.load.prefilled(choice.prefill[0], choice.uncached_tokens)
        self.parts.metrics.prefix_cache(prompt_tokens, cached_tokens)
        device_expected, tier_expected = choice.cached
        medium = choice.tier_medium if choice.pull is None else None
        tier = min(tier_expected, max(0, cached_tokens - device_expected)) if medium else 0
        self.parts.metrics.cached_by_medium("device", cached_tokens - tier)
        if medium is not None and tier:
            self.parts.metrics.cached_by_medium(medium, tier)
        self.parts.tally.prompt(prompt_tokens, cached_tokens)

    def _abort(self, exc: WorkerFailed, choice: Choice) -> None:
        """Mark the failed worker unhealthy (until the controller's next health report) and
        abort the request on this attempt's workers, quietly: on the failed one in the
        background (it may hang), on the others now (the next attempt may reuse one)."""
        self.parts.pools.mark_unhealthy(exc.worker_id)
        for worker_id, worker in filter(None, (choice.prefill, choice.decode)):
            abort = lambda w=worker: w.abort(self.request_id, propagate=False)  # noqa: E731
            if worker_id == exc.worker_id:
                self.parts.calls.submit(ask, worker_id, "abort", abort)
            else:
                ask(worker_id, "abort", abort)

    def _move(self, exc: WorkerFailed) -> None:
        """Count the move (MigrationLimitExceeded past the limit); the next attempt leaves
        the failed worker out and waits for workers afresh."""
        logger.warning("request %s: %s; moving it", self.request_id, exc)
        self.failed_at[exc.worker_id] = self.parts.pools.num_reports()
        self.progress.failed(exc)
        self.parts.tally.migrated()
        self.deadline = time.monotonic() + self.rules.wait_for_workers_s


def watch(outputs: Iterator[dict], worker_id: str) -> Iterator[dict]:
    """`outputs` of one attempt, raising WorkerFailed for a worker failure: an exception that
    means one (blamed on worker_id, the decode worker, which every call that raises here goes
    to) or an error output naming its failed_worker."""
    try:
        for out in outputs:
            failed = out.get("failed_worker")
            if failed is not None:
                raise WorkerFailed(failed, out.get("error") or "failed")
            yield out
    except WorkerFailed:
        raise
    except Exception as exc:
        if is_worker_failure(exc):
            raise WorkerFailed(worker_id, f"{type(exc).__name__}: {exc}") from exc
        raise


class Progress:
    """One request across attempts: the tokens streamed so far and the workers that failed."""

    def __init__(self, prompt_token_ids: list[int], params: dict, limit: int) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = dict(params)
        if self.params.get("seed") is None:  # every attempt draws the same random stream
            self.params["seed"] = random.getrandbits(63)
        self.limit = limit
        self.generated: list[int] = []
        self.failures: list[WorkerFailed] = []
        self.num_cached_tokens: int | None = None  # the first attempt's (the client's prompt)

    def attempt(self) -> tuple[list[int], dict]:
        """(prompt, params) of the next attempt: the original ones, or a continuation."""
        if not self.generated:
            return self.prompt_token_ids, self.params
        params = {**self.params, "num_prior_output_tokens": len(self.generated)}
        return self.prompt_token_ids + self.generated, params

    def failed(self, failure: WorkerFailed) -> None:
        """Count a failure; MigrationLimitExceeded once more than `limit` happened."""
        self.failures.append(failure)
        if len(self.failures) > self.limit:
            workers = ", ".join(f.worker_id for f in self.failures)
            raise MigrationLimitExceeded(
                f"request failed on workers {workers} (migration_limit={self.limit}); "
                f"last error: {failure.reason}"
            ) from failure

    def no_worker_left(self, exc: Exception) -> MigrationLimitExceeded:
        """The error for a request that must move but has no healthy worker left to go to."""
        workers = ", ".join(f.worker_id for f in self.failures)
        return MigrationLimitExceeded(
            f"request failed on workers {workers} and could not move: {exc}"
        )

    def track(self, outputs: Generator[dict, None, T]) -> Generator[dict, None, T]:
        """`outputs` of one attempt as the client sees them; returns what the attempt
        returns, and closes it when closed."""
        return tap(outputs, self._seen)

    def _seen(self, out: dict) -> None:
        """Count the output's tokens; keep the first attempt's cached-token count and the
        client's prompt length in what the client is told."""
        self.generated += out["token_ids"]
        if self.num_cached_tokens is None:
            self.num_cached_tokens = out["num_cached_tokens"]
        if self.failures:
            out["num_cached_tokens"] = self.num_cached_tokens
        if out["finished"]:
            out["prompt_tokens"] = len(self.prompt_token_ids)
            out["num_migrations"] = len(self.failures)


class Tally:
    """The router's request counters (its hit rate, the migrations metric); thread-safe."""

    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0  # of those, served from the chosen worker's prefix cache
        self.num_migrations = 0  # requests moved after a worker failed
        self._lock = threading.Lock()

    def prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        with self._lock:
            self.num_prompt_tokens += prompt_tokens
            self.num_cached_tokens += cached_tokens

    def migrated(self) -> None:
        with self._lock:
            self.num_migrations += 1
