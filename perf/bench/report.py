"""A benchmark run's metrics from its recorded timeline, the stdout table and `compare`.

Definitions (per request: see perf/bench/timeline.py for TTFT, TPOT, ITL and E2E):
- Percentiles: perf/stats.py (linear interpolation between the two nearest ranks);
  statistics are over successful requests; latencies are reported in milliseconds.
- Duration: from the start (t = 0, the first arrival) to the last response of any request.
- Throughput: successful requests, output tokens, and prompt + output tokens per second.
- Goodput (DistServe): successful requests that meet every given SLO, per second. A one-token
  answer has no TPOT and meets a TPOT SLO.
- Cached fraction: cached prompt tokens / prompt tokens; the oracle fraction is the same for
  one infinite shared cache over the same request sequence (perf/bench/oracle.py), and
  of_oracle the cluster's cached tokens / the oracle's. Prefill tokens computed: prompt tokens
  - cached tokens (what the cluster prefilled, local prefills included).
- KV tier and pulls (from /metrics when the driver reaches it): bytes loaded from the workers'
  KV tiers, decode -> prefill pulls and their bytes, and the router's pull / local /
  recompute decisions.
- By kind (when a workload mixes kinds, e.g. long-prompt's "chat" and "long"): TTFT, TPOT
  and ITL of each kind's successful requests apart, so a long prompt's price (its TTFT) and
  its effect on the others (their ITL) are read separately.
- Load balance, per pool: max / mean over its workers of requests and of prefill tokens (the
  prompt tokens a worker computed: prompt - cached). Local prefills (the decode worker
  prefilled the prompt itself) count for that decode worker and are also counted apart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from perf.bench.timeline import RequestRecord
from perf.stats import summary_ms

SLO_KEYS = ("ttft", "tpot", "e2e")  # milliseconds


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500,tpot=50' -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in SLO_KEYS:
            raise ValueError(f"bad SLO {item!r}: expected KEY=MS with KEY one of {SLO_KEYS}")
        out[key.strip()] = float(value)
    return out


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Successful and within every SLO (ms)."""
    if not record.ok or record.ttft is None:
        return False
    values = dict(ttft=record.ttft, tpot=record.tpot, e2e=record.e2e)
    return all((v := values[k]) is None or v * 1000.0 <= limit for k, limit in slo.items())


def duration_s(records: list[RequestRecord]) -> float:
    return max((r.end_s for r in records), default=0.0)


def balance(counts: Mapping[str, float]) -> float | None:
    """max / mean over the workers (1.0 is perfectly even); None without workers or load."""
    values = list(counts.values())
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else None


def load_balance(records: list[RequestRecord], workers: dict[str, list[str]]) -> dict:
    """Requests and prefill tokens per worker of each pool; `workers` (role -> ids, e.g. from
    ClusterStatus) adds the workers that got nothing. A prefill worker's requests are its
    remote prefills; a decode worker's are all it decoded, its prefill tokens those of its
    local prefills."""
    ok = [r for r in records if r.ok]
    out = {}
    for role in ("prefill", "decode"):
        requests = {w: 0 for w in workers.get(role, ())}
        tokens = dict(requests)
        for r in ok:
            w = r.prefill_worker if role == "prefill" else r.decode_worker
            if not w or (role == "prefill" and r.local_prefill):
                continue
            requests[w] = requests.get(w, 0) + 1
            computed = r.prompt_tokens - r.cached_tokens
            tokens[w] = tokens.get(w, 0) + (computed if role == "prefill" or r.local_prefill else 0)
        out[role] = dict(
            requests=requests,
            prefill_tokens=tokens,
            requests_max_over_mean=balance(requests),
            prefill_tokens_max_over_mean=balance(tokens),
        )
    return out


def latency_ms(records: list[RequestRecord]) -> dict:
    """TTFT / TPOT / ITL / E2E statistics (ms) of the successful records."""
    ok = [r for r in records if r.ok]
    return dict(
        ttft=summary_ms(r.ttft for r in ok if r.ttft is not None),
        tpot=summary_ms(r.tpot for r in ok if r.tpot is not None),
        itl=summary_ms(g for r in ok for g in r.itls),
        e2e=summary_ms(r.e2e for r in ok),
    )


def itls_beside_prefills(records: list[RequestRecord], prefilling: list[RequestRecord]) -> list:
    """The inter-token gaps of `records` that overlap a prefill of `prefilling` (from a
    request's send to its first token): what a decode waits while a prompt is computed
    beside it. Seconds."""
    windows = [(r.send_s, r.chunks[0][0]) for r in prefilling if r.ok and r.chunks]
    gaps = []
    for r in records:
        if not r.ok:
            continue
        times = [t for t, _ in r.chunks]
        for start, end in zip(times, times[1:], strict=False):
            if any(start < w_end and end > w_start for w_start, w_end in windows):
                gaps.append(end - start)
    return gaps


