"""The serving experiments of the README, one command each: when do disaggregation, cache-aware
routing, conditional disaggregation and dynamic chunking pay off?

    python -m benchmarks.experiments long-prompt        # aggregated vs disaggregated, ITL
    python -m benchmarks.experiments short-random       # the same shapes, short prompts
    python -m benchmarks.experiments agentic-policies   # routing policies, 2 prefill workers
    python -m benchmarks.experiments local-prefill      # conditional disaggregation sweep
    python -m benchmarks.experiments chunking           # fixed chunks vs itl_target_ms (Pareto)
    python -m benchmarks.experiments idle               # one request at a time (sim calibration)
    python -m benchmarks.experiments all [--out runs/experiments] [--seed 0]

Every run of an experiment starts its own local cluster (Ray in this process, workers and router
from `--base-manifest`, default deploy/examples/local.yaml: SmolLM2, one CPU and one torch thread
per worker, any free port) so that no run inherits another's caches, sends the same seeded
workload through the gRPC door with `baton bench`'s driver, and tears the cluster down. Each
run's results.json and plots go to OUT/EXPERIMENT/RUN; OUT/EXPERIMENT/summary.md holds the
table, the targets with their verdicts, and the conditions (machine, model, requests, seed).
`--quick` shrinks every workload and request count (the test suite runs it on a tiny model).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import math
import os
import platform
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import yaml

from benchmarks.driver import BenchConfig, bench
from benchmarks.report import parse_slo, table
from benchmarks.serving import Progress
from benchmarks.timeline import write_results
from benchmarks.workloads import TokenSpace, make_workload

NEVER = 10**9  # long_every that sends no long prompt within any run


@dataclass(frozen=True)
class Shape:
    """A cluster shape: pool sizes, the router's policy and threshold, engine overrides."""

    prefill: int
    decode: int
    policy: str = "cache_aware"
    local_prefill_tokens: int = 0
    engine: Mapping[str, object] = field(default_factory=dict)

    def manifest(self, base: dict, name: str) -> dict:
        """The base manifest with this shape applied (free ports, a name per run)."""
        data = copy.deepcopy(base)
        spec = data["spec"]
        data["metadata"]["name"] = name
        spec["prefill"]["replicas"] = self.prefill
        spec["decode"]["replicas"] = self.decode
        spec["router"].update(
            policy=self.policy, local_prefill_tokens=self.local_prefill_tokens, port=0, http_port=0
        )
        spec["engine"].update(self.engine)
        if "chunk_size" in self.engine:  # a step must fit one chunk
            budget = spec["engine"].get("max_num_batched_tokens") or 0
            spec["engine"]["max_num_batched_tokens"] = max(budget, self.engine["chunk_size"])
        return data


@dataclass(frozen=True)
class Run:
    name: str
    shape: Shape
    options: Mapping[str, object] = field(default_factory=dict)  # over the experiment's


@dataclass(frozen=True)
class Experiment:
    name: str
    question: str
    workload: str
    options: Mapping[str, object]  # workload options (full size)
    quick_options: Mapping[str, object]  # --quick: sizes for a tiny model
    num_requests: int
    request_rate: float
    slo: str
    runs: tuple[Run, ...]
    verdict: Callable[[dict[str, dict]], list[str]]  # run name -> summary => lines
    max_concurrency: int | None = None  # 1: one request at a time (no queueing anywhere)


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
    return "met" if ok else "NOT met"


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
    from benchmarks.simulate import DEFAULT_PROFILE
    from engine.step_model import StepModel, StepShape

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
            ok = beside is not None and beside <= 1.1 * target
            ratio = _f(beside / target if beside else None, ".2f")
            floor = floor_step_ms(x["config"])
            if floor > target:
                line += (
                    f" ({ratio}x target; below this hardware's floor: one block after "
                    f"{x['config']['options']['long_max']:,} tokens beside one decode is "
                    f"predicted at {floor:.0f} ms, so the target cannot hold)"
                )
            else:
                line += f" ({ratio}x target: {_check(ok)} <= 1.1x)"
        lines.append(line)
    return lines


