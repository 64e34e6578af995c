"""Router: picks the prefill and decode worker of each request and streams its tokens.

A facade over four parts, each in its own module:

  router/pools.py          the pools, their health and mode, and which requests run where
  router/worker_choice.py  the choice of an attempt's workers (KV index, policy, free KV)
  router/request_life.py   one request's life: attempts, failure watch, moves, finish
  router/handoff.py        an attempt's calls to its workers (reserve, prefill, stream)

Transport-agnostic: workers are kvtransfer.worker_api.PrefillAPI / DecodeAPI (in-process
workers, or kvtransfer.worker_client clients over RPC or Ray). The front doors
(router/server.py for gRPC, router/openai_http.py for HTTP) translate the dicts of `generate`.
"""

from __future__ import annotations

from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from engine.options import EngineOptions
from kvtransfer.worker_api import DecodeAPI, PrefillAPI
from router.kv_index import KVIndex
from router.metrics import RouterMetrics
from router.policy import Policy
from router.pools import Placement, WorkerPools, WorkerStatus
from router.readiness import Readiness
from router.request_life import RequestLife, RequestRules, RouterParts, Tally
from router.sessions import AFFINITY_TOKENS, SessionBook, SessionHint
from router.worker_choice import WorkerChooser

__all__ = ["Router", "WorkerStatus"]

MAX_RETENTION_S = EngineOptions().max_retention_seconds  # the engine option's default


