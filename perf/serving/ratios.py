"""Each stream count's client figures as ratios to the first stream count's of the same shape
and round, and their median over the rounds.

A host whose speed drifts between minutes moves every absolute figure, and a ratio of two
runs measured minutes apart by as much; `baton profile serving --rounds N` goes through the
stream counts N times, so each round's ratio compares neighbouring runs and the median of the
rounds is the figure to quote."""

from __future__ import annotations

from statistics import median

# ratio name -> the run summary's figure it divides
FIGURES = {
    "tok_s": lambda s: s["throughput"]["output_tokens_per_s"],
    "ttft_p50": lambda s: s["latency_ms"]["ttft"]["median"],
    "itl_p50": lambda s: s["latency_ms"]["itl"]["median"],
}
LABELS = {"tok_s": "tok/s", "ttft_p50": "TTFT p50", "itl_p50": "ITL p50"}


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def stream_ratios(runs: list[dict]) -> dict:
    """{shape: {str(S): {"base_streams", "rounds": {name: [ratio per round]}, "median":
    {name: ratio}}}} for every stream count S after the first of its (shape, round); runs
    without a "round" are the first round. Empty when no shape ran two stream counts."""
    firsts: dict[tuple[str, int], dict] = {}
    out: dict[str, dict] = {}
    for run in runs:
        key = (run["shape"], run.get("round", 0))
        base = firsts.setdefault(key, run)
        if base is run:
            continue
        entry = out.setdefault(run["shape"], {}).setdefault(
            str(run["streams"]),
            {"base_streams": base["streams"], "rounds": {name: [] for name in FIGURES}},
        )
        for name, figure in FIGURES.items():
            entry["rounds"][name].append(_ratio(figure(run["summary"]), figure(base["summary"])))
    for per_streams in out.values():
        for entry in per_streams.values():
            entry["median"] = {
                name: median(known) if (known := [r for r in values if r is not None]) else None
                for name, values in entry["rounds"].items()
            }
    return out


def ratios_table(ratios: dict) -> str:
    """One line per (shape, S): each ratio's median, then every round's in brackets."""

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = []
    for shape, per_streams in ratios.items():
        for streams, entry in per_streams.items():
            rounds = len(entry["rounds"]["tok_s"])
            parts = [
                f"{LABELS[name]} {cell(entry['median'][name])}"
                f"{'' if entry['median'][name] is None else 'x'} "
                f"[{' '.join(cell(r) for r in entry['rounds'][name])}]"
                for name in FIGURES
            ]
            lines.append(
                f"{shape}, {streams} vs {entry['base_streams']} stream"
                f"{'s' if entry['base_streams'] != 1 else ''} (median of {rounds} round"
                f"{'s' if rounds != 1 else ''}; each round's in brackets): " + ", ".join(parts)
            )
    return "\n".join(["== ratios, same shape and round", *lines]) if lines else ""
