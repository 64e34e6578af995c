"""The simulated cluster: workers, and the router's choices made by router/policy.py itself
over a KVIndex (FastKVIndex: the same answers, one walk per query) fed by the workers' own KV
events, with its LoadTracker; KV moves in latency + bytes / bandwidth.

Request path (router/worker_choice.py `WorkerChooser`, router/request_life.py `RequestLife`):
choose prefill P (policy) and decode D (choose_decode); local when aggregated or the uncached
tail on D is at most local_prefill_tokens. Local: D prefills and decodes. Remote: D reserves
blocks (its own cached prefix + new ones; a reservation that does not fit waits on D), P
prefills in chunks and samples the first token, the blocks D lacks travel, then (between two of
D's steps, as its engine loop does it) the first token reaches the client and D decodes the
rest. Transfers do not contend with each other. The control path (the router's Ray and gRPC
calls, its index refresh, the streams back to the client) costs a measured fixed time per
request, one for the local path and one for the remote one (benchmarks/sim_calibration.py): the
request reaches its worker that much later, without occupying any worker meanwhile. With
shared_cores set (a cluster of CPU workers on one machine, as the experiments run here), a step
that starts while more workers compute than there are cores takes busy / cores times its
profiled time: each worker was profiled with a core of its own. step_time_scale multiplies
every step (a machine that runs steps slower or faster now than when it was profiled: a real
run's engine step seconds over the simulated ones, benchmarks/sim_validation.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.step_model import StepModel
from perf.sim.events import EventLoop
from perf.sim.fast_index import FastKVIndex
from perf.sim.request import DECODE, FULL, PREFILL, Job, SimRequest
from perf.sim.worker import SimWorker, WorkerConfig
from router.policy import (
    LoadTracker,
    WorkerLoad,
    choose_decode,
    choose_prefill,
    make_policy,
)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The cluster's shape: pools, routing and the KV link."""

    prefill: int = 1  # 0: aggregated
    decode: int = 1
    policy: str = "cache_aware"
    local_prefill_tokens: int = 0
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    prefill_worker: WorkerConfig | None = None  # the prefill pool's own options, if they differ
    block_bytes: int = 0  # KV bytes of one block (perf/sim/kv_bytes.py)
    kv_bandwidth_gbs: float = 4.0  # GB/s (1e9 bytes) of one transfer
    kv_latency_s: float = 0.002  # fixed cost of one transfer
    local_overhead_s: float = 0.0  # control path of a request prefilled on its decode worker
    remote_overhead_s: float = 0.0  # control path of a request prefilled on a prefill worker
    shared_cores: float | None = None  # cores all workers share (one machine); None: one each
    step_time_scale: float = 1.0  # every step's profiled time times this
    seed: int = 0  # the random policy's

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"need prefill >= 0 and decode >= 1, got {self.prefill}/{self.decode}")
        if self.kv_bandwidth_gbs <= 0:
            raise ValueError(f"kv bandwidth must be > 0 GB/s, got {self.kv_bandwidth_gbs}")
        if self.local_overhead_s < 0 or self.remote_overhead_s < 0:
            raise ValueError("request overheads must be >= 0 s")
        if self.shared_cores is not None and self.shared_cores <= 0:
            raise ValueError(f"shared cores must be > 0, got {self.shared_cores}")
        if self.step_time_scale <= 0:
            raise ValueError(f"step time scale must be > 0, got {self.step_time_scale}")


