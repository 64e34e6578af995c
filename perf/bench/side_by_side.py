"""Several OpenAI-compatible servers under the same seeded workload, one table side by side.

    baton bench --url http://127.0.0.1:8000 --label baton \\
                --url http://127.0.0.1:8080 --label llama.cpp \\
                --workload shared-prefix --streams 1,4,16 --num-requests 32

Each server is driven alone, one after another (never two at once: on a shared CPU a second
run would take the first one's cores), through its /v1/completions with token-id prompts,
greedy, exactly max_tokens tokens (perf/bench/servers.py says how each kind of server is
told so). For every stream count S, each server gets `warmup` requests of the workload one at
a time, then the workload at S concurrent streams (--max-concurrency S); the same seed gives
every server the same prompts in the same order. Each S draws its requests with seed + S, the
warm-up the first of them and the run the ones after, so that no run repeats a prompt a
server may have cached from the warm-up or an earlier run. The table's statistics are
perf/stats.py's (through perf/bench/report.summarize).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace

from perf.bench.driver import BenchConfig, bench
from perf.bench.workloads import TokenSpace, Workload


@dataclass(frozen=True, slots=True)
class Target:
    """One server to compare: its label in the table and its base URL."""

    label: str
    url: str
    model: str | None = None  # None: the first one its /v1/models lists
    kind: str | None = None  # perf/bench/servers.py KINDS; None: from its /v1/models


def targets_of(urls: list[str], labels: list[str] | None = None) -> list[Target]:
    """--url and --label pairs as targets (a missing label is the URL's host:port);
    ValueError for more labels than URLs or a label used twice."""
    labels = list(labels or [])
    if len(labels) > len(urls):
        raise ValueError(f"{len(labels)} --label for {len(urls)} --url")
    out = []
    for i, url in enumerate(urls):
        url = url.rstrip("/") if "://" in url else f"http://{url.rstrip('/')}"
        label = labels[i] if i < len(labels) else url.split("://", 1)[1]
        out.append(Target(label, url))
    names = [t.label for t in out]
    if len(set(names)) != len(names):
        raise ValueError(f"labels must differ: {names}")
    return out


def parse_streams(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; ValueError for a count below 1 or not a number."""
    try:
        streams = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--streams takes counts like 1,4,16, got {text!r}") from None
    if not streams or min(streams) < 1:
        raise ValueError(f"--streams takes counts >= 1, got {text!r}")
    return streams


def run_target(
    target: Target,
    workload: Workload,
    tokens: TokenSpace,
    config: BenchConfig,
    streams: int,
    warmup: int = 1,
    api_key: str | None = None,
) -> tuple[dict, list]:
    """Warm-up requests (one at a time), then the run at `streams` concurrent streams:
    (summary, records) of the run."""

    def one(cfg: BenchConfig):
        return asyncio.run(
            bench(
                target.url,
                workload,
                tokens,
                cfg,
                door="openai",
                api_key=api_key,
                model=target.model,
                kind=target.kind,
            )
        )

    # Each stream count draws its own requests (seed + streams: a server that keeps its
    # prefix cache between runs has not seen them); the warm-up sends the first ones and
    # the run the ones after (a shared-prefix workload's system prompt is then cached).
    config = replace(config, seed=config.seed + streams)
    if warmup:
        one(replace(config, num_requests=warmup, duration_s=None, max_concurrency=1))
    summary, records = one(replace(config, max_concurrency=streams, skip_sessions=warmup))
    summary["config"]["label"] = target.label
    # the first error of each failure status, to tell why without the records
    summary["error_examples"] = {}
    for r in records:
        if not r.ok:
            summary["error_examples"].setdefault(r.status, r.error)
    return summary, records


def run_side_by_side(
    targets: list[Target],
    workload: Workload,
    tokens: TokenSpace,
    config: BenchConfig,
    streams: list[int],
    warmup: int = 1,
    api_key: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[int, dict[str, dict]]:
    """{streams: {label: summary}}: every target at every stream count, one run at a time."""
    results: dict[int, dict[str, dict]] = {}
    for n in streams:
        for target in targets:
            log(f"{target.label} ({target.url}): {n} streams")
            summary, _ = run_target(target, workload, tokens, config, n, warmup, api_key)
            results.setdefault(n, {})[target.label] = summary
    return results


def _ms(summary: dict, metric: str, q: str) -> str:
    value = summary["latency_ms"][metric][q]
    return "-" if value is None else f"{value:.1f}"


def _errors(summary: dict) -> str:
    kinds = ", ".join(f"{k} x{n}" for k, n in sorted(summary["failures"].items()))
    return f"{summary['failed']}" + (f" ({kinds})" if kinds else "")


ROWS: tuple[tuple[str, Callable[[dict], str]], ...] = (
    ("TTFT p50 ms", lambda s: _ms(s, "ttft", "median")),
    ("TTFT p99 ms", lambda s: _ms(s, "ttft", "p99")),
    ("ITL p50 ms", lambda s: _ms(s, "itl", "median")),
    ("ITL p99 ms", lambda s: _ms(s, "itl", "p99")),
    ("output tok/s", lambda s: f"{s['throughput']['output_tokens_per_s']:.1f}"),
    ("requests ok", lambda s: f"{s['completed']}/{s['num_requests']}"),
    ("errors", _errors),
)


def side_by_side_table(results: dict[int, dict[str, dict]], title: str = "") -> str:
    """One column per server, a block of ROWS per stream count (the servers that have no run
    at a count show '-')."""
    labels: list[str] = []
    for by_label in results.values():
        labels += [label for label in by_label if label not in labels]
    cells = {
        (n, label, name): get(results[n][label]) if label in results[n] else "-"
        for n in results
        for label in labels
        for name, get in ROWS
    }
    width = max([12, *(len(c) + 2 for c in cells.values()), *(len(x) + 2 for x in labels)])
    first = max(len(name) for name, _ in ROWS) + 4
    lines = [title] if title else []
    lines.append(f"{'':<{first}}" + "".join(f"{label:>{width}}" for label in labels))
    for n in results:
        lines.append(f"{n} stream{'s' if n != 1 else ''}")
        for name, _ in ROWS:
            row = "".join(f"{cells[(n, label, name)]:>{width}}" for label in labels)
            lines.append(f"  {name:<{first - 2}}{row}")
    return "\n".join(lines)
