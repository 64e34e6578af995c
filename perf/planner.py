"""`baton plan`: the cheapest cluster shape that meets latency SLOs, found with the simulator.

    baton plan --ttft-p99 2000 --itl-p99 200 --workload agentic \\
        --request-rate 2 --num-requests 200 --prefill-range 0-4 --decode-range 1-8 \\
        --policies cache_aware,least_loaded --itl-targets-ms 0,250 --out plan.yaml

Candidates are every (prefill replicas, decode replicas, routing policy, chunk setting) of the
search space; a shape's cost is prefill_cost * prefill + decode_cost * decode (workers, by
default). Shapes are simulated cheapest first (perf/sim/command.py's model, same workload,
seed and arrivals for all); the first cost at which some shape completes every request with
TTFT p99 and ITL p99 within the SLOs wins, ties going to the lowest TTFT p99. The plan is
printed with a manifest for it (built on --manifest when given, validated by
deploy/manifest.py's schema).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace

import yaml

from deploy.manifest import parse_manifest
from perf.bench.driver import BenchConfig
from perf.bench.flags import workload_options
from perf.bench.report import summarize
from perf.bench.workloads import WORKLOADS, TokenSpace, make_workload
from perf.sim.cluster import ClusterConfig
from perf.sim.command import DEFAULT_PROFILE, cluster_config
from perf.sim.driver import simulate
from router.policy_names import POLICY_NAMES


@dataclass(frozen=True, slots=True)
class Candidate:
    """One point of the search space."""

    prefill: int
    decode: int
    policy: str
    chunk_size: int | None  # None: keep the base's
    itl_target_ms: float | None
    cost: float


@dataclass(frozen=True, slots=True)
class Outcome:
    """A simulated candidate: its latency percentiles (ms) and whether it meets the SLOs."""

    candidate: Candidate
    ttft_p99: float
    itl_p99: float
    completed: int
    feasible: bool


def candidates(
    prefill: list[int],
    decode: list[int],
    policies: list[str],
    chunk_sizes: list[int | None],
    itl_targets: list[float | None],
    prefill_cost: float = 1.0,
    decode_cost: float = 1.0,
) -> list[Candidate]:
    """The search space, cheapest first (then fewer prefill workers, then input order)."""
    out = []
    for p in prefill:
        for d in decode:
            for policy in policies if p else policies[:1]:  # no prefill pool: no policy
                for chunk in chunk_sizes:
                    for target in itl_targets:
                        cost = prefill_cost * p + decode_cost * d
                        out.append(Candidate(p, d, policy, chunk, target, cost))
    return sorted(out, key=lambda c: (c.cost, c.prefill))


def evaluate(
    c: Candidate,
    base: ClusterConfig,
    model,
    workload,
    config: BenchConfig,
    slo: tuple[float, float],
    vocab: int = 49152,
) -> Outcome:
    """Simulate one candidate."""
    worker = base.worker
    if c.chunk_size is not None:
        worker = replace(
            worker,
            chunk_size=c.chunk_size,
            max_num_batched_tokens=max(worker.max_num_batched_tokens, c.chunk_size),
        )
    worker = replace(worker, itl_target_ms=c.itl_target_ms)
    cluster = replace(
        base,
        prefill=c.prefill,
        decode=c.decode,
        policy=c.policy,
        worker=worker,
        prefill_worker=None,
    )
    records, _ = simulate(workload, TokenSpace(high=vocab), config, cluster, model)
    s = summarize(records)
    ttft = s["latency_ms"]["ttft"]["p99"]
    itl = s["latency_ms"]["itl"]["p99"] or 0.0  # one-token answers have no ITL
    ok = s["completed"] == s["num_requests"] and ttft is not None
    feasible = ok and ttft <= slo[0] and itl <= slo[1]
    return Outcome(c, ttft if ttft is not None else math.inf, itl, s["completed"], feasible)


def search(cands: list[Candidate], run, log=None) -> tuple[Outcome | None, list[Outcome]]:
    """Cheapest feasible outcome (ties: lowest TTFT p99) and every outcome simulated.
    `run(candidate) -> Outcome`; stops after the first cost level holding a feasible one."""
    outcomes: list[Outcome] = []
    best: Outcome | None = None
    for c in cands:
        if best is not None and c.cost > best.candidate.cost:
            break
        o = run(c)
        outcomes.append(o)
        if log:
            log(o)
        if o.feasible and (best is None or o.ttft_p99 < best.ttft_p99):
            best = o
    return best, outcomes


def manifest_for(
    c: Candidate,
    base: ClusterConfig,
    name: str = "planned",
    model_path: str = "smollm2-135m-instruct",
    start: dict | None = None,
) -> str:
    """A validated manifest (YAML) for the candidate, on top of `start` (a manifest dict)."""
    data = dict(start or {"apiVersion": "baton/v1", "kind": "Cluster", "metadata": {"name": name}})
    spec = dict(data.get("spec", {}))
    spec.setdefault("model", {"path": model_path})
    engine = dict(spec.get("engine", {}))
    w = base.worker
    engine.update(
        block_size=w.block_size,
        num_kv_blocks=w.num_kv_blocks,
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=max(w.max_num_batched_tokens, c.chunk_size or 0),
        chunk_size=c.chunk_size or w.chunk_size,
    )
    if c.itl_target_ms is not None:
        engine["itl_target_ms"] = float(c.itl_target_ms)
    else:
        engine.pop("itl_target_ms", None)
    spec["engine"] = engine
    spec["prefill"] = dict(spec.get("prefill", {}), replicas=c.prefill)
    spec["decode"] = dict(spec.get("decode", {}), replicas=c.decode)
    spec["router"] = dict(
        spec.get("router", {}), policy=c.policy, local_prefill_tokens=base.local_prefill_tokens
    )
    for pool in ("prefill", "decode"):
        spec[pool].pop("engine", None)  # one engine for both pools: the planned one
    data["spec"] = spec
    text = yaml.safe_dump(data, sort_keys=False)
    parse_manifest(text)  # raises ManifestError if the schema rejects it
    return text


def _ints(text: str) -> list[int]:
    """'1-4' -> [1, 2, 3, 4]; '1,2,8' -> [1, 2, 8]."""
    if "-" in text and "," not in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(x) for x in text.split(",")]


def _maybe(text: str, cast) -> list:
    """'0,250' -> [None, 250.0]: 0 or 'none' keeps the base setting / no target."""
    return [None if x in ("0", "none") else cast(x) for x in text.split(",")]


def parser() -> argparse.ArgumentParser:
    from perf.sim.command import add_cluster_args

    p = argparse.ArgumentParser(prog="baton plan", description=__doc__.split("\n")[0])
    p.add_argument("--ttft-p99", type=float, required=True, help="SLO in ms")
    p.add_argument("--itl-p99", type=float, required=True, help="SLO in ms")
    p.add_argument("--workload", choices=list(WORKLOADS), default="random")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--duration", type=float)
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-range", default="0-2", help="e.g. 0-4 or 0,1,2,4")
    p.add_argument("--decode-range", default="1-4")
    p.add_argument("--policies", default="cache_aware", help=f"of {','.join(POLICY_NAMES)}")
    p.add_argument("--chunk-sizes", default="0", help="e.g. 256,512,1024 (0: the base's)")
    p.add_argument("--itl-targets-ms", default="0", help="e.g. 0,100,250 (0: fixed chunks)")
    p.add_argument("--prefill-cost", type=float, default=1.0, help="cost of one prefill worker")
    p.add_argument("--decode-cost", type=float, default=1.0, help="cost of one decode worker")
    p.add_argument("--out", help="write the manifest here too")
    add_cluster_args(p)
    p.set_defaults(profile=str(DEFAULT_PROFILE))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        workload = make_workload(args.workload, workload_options(args.option))
        base, model = cluster_config(args, args.seed)
        config = BenchConfig(
            num_requests=None if args.duration else args.num_requests,
            duration_s=args.duration,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            seed=args.seed,
            block_size=base.worker.block_size,
        )
        policies = args.policies.split(",")
        bad = [x for x in policies if x not in POLICY_NAMES]
        if bad:
            raise ValueError(f"unknown policies {bad}; of {', '.join(POLICY_NAMES)}")
        cands = candidates(
            _ints(args.prefill_range),
            _ints(args.decode_range),
            policies,
            _maybe(args.chunk_sizes, int),
            _maybe(args.itl_targets_ms, float),
            args.prefill_cost,
            args.decode_cost,
        )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    slo = (args.ttft_p99, args.itl_p99)

    def log(o: Outcome) -> None:
        c = o.candidate
        print(
            f"  P={c.prefill} D={c.decode} {c.policy} chunk={c.chunk_size or '-'} "
            f"itl_target={c.itl_target_ms or '-'}: TTFT p99 {o.ttft_p99:.0f} ms, "
            f"ITL p99 {o.itl_p99:.0f} ms{'  meets the SLOs' if o.feasible else ''}",
            file=sys.stderr,
        )

    best, outcomes = search(cands, lambda c: evaluate(c, base, model, workload, config, slo), log)
    if best is None:
        print(
            f"no shape in the search space meets TTFT p99 <= {slo[0]:g} ms and ITL p99 <= "
            f"{slo[1]:g} ms ({len(outcomes)} simulated); widen --decode-range/--prefill-range"
        )
        return 1
    c = best.candidate
    start = None
    if args.manifest:
        start = yaml.safe_load(open(args.manifest).read())
    text = manifest_for(c, base, start=start)
    print(
        f"cheapest shape meeting TTFT p99 <= {slo[0]:g} ms, ITL p99 <= {slo[1]:g} ms: "
        f"{c.prefill} prefill + {c.decode} decode, {c.policy}, chunk_size "
        f"{c.chunk_size or base.worker.chunk_size}, itl_target_ms {c.itl_target_ms or '-'} "
        f"(cost {c.cost:g}; simulated TTFT p99 {best.ttft_p99:.0f} ms, ITL p99 "
        f"{best.itl_p99:.0f} ms; {len(outcomes)} shapes simulated)"
    )
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