class SimCluster:
    """Workers named prefill-i / decode-i; route(request) sends a request through."""

    def __init__(self, config: ClusterConfig, model: StepModel, loop: EventLoop) -> None:
        self.config = config
        self.loop = loop
        self.index = FastKVIndex()
        self.load = LoadTracker()
        options = {"seed": config.seed} if config.policy == "random" else {}
        self.policy = make_policy(config.policy, **options)
        pw = config.prefill_worker or config.worker
        self.prefill = {
            f"prefill-{i}": SimWorker(f"prefill-{i}", pw, model, loop, self)
            for i in range(config.prefill)
        }
        self.decode = {
            f"decode-{i}": SimWorker(f"decode-{i}", config.worker, model, loop, self)
            for i in range(config.decode)
        }
        for wid in (*self.prefill, *self.decode):
            self.index.add_worker(wid)
        self.pending: dict[str, deque[tuple[str, Job]]] = {w: deque() for w in self.decode}
        self.transfers = 0
        self.bytes_moved = 0
        # workers with a step in flight (SimWorker._set_busy), and on a shared machine the KV
        # transfers in flight (CPU transfers copy on both ends: a sender and receiver thread)
        self.busy_workers = 0

    @property
    def block_size(self) -> int:
        return self.config.worker.block_size

    def slowdown(self) -> float:
        """How much slower a step starting now runs than its profile: step_time_scale times
        busy workers over the shared cores, at least 1 (1 without shared_cores)."""
        cores = self.config.shared_cores
        shared = 1.0 if cores is None else max(1.0, self.busy_workers / cores)
        return self.config.step_time_scale * shared

    def workers(self) -> dict[str, list[str]]:
        return {"prefill": list(self.prefill), "decode": list(self.decode)}

    def engine_steps(self) -> dict[str, dict]:
        """{worker: {"steps", "busy_s"}}, as `baton bench` records a real run's."""
        return {
            w.worker_id: {"steps": w.steps, "busy_s": w.busy_s}
            for w in (*self.prefill.values(), *self.decode.values())
        }

    def route(self, r: SimRequest) -> None:
        """The router's choice for one request, then its first move."""
        n, bs = r.prompt_tokens, self.block_size
        choice = None
        if self.prefill:
            loads = [WorkerLoad(w, self.load.queued(w)) for w in self.prefill]
            choice = choose_prefill(
                self.policy, r.hashes, bs, loads, self.index, num_prompt_tokens=n
            )
        decode_loads = [d.decode_load(len(self.pending[w])) for w, d in self.decode.items()]
        d = choose_decode(r.hashes, n, bs, decode_loads, self.index)
        r.decode_worker = d.worker_id
        worker = self.decode[d.worker_id]
        if choice is None or n - d.hit_blocks * bs <= self.config.local_prefill_tokens:
            r.prefill_worker = d.worker_id
            self._after(self.config.local_overhead_s, worker.submit, Job(r, FULL, n))
            return
        r.prefill_worker = choice.worker_id
        job = Job(r, DECODE, n + 1, output=1, queued=n - choice.cached_tokens)
        if worker.reserve(job):
            self._dispatch(choice.worker_id, job)
        else:  # the router would wait for room on D: here the reservation queues on D
            self.pending[d.worker_id].append((choice.worker_id, job))

    def _dispatch(self, prefill_id: str, decode_job: Job) -> None:
        self.load.dispatched(prefill_id, decode_job.queued)
        r = decode_job.request
        job = Job(r, PREFILL, r.prompt_tokens, peer=decode_job, queued=decode_job.queued)
        self._after(self.config.remote_overhead_s, self.prefill[prefill_id].submit, job)

    def _after(self, seconds: float, call, *args) -> None:
        """call(*args) now, or `seconds` of control path later."""
        if seconds > 0:
            self.loop.at(self.loop.now + seconds, call, *args)
        else:
            call(*args)

    # ---- worker callbacks ---------------------------------------------------------------
    def prefilled(self, worker: SimWorker, job: Job) -> None:
        """P sampled the first token: send the blocks D lacks."""
        self.load.prefilled(worker.worker_id, job.queued)
        d = job.decode_job()
        blocks = -(-job.request.prompt_tokens // self.block_size) - d.hit_blocks
        nbytes = blocks * self.config.block_bytes
        self.transfers += 1
        self.bytes_moved += nbytes
        seconds = self.config.kv_latency_s + nbytes / (self.config.kv_bandwidth_gbs * 1e9)
        if self.config.shared_cores is not None:  # the copies take a core of the machine too
            self.busy_workers += 1
        self.loop.at(self.loop.now + seconds, self._transferred, worker, job)

    def _transferred(self, prefill: SimWorker, job: Job) -> None:
        if self.config.shared_cores is not None:
            self.busy_workers -= 1
        prefill.release(job)
        prefill._kick()  # its waiting prompts may fit now
        decode = self.decode[job.request.decode_worker]
        d = job.decode_job()
        decode.between_steps(lambda: self._first_token(decode, d))

    def _first_token(self, decode: SimWorker, d: Job) -> None:
        """D completes the remote request: the first token goes out, decoding starts."""
        r = d.request
        r.chunks.append((self.loop.now, 1))
        if r.max_tokens <= 1:
            decode.reserved -= 1
            decode.release(d)
            self.finished(decode, d)
        else:
            decode.activate(d)

    def finished(self, worker: SimWorker, job: Job) -> None:
        """The request's last token is out; a decode worker's queued reservations retry."""
        r = job.request
        r.end_s = self.loop.now
        queue = self.pending.get(worker.worker_id)
        while queue and worker.reserve(queue[0][1]):
            prefill_id, decode_job = queue.popleft()
            self._dispatch(prefill_id, decode_job)
        worker._kick()
        if r.on_done is not None:
            r.on_done(r)
