"""`baton deploy ...`: deploy/commands.py's commands, run with one-line errors."""

from __future__ import annotations

from cluster.cli import run_one_line
from deploy import commands


def main(argv: list[str]) -> int:
    """`baton deploy ARGV`."""
    args = commands.parser().parse_args(argv)
    return run_one_line(lambda: args.run(args))
