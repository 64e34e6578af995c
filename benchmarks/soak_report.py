"""The soak benchmark's report: progress lines, latency per window of send time, the memory
table and the p99 figure."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from perf.bench.driver import ProgressSink
from perf.bench.timeline import RequestRecord
from perf.stats import summary, summary_ms


class PrintProgress(ProgressSink):
    """One line every `every` requests: done, failed, recent p99 of end-to-end latency."""

    def __init__(self, total: int, every: int = 100) -> None:
        self.total, self.every = total, every
        self.records: list[RequestRecord] = []
        self.start = time.monotonic()

    def update(self, record: RequestRecord) -> None:
        self.records.append(record)
        n = len(self.records)
        if n % self.every and n != self.total:
            return
        recent = [r.e2e for r in self.records[-self.every :] if r.ok]
        p99 = summary(recent)["p99"]
        failed = sum(not r.ok for r in self.records)
        print(
            f"[{time.monotonic() - self.start:7.1f}s] {n}/{self.total} requests, "
            f"{failed} failed, last {self.every}: e2e p99 {_ms(p99)} ms",
            file=sys.stderr,
            flush=True,
        )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def windows(records: list[RequestRecord], window_s: float) -> list[dict]:
    """Per window of send time: requests, failures, TTFT and E2E p50 / p99 (ms, completed)."""
    if not records:
        return []
    end = max(r.send_s for r in records)
    out = []
    for k in range(int(end // window_s) + 1):
        rs = [r for r in records if k * window_s <= r.send_s < (k + 1) * window_s]
        ok = [r for r in rs if r.ok]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        e2e = [r.e2e for r in ok]
        row = {"start_s": k * window_s, "requests": len(rs), "failed": len(rs) - len(ok)}
        for name, values in (("ttft", ttft), ("e2e", e2e)):
            s = summary_ms(values)
            for q, key in ((50, "median"), (99, "p99")):
                row[f"{name}_p{q}_ms"] = None if s[key] is None else round(s[key], 1)
        out.append(row)
    return out


def window_table(rows: list[dict]) -> str:
    head = "| window (s) | requests | failed | TTFT p50 / p99 (ms) | E2E p50 / p99 (ms) |"
    lines = [head, "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['start_s']:.0f} | {r['requests']} | {r['failed']} | "
            f"{r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['e2e_p50_ms']} / {r['e2e_p99_ms']} |"
        )
    return "\n".join(lines)


def memory_table(start: dict, end: dict, bound_mb: float) -> tuple[str, list[str]]:
    """The RSS table and the processes past the bound (same pid at start and end only)."""
    lines = ["| process | RSS start (MiB) | RSS end (MiB) | growth (MiB) |", "|---|---|---|---|"]
    over = []
    for name, s in start.items():
        e = end.get(name, {})
        if e.get("pid") != s["pid"]:
            lines.append(f"| {name} | {s['rss_mb']:.0f} | {e.get('rss_mb') or 0:.0f} | restarted |")
            continue
        if s["rss_mb"] is None or e.get("rss_mb") is None:
            lines.append(f"| {name} | {s['rss_mb']} | {e.get('rss_mb')} | gone |")
            continue
        growth = e["rss_mb"] - s["rss_mb"]
        lines.append(f"| {name} | {s['rss_mb']:.0f} | {e['rss_mb']:.0f} | {growth:+.0f} |")
        if growth > bound_mb:
            over.append(f"{name}: +{growth:.0f} MiB")
    return "\n".join(lines), over


def p99_figure(rows: list[dict], path: Path) -> None:
    from perf.bench.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    x = [r["start_s"] for r in rows]
    for key, label in (("e2e_p99_ms", "E2E p99"), ("ttft_p99_ms", "TTFT p99")):
        ax.plot(x, [r[key] if r[key] is not None else float("nan") for r in rows], label=label)
    ax.set(xlabel="send time (s)", ylabel="latency (ms)", title="p99 latency per window")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
