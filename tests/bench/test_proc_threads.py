"""The /proc thread reader: a stat line's name (spaces and parentheses included) and CPU
ticks, a schedstat line's nanoseconds, threads grouped by name over a run (born, exited,
renamed by Python's names), and the OS names cluster/thread_names.py gives Python threads,
read back from this very process."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from cluster.thread_names import name_os_threads
from perf.serving.proc_threads import (
    EXITED,
    ThreadCPU,
    ThreadGroupCPU,
    cpu_over_run,
    group_name,
    parse_schedstat,
    parse_stat,
    read_process,
)

# pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
LINE = "4242 (rpc (serve) 2) S 1 4242 4242 0 -1 4194560 120 0 0 0 250 75 0 0 20 0 9 0 88 0"


def test_stat_line():
    assert parse_stat(LINE, ticks_per_s=100) == ("rpc (serve) 2", 3.25)
    assert parse_schedstat("1250000000 881560 2\n") == 1.25
    with pytest.raises(ValueError, match="not a /proc stat line"):
        parse_stat("4242 rpc S 1")
    with pytest.raises(ValueError, match="fields"):
        parse_stat("4242 (x) S 1 2")


def test_group_names():
    assert group_name("router-call_3") == "router-call"
    assert group_name("kv-recv-p0") == "kv-recv-p"
    assert group_name("Thread-12 (_serve)") == "Thread (_serve)"
    assert group_name("engine-loop") == "engine-loop"
    assert group_name("7") == "7"


def test_cpu_over_a_run():
    before = (10.0, [ThreadCPU(1, "python", 6.0), ThreadCPU(2, "rpc-serve", 1.0),
                     ThreadCPU(3, "gone", 2.0)])  # fmt: skip
    after = (16.5, [ThreadCPU(1, "python", 7.0), ThreadCPU(2, "rpc-serve", 2.5),
                    ThreadCPU(4, "rpc-serve", 0.5), ThreadCPU(5, "python", 2.0)])  # fmt: skip
    total, groups = cpu_over_run(before, after, names={5: "engine-loop"})
    # threads 1, 2 rose by 1.0 and 1.5; 4 and 5 were born (0.5, 2.0); the rest (thread 3's
    # last moments and any short-lived thread) is what the process total has beyond them
    assert total == 6.5
    assert groups == [
        ThreadGroupCPU("engine-loop", 1, 2.0),
        ThreadGroupCPU("rpc-serve", 2, 2.0),
        ThreadGroupCPU(EXITED, 1, 1.5),
        ThreadGroupCPU("python", 1, 1.0),
    ]


def test_this_process_threads_by_their_python_names():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    worker = threading.Thread(target=spin, name="kv-recv-prefill-0", daemon=True)
    worker.start()
    try:
        names = name_os_threads()
        total, threads = read_process(os.getpid())
    finally:
        stop.set()
        worker.join()
    assert names[worker.native_id] == "kv-recv-prefill-0"
    assert names[threading.main_thread().native_id] == "MainThread"
    comm = {t.tid: t.name for t in threads}
    assert comm[worker.native_id] == "kv-recv-prefill"  # the OS keeps 15 bytes
    assert comm[os.getpid()] == Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    # the total is in 10 ms ticks the kernel samples, each thread's time in exact ns from
    # schedstat, read one after another: on a busy (or virtual) machine the sampled total
    # may fall short of their sum by a tick per thread and a few percent (threads that
    # exited count in the total only, so it has no upper bound here)
    exact = sum(t.cpu_s for t in threads)
    assert total >= exact * 0.95 - 0.01 * (len(threads) + 2)
    with pytest.raises(ProcessLookupError):
        read_process(2**22 + 1)  # above Linux's pid_max
