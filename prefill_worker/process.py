"""Run a PrefillWorker as its own OS process, controlled over kvtransfer.control RPC."""

from __future__ import annotations

from multiprocessing.connection import Connection

import torch

from engine.gc_freeze import freeze_startup_objects
from kvtransfer.control import serve_until_closed
from prefill_worker.worker import PrefillWorker


def main(
    worker_id: str, engine_options: dict, transfer: dict, conn: Connection, num_threads: int = 1
) -> None:
    """Process entry point (multiprocessing target)."""
    torch.set_num_threads(num_threads)
    worker = PrefillWorker(worker_id, engine_options, transfer)
    freeze_startup_objects()
    serve_until_closed(worker, conn)
