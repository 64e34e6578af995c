"""KV transfer benchmark: kvtransfer's packed and zero-copy paths vs one plain send, in one run.

    python -m benchmarks.kvtransfer [--tokens 1024 8192 32768] [--repeats 3] [--json FILE]
                                    [--skip-workload] [--model smollm2-135m-instruct]

Two processes on CPU (gloo): this one is the prefill side (host, sender), a spawned child the
decode side (receiver). For each prompt length it moves the KV of all the prompt's blocks with
SmolLM2-135M shapes (30 layers, 3 KV heads, head_dim 64, block_size 16, fp32, head-major caches
like the engine's) through KVTransfer, in two cases:
  - scattered: random source ids to random destination ids, the packed path (pack, announce,
    send, unpack);
  - consecutive: ids 0..n-1 on both sides, as a fresh engine allocates a new prompt's blocks:
    one run, the zero-copy path (each (layer, k/v, head) region sent from and received into the
    cache directly) once those regions reach kvtransfer's 256 KiB floor (1k tokens here),
    packed below it;
and compares each with one `send` of a contiguous tensor of the same byte size over the same
gloo group, between the same two processes, in the same run. Times run from the sender's call
until the receiver reports completion over the same pipe; within a case the variants run
round-robin and the median of --repeats rounds is reported.

The baseline is the floor, not a peer: its receive is posted before the clock starts and it
moves one contiguous buffer, while KVTransfer also announces the transfer through the pair
store and moves blocks from and to where they lie. On a shared 2-CPU box the figures swing by
tens of percent between runs, so the ratio column also gives the range of the per-round ratios
(plain seconds / kvtransfer seconds of the same round), which load drift affects less, and
the ratio of CPU seconds (both processes, all threads: plain / kvtransfer). When the CPUs are
the bottleneck the time ratio follows the CPU ratio: the packed path's gather and scatter are
two memory copies more than a socket send and receive, which no overlap on 2 CPUs can hide.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from typing import Any

# Before torch loads: c10d logs a warning each time a receiver's 0.5 s wait for the next
# announcement passes with none (a TCPStore socket timeout); those are not errors.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

from kvtransfer import GroupRegistry, KVTransfer, TransferDescriptor  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16  # SmolLM2-135M
BLOCK_SHAPE = (BLOCK_SIZE, KV_HEADS, HEAD_DIM)
VARIANTS: dict[str, dict[str, Any]] = {
    "kvtransfer": {},  # defaults: 32 MiB messages, double-buffered
    "kvtransfer, 1 layer/msg": {"message_bytes": 1},
    "kvtransfer, no pipeline": {"pipeline": False},
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def make_cache(num_blocks: int, random: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-layer [2, num_blocks, bs, kvh, d] fp32 views of one allocation, and its flat bytes.

    One allocation lets the plain baseline send/receive a contiguous slice of the same memory
    instead of a second 1.5 GB buffer. Every page is touched (no page faults while timed).
    """
    # The engine's layout (engine.attention.kv_layout): each layer stored head-major.
    full = torch.empty(LAYERS, 2, KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)
    full.uniform_() if random else full.zero_()
    layers = [layer.permute(0, 2, 3, 1, 4) for layer in full.unbind(0)]
    return layers, full.view(-1).view(torch.uint8)


