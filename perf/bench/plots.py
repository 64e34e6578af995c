"""A run's figures (matplotlib PNGs) and the side-by-side figure of `compare`.

- ttft_cdf.png: the CDF of TTFT over successful requests.
- itl_over_time.png: every inter-token gap at the time it ended, with the sends of long
  prompts (kind "long") marked: head-of-line blocking shows as ITL spikes after them.
- worker_load.png: requests in flight per worker over time (prefill: from send to the first
  token; decode: from the first token to the end).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from perf.bench.timeline import RequestRecord


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_s: list[float], label: str) -> None:
    x = np.sort(np.asarray(values_s) * 1000.0)
    ax.step(x, np.arange(1, len(x) + 1) / max(len(x), 1), where="post", label=label)


def ttft_cdf(records: list[RequestRecord], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    _cdf(ax, [r.ttft for r in records if r.ok and r.ttft is not None], "TTFT")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def itl_over_time(records: list[RequestRecord], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    times, gaps = [], []
    for r in records:
        for (t, _), gap in zip(r.chunks[1:], r.itls, strict=True):
            times.append(t)
            gaps.append(gap * 1000.0)
    ax.scatter(times, gaps, s=4, alpha=0.5, label="ITL")
    for i, r in enumerate(x for x in records if x.kind == "long"):
        ax.axvline(r.send_s, color="red", alpha=0.6, label="long prompt sent" if i == 0 else None)
    ax.set(xlabel="time (s)", ylabel="inter-token latency (ms)", title="ITL over time")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def in_flight(intervals: list[tuple[float, float]]) -> tuple[list[float], list[int]]:
    """Step function of how many [start, end) intervals are open: (times, counts)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    times, counts, n = [0.0], [0], 0
    for t, step in events:
        n += step
        times.append(t)
        counts.append(n)
    return times, counts


def worker_load(records: list[RequestRecord], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    ok = [r for r in records if r.ok and r.chunks]
    phases = (
        ("prefill", lambda r: r.prefill_worker, lambda r: (r.send_s, r.chunks[0][0])),
        ("decode", lambda r: r.decode_worker, lambda r: (r.chunks[0][0], r.end_s)),
    )
    for ax, (role, worker, interval) in zip(axes, phases, strict=True):
        for w in sorted({worker(r) for r in ok}):
            times, counts = in_flight([interval(r) for r in ok if worker(r) == w])
            ax.step(times, counts, where="post", label=w)
        ax.set(ylabel=f"{role} in flight")
        ax.legend(loc="upper right", fontsize="small")
        ax.grid(alpha=0.3)
    axes[-1].set(xlabel="time (s)")
    fig.suptitle("per-worker load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_figures(records: list[RequestRecord], out_dir: str | Path) -> list[Path]:
    """Write the three PNGs of one run; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "ttft_cdf.png", out / "itl_over_time.png", out / "worker_load.png"]
    for draw, path in zip((ttft_cdf, itl_over_time, worker_load), paths, strict=True):
        draw(records, path)
    return paths


def compare_figure(runs: dict[str, tuple[dict, list[RequestRecord]]], path: Path) -> Path:
    """TTFT CDFs of several runs overlaid, next to their median / p99 TPOT."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, (_, records) in runs.items():
        _cdf(left, [r.ttft for r in records if r.ok and r.ttft is not None], name)
    left.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    left.legend(fontsize="small")
    left.grid(alpha=0.3)
    x = np.arange(len(runs))
    for i, q in enumerate(("median", "p99")):
        values = [s["latency_ms"]["tpot"][q] or 0.0 for s, _ in runs.values()]
        right.bar(x + (i - 0.5) * 0.4, values, width=0.4, label=f"TPOT {q}")
    right.set_xticks(x, list(runs), rotation=20, fontsize="small")
    right.set(ylabel="ms", title="TPOT")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def pareto_figure(points: dict[str, tuple[float | None, float | None]], path: Path) -> Path:
    """One point per run: the chats' ITL p99 beside long prefills (x, ms) against the long
    prompts' TTFT (y, ms); lower-left is better on both. Runs missing either are left out."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, (itl, ttft) in points.items():
        if itl is None or ttft is None:
            continue
        marker = "o" if name.startswith("chunk") else "s"
        ax.scatter([itl], [ttft / 1000.0], marker=marker)
        ax.annotate(
            name, (itl, ttft / 1000.0), fontsize="small", xytext=(4, 4), textcoords="offset points"
        )
    ax.set(
        xlabel="chat ITL p99 beside long prefills (ms)",
        ylabel="long-prompt TTFT p50 (s)",
        title="ITL vs long-prompt TTFT (o fixed chunk, s itl_target_ms)",
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
