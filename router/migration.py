"""Request migration: which errors mean "a worker failed" (the request moves to another worker)
rather than "the request is invalid" (the client gets the error), and a request's progress
across attempts.

A worker failed when it cannot be reached or died during a call (PeerUnavailable, any
ConnectionError or EOFError), did not answer a call within its transport's timeout
(TimeoutError, Ray's GetTimeoutError), its actor died (Ray's RayActorError family), the KV
pair with it broke (PeerLost, TransferTimeout), or, for a prefill worker, its KV never reached
the decode worker (an error output the hand-off marks with "failed_worker"). Everything else,
engine errors included (InvalidRequestError, CapacityError, NoFreeBlocksError, ...), is the
request's own outcome and is not retried here.

A continuation is prompt + the tokens already streamed, with the same request id and seed and
params["num_prior_output_tokens"] = how many were streamed: the engine counts them towards
max_tokens and primes its detokenizer with them (text and stop strings continue across the
move), and seeded draws depend on a token's absolute position, so they continue exactly.
"""

from __future__ import annotations

import random
from collections.abc import Generator, Iterator
from typing import TypeVar

from kvtransfer.errors import PeerLost, TransferTimeout

T = TypeVar("T")

# Ray's exceptions by class name (the router does not import ray): a dead or unreachable actor.
_RAY_WORKER_FAILURES = frozenset(
    {
        "RayActorError",
        "ActorDiedError",
        "ActorUnavailableError",
        "WorkerCrashedError",
        "NodeDiedError",
        "GetTimeoutError",
    }
)


class WorkerFailed(Exception):
    """A worker failed under a request (died, hung, or its KV never arrived): it may move."""

    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(f"worker {worker_id} failed: {reason}")
        self.worker_id = worker_id
        self.reason = reason


class PairNotReady(Exception):
    """The prefill worker has no pair group with the chosen decode worker (UnknownPeer): one of
    them was restarted and the controller has not paired them again yet. Nothing was prefilled
    or streamed, so this is no migration: the request waits until the controller's next health
    report (sent after it re-paired restarted workers) marks both healthy, then goes again."""

    def __init__(self, prefill_id: str, decode_id: str, reason: str) -> None:
        super().__init__(f"workers {prefill_id} and {decode_id} are not paired: {reason}")
        self.prefill_id = prefill_id
        self.decode_id = decode_id


class MigrationLimitExceeded(RuntimeError):
    """A request's workers failed more often than migration_limit allows (UNAVAILABLE / 503)."""


def is_worker_failure(exc: BaseException) -> bool:
    """True if `exc` from a worker call means the worker failed, not the request."""
    if isinstance(exc, ConnectionError | EOFError | TimeoutError | PeerLost | TransferTimeout):
        return True
    return any(cls.__name__ in _RAY_WORKER_FAILURES for cls in type(exc).__mro__)


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

    @property
    def num_migrations(self) -> int:
        return len(self.failures)

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
        """`outputs` of one attempt as the client sees them (tokens counted, the first
        attempt's cached-token count and the original prompt length kept); returns what the
        attempt returns, and closes it when closed."""
        try:
            while True:
                try:
                    out = next(outputs)
                except StopIteration as stop:
                    return stop.value
                self.generated += out["token_ids"]
                if self.num_cached_tokens is None:
                    self.num_cached_tokens = out["num_cached_tokens"]
                if self.failures:
                    out["num_cached_tokens"] = self.num_cached_tokens
                if out["finished"]:
                    out["prompt_tokens"] = len(self.prompt_token_ids)
                    out["num_migrations"] = self.num_migrations
                yield out
        finally:
            outputs.close()
