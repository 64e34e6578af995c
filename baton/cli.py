"""`baton COMMAND [ARGS ...]`: the entry point. Every subcommand is one row of COMMANDS (its
name, help line and the function that runs it); the row's module is imported only when its
command runs, so `baton generate` never loads the simulator and `baton --help` loads nothing.

This package sits above every other one (it may import any of them; none imports it): the
serving commands live in `cluster`, the measuring ones in `perf`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Command:
    """One subcommand: `baton NAME ARGS...` runs `module.function(ARGS)` (-> exit code)."""

    name: str
    help: str
    module: str
    function: str = "main"

    def load(self) -> Callable[[list[str]], int]:
        """The function that runs this command (its module imported now)."""
        return getattr(importlib.import_module(self.module), self.function)


COMMANDS = (
    Command("serve", "start a local Ray cluster and the gRPC server", "cluster.cli", "serve_main"),
    Command(
        "generate", "stream one completion from a running server", "cluster.cli", "generate_main"
    ),
    Command("chat", "interactive chat with a running server", "cluster.cli", "chat_main"),
    Command(
        "deploy",
        "apply, scale, inspect or remove a Baton cluster on a running Ray cluster",
        "cluster.deploy_command",
    ),
    Command("bench", "benchmark a running cluster with a workload", "perf.bench.command"),
    Command(
        "profile",
        "measure one engine's step times and fit a step-time profile; `profile serving`: "
        "where a serving step's time goes (phases, threads, token path)",
        "perf.profiler",
    ),
    Command("simulate", "a bench run against a simulated cluster", "perf.sim.command"),
    Command(
        "plan",
        "the cheapest cluster shape meeting TTFT/ITL p99 SLOs, by simulation",
        "perf.planner",
    ),
)
BY_NAME = {c.name: c for c in COMMANDS}


def usage() -> str:
    """`baton --help`: every subcommand with its help line."""
    width = max(len(c.name) for c in COMMANDS) + 2
    lines = [
        "usage: baton COMMAND [ARGS ...]",
        "",
        "Baton: disaggregated prefill/decode LLM serving.",
        "",
        "commands:",
        *(f"  {c.name:<{width}}{c.help}" for c in COMMANDS),
        "",
        "`baton COMMAND --help` shows a command's own flags.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run `baton ARGV`; its exit code (2 for an unknown or missing command)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    command = BY_NAME.get(argv[0]) if argv else None
    if command is None:
        what = f"unknown command {argv[0]!r}" if argv else "a command is required"
        print(f"{usage()}\n\nbaton: error: {what}", file=sys.stderr)
        return 2
    return command.load()(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
