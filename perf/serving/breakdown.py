"""Where a serving step's time goes, from what perf/serving/probes.py read before and after a
run: plain functions from readings to a JSON-ready breakdown, and its text table.

- engines: per worker, the rise over the run of baton:engine_step_duration_seconds (steps
  and their seconds), of baton:engine_step_phase_seconds{phase} (engine/step_phases.py) and
  of baton:engine_step_gap_seconds (the time between steps that left work): ms per step by
  phase, "unattributed" = the step's mean less its phases' (0 up to float rounding: the
  phases are laps of one timer) and the mean gap;
- token path: for each token the client received, the client's receipt time less the end of
  the engine step that sampled it (engine/step_phases.TokenTimes; one monotonic clock for
  every process of the host): what the worker's output streams, the router, the front door
  and the client's parsing add to a token, the first token apart (in the disaggregated shape
  its path includes the KV handoff);
- threads: per process, the CPU seconds of each thread group over the run
  (perf/serving/proc_threads.py), as seconds and as a share of one core over the run.
"""

from __future__ import annotations

from perf.serving.proc_threads import ThreadCPU, cpu_over_run
from perf.stats import summary_ms

STEP = "baton:engine_step_duration_seconds"
PHASE = "baton:engine_step_phase_seconds"
GAP = "baton:engine_step_gap_seconds"


def step_counters(families: list[dict]) -> dict:
    """{"steps", "step_s", "gaps", "gap_s", "phases": {phase: seconds}} from one worker's
    metrics families (engine.metrics.snapshot form)."""
    phases: dict[str, float] = {}
    out: dict = {"steps": 0.0, "step_s": 0.0, "gaps": 0.0, "gap_s": 0.0, "phases": phases}
    keys = {
        f"{STEP}_count": "steps",
        f"{STEP}_sum": "step_s",
        f"{GAP}_count": "gaps",
        f"{GAP}_sum": "gap_s",
    }
    for family in families:
        for name, labels, value in family["samples"]:
            if name in keys:
                out[keys[name]] += value
            elif name == f"{PHASE}_sum":
                phases[labels["phase"]] = phases.get(labels["phase"], 0.0) + value
    return out


def engine_breakdown(before: list[dict], after: list[dict]) -> dict:
    """One worker's steps over the run: {"steps", "busy_s", "step_ms", "gap_ms", "gaps",
    "phases_ms": {phase: ms per step}, "phases_sum_ms", "unattributed_ms"}."""
    a, b = step_counters(before), step_counters(after)
    steps = int(round(b["steps"] - a["steps"]))
    gaps = int(round(b["gaps"] - a["gaps"]))
    busy = b["step_s"] - a["step_s"]
    per = (lambda s: 1000.0 * s / steps) if steps else (lambda s: 0.0)  # noqa: E731
    phases = {
        p: per(s - a["phases"].get(p, 0.0))
        for p, s in b["phases"].items()
        if s - a["phases"].get(p, 0.0)
    }
    phase_sum = sum(phases.values())
    return dict(
        steps=steps,
        busy_s=busy,
        step_ms=per(busy),
        gaps=gaps,
        gap_ms=1000.0 * (b["gap_s"] - a["gap_s"]) / gaps if gaps else 0.0,
        phases_ms=dict(sorted(phases.items(), key=lambda kv: -kv[1])),
        phases_sum_ms=phase_sum,
        unattributed_ms=per(busy) - phase_sum,
    )


def token_path(records: list, token_times: list[tuple[str, int, float]], start: float) -> dict:
    """{"first_ms", "later_ms" (perf/stats summaries), "chunks", "matched"}: per chunk the
    client received, its receipt (start + its run time: `start` is the run's monotonic t = 0)
    less the step end of the chunk's last token. A chunk whose token no engine recorded is
    counted in "chunks" but not "matched"."""
    ends: dict[tuple[str, int], float] = {}
    for rid, index, at in token_times:
        ends.setdefault((rid, index), at)
    first: list[float] = []
    later: list[float] = []
    chunks = matched = 0
    for r in records:
        if not r.ok:
            continue
        count = 0
        for i, (t, n) in enumerate(r.chunks):
            count += n
            chunks += 1
            end = ends.get((r.server_request_id, count - 1))
            if end is None:
                continue
            matched += 1
            (first if i == 0 else later).append(start + t - end)
    return dict(first_ms=summary_ms(first), later_ms=summary_ms(later), chunks=chunks,
                matched=matched)  # fmt: skip


