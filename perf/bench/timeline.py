"""What a benchmark run records per request, and its per-request latencies.

All times are seconds from the start of the run (t = 0 is the first arrival). Definitions, as
vLLM's benchmark_serving and DistServe use them:
- TTFT: first message carrying tokens - send time.
- E2E: last message - send time.
- TPOT (time per output token, after the first): (E2E - TTFT) / (output_tokens - 1); undefined
  for a one-token answer.
- ITL (inter-token latency): every gap between consecutive messages that carry tokens (a
  message carrying several tokens is one gap, as a vLLM stream chunk is).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

OK = "OK"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the client saw it; status is OK or the gRPC status code's name."""

    request_id: str
    send_s: float
    end_s: float  # the last message, or the error
    chunks: tuple[tuple[float, int], ...]  # (arrival time, number of tokens) per message
    prompt_tokens: int
    cached_tokens: int = 0  # the cluster's prefix-cache hit, from the last message's usage
    oracle_cached_tokens: int = 0  # what one infinite shared cache would have hit
    prefill_worker: str = ""
    decode_worker: str = ""
    status: str = OK
    error: str = ""
    kind: str = "chat"
    tenant: str = ""
    server_request_id: str = ""  # the id the server gave the request (its logs and traces)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.send_s if self.chunks else None

    @property
    def e2e(self) -> float:
        return self.end_s - self.send_s

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = [t for t, _ in self.chunks]
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def local_prefill(self) -> bool:
        """The decode worker prefilled the prompt itself (no KV crossed the network)."""
        return bool(self.prefill_worker) and self.prefill_worker == self.decode_worker


def record_to_dict(record: RequestRecord) -> dict:
    out = asdict(record)
    out["chunks"] = [list(c) for c in record.chunks]
    return out


def record_from_dict(data: dict) -> RequestRecord:
    data = dict(data)
    data["chunks"] = tuple((float(t), int(n)) for t, n in data["chunks"])
    return RequestRecord(**data)


def write_results(out_dir: str | Path, summary: dict, records: list[RequestRecord]) -> Path:
    """results.json: the summary plus every request's record."""
    path = Path(out_dir) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(summary, records=[record_to_dict(r) for r in records])
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def read_results(path: str | Path) -> tuple[dict, list[RequestRecord]]:
    """(summary, records) of a results.json, or of the results.json in a directory."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    data = json.loads(path.read_text())
    records = [record_from_dict(r) for r in data.pop("records", [])]
    return data, records