# ---- the experiments -----------------------------------------------------------------------
AGGREGATED, DISAGGREGATED = Shape(prefill=0, decode=2), Shape(prefill=1, decode=1)
LONG_PROMPT = dict(
    chat_len=256,
    chat_output_len=64,
    long_min=6000,
    long_max=7000,
    long_output_len=16,
    long_every=12,
)
LONG_PROMPT_QUICK = dict(
    chat_len=24, chat_output_len=8, long_min=160, long_max=200, long_output_len=4, long_every=4
)
AGENTIC = dict(
    num_tenants=4,
    system_len=512,
    tools_len=512,
    user_len=64,
    min_turns=2,
    max_turns=5,
    output_len=32,
)
AGENTIC_QUICK = dict(
    num_tenants=2, system_len=48, tools_len=32, user_len=8, min_turns=2, max_turns=3, output_len=4
)

EXPERIMENTS = {
    e.name: e
    for e in (
        Experiment(
            "long-prompt",
            "Do long prompts stall running decodes less when prefill runs on its own worker?",
            "long-prompt",
            LONG_PROMPT,
            LONG_PROMPT_QUICK,
            num_requests=36,
            request_rate=0.33,
            slo="ttft=3000,tpot=150",
            runs=(
                Run("disaggregated, no long prompts", DISAGGREGATED, {"long_every": NEVER}),
                Run("aggregated", AGGREGATED),
                Run("disaggregated", DISAGGREGATED),
            ),
            verdict=long_prompt_verdict,
        ),
        Experiment(
            "short-random",
            "With short prompts and no sharing, is disaggregation worth its transfers?",
            "random",
            dict(input_len=256, output_len=64, range_ratio=0.5),
            dict(input_len=24, output_len=8, range_ratio=0.5),
            num_requests=48,
            request_rate=0.6,
            slo="ttft=3000,tpot=150",
            runs=(Run("aggregated", AGGREGATED), Run("disaggregated", DISAGGREGATED)),
            verdict=short_random_verdict,
        ),
        Experiment(
            "agentic-policies",
            "Which prefill routing policy serves shared-prefix agent sessions best?",
            "agentic",
            AGENTIC,
            AGENTIC_QUICK,
            num_requests=48,
            request_rate=0.3,
            slo="ttft=3000,tpot=150",
            runs=tuple(
                Run(p, Shape(prefill=2, decode=1, policy=p))
                for p in ("cache_aware", "round_robin", "least_loaded", "random")
            ),
            verdict=policies_verdict,
        ),
        Experiment(
            "local-prefill",
            "Where does conditional disaggregation (local_prefill_tokens) beat both pure shapes?",
            "agentic",
            AGENTIC,
            AGENTIC_QUICK,
            num_requests=48,
            request_rate=0.3,
            slo="ttft=3000,tpot=150",
            runs=(
                Run("aggregated", AGGREGATED),
                *(
                    Run(f"disaggregated (threshold {t})", Shape(1, 1, local_prefill_tokens=t))
                    for t in (0, 128, 512, 2048)
                ),
            ),
            verdict=local_prefill_verdict,
        ),
        Experiment(
            "chunking",
            "Fixed chunk sizes vs dynamic chunking (itl_target_ms) on the long-prompt mix, "
            "aggregated: running decodes' ITL p99 against the long prompts' TTFT",
            "long-prompt",
            LONG_PROMPT,
            LONG_PROMPT_QUICK,
            num_requests=24,
            request_rate=0.33,
            slo="ttft=3000,tpot=150",
            runs=(
                *(
                    Run(f"chunk {c}", Shape(0, 1, engine={"chunk_size": c}))
                    for c in (256, 512, 1024, 2048)
                ),
                *(
                    Run(f"itl_target {t} ms", Shape(0, 1, engine={"itl_target_ms": t}))
                    for t in (150, 300, 600)
                ),
            ),
            verdict=chunking_verdict,
        ),
        Experiment(
            "idle",
            "What does one request cost beyond its engine steps on an idle cluster? "
            "(one request at a time; calibrates the simulator's control path)",
            "random",
            dict(input_len=256, output_len=16, range_ratio=0.5),
            dict(input_len=24, output_len=4, range_ratio=0.5),
            num_requests=16,
            request_rate=math.inf,
            max_concurrency=1,
            slo="ttft=3000,tpot=150",
            runs=(Run("aggregated", Shape(0, 1)), Run("disaggregated", DISAGGREGATED)),
            verdict=idle_verdict,
        ),
    )
}


