"""Baton's performance tools, installed with it: `baton bench` (bench/), `baton profile`
(profiler.py), `baton simulate` (sim/), `baton plan` (planner.py), and the latency statistics
every report uses (stats.py)."""
