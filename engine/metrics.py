"""EngineMetrics: what one engine's step loop records, in Prometheus form (names as vLLM's).

Each engine owns its own prometheus_client CollectorRegistry (never the process-global one:
several engines live in one test process). A worker hands `snapshot(registry)` to the router,
which merges every worker's families into one exposition (router.metrics_exposition).

Units and scopes (the same as vLLM v1, so that its dashboards map over):
  prompt_tokens_total       prompts whose first token this engine sampled (all their tokens,
                            cached ones included; a preempted request is not counted again)
  generation_tokens_total   tokens this engine sampled (on a prefill worker: the first token)
  prefix_cache_*_total      tokens: queries = prompt tokens looked up, hits = tokens served
                            from the cache, once per request (when first scheduled, or when a
                            decode worker reserves blocks for remote KV)
  request_*_time_seconds    per request: queue = arrival -> first scheduled, prefill = first
                            scheduled -> first token, decode = first token -> finished (stop or
                            length); a decode worker records only decode time for remote KV
  engine_step_duration_seconds  Baton's own: wall time of each engine step that ran a batch
                            (scheduling, the model, sampling, outputs): its _sum over a run is
                            the time the engine computed, what a step profile predicts
  engine_step_phase_seconds{phase}  Baton's own: the same steps by phase (engine/step_phases.py
                            PHASES: schedule, inputs, forward, matmul, attention, norms,
                            logits, sample, grammar, outputs, kv); a step's phases add up to
                            its engine_step_duration_seconds, so the _sums do over a run
  engine_step_gap_seconds   Baton's own: from the end of a step that left work to the start of
                            the next (the engine loop's dispatch, calls between steps, GC)
  itl_target_floor_steps_total  Baton's own: steps (with itl_target_ms or decode_stretch) whose
                            one-block floor chunk alone was predicted over the step's limit (a
                            limit this hardware cannot hold at that context and load)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.request import Request, RequestStatus
from engine.step_phases import PHASES

PREFIX = "baton:"

# Bucket boundaries as vLLM's (vllm/v1/metrics/loggers.py, PrometheusStatLogger): TTFT has its
# own list; the per-token histograms (time_per_output_token, inter_token_latency) share one;
# the per-request latency histograms (e2e, queue, prefill, decode, inference) share another.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# vLLM's NIXL connector's transfer-time histogram (vllm:nixl_xfer_time_seconds,
# vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py, NixlPromMetrics).
# A phase of a step, or the gap between steps: tens of microseconds to seconds.
PHASE_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5,
)  # fmt: skip
KV_TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)

NORMAL_FINISH = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class EngineMetrics:
    """Counters, gauges and per-request histograms of one engine; called on its loop thread."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.running = Gauge(
            f"{PREFIX}num_requests_running", "Requests in the running batch.", registry=r
        )
        self.waiting = Gauge(
            f"{PREFIX}num_requests_waiting",
            "Requests waiting to be scheduled (queued, preempted, or waiting for remote KV).",
            registry=r,
        )
        self.kv_usage = Gauge(
            f"{PREFIX}kv_cache_usage_perc",
            "KV-cache usage: fraction of blocks in use (cached free blocks count as free); "
            "1 means 100 percent.",
            registry=r,
        )
        self.preemptions = Counter(
            f"{PREFIX}num_preemptions", "Preemptions (requests requeued for recompute).", registry=r
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}prompt_tokens", "Prompt tokens of requests this engine prefilled.", registry=r
        )
        self.generation_tokens = Counter(
            f"{PREFIX}generation_tokens", "Tokens this engine sampled.", registry=r
        )
        self.cache_queries = Counter(
            f"{PREFIX}prefix_cache_queries",
            "Prefix cache queries, in prompt tokens looked up.",
            registry=r,
        )
        self.cache_hits = Counter(
            f"{PREFIX}prefix_cache_hits", "Prefix cache hits, in tokens served.", registry=r
        )
        self.floor_steps = Counter(
            f"{PREFIX}itl_target_floor_steps",
            "Steps whose one-block floor chunk was predicted over the step's limit "
            "(itl_target_ms or decode_stretch; the limit cannot hold there).",
            registry=r,
        )
        self.step_time = Histogram(
            f"{PREFIX}engine_step_duration_seconds",
            "Wall time of one engine step that ran a batch, in seconds.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        phase_time = Histogram(
            f"{PREFIX}engine_step_phase_seconds",
            "Wall time of one phase of an engine step that ran a batch, in seconds.",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.phase_time = {phase: phase_time.labels(phase=phase) for phase in PHASES}
        self.step_gap = Histogram(
            f"{PREFIX}engine_step_gap_seconds",
            "From the end of an engine step that left work to the start of the next, in seconds.",
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.queue_time = _histogram("request_queue_time_seconds", "arrival -> first scheduled", r)
        self.prefill_time = _histogram(
            "request_prefill_time_seconds", "first scheduled -> first token", r
        )
        self.decode_time = _histogram(
            "request_decode_time_seconds", "first token -> finished (stop or length)", r
        )

    # ---- events --------------------------------------------------------------------------
    def scheduled(self, req: Request, now: float) -> None:
        """req was scheduled for the first time (its num_cached_tokens is now known)."""
        self.queue_time.observe(max(0.0, now - req.arrival_time))
        self.prefix_cache(req.num_prompt_tokens, req.num_cached_tokens or 0)

    def prefix_cache(self, queries: int, hits: int) -> None:
        """One lookup of `queries` prompt tokens, `hits` of them cached."""
        self.cache_queries.inc(queries)
        self.cache_hits.inc(hits)

    def sampled(self, req: Request, first: bool, now: float) -> None:
        """This engine sampled one token of req; `first`: its first token (prompt done)."""
        self.generation_tokens.inc()
        if first:
            self.prompt_tokens.inc(req.num_prompt_tokens)
            if req.scheduled_time is not None:
                self.prefill_time.observe(max(0.0, now - req.scheduled_time))

    def stepped(
        self, seconds: float, phases: dict[str, float] | None = None, gap: float | None = None
    ) -> None:
        """One step that ran a batch took `seconds` (wall time), `phases` of it by phase
        (zero phases are not observed), `gap` after the previous step's end (None: the engine
        had been idle)."""
        self.step_time.observe(seconds)
        for phase, spent in (phases or {}).items():
            if spent:
                self.phase_time[phase].observe(spent)
        if gap is not None:
            self.step_gap.observe(gap)

    def finished(self, req: Request, now: float) -> None:
        """req finished; a normal finish (stop or length) records its decode time."""
        if req.status in NORMAL_FINISH and req.first_token_time is not None:
            self.decode_time.observe(max(0.0, now - req.first_token_time))

    def state(self, running: int, waiting: int, kv_usage: float, preempted: int = 0) -> None:
        """The scheduler's state after a step (or an idle tick) and the step's preemptions."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        if preempted:
            self.preemptions.inc(preempted)


def _histogram(name: str, what: str, registry: CollectorRegistry) -> Histogram:
    return Histogram(
        f"{PREFIX}{name}",
        f"Histogram of per-request time, {what}, in seconds.",
        buckets=REQUEST_LATENCY_BUCKETS,
        registry=registry,
    )


def snapshot(*registries: CollectorRegistry) -> list[dict]:
    """Every family of the registries as plain (msgpack-able) values, `_created` samples left
    out: [{"name", "type", "help", "samples": [[sample name, {label: value}, value], ...]}]."""
    families = []
    for registry in registries:
        for metric in registry.collect():
            samples = [
                [s.name, dict(s.labels), float(s.value)]
                for s in metric.samples
                if not s.name.endswith("_created")
            ]
            families.append(
                {
                    "name": metric.name,
                    "type": metric.type,
                    "help": metric.documentation,
                    "samples": samples,
                }
            )
    return families