def scattered_ids(n: int, total: int, seed: int) -> list[int]:
    """n distinct block ids out of `total`, in random order (non-contiguous)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(total, generator=g)[:n].tolist()


def digest(kv: list[torch.Tensor], ids: list[int]) -> list[float]:
    """fp64 sums of the given blocks of the first and last layer (equal iff copied exactly)."""
    index = torch.tensor(ids)
    return [kv[layer].index_select(1, index).double().sum().item() for layer in (0, LAYERS - 1)]


# ---- receiver process ------------------------------------------------------------------------
def receiver_main(conn: Any, address: dict[str, Any], threads: int) -> None:
    """Decode side: executes ("alloc" | "recv" | "plain" | "free" | "exit") commands."""
    torch.set_num_threads(threads)
    registry = GroupRegistry("cpu", timeout=120.0)
    registry.join("prefill", address)
    kv: list[torch.Tensor] = []
    flat = torch.empty(0, dtype=torch.uint8)
    while True:
        cmd, *args = conn.recv()
        if cmd == "alloc":
            kv, flat = make_cache(args[0], random=False)
            conn.send(("ok",))
        elif cmd == "recv":
            rx = KVTransfer(registry, **args[0])
            conn.send(("ready",))
            start = cpu_seconds()
            desc, _ = rx.recv("prefill", kv, wait=120.0)
            conn.send(("done", cpu_seconds() - start))  # the timed part ends here
            conn.send(("digest", digest(kv, list(desc.dst_block_ids))))
        elif cmd == "plain":
            start = cpu_seconds()
            work = registry.get("prefill").pg.recv([flat[: args[0]]], 0, 0)
            conn.send(("ready",))
            work.wait()
            conn.send(("done", cpu_seconds() - start))
        elif cmd == "free":
            kv, flat = [], torch.empty(0, dtype=torch.uint8)
            conn.send(("ok",))
        elif cmd == "exit":
            registry.close()
            conn.send(("ok",))
            return


class Receiver:
    """The spawned decode-side process."""

    def __init__(self, address: dict[str, Any], threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(child, address, threads), daemon=True)
        self.proc.start()

    def call(self, *cmd: Any, expect: str = "ok", timeout: float = 300.0) -> Any:
        self.conn.send(cmd)
        return self.expect(expect, timeout)

    def expect(self, tag: str, timeout: float = 300.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"receiver sent no {tag!r} within {timeout}s")
        msg = self.conn.recv()
        if msg[0] != tag:
            raise RuntimeError(f"receiver answered {msg!r}, expected {tag!r}")
        return msg[1] if len(msg) > 1 else None


# ---- sender side -----------------------------------------------------------------------------
def descriptor(tokens: int, src: list[int], dst: list[int]) -> TransferDescriptor:
    return TransferDescriptor(
        request_id=f"bench-{tokens}",
        block_hashes=list(range(1, tokens // BLOCK_SIZE + 1)),
        missing=list(range(len(src))),
        src_block_ids=src,
        dst_block_ids=dst,
        layers=(0, LAYERS),
        dtype="float32",
        block_shape=BLOCK_SHAPE,
        first_token=1,
        num_prompt_tokens=tokens,
        sampling={"seed": 0},
    )


def time_kvtransfer(
    registry: GroupRegistry,
    receiver: Receiver,
    kv: list[torch.Tensor],
    desc: TransferDescriptor,
    options: dict[str, Any],
) -> tuple[float, float]:
    """(seconds, CPU seconds of both processes) for one KVTransfer, from send() until the
    receiver reports it applied."""
    tx = KVTransfer(registry, **options)
    receiver.call("recv", options, expect="ready")
    start, cpu = time.perf_counter(), cpu_seconds()
    tx.send("decode", kv, desc)
    receiver_cpu = receiver.expect("done")
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu + receiver_cpu
    got = receiver.expect("digest")
    want = digest(kv, list(desc.src_block_ids))
    if got != want:
        raise RuntimeError(f"receiver's blocks differ from the sender's: {got} != {want}")
    return elapsed, cpu


def time_plain(
    registry: GroupRegistry, receiver: Receiver, flat: torch.Tensor, nbytes: int
) -> tuple[float, float]:
    """(seconds, CPU seconds of both processes) for one send of `nbytes` contiguous bytes over
    the same gloo group."""
    pg = registry.get("decode").pg
    receiver.call("plain", nbytes, expect="ready")
    start, cpu = time.perf_counter(), cpu_seconds()
    pg.send([flat[:nbytes]], 1, 0).wait()
    receiver_cpu = receiver.expect("done")
    return time.perf_counter() - start, cpu_seconds() - cpu + receiver_cpu


def measure(
    registry: GroupRegistry,
    receiver: Receiver,
    kv: list[torch.Tensor],
    flat: torch.Tensor,
    desc: TransferDescriptor,
    repeats: int,
) -> dict[str, list[float]]:
    """Seconds per run of every variant and of the plain send, `repeats` rounds each, and
    under "cpu <name>" the CPU seconds (both processes) of those runs.

    Round-robin over the variants, so that load changes hit them all alike; the first round
    is a warm-up (group, staging buffers) and is not recorded.
    """
    names = [*VARIANTS, "plain"]
    times: dict[str, list[float]] = {key: [] for name in names for key in (name, f"cpu {name}")}
    for i in range(repeats + 1):
        log(f"  round {i}/{repeats}")
        for name in names:
            if name == "plain":
                elapsed, cpu = time_plain(registry, receiver, flat, desc.payload_bytes)
            else:
                elapsed, cpu = time_kvtransfer(registry, receiver, kv, desc, VARIANTS[name])
            if i:
                times[name].append(elapsed)
                times[f"cpu {name}"].append(cpu)
    return times


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    registry = GroupRegistry("cpu", timeout=120.0)
    receiver = Receiver(registry.host("decode"), args.threads)
    rows = []
    try:
        for tokens in args.tokens:
            n = -(-tokens // BLOCK_SIZE)
            total = n + n // 8 + 1  # a little slack, so ids are scattered, not a permutation
            log(
                f"{tokens} tokens: {n} blocks of {total} per side, "
                f"{2 * total * LAYERS * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4 / 1e9:.2f} GB each"
            )
            kv, flat = make_cache(total, random=True)
            receiver.call("alloc", total)
            cases = {
                "scattered": (scattered_ids(n, total, 1), scattered_ids(n, total, 2)),
                "consecutive": (list(range(n)), list(range(n))),
            }
            for case, (src, dst) in cases.items():
                log(f" case {case}")
                desc = descriptor(tokens, src, dst)
                row: dict[str, Any] = {
                    "tokens": tokens,
                    "case": case,
                    "blocks": n,
                    "bytes": desc.payload_bytes,
                    "mode": KVTransfer(registry).payload_mode(kv, desc),
                }
                row.update(measure(registry, receiver, kv, flat, desc, args.repeats))
                rows.append(row)
            kv, flat = [], None
            receiver.call("free")
    finally:
        receiver.call("exit")
        receiver.proc.join(10)
        registry.close()
    return rows


def report(rows: list[dict[str, Any]]) -> None:
    names = [*VARIANTS, "plain"]
    print(
        f"{'tokens':>7} {'ids':>12} {'mode':>7} {'MB':>8} "
        + " ".join(f"{n + ' GB/s':>30}" for n in names)
        + f" {'ratio':>6} {'per round':>11}"
        + f" {'cpu ratio':>9}"
    )
    for row in rows:
        gbps = {n: row["bytes"] / statistics.median(row[n]) / 1e9 for n in names}
        paired = [p / t for p, t in zip(row["plain"], row["kvtransfer"], strict=True)]
        row["gb_per_s"] = gbps
        row["ratio"] = gbps["kvtransfer"] / gbps["plain"]
        row["round_ratios"] = paired
        row["cpu_ratio"] = statistics.median(row["cpu plain"]) / statistics.median(
            row["cpu kvtransfer"]
        )
        print(
            f"{row['tokens']:>7} {row['case']:>12} {row['mode']:>7} {row['bytes'] / 1e6:>8.1f} "
            + " ".join(f"{gbps[n]:>30.2f}" for n in names)
            + f" {row['ratio']:>6.2f}"
            + f" {min(paired):>5.2f}-{max(paired):.2f} {row['cpu_ratio']:>9.2f}"
        )
    print(
        "ratio = kvtransfer (default) / plain GB/s; per round = range of plain / kvtransfer "
        "seconds within each round; cpu ratio = plain / kvtransfer CPU seconds (both processes, "
        "medians); mode: the default variant's payload mode (packed = gather, "
        "send, scatter; runs = zero-copy, for consecutive ids whose regions are >= 256 KiB); "
        "GB/s = bytes / median seconds (1e9 bytes); "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )


class _RecordingDecode:
    """A decode worker that remembers how many prompt blocks it already held per request."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.hit_blocks: list[int] = []

    def reserve(self, *args: Any) -> Any:
        out = self.worker.reserve(*args)  # a kvtransfer.worker_api.Reservation
        self.hit_blocks.append(out.num_hit_blocks)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def prefix_workload(
    model: str, requests: int = 8, prefix_tokens: int = 448, tail_tokens: int = 70
) -> dict[str, Any]:
    """Agent-style traffic through real prefill and decode workers (gloo pair group, one
    process): every request shares a system prompt. Only the blocks the decode worker does not
    already hold may move: moved blocks / uncached blocks must be <= 1."""
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker
    from router.handoff import generate_disaggregated

    options = dict(
        model=model, dtype="float32", block_size=16, num_kv_blocks=512, skip_tokenizer_init=True
    )
    prefill, decode = PrefillWorker("p0", options), DecodeWorker("d0", options)
    decode.connect_prefill("p0", prefill.connect_decode("d0", decode), prefill)
    recording = _RecordingDecode(decode)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(100, 40000, (prefix_tokens,), generator=g).tolist()
    prompts = [
        prefix + torch.randint(100, 40000, (tail_tokens,), generator=g).tolist()
        for _ in range(requests)
    ]
    params = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    try:
        before = decode.stats().blocks_received
        for i, prompt in enumerate(prompts):
            outs = list(
                generate_disaggregated(
                    prefill, recording, f"w{i}", prompt, params, prefill_id="p0", decode_id="d0"
                )
            )
            if outs[-1]["finish_reason"] != "length":
                raise RuntimeError(f"request w{i} failed: {outs[-1]}")
        moved = decode.stats().blocks_received - before
    finally:  # the receiver first: its receive loop stops before the sender's store closes
        decode.shutdown()
        prefill.shutdown()
    total = sum(-(-len(p) // 16) for p in prompts)
    uncached = total - sum(recording.hit_blocks)
    return {
        "requests": requests,
        "prefix_tokens": prefix_tokens,
        "tail_tokens": tail_tokens,
        "prompt_blocks": total,
        "uncached_blocks": uncached,
        "moved_blocks": moved,
        "moved_over_uncached": moved / uncached,
    }


def report_workload(w: dict[str, Any]) -> None:
    total = w["prompt_blocks"]
    print(
        f"prefix-sharing workload: {w['requests']} requests, {w['prefix_tokens']}-token "
        f"shared prefix + {w['tail_tokens']}-token tails (block 16): {total} prompt blocks, "
        f"{w['uncached_blocks']} not in the decode worker's cache at reservation "
        f"({w['uncached_blocks'] / total:.1%}), {w['moved_blocks']} moved "
        f"({w['moved_blocks'] / total:.1%}) -> moved / uncached "
        f"{w['moved_over_uncached']:.2f} (target <= 1)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--skip-workload",
        action="store_true",
        help="skip the prefix-sharing workload through real workers",
    )
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="model of the prefix-sharing workload"
    )
    args = parser.parse_args()
    rows = run(args)
    report(rows)
    workload = None
    if not args.skip_workload:
        log("prefix-sharing workload through a prefill and a decode worker ...")
        workload = prefix_workload(args.model)
        report_workload(workload)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transfers": rows, "workload": workload}, f, indent=2)


if __name__ == "__main__":
    main()
