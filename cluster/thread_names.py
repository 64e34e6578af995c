"""Threads by name at the OS level: each Python thread's name given to its OS thread, so that
/proc/<pid>/task/<tid>/comm, `top -H` and py-spy show "engine-loop" or "rpc-serve" rather
than "python" (CPython 3.11 names only the Python object)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

OS_NAME_BYTES = 15  # Linux keeps 15 bytes of a thread's name (16 with the NUL)


def _setname():
    """libc's pthread_setname_np, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = getattr(libc, "pthread_setname_np", None)
    if fn is not None:
        fn.argtypes = (ctypes.c_ulong, ctypes.c_char_p)
        fn.restype = ctypes.c_int
    return fn


_SETNAME = _setname()


FOREIGN = "ray-call"  # a thread Python did not start that ran Python code (see below)


def name_os_threads() -> dict[int, str]:
    """Give every live Python thread of this process its name at the OS level (its first 15
    bytes) and return {native thread id: full name}. The main thread keeps its OS name (it is
    the process's name), and so do threads that Python did not start but that ran Python code
    (a "Dummy-N" to Python): in a Ray actor those are the threads Ray runs actor calls on (a
    router's token polls of a worker among them), named FOREIGN in the returned map."""
    out = {}
    for thread in threading.enumerate():
        if thread.native_id is None or thread.ident is None:
            continue
        foreign = isinstance(thread, threading._DummyThread)
        out[thread.native_id] = FOREIGN if foreign else thread.name
        if _SETNAME is not None and not foreign and thread is not threading.main_thread():
            _SETNAME(thread.ident, thread.name.encode()[:OS_NAME_BYTES])
    return out