class Router:
    """Routes requests over the prefill and decode workers set_workers names."""

    def __init__(
        self,
        prefill: dict[str, PrefillAPI],
        decode: dict[str, DecodeAPI],
        *,
        block_size: int,
        hash_seed: str,
        policy: str | Policy = "cache_aware",
        timeout: float = 600.0,
        local_prefill_tokens: int = 0,
        max_model_len: int | None = None,
        wait_for_workers_s: float = 0.0,
        aggregated: bool = False,
        migration_limit: int = 3,
        max_retention_seconds: float = MAX_RETENTION_S,
        sessions: SessionBook | None = None,
        affinity_tokens: int = AFFINITY_TOKENS,
    ) -> None:
        self.pools = WorkerPools(
            prefill,
            decode,
            block_size=block_size,
            hash_seed=hash_seed,
            max_model_len=max_model_len,
            aggregated=aggregated,
        )
        # Workers are asked side by side (each call may be a network round trip).
        calls = ThreadPoolExecutor(max_workers=16, thread_name_prefix="router-call")
        self.chooser = WorkerChooser(
            self.pools, calls, policy, local_prefill_tokens, sessions, affinity_tokens
        )
        # the bound of a request's retention_seconds: the workers' max_retention_seconds
        self.max_retention_seconds = max_retention_seconds
        self.rules = RequestRules(timeout, wait_for_workers_s, migration_limit)
        self.tally = Tally()
        self.metrics = RouterMetrics()  # router/metrics.py; the scrape: metrics_exposition
        self.metrics.read_counter(
            "request_migrations",
            "Requests moved to other workers after a worker failed.",
            lambda: self.tally.num_migrations,
        )
        self._parts = RouterParts(self.pools, self.chooser, self.metrics, self.tally, calls)

    # ---- requests ----------------------------------------------------------------------
    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict,
        cache_salt: str | None = None,
        session: SessionHint | None = None,
    ) -> Generator[dict, None, None]:
        """Output dicts of one request; the last carries prefill_worker and decode_worker.

        A session (router/sessions.py) is checked first (InvalidRequestError naming the field),
        goes to the workers (they keep its blocks for retention_seconds) and steers the next
        turn towards the workers that ran this one.

        Up to wait_for_workers_s, a request waits for a healthy worker in each pool and for a
        decode worker with enough free KV blocks for its prompt (running requests free them
        as they finish), instead of failing. When a worker fails under it, it moves: prompt
        + the tokens streamed so far go to other workers, the client's stream goes on; after
        migration_limit moves it fails with MigrationLimitExceeded (router/request_life.py)."""
        if session is not None:
            self.check_session(session)
        yield from RequestLife(
            self._parts, self.rules, request_id, prompt_token_ids, params, cache_salt, session
        ).run()

    def check_session(self, session: SessionHint) -> None:
        """InvalidRequestError naming the field unless the session's fields are valid here
        (the front doors call it before a request is admitted)."""
        session.check(self.max_retention_seconds)

    def abort(self, request_id: str) -> bool:
        """Abort a running request on its decode worker (which tells the prefill worker)."""
        placement = self.pools.placement(request_id)
        if placement is None:
            return False
        prefill, (_, decode) = placement
        decode.abort(request_id)
        if prefill is not None:
            prefill[1].abort(request_id)
        return True

    def placement(self, request_id: str) -> Placement | None:
        """Where a running request runs now: ((prefill id, worker) or None, (decode id,
        worker)); None when it does not run."""
        return self.pools.placement(request_id)

    # ---- control (the controller, through cluster/router_actor.py) ---------------------
    def set_workers(
        self,
        prefill: dict[str, PrefillAPI],
        decode: dict[str, DecodeAPI],
        *,
        block_size: int | None = None,
        hash_seed: str | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """Replace the pools new requests are routed to. A worker left out takes no new
        request once this returns; requests already on it finish (see active_counts)."""
        self.pools.set_workers(
            prefill,
            decode,
            block_size=block_size,
            hash_seed=hash_seed,
            max_model_len=max_model_len,
        )

    def configure(
        self,
        policy: str,
        local_prefill_tokens: int,
        wait_for_workers_s: float,
        aggregated: bool = False,
        migration_limit: int | None = None,
        max_retention_seconds: float | None = None,
    ) -> None:
        """Change the prefill policy, the conditional-disaggregation threshold, the wait for
        workers, aggregated mode, the migration limit and the retention bound (None:
        unchanged) in place; requests that arrive from now on live by them."""
        self.chooser.configure(policy, local_prefill_tokens)
        if max_retention_seconds is not None:
            self.max_retention_seconds = max_retention_seconds
        self.rules = replace(
            self.rules,
            wait_for_workers_s=wait_for_workers_s,
            migration_limit=self.rules.migration_limit
            if migration_limit is None
            else migration_limit,
        )
        self.pools.set_aggregated(aggregated)

    def update_membership(self, health: dict) -> None:
        """Apply the controller's check_health(): restarted workers start with an empty cache,
        unhealthy ones get no new requests."""
        self.pools.update_membership(health)

    def active_counts(self) -> dict[str, int]:
        """Running requests per worker id (prefill and decode side both count)."""
        return self.pools.active_counts()

    def refresh_index(self) -> None:
        """Apply the KV events every healthy worker published since the last refresh."""
        self.chooser.refresh_index()

    # ---- what it reports ---------------------------------------------------------------
    def status(self) -> list[WorkerStatus]:
        """Every worker's stats with its role and health (healthy: it answered)."""
        return self.pools.status()

    def readiness(self) -> Readiness:
        """Whether a new request can be served now: what /health and gRPC health answer."""
        return self.pools.readiness()

    def hit_rate(self) -> float:
        """Prompt tokens served from prefill workers' prefix caches / all prompt tokens."""
        return self.tally.num_cached_tokens / max(1, self.tally.num_prompt_tokens)

    @property
    def prefill(self) -> dict[str, PrefillAPI]:
        return self.pools.prefill

    @property
    def decode(self) -> dict[str, DecodeAPI]:
        return self.pools.decode

    @property
    def block_size(self) -> int:
        return self.pools.block_size

    @property
    def max_model_len(self) -> int | None:
        return self.pools.max_model_len

    @property
    def aggregated(self) -> bool:
        """Aggregated mode in effect: every new request is prefilled on its decode worker."""
        return self.pools.aggregated

    @property
    def index(self) -> KVIndex:
        return self.pools.index

    @property
    def policy_name(self) -> str:
        return self.chooser.policy_name

    @property
    def num_migrations(self) -> int:
        return self.tally.num_migrations

    @property
    def num_prompt_tokens(self) -> int:
        return self.tally.num_prompt_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self.tally.num_cached_tokens
