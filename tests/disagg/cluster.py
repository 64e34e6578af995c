"""Start prefill and decode workers as real OS processes, controlled over RPC (test helper)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvtransfer.control import RpcClient
from kvtransfer.worker_api import Role
from kvtransfer.worker_client import DecodeClient, PrefillClient, client
from router.handoff import generate_disaggregated


@dataclass
class WorkerProcess:
    """A worker in a child process: its typed RPC client, its address and its process."""

    worker_id: str
    role: Role
    process: mp.Process
    conn: object
    address: dict
    rpc: RpcClient = field(init=False)
    client: PrefillClient | DecodeClient = field(init=False)

    def __post_init__(self) -> None:
        self.rpc = RpcClient(self.address, default_timeout=120.0)
        self.client = client(self.role, self.rpc)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send("stop")
            except (OSError, BrokenPipeError):
                pass
            self.process.join(20)
            if self.process.is_alive():
                self.kill()
        self.rpc.close()


def start_worker(
    role: Role | str, worker_id: str, engine_options: dict, transfer: dict
) -> WorkerProcess:
    role = Role(role)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    if role is Role.PREFILL:
        from prefill_worker.process import main
    else:
        from decode_worker.process import main
    proc = ctx.Process(
        target=main,
        args=(worker_id, engine_options, transfer, child),
        daemon=True,
        name=f"{role}-{worker_id}",
    )
    proc.start()
    if not parent.poll(180):
        proc.kill()
        raise RuntimeError(f"{role} worker {worker_id} did not start")
    return WorkerProcess(worker_id, role, proc, parent, parent.recv())


def pair(prefill: WorkerProcess, decode: WorkerProcess) -> None:
    """Connect a prefill and a decode worker: pair group + control channels both ways."""
    address = prefill.client.connect_decode(decode.worker_id, decode.address)
    decode.client.connect_prefill(prefill.worker_id, address, prefill.address)


@contextmanager
def paired_workers(engine: dict, transfer: dict) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """A prefill ("p0") and a decode ("d0") worker process on one engine's options, paired;
    both stopped on exit."""
    prefill = start_worker("prefill", "p0", engine, transfer)
    decode = start_worker("decode", "d0", engine, transfer)
    try:
        pair(prefill, decode)
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


def run_concurrently(
    prefill, decode, prompts, params, prefix="r", timeout=60.0
) -> dict[str, list[dict]]:
    """Run every prompt through the hand-off at once; a request whose control call fails
    (a killed worker) reports what the decode side says of it, or the error."""
    results: dict[str, list[dict]] = {}

    def one(i: int) -> None:
        rid = f"{prefix}{i}"
        try:
            results[rid] = list(
                generate_disaggregated(
                    prefill.client,
                    decode.client,
                    rid,
                    prompts[i],
                    params[i],
                    prefill_id=prefill.worker_id,
                    decode_id=decode.worker_id,
                    timeout=timeout,
                )
            )
        except Exception as exc:  # noqa: BLE001 - a worker died under the request
            outs: list[dict] = []
            try:
                while not (outs and outs[-1]["finished"]):
                    outs += [o.to_dict() for o in decode.client.poll(rid, 1.0)]
            except Exception:  # noqa: BLE001
                outs = outs or [{"finish_reason": "error", "error": str(exc)}]
            results[rid] = outs

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return results


def tokens(outs: list[dict]) -> list[int]:
    return [t for o in outs for t in o["token_ids"]]
