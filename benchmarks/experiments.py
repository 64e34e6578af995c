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
import math
import sys
from dataclasses import replace

from benchmarks.experiment_runs import run_experiment
from benchmarks.experiment_shapes import Experiment, Run, Shape
from benchmarks.experiment_verdicts import (
    chunking_verdict,
    idle_verdict,
    local_prefill_verdict,
    long_prompt_verdict,
    policies_verdict,
    short_random_verdict,
)

NEVER = 10**9  # long_every that sends no long prompt within any run


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
            "Fixed chunk sizes vs dynamic chunking (decode_stretch, itl_target_ms) on the "
            "long-prompt mix, aggregated: running decodes' ITL p99 against the long prompts' "
            "TTFT",
            "long-prompt",
            LONG_PROMPT,
            LONG_PROMPT_QUICK,
            num_requests=24,
            request_rate=0.33,
            slo="ttft=3000,tpot=150",
            runs=(
                *(
                    Run(f"chunk {c}", Shape(0, 1, engine={"chunk_size": c, "decode_stretch": 0}))
                    for c in (256, 512, 1024, 2048)
                ),
                *(
                    Run(f"decode_stretch {x:g}", Shape(0, 1, engine={"decode_stretch": x}))
                    for x in (2.0, 3.0)
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
