"""Running an experiment: one local cluster per run, driven with `baton bench`'s driver; each
run's results.json, manifest and plots, and the experiment's summary.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path

import yaml

from benchmarks.experiment_shapes import Experiment, Run
from benchmarks.experiment_verdicts import itl_beside_long, lat
from perf.bench.command import Progress
from perf.bench.driver import BenchConfig, bench
from perf.bench.report import by_kind, compare_table, parse_slo, table
from perf.bench.timeline import read_results, write_results
from perf.bench.workloads import TokenSpace, make_workload


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
        from perf.bench.plots import run_figures

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
        from perf.bench.plots import compare_figure, pareto_figure

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
