"""TransferMetrics: what a worker's KV transfers record (bytes, blocks, failures, hand-over time).

Recorded once per transfer, by the side that sees it complete, so that summing over the
cluster counts each transfer once:
  kv_transfer_bytes_total / kv_transfer_blocks_total   the sender (prefill worker), per send:
      payload bytes through the backend group, and the blocks they carry (bytes equal
      blocks x layers x 2 (K, V) x block_size x kv_heads x head_dim x dtype size)
  kv_transfer_time_seconds   the sender, when the decode worker acknowledges: from the end of
      the prefill (first token sampled, blocks held) to the blocks being usable on the decode
      side (measured on the prefill worker's clock, so it includes the ack's one-way trip)
  kv_transfer_failures_total   the receiver (decode worker): requests that failed because
      their KV did not arrive (a broken or timed-out transfer, or a lease that ran out)
Pulls (decode -> prefill, PrefillAPI.pull_blocks) are recorded on both sides, each under its
own names:
  kv_pull_seconds / kv_pull_blocks_total / kv_pull_bytes_total / kv_pull_failures_total
      the prefill worker: per pull, ask -> blocks in place (the histogram's count is the
      pulls), the blocks and payload bytes that arrived, pulls that failed (nothing cached)
  kv_pull_served_seconds / _blocks_total / _bytes_total / kv_pull_served_failures_total
      the decode worker: per answered ask, pinning -> payload sent, what it sent, answers
      that failed
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from engine.metrics import KV_TRANSFER_BUCKETS, PREFIX


class TransferMetrics:
    """KV-transfer counters and the hand-over histogram of one worker (thread-safe)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.bytes = Counter(
            f"{PREFIX}kv_transfer_bytes", "KV payload bytes sent to decode workers.", registry=r
        )
        self.blocks = Counter(
            f"{PREFIX}kv_transfer_blocks", "KV blocks sent to decode workers.", registry=r
        )
        self.failures = Counter(
            f"{PREFIX}kv_transfer_failures",
            "Requests whose KV did not arrive (transfer failed or lease ran out).",
            registry=r,
        )
        self.time = Histogram(
            f"{PREFIX}kv_transfer_time_seconds",
            "Histogram of prefill done -> blocks usable on the decode side, in seconds.",
            buckets=KV_TRANSFER_BUCKETS,
            registry=r,
        )
        # Pulls, decode -> prefill (kvtransfer.pull): each side's own families.
        self.pulls = ExchangeMetrics(
            "kv_pull", "pulled from decode workers", "pulls from decode workers", r
        )
        self.served = ExchangeMetrics(
            "kv_pull_served", "sent to prefill workers' pulls", "answers to pulls", r
        )

    def sent(self, num_blocks: int, payload_bytes: int) -> None:
        """One transfer left this (sending) worker."""
        self.blocks.inc(num_blocks)
        self.bytes.inc(payload_bytes)

    def handed_over(self, seconds: float) -> None:
        """The decode side acknowledged a request's blocks `seconds` after its prefill ended."""
        self.time.observe(max(0.0, seconds))

    def failed(self, num_requests: int = 1) -> None:
        """Requests that failed because their KV did not arrive (receiving side)."""
        if num_requests:
            self.failures.inc(num_requests)


class ExchangeMetrics:
    """One side's record of pulls: <name>_seconds (a histogram: its count is the pulls),
    <name>_blocks_total, <name>_bytes_total and <name>_failures_total."""

    def __init__(self, name: str, moved: str, each: str, registry: CollectorRegistry) -> None:
        self.time = Histogram(
            f"{PREFIX}{name}_seconds",
            f"Histogram of {each}, start -> blocks in place or sent, in seconds.",
            buckets=KV_TRANSFER_BUCKETS,
            registry=registry,
        )
        self.blocks = Counter(f"{PREFIX}{name}_blocks", f"KV blocks {moved}.", registry=registry)
        self.bytes = Counter(
            f"{PREFIX}{name}_bytes", f"KV payload bytes {moved}.", registry=registry
        )
        self.failures = Counter(
            f"{PREFIX}{name}_failures", f"{each.capitalize()} that failed.", registry=registry
        )

    def done(self, num_blocks: int, payload_bytes: int, seconds: float) -> None:
        """One pull ended with these blocks moved."""
        self.time.observe(max(0.0, seconds))
        self.blocks.inc(num_blocks)
        self.bytes.inc(payload_bytes)
