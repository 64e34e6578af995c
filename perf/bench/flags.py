"""The workload and arrival flags that `baton bench`, `baton simulate` and `baton plan` share."""

from __future__ import annotations

import argparse
import math

from perf.bench.driver import BenchConfig
from perf.bench.workloads import WORKLOADS


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The workload and arrival flags a bench run and a simulated run share."""
    p.add_argument("--workload", choices=list(WORKLOADS), default="random")
    p.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a workload option (a field of its class in perf/bench/workloads.py)",
    )
    p.add_argument("--num-requests", type=int, help="default 100 unless --duration is given")
    p.add_argument("--duration", type=float, help="seconds to keep sending")
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", help="e.g. ttft=500,tpot=50 (ms); goodput counts requests meeting all")


def workload_options(items: list[str], flag: str = "--option") -> dict[str, str]:
    """The -o KEY=VALUE items (or another `flag`'s) as a dict; SystemExit on an item
    without "="."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"bad {flag} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def run_config(args: argparse.Namespace, **fields) -> BenchConfig:
    """The run that add_run_args' flags describe (requests, pacing, seed; 100 requests unless
    --num-requests or --duration), with the other BenchConfig `fields` as given."""
    return BenchConfig(
        num_requests=args.num_requests or (None if args.duration else 100),
        duration_s=args.duration,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        **fields,
    )