# ---- running -------------------------------------------------------------------------------
def run_one(
    experiment: Experiment, run: Run, base: dict, args: argparse.Namespace, out: Path
) -> dict:
    """Start the run's cluster, drive the workload through it, tear it down; its summary."""
    from cluster.local import LocalCluster
    from deploy.manifest import parse_manifest

    manifest = parse_manifest(run.shape.manifest(base, experiment.name))
    engine = manifest.spec.engine_for("decode")
    options = {**(experiment.quick_options if args.quick else experiment.options), **run.options}
    workload = make_workload(experiment.workload, {k: str(v) for k, v in options.items()})
    config = BenchConfig(
        num_requests=args.num_requests or (8 if args.quick else experiment.num_requests),
        request_rate=args.request_rate or (math.inf if args.quick else experiment.request_rate),
        max_concurrency=experiment.max_concurrency,
        seed=args.seed,
        timeout_s=args.timeout,
        block_size=engine.block_size,
        hash_seed=str(engine.hash_seed),
    )
    tokens = token_space(manifest)
    log = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr))
    cluster = LocalCluster(manifest).start(log=log)
    progress = Progress(config.num_requests, enabled=not args.quiet)
    try:
        summary, records = asyncio.run(
            bench(
                cluster.address,
                workload,
                tokens,
                config,
                parse_slo(experiment.slo),
                progress,
                metrics_url=f"{cluster.http_address}/metrics" if cluster.http_address else None,
            )
        )
    finally:
        progress.close()
        cluster.close()
    summary["config"].update(
        workload_name=experiment.workload,
        shape=dict(
            prefill=run.shape.prefill,
            decode=run.shape.decode,
            policy=run.shape.policy,
            local_prefill_tokens=run.shape.local_prefill_tokens,
        ),
        **run.shape.engine,
    )
    run_dir = out / experiment.name / slug(run.name)
    write_results(run_dir, summary, records)
    # what benchmarks/sim_validation.py simulates the run from
    (run_dir / "manifest.yaml").write_text(yaml.safe_dump(manifest.model_dump(mode="json")))
    if not args.no_plots:
        from benchmarks.plots import run_figures

        run_figures(records, run_dir)
    if not args.quiet:
        print(f"\n== {experiment.name}: {run.name}\n{table(summary)}\n")
    return summary


def token_space(manifest) -> TokenSpace:
    """Prompt ids from the model's tokenizer, or from the checkpoint's vocabulary without one."""
    from engine.model_resolver import resolve_model

    path = resolve_model(manifest.spec.model.path)
    if not manifest.spec.model.skip_tokenizer_init:
        from engine.tokenizer import load_tokenizer

        return TokenSpace.from_tokenizer(load_tokenizer(Path(path)))
    import json

    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    return TokenSpace(low=3, high=vocab)


def slug(name: str) -> str:
    keep = "".join(c if c.isalnum() else "-" for c in name.lower())
    return "-".join(filter(None, keep.split("-")))


