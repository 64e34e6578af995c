"""RouterMetrics: what the router records, as its clients see it (names as vLLM's).

  time_to_first_token_seconds   Router.generate called -> first output carrying tokens
  inter_token_latency_seconds   between consecutive outputs carrying tokens (one observation
                                per output after the first, as vLLM's per engine output)
  e2e_request_latency_seconds   Router.generate called -> finished output
  request_success_total         finished requests by finished_reason (stop, length, abort,
                                error: the reason the client sees)
  router_decisions_total        worker choices by policy and prefill="local" | "remote"
  prefix_cache_*_total          prompt tokens routed / tokens the chosen worker's cache served
                                (the cached_tokens clients are told), once per request
  request_errors_total          requests a front door answered with an error, by door ("http"
                                or "grpc"), code (the HTTP status or the gRPC code name) and
                                reason (router/errors.py: error_reason, e.g. invalid_request,
                                model_not_found, prompt_too_long, unauthenticated, overloaded)
Counters kept by other router modules (auth failures, refused admissions) are read at scrape
time through read_counter(). The registry is this object's own, never the global one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, Metric

from engine.metrics import ITL_BUCKETS, PREFIX, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

T = TypeVar("T")


class RouterMetrics:
    """The router's own series; thread-safe (requests stream on many threads)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "Histogram of time to first token in seconds (as the router's clients see it).",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (between streamed outputs).",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.success = Counter(
            f"{PREFIX}request_success",
            "Finished requests, by the finish reason the client sees.",
            ["finished_reason"],
            registry=r,
        )
        self.decisions = Counter(
            f"{PREFIX}router_decisions",
            "Routing decisions, by prefill policy and prefill placement (local or remote).",
            ["policy", "prefill"],
            registry=r,
        )
        self.cache_queries = Counter(
            f"{PREFIX}prefix_cache_queries",
            "Prefix cache queries, in prompt tokens looked up.",
            registry=r,
        )
        self.cache_hits = Counter(
            f"{PREFIX}prefix_cache_hits", "Prefix cache hits, in tokens served.", registry=r
        )
        self.errors = Counter(
            f"{PREFIX}request_errors",
            "Requests answered with an error, by front door, status code and reason.",
            ["door", "code", "reason"],
            registry=r,
        )
        self._read: dict[str, _ReadCounter] = {}  # read_counter()'s collectors by name

    def start(self) -> RequestTimer:
        """A timer for one request, started now (call when the request reaches the router)."""
        return RequestTimer(self)

    def decided(self, policy: str, local: bool) -> None:
        """One routing decision: prefill on the decode worker (local) or a prefill worker."""
        self.decisions.labels(policy=policy, prefill="local" if local else "remote").inc()

    def prefix_cache(self, queries: int, hits: int) -> None:
        """A request's prompt tokens and the cached tokens its prefill was served."""
        self.cache_queries.inc(queries)
        self.cache_hits.inc(hits)

    def request_error(self, door: str, code: str | int, reason: str) -> None:
        """One request a front door answered with an error (door "http" or "grpc"; code the
        HTTP status or the gRPC code name; reason: router.errors.error_reason)."""
        self.errors.labels(door=door, code=str(code), reason=reason).inc()

    def read_counter(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """Expose a counter another module keeps (e.g. auth failures) as baton:<name>_total,
        read at scrape time. Registering a name again replaces its reader."""
        old = self._read.pop(name, None)
        if old is not None:
            self.registry.unregister(old)
        self._read[name] = _ReadCounter(f"{PREFIX}{name}", documentation, read)
        self.registry.register(self._read[name])


class RequestTimer:
    """Observes one request's output dicts (tokens, finished, finish_reason) as they pass."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: float | None = None  # when the last output carrying tokens passed

    def track(self, outputs: Generator[dict, None, T]) -> Generator[dict, None, T]:
        """Yield `outputs`' items, observing each; returns its return value. Closing this
        generator closes `outputs`."""
        return tap(outputs, self.observe)

    def observe(self, out: dict) -> None:
        now = time.monotonic()
        m = self.metrics
        if out.get("token_ids"):
            if self.last is None:
                m.ttft.observe(now - self.start)
            else:
                m.itl.observe(now - self.last)
            self.last = now
        if out.get("finished"):
            m.e2e.observe(now - self.start)
            m.success.labels(finished_reason=out.get("finish_reason") or "unknown").inc()


def tap(outputs: Generator[dict, None, T], see: Callable[[dict], None]) -> Generator[dict, None, T]:
    """`outputs`' items, each passed to see() before it is yielded (see may change it);
    returns what `outputs` returns, and closes it when closed."""
    try:
        while True:
            try:
                out = next(outputs)
            except StopIteration as stop:
                return stop.value
            see(out)
            yield out
    finally:
        outputs.close()


class _ReadCounter:
    """A collector of one counter whose value another object keeps."""

    def __init__(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        self.name, self.documentation, self.read = name, documentation, read

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterable[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, value=float(self.read()))]
