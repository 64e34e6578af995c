"""The experiments' verdicts: figures read from run summaries and checked against each
experiment's targets (one line of text each)."""

from __future__ import annotations


# ---- reading a summary ---------------------------------------------------------------------
def lat(summary: dict, metric: str, q: str = "p99", kind: str | None = None) -> float | None:
    """A latency statistic (ms), of one request kind when given (long-prompt: chat / long)."""
    source = summary["by_kind"].get(kind, {}) if kind else summary
    return source.get("latency_ms", {}).get(metric, {}).get(q)


def goodput(summary: dict) -> float:
    return summary["goodput"]["requests_per_s"]


def hit_vs_oracle(summary: dict) -> float | None:
    c = summary["cache"]
    return c["cached_fraction"] / c["oracle_fraction"] if c["oracle_fraction"] else None


def prefill_balance(summary: dict) -> float | None:
    """The prefill pool's max/mean, the worse of requests and prefill tokens."""
    lb = summary["load_balance"]["prefill"]
    values = [lb["requests_max_over_mean"], lb["prefill_tokens_max_over_mean"]]
    return max((v for v in values if v is not None), default=None)


def _f(value: float | None, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)


def _check(ok: bool) -> str:
    return "within the target" if ok else "outside the target"


# ---- verdicts ------------------------------------------------------------------------------
def long_prompt_verdict(s: dict[str, dict]) -> list[str]:
    base, agg, dis = s["disaggregated, no long prompts"], s["aggregated"], s["disaggregated"]
    b, a, d = (lat(x, "itl", kind="chat") or lat(x, "itl") for x in (base, agg, dis))
    ratio = d / b if b and d else None
    return [
        f"chat ITL p99: no long prompts {_f(b)} ms, aggregated {_f(a)} ms, "
        f"disaggregated {_f(d)} ms",
        f"target disaggregated <= 1.5x no-long ({_f(ratio, '.2f')}x): "
        + _check(bool(ratio and ratio <= 1.5)),
        f"target disaggregated beats aggregated on p99 ITL: {_check(bool(a and d and d < a))}",
        "the price, long prompts' TTFT p50 / p99: aggregated "
        f"{_f(lat(agg, 'ttft', 'median', 'long'))}"
        f" / {_f(lat(agg, 'ttft', 'p99', 'long'))} ms, disaggregated "
        f"{_f(lat(dis, 'ttft', 'median', 'long'))} / {_f(lat(dis, 'ttft', 'p99', 'long'))} ms",
    ]


def short_random_verdict(s: dict[str, dict]) -> list[str]:
    agg, dis = s["aggregated"], s["disaggregated"]
    lines = []
    for label, get in (
        ("goodput (req/s)", goodput),
        ("output tok/s", lambda x: x["throughput"]["output_tokens_per_s"]),
        ("TTFT p50 (ms)", lambda x: lat(x, "ttft", "median")),
        ("TPOT p50 (ms)", lambda x: lat(x, "tpot", "median")),
        ("E2E p99 (ms)", lambda x: lat(x, "e2e")),
    ):
        va, vd = get(agg), get(dis)
        rel = va / vd if va and vd else None
        lines.append(
            f"{label}: aggregated {_f(va, '.2f')}, disaggregated {_f(vd, '.2f')} "
            f"(aggregated / disaggregated {_f(rel, '.2f')})"
        )
    ga, gd = goodput(agg), goodput(dis)
    lines.append(f"expected aggregated wins or ties on goodput: {_check(ga >= 0.95 * gd)}")
    return lines