def conditions(experiment: Experiment, base: dict, args: argparse.Namespace) -> str:
    options = experiment.quick_options if args.quick else experiment.options
    n = args.num_requests or (8 if args.quick else experiment.num_requests)
    rate = args.request_rate or (math.inf if args.quick else experiment.request_rate)
    limit = experiment.max_concurrency
    concurrency = f", at most {limit} in flight" if limit else ""
    return (
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {platform.machine()} {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f} at the end; model {base['spec']['model']['path']}; "
        f"workload {experiment.workload} {dict(options)}; {n} requests per run at {rate} req/s "
        f"(Poisson){concurrency}; seed {args.seed}; SLO {experiment.slo}"
    )


def summary_markdown(experiment: Experiment, summaries: dict[str, dict], cond: str) -> str:
    from benchmarks.report import compare_table

    try:
        lines = experiment.verdict(summaries)
    except KeyError as exc:  # --only left out a run the targets compare
        lines = [f"no verdict: run {exc} was not part of this invocation"]
    verdict = "\n".join(f"- {line}" for line in lines)
    return (
        f"# {experiment.name}\n\n{experiment.question}\n\n{cond}\n\n"
        f"```\n{compare_table(summaries)}\n```\n\n{verdict}\n"
    )


def report_again(run_dir: Path) -> dict:
    """A finished run's summary with the report's per-kind figures computed again from its
    records (for reports extended after the run); results.json rewritten."""
    from benchmarks.report import by_kind
    from benchmarks.timeline import read_results

    summary, records = read_results(run_dir)
    summary["by_kind"] = by_kind(records)
    write_results(run_dir, summary, records)
    return summary


def run_experiment(experiment: Experiment, base: dict, args: argparse.Namespace) -> dict:
    out = Path(args.out)
    if args.report_only:
        summaries = {
            r.name: report_again(out / experiment.name / slug(r.name)) for r in experiment.runs
        }
    else:
        summaries = {r.name: run_one(experiment, r, base, args, out) for r in experiment.runs}
    text = summary_markdown(experiment, summaries, conditions(experiment, base, args))
    path = out / experiment.name / "summary.md"
    path.write_text(text)
    if not args.no_plots:
        from benchmarks.plots import compare_figure, pareto_figure
        from benchmarks.timeline import read_results

        runs = {r.name: read_results(out / experiment.name / slug(r.name)) for r in experiment.runs}
        compare_figure(runs, out / experiment.name / "compare.png")
        if experiment.name == "chunking":
            pareto_figure(
                {
                    n: (itl_beside_long(s), lat(s, "ttft", "median", "long"))
                    for n, s in summaries.items()
                },
                out / experiment.name / "pareto.png",
            )
    print(text)
    print(f"written: {path}")
    return summaries


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.experiments", description=__doc__.split("\n")[0]
    )
    p.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    p.add_argument("--out", default="runs/experiments")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-manifest", help="default: deploy/examples/local.yaml")
    p.add_argument("--model", help="the base manifest's spec.model.path instead")
    p.add_argument("--num-requests", type=int, help="per run, instead of the experiment's")
    p.add_argument("--request-rate", type=float, help="instead of the experiment's")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument("--only", action="append", help="run only these runs (by name), repeatable")
    p.add_argument("--quick", action="store_true", help="tiny workloads (tests)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: the summary, verdicts and plots again from OUT's results.json files",
    )
    args = p.parse_args(argv)
    from cluster.local import LOCAL_MANIFEST
    from deploy.manifest import load_manifest

    base = load_manifest(args.base_manifest or LOCAL_MANIFEST).model_dump(mode="json")
    if args.model:
        base["spec"]["model"]["path"] = args.model
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    for name in names:
        experiment = EXPERIMENTS[name]
        if args.only:
            runs = tuple(r for r in experiment.runs if r.name in args.only)
            experiment = replace(experiment, runs=runs)
        run_experiment(experiment, base, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
