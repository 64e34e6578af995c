"""The `baton` command: one table of subcommands (baton/cli.py) over every other package."""