def policies_verdict(s: dict[str, dict]) -> list[str]:
    lines = []
    for name, x in s.items():
        lines.append(
            f"{name}: hit/oracle {_f(hit_vs_oracle(x), '.2f')}, prefill max/mean "
            f"{_f(prefill_balance(x), '.2f')}, goodput {goodput(x):.3f} req/s"
        )
    ca = s["cache_aware"]
    hit, bal = hit_vs_oracle(ca) or 0.0, prefill_balance(ca)
    best = max(s, key=lambda n: goodput(s[n]))
    lines += [
        f"target cache_aware hit rate >= 0.9x oracle ({hit:.3g}x): {_check(hit >= 0.9)}",
        f"target cache_aware max/mean <= 1.25 ({_f(bal, '.2f')}): "
        + _check(bal is not None and bal <= 1.25),
        f"target cache_aware best goodput (best: {best}): "
        f"{_check(goodput(ca) >= max(goodput(x) for x in s.values()))}",
    ]
    return lines


def local_prefill_verdict(s: dict[str, dict]) -> list[str]:
    pure = [s["aggregated"], s["disaggregated (threshold 0)"]]
    lines = []
    for name, x in s.items():
        kv = x["kv"]
        lines.append(
            f"{name}: goodput {goodput(x):.3f} req/s, TTFT p99 {_f(lat(x, 'ttft'))} ms, "
            f"TPOT p50 {_f(lat(x, 'tpot', 'median'))} ms, prefills remote/local "
            f"{kv['remote_prefills']}/{kv['local_prefills']}"
        )
    winners = [
        n
        for n, x in s.items()
        if "threshold" in n
        and "threshold 0)" not in n
        and all(goodput(x) > goodput(p) for p in pure)
    ]
    lines.append(
        "thresholds beating both pure shapes on goodput: " + (", ".join(winners) or "none")
    )
    return lines


def idle_verdict(s: dict[str, dict]) -> list[str]:
    return [
        f"{name}: TTFT p50 {_f(lat(x, 'ttft', 'median'))} ms, TPOT p50 "
        f"{_f(lat(x, 'tpot', 'median'))} ms (python -m benchmarks.sim_calibration: the part "
        "of TTFT the step profile does not explain)"
        for name, x in s.items()
    ]


def itl_beside_long(summary: dict, q: str = "p99") -> float | None:
    """Chat inter-token gaps that overlap a long prompt's prefill (report.by_kind), in ms."""
    return summary["by_kind"].get("chat", {}).get("itl_beside_long_prefill_ms", {}).get(q)


def floor_step_ms(config: dict) -> float:
    """Predicted ms (shipped 1-thread profile) of the cheapest step beside the longest prompt
    the workload can send near its end: one chat decode and a one-block chunk after
    long_max - block_size cached tokens. A target below it cannot hold there: the engine must
    still advance the prompt by a block a step (engine/chunk_budget.py's floor)."""
    from engine.step_model import StepModel, StepShape
    from perf.sim.command import DEFAULT_PROFILE

    o, block = config["options"], config["block_size"]
    shape = StepShape.of([o["chat_len"]], [(o["long_max"] - block, block)])
    return 1000 * StepModel.load(DEFAULT_PROFILE).predict(shape)


def chunking_verdict(s: dict[str, dict]) -> list[str]:
    lines = []
    for name, x in s.items():
        beside, ttft = itl_beside_long(x), lat(x, "ttft", "median", "long")
        line = (
            f"{name}: chat ITL p99 beside long prefills {_f(beside)} ms (all chat ITLs: "
            f"{_f(lat(x, 'itl', kind='chat'))} ms), long-prompt TTFT p50 {_f(ttft)} ms"
        )
        target = x["config"].get("itl_target_ms")
        if target:
            ratio = _f(beside / target if beside else None, ".2f")
            floor = floor_step_ms(x["config"])
            if floor > target:
                line += (
                    f" ({ratio}x target; below this hardware's floor: one block after "
                    f"{x['config']['options']['long_max']:,} tokens beside one decode is "
                    f"predicted at {floor:.0f} ms, so the target cannot hold)"
                )
            else:
                line += f" ({ratio}x the target; bound 1.1x)"
        lines.append(line)
    return lines
