"""The `baton` entry point: one table of subcommands, each dispatched with its own arguments."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from baton.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_command_with_its_help_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: baton COMMAND [ARGS ...]\n")
    listed = [line.split(None, 1) for line in out.split("commands:\n", 1)[1].splitlines()[:8]]
    assert [(c.name, c.help) for c in COMMANDS] == [(n, h) for n, h in listed]
    names = ["serve", "generate", "chat", "deploy", "bench", "profile", "simulate", "plan"]
    assert [c.name for c in COMMANDS] == names


def test_every_row_names_a_function_its_module_defines():
    for command in COMMANDS:
        path = ROOT / Path(*command.module.split(".")).with_suffix(".py")
        tree = ast.parse(path.read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert command.function in defined, command


@pytest.mark.parametrize(
    ("argv", "message"),
    [([], "a command is required"), (["nosuch"], "unknown command 'nosuch'")],
)
def test_a_missing_or_unknown_command_exits_2_with_the_list(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"\n\nbaton: error: {message}\n")
    assert "  simulate  a bench run against a simulated cluster" in err


@pytest.mark.parametrize(
    "name", ["serve", "generate", "chat", "deploy", "bench", "profile", "simulate", "plan"]
)
def test_command_help_is_the_commands_own(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: baton {name} ")


def test_arguments_reach_the_command(capsys):
    argv = ["plan", "--ttft-p99", "100", "--itl-p99", "50", "--policies", "cache_aware,nosuch"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "error: unknown policies ['nosuch']; of cache_aware, round_robin, least_loaded, random\n"
    )


def test_help_imports_no_command_module():
    code = (
        "import sys; from baton.cli import main; main(['--help']); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'cluster', 'deploy', 'perf', 'engine', 'router', 'ray', 'torch', 'numpy'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.splitlines()[-1] == "[]"
