"""CPU time of a process's threads, by name, from Linux's /proc.

/proc/<pid>/task/<tid>/stat holds a thread's CPU time in clock ticks (utime, field 14: user;
stime, field 15: system) after its name in parentheses (field 2, comm: the OS name, which may
itself hold spaces and parentheses, so it ends at the stat line's LAST ")"). Ticks are
10 ms: a thread's figure is cut down to a whole tick, so with dozens of threads their sum
falls short of the process's by up to a tick each; a thread's time is therefore taken from
its schedstat (the first field: nanoseconds on a CPU) where the kernel has one, and from its
ticks otherwise. A thread that exited is gone from task/; the process's own stat line still
counts its time, so a process's "exited threads" line is its total less its live threads'.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
EXITED = "(exited threads)"


@dataclass(frozen=True, slots=True)
class ThreadCPU:
    """One thread (or a whole process, tid = pid) at one moment: its name and CPU seconds."""

    tid: int
    name: str
    cpu_s: float


def parse_stat(line: str, ticks_per_s: int = TICKS_PER_S) -> tuple[str, float]:
    """(comm, user + system CPU seconds) of one /proc stat line; ValueError if malformed."""
    open_at, close_at = line.find("("), line.rfind(")")
    if open_at < 0 or close_at < open_at:
        raise ValueError(f"not a /proc stat line: {line[:80]!r}")
    fields = line[close_at + 1 :].split()  # fields[0] is field 3 (state)
    if len(fields) < 13:
        raise ValueError(f"a /proc stat line with {len(fields) + 2} fields: {line[:80]!r}")
    utime, stime = int(fields[11]), int(fields[12])
    return line[open_at + 1 : close_at], (utime + stime) / ticks_per_s


def parse_schedstat(text: str) -> float:
    """A /proc schedstat line's time on a CPU (its first field, ns), in seconds."""
    return int(text.split()[0]) / 1e9


def read_process(pid: int, proc: Path = Path("/proc")) -> tuple[float, list[ThreadCPU]]:
    """(the process's CPU seconds, its live threads); ProcessLookupError once it is gone."""
    try:
        _, total = parse_stat((proc / str(pid) / "stat").read_text())
        threads = []
        for task in sorted((proc / str(pid) / "task").iterdir(), key=lambda p: int(p.name)):
            try:
                name, cpu = parse_stat((task / "stat").read_text())
                if (task / "schedstat").is_file():
                    cpu = parse_schedstat((task / "schedstat").read_text())
            except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
                continue
            threads.append(ThreadCPU(int(task.name), name, cpu))
    except FileNotFoundError as exc:
        raise ProcessLookupError(f"no process {pid}") from exc
    return total, threads


def group_name(name: str) -> str:
    """A pool's threads under one name: a trailing number (and the '-' or '_' before it)
    dropped, e.g. "router-call_3" -> "router-call", "Thread-12 (_serve)" -> "Thread (_serve)"."""
    name = re.sub(r"[-_ ]?\d+(?= \()", "", name)
    return re.sub(r"[-_]?\d+$", "", name) or name


@dataclass(frozen=True, slots=True)
class ThreadGroupCPU:
    """The CPU seconds a group of equally named threads spent over a run."""

    name: str
    threads: int
    cpu_s: float


def cpu_over_run(
    before: tuple[float, list[ThreadCPU]],
    after: tuple[float, list[ThreadCPU]],
    names: dict[int, str] | None = None,
) -> tuple[float, list[ThreadGroupCPU]]:
    """(the process's CPU seconds over the run, per thread group, most first) from two
    read_process() readings. `names` (native id -> Python name) overrides the OS names; a
    thread born during the run counts from 0; the threads that exited during it are one
    EXITED line (what the process's total has beyond its live threads')."""
    names = names or {}
    (total_before, threads_before), (total_after, threads_after) = before, after
    was = {t.tid: t.cpu_s for t in threads_before}
    groups: dict[str, list[float]] = {}
    live = 0.0
    for t in threads_after:
        spent = t.cpu_s - was.get(t.tid, 0.0)
        live += spent
        groups.setdefault(group_name(names.get(t.tid, t.name)), []).append(spent)
    total = total_after - total_before
    exited = round(total - live, 6)  # the process total is whole ticks: below 1 is noise
    if exited >= 1.0 / TICKS_PER_S:
        groups[EXITED] = [exited]
    rows = [ThreadGroupCPU(name, len(v), round(sum(v), 6)) for name, v in groups.items()]
    return round(total, 6), sorted(rows, key=lambda r: (-r.cpu_s, r.name))