def thread_breakdown(
    before: dict[str, tuple[float, list[ThreadCPU]]],
    after: dict[str, tuple[float, list[ThreadCPU]]],
    names: dict[str, dict[int, str]],
    duration_s: float,
) -> dict:
    """{process label: {"cpu_s", "core_share", "threads": [{"name", "threads", "cpu_s",
    "core_share"}]}}: core_share is CPU seconds / the run's duration (1.0 = one core)."""
    out = {}
    share = (lambda s: s / duration_s) if duration_s > 0 else (lambda s: 0.0)  # noqa: E731
    for label in after:
        total, groups = cpu_over_run(before[label], after[label], names.get(label))
        out[label] = dict(
            cpu_s=total,
            core_share=share(total),
            threads=[
                dict(name=g.name, threads=g.threads, cpu_s=g.cpu_s, core_share=share(g.cpu_s))
                for g in groups
            ],
        )
    return out


def _cell(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def breakdown_table(run: dict, top_threads: int = 6) -> str:
    """One (shape, streams) run as text: the client's view, each engine's phases, the token
    path and the busiest threads of each process."""
    s = run["summary"]
    lat = s["latency_ms"]
    lines = [
        f"== {run['shape']}, {run['streams']} stream{'s' if run['streams'] != 1 else ''}: "
        f"{s['completed']}/{s['num_requests']} requests in {s['duration_s']:.2f} s",
        f"client: TTFT p50 {_cell(lat['ttft']['median'], '{:.1f}')} ms, "
        f"ITL p50 {_cell(lat['itl']['median'], '{:.1f}')} / p99 "
        f"{_cell(lat['itl']['p99'], '{:.1f}')} ms, "
        f"{s['throughput']['output_tokens_per_s']:.1f} output tok/s",
    ]
    for worker, e in run["engines"].items():
        busy = e["busy_s"] / s["duration_s"] if s["duration_s"] > 0 else 0.0
        lines.append(
            f"engine {worker}: {e['steps']} steps, busy {busy:.0%}; step {e['step_ms']:.2f} ms "
            f"+ gap {e['gap_ms']:.2f} ms between steps ({e['gaps']} gaps)"
        )
        lines.append(f"  {'phase':<14}{'ms/step':>9}{'share':>8}")
        for phase, ms in e["phases_ms"].items():
            part = ms / e["step_ms"] if e["step_ms"] else 0.0
            lines.append(f"  {phase:<14}{ms:>9.3f}{part:>8.1%}")
        lines.append(f"  {'unattributed':<14}{e['unattributed_ms']:>9.3f}")
    tp = run["token_path"]
    lines.append(
        f"token path (engine step end -> client), {tp['matched']}/{tp['chunks']} chunks: "
        f"first token p50 {_cell(tp['first_ms']['median'])} p99 {_cell(tp['first_ms']['p99'])}"
        f" ms; later tokens p50 {_cell(tp['later_ms']['median'])} p99 "
        f"{_cell(tp['later_ms']['p99'])} ms"
    )
    lines.append("CPU by thread (CPU s over the run; 100% = one core for the whole run):")
    for label, proc in run["threads"].items():
        busiest = ", ".join(
            f"{t['name']}{'' if t['threads'] == 1 else ' x' + str(t['threads'])} "
            f"{t['cpu_s']:.2f} ({t['core_share']:.0%})"
            for t in proc["threads"][:top_threads]
            if t["cpu_s"] > 0
        )
        lines.append(
            f"  {label:<10}{proc['cpu_s']:>7.2f} s ({proc['core_share']:.0%}): {busiest or '-'}"
        )
    return "\n".join(lines)