def by_kind(records: list[RequestRecord]) -> dict:
    """latency_ms per request kind, with the count; {} when every request is of one kind.
    With "long" requests, the other kinds also get itl_beside_long_prefill_ms: their
    inter-token gaps that overlap a long prompt's prefill (itls_beside_prefills)."""
    kinds = sorted({r.kind for r in records})
    if len(kinds) < 2:
        return {}
    longs = [r for r in records if r.kind == "long"]
    out = {}
    for kind in kinds:
        mine = [r for r in records if r.kind == kind]
        out[kind] = dict(requests=len(mine), latency_ms=latency_ms(mine))
        if longs and kind != "long":
            gaps = itls_beside_prefills(mine, longs)
            out[kind]["itl_beside_long_prefill_ms"] = dict(summary_ms(gaps), count=len(gaps))
    return out


def summarize(
    records: list[RequestRecord],
    slo: dict[str, float] | None = None,
    workers: dict[str, list[str]] | None = None,
    config: dict | None = None,
) -> dict:
    """Every metric of the run, JSON-ready (results.json without the records)."""
    ok = [r for r in records if r.ok]
    slo = slo or {}
    duration = duration_s(records)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)  # noqa: E731
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    oracle = sum(r.oracle_cached_tokens for r in ok)
    good = sum(meets_slo(r, slo) for r in records)
    return dict(
        config=config or {},
        duration_s=duration,
        num_requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        failures=dict(Counter(r.status for r in records if not r.ok)),
        latency_ms=latency_ms(records),
        by_kind=by_kind(records),
        throughput=dict(
            requests_per_s=per_s(len(ok)),
            output_tokens_per_s=per_s(output),
            total_tokens_per_s=per_s(prompt + output),
        ),
        goodput=dict(
            slo_ms=slo,
            requests_per_s=per_s(good),
            fraction=good / len(records) if records else 0.0,
        ),
        cache=dict(
            prompt_tokens=prompt,
            cached_tokens=cached,
            oracle_cached_tokens=oracle,
            cached_fraction=cached / prompt if prompt else 0.0,
            oracle_fraction=oracle / prompt if prompt else 0.0,
            of_oracle=cached / oracle if oracle else None,
            prefill_tokens_computed=prompt - cached,
        ),
        load_balance=load_balance(records, workers or {}),
        kv=dict(
            remote_prefills=sum(not r.local_prefill for r in ok),
            local_prefills=sum(r.local_prefill for r in ok),
            # KV bytes moved are not in the public API (usage has no transfer size): the
            # driver fills this in from the cluster's /metrics when it can reach one.
            kv_bytes_moved=None,
            transfers=None,  # KV transfers and their summed time (prefill done -> decode side
            transfer_s=None,  # acknowledges), from /metrics as well
            tier_read_bytes=None,  # loaded from the workers' KV tiers, from /metrics
            tier_written_bytes=None,  # stored into them
            tier_dropped_writes=None,  # blocks offered while the write queue was full
            tier_loads=None,  # loads and their summed time (start -> blocks in place)
            tier_load_s=None,
            pulls=None,  # decode -> prefill pulls, their bytes and the router's decisions
            pull_bytes=None,
            pull_decisions=None,
        ),
        # {worker: {"steps", "busy_s"}}: the engines' steps and the seconds they took over the
        # run; the driver fills it from /metrics (baton:engine_step_duration_seconds), the
        # simulator from its own steps.
        engine_steps={},
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _mib(n: int) -> str:
    return f"{n:,} ({n / 2**20:.1f} MiB)"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(summary: dict) -> str:
    """The run's summary as a plain-text table for stdout."""
    lines = [
        f"{'requests':<28}{summary['completed']} ok / {summary['num_requests']}"
        f" ({summary['failed']} failed{': ' if summary['failures'] else ''}"
        + ", ".join(f"{k} x{n}" for k, n in summary["failures"].items())
        + ")",
        f"{'duration (s)':<28}{summary['duration_s']:.2f}",
    ]
    t = summary["throughput"]
    lines += [
        f"{'request throughput (req/s)':<28}{t['requests_per_s']:.2f}",
        f"{'output tokens/s':<28}{t['output_tokens_per_s']:.1f}",
        f"{'total tokens/s':<28}{t['total_tokens_per_s']:.1f}",
    ]
    g = summary["goodput"]
    if g["slo_ms"]:
        slo = ",".join(f"{k}={v:g}" for k, v in g["slo_ms"].items())
        lines.append(
            f"{'goodput (req/s)':<28}{g['requests_per_s']:.2f}  ({g['fraction']:.0%} meet {slo} ms)"
        )
    lines.append(f"{'latency (ms)':<28}{'mean':>9}{'median':>9}{'p90':>9}{'p99':>9}")
    for name, s in summary["latency_ms"].items():
        cells = "".join(f"{_ms(s[k]):>9}" for k in ("mean", "median", "p90", "p99"))
        lines.append(f"  {name.upper():<26}{cells}")
    for kind, k in summary.get("by_kind", {}).items():
        for name in ("ttft", "itl"):
            s = k["latency_ms"][name]
            cells = "".join(f"{_ms(s[q]):>9}" for q in ("mean", "median", "p90", "p99"))
            lines.append(
                f"  {(kind + ' ' + name.upper() + ' (' + str(k['requests']) + ')'):<26}{cells}"
            )
        beside = k.get("itl_beside_long_prefill_ms")
        if beside:
            cells = "".join(f"{_ms(beside[q]):>9}" for q in ("mean", "median", "p90", "p99"))
            label = f"{kind} ITL by long prefill ({beside['count']})"
            lines.append(f"  {label:<26}{cells}")
    c = summary["cache"]
    of_oracle = c.get("of_oracle")
    lines.append(
        f"{'cached prompt tokens':<28}{c['cached_fraction']:.1%}"
        f" (oracle {c['oracle_fraction']:.1%}"
        + (f", {of_oracle:.1%} of it)" if of_oracle is not None else ")")
    )
    if "prefill_tokens_computed" in c:
        lines.append(f"{'prefill tokens computed':<28}{c['prefill_tokens_computed']:,}")
    for role, lb in summary["load_balance"].items():
        lines.append(
            f"{role + ' balance (max/mean)':<28}requests {_ratio(lb['requests_max_over_mean'])}, "
            f"prefill tokens {_ratio(lb['prefill_tokens_max_over_mean'])}"
        )
    kv = summary["kv"]
    lines.append(f"{'prefills remote / local':<28}{kv['remote_prefills']} / {kv['local_prefills']}")
    moved = kv.get("kv_bytes_moved")
    lines.append(
        f"{'KV bytes moved':<28}"
        + (f"{moved:,} ({moved / 2**20:.1f} MiB)" if moved is not None else "- (no /metrics)")
    )
    if kv.get("tier_read_bytes") is not None:
        lines.append(f"{'KV tier bytes loaded':<28}{_mib(kv['tier_read_bytes'])}")
    if kv.get("tier_written_bytes") is not None:
        lines.append(
            f"{'KV tier bytes written':<28}{_mib(kv['tier_written_bytes'])}; "
            f"{kv['tier_dropped_writes']} blocks dropped (write queue full); "
            f"{kv['tier_loads']} loads, {kv['tier_load_s']:.1f} s"
        )
    if kv.get("pulls") is not None:
        decided = ", ".join(f"{k} {v}" for k, v in sorted((kv.get("pull_decisions") or {}).items()))
        lines.append(
            f"{'pulls decode -> prefill':<28}{kv['pulls']} ({_mib(kv['pull_bytes'] or 0)})"
            + (f"; decisions: {decided}" if decided else "")
        )
    for worker, steps in summary.get("engine_steps", {}).items():
        mean_ms = 1000.0 * steps["busy_s"] / steps["steps"] if steps["steps"] else 0.0
        lines.append(
            f"{'engine ' + worker:<28}{steps['steps']} steps, {steps['busy_s']:.1f} s "
            f"(mean {mean_ms:.1f} ms)"
        )
    return "\n".join(lines)


COMPARE_ROWS = (
    ("completed", lambda s: s["completed"]),
    ("failed", lambda s: s["failed"]),
    ("req/s", lambda s: round(s["throughput"]["requests_per_s"], 2)),
    ("output tok/s", lambda s: round(s["throughput"]["output_tokens_per_s"], 1)),
    ("goodput req/s", lambda s: round(s["goodput"]["requests_per_s"], 2)),
    *(
        (f"{m.upper()} {q} ms", lambda s, m=m, q=q: _ms(s["latency_ms"][m][q]))
        for m in ("ttft", "tpot", "itl", "e2e")
        for q in ("median", "p99")
    ),
    ("cached %", lambda s: f"{s['cache']['cached_fraction']:.1%}"),
    ("oracle %", lambda s: f"{s['cache']['oracle_fraction']:.1%}"),
    ("of oracle %", lambda s: _pct(s["cache"].get("of_oracle"))),
    ("prefill tokens", lambda s: s["cache"].get("prefill_tokens_computed", "-")),
    ("tier MiB loaded", lambda s: _mib_or_dash(s["kv"].get("tier_read_bytes"))),
    ("tier MiB written", lambda s: _mib_or_dash(s["kv"].get("tier_written_bytes"))),
    (
        "tier writes dropped",
        lambda s: (
            s["kv"].get("tier_dropped_writes")
            if s["kv"].get("tier_dropped_writes") is not None
            else "-"
        ),
    ),
    ("pulls", lambda s: s["kv"].get("pulls") if s["kv"].get("pulls") is not None else "-"),
)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _mib_or_dash(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def compare_table(runs: dict[str, dict]) -> str:
    """Several runs' summaries side by side (one column per run)."""
    names = list(runs)
    width = max([14, *(len(n) + 2 for n in names)])
    lines = [f"{'':<16}" + "".join(f"{n:>{width}}" for n in names)]
    for label, get in COMPARE_ROWS:
        lines.append(f"{label:<16}" + "".join(f"{get(runs[n])!s:>{width}}" for n in names))
    return "\n".join(lines)
