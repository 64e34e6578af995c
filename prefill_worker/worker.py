"""PrefillWorker: an engine in the prefill role.

It runs chunked prefill (with prefix caching) for many requests at once, samples each
request's first token, sends the KV blocks the decode worker lacks over the pair's process
group, and keeps the blocks as prefix cache once the decode side acknowledges (or the lease
runs out). It also pulls cached blocks back from a decode worker (pull_blocks: the next turn
of a conversation starts with what that worker decoded), on the same pair and the same
sender thread as the transfers to it. Its public methods are kvtransfer.worker_api.PrefillAPI,
called in process, over kvtransfer.control RPC or as Ray actor methods.
"""

from __future__ import annotations

import logging
import operator
import queue
import random
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from engine import SamplingParams
from engine.block_hash import hash_prompt_blocks
from engine.config import use_device
from kvtransfer import (
    PullAsk,
    TransferDescriptor,
    TransferError,
    TransferTimeout,
    UnknownPeer,
    dtype_name,
)
from kvtransfer.endpoint import TransferEndpoint
from kvtransfer.worker_api import PrefillResult, PromptRequest, PullResult, Reservation, Role

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _SendJob:
    request_id: str
    decode_id: str
    missing: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    first_token: int
    sampling: dict  # seed, params and what the prefill produced (first_tokens, logprobs...)
    num_prompt_tokens: int
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _PullJob:
    decode_id: str
    ask: PullAsk
    result: Future = field(default_factory=Future)  # PullResult, or the error
    # Whoever takes this first (the sender thread running it, or the caller giving up on it
    # before that) owns freeing its blocks: exactly one of them does.
    _owner: threading.Lock = field(default_factory=threading.Lock)

    def claim(self) -> bool:
        """True for the first caller only."""
        return self._owner.acquire(blocking=False)


def prefill_handoff(outs: list) -> dict:
    """What a prefill hands the decode side besides the KV (plain values, in the transfer
    descriptor's sampling dict): first_tokens (one per choice), their logprobs (None each
    when not asked for) and the prompt logprobs (None when not asked for)."""
    by_index = sorted(outs, key=lambda o: o.index)
    prompt = next((o.prompt_logprobs for o in by_index if o.prompt_logprobs is not None), None)
    return {
        "first_tokens": [o.new_token_ids[0] for o in by_index],
        "logprobs": [o.logprobs[0].to_wire() if o.logprobs else None for o in by_index],
        "prompt_logprobs": None
        if prompt is None
        else [None if lp is None else lp.to_wire() for lp in prompt],
    }


class PrefillWorker(TransferEndpoint):
    """Prefill role: prompt in, first token out, KV shipped to a decode worker."""

    role = Role.PREFILL
    peer_role = Role.DECODE

    def __init__(
        self, worker_id: str, engine_options: dict | None = None, transfer: dict | None = None
    ) -> None:
        super().__init__(worker_id, engine_options, transfer)
        self._senders: dict[str, queue.Queue[_SendJob | _PullJob | None]] = {}
        self._addresses: dict[str, dict] = {}
        self.bytes_sent = 0
        self.blocks_sent = 0
        self.blocks_pulled = 0
        # Requests being prefilled for a decode worker (id -> decode worker id): a third of a
        # lease at a time, that worker is told their KV is still coming, so a prompt queued
        # behind long ones, or long itself, is not taken for lost (only a dead or frozen
        # prefill worker lets the reservation lapse).
        self._computing: dict[str, str] = {}
        self._stopped = threading.Event()
        threading.Thread(target=self._renew_loop, daemon=True, name="lease-renew").start()

    # ---- control API -----------------------------------------------------------------------
    def connect_decode(self, decode_id: str, peer: Any = None) -> dict:
        """Host the pair group with a decode worker; returns the address it must join.

        `peer`, if given, is the decode worker (DecodeAPI, a transport or an RPC address):
        aborts here reach it.
        """
        with self._lock:
            self._attach_peer(decode_id, peer)
            if decode_id not in self.registry:
                address = self.registry.host(decode_id)
                q: queue.Queue[_SendJob | _PullJob | None] = queue.Queue()
                self._senders[decode_id] = q
                threading.Thread(
                    target=self._send_loop,
                    args=(decode_id, q),
                    daemon=True,
                    name=f"kv-send-{decode_id}",
                ).start()
                self._addresses[decode_id] = address
            return self._addresses[decode_id]

    def disconnect_decode(self, decode_id: str) -> None:
        """Tear down the pair group (the decode worker left)."""
        self._disconnect(decode_id)

    def _disconnect(self, peer_id: str) -> None:
        with self._lock:
            q = self._senders.pop(peer_id, None)
            self._addresses.pop(peer_id, None)
            if q is not None:
                q.put(None)
        super()._disconnect(peer_id)

    def prefill(
        self,
        request: PromptRequest,
        decode_id: str | None = None,
        reservation: Reservation | None = None,
        timeout: float = 600.0,
    ) -> PrefillResult:
        """Prefill the prompt and sample its first token.

        With decode_id, the blocks from reservation.num_hit_blocks on are sent to
        reservation.dst_block_ids of that decode worker; the blocks stay held (leased) until
        ack() or the lease ends.
        """
        rid, prompt, params = request.request_id, list(request.prompt_token_ids), request.params
        retention = request.retention()
        if decode_id is not None:
            self._sender(decode_id)  # not paired (yet): fail before any prefill work
        seed = request.seed if request.seed is not None else random.getrandbits(63)
        if decode_id is not None:
            self._computing[rid] = decode_id  # its reservation is renewed until it is prefilled
        try:
            stream = self.loop.submit(
                rid,
                prompt,
                SamplingParams(**params),
                cache_salt=request.cache_salt,
                seed=seed,
                prefill_only=True,
                retention=retention,
            )
            outs = [stream.get(timeout=timeout)]  # one per choice, the last finished
            while not outs[-1].finished:
                outs.append(stream.get(timeout=timeout))
        finally:
            self._computing.pop(rid, None)
        out = next((o for o in outs if o.finish_reason != "prefilled"), outs[-1])
        if out.finish_reason != "prefilled":
            return PrefillResult(out.finish_reason, None, seed, out.num_cached_tokens, out.error)
        handoff = prefill_handoff(outs)
        first_token: int = handoff["first_tokens"][0]
        result = PrefillResult(
            out.finish_reason, first_token, seed, out.num_cached_tokens, out.error
        )
        if decode_id is None:
            self.loop.run(self.engine.release_held, rid)
            return result
        num_hit_blocks = reservation.num_hit_blocks if reservation is not None else 0
        num_blocks = -(-len(prompt) // self.engine.config.block_size)
        missing = tuple(range(num_hit_blocks, num_blocks))
        if reservation is None or len(reservation.dst_block_ids) != len(missing):
            self.loop.run(self.engine.release_held, rid)
            raise ValueError(
                f"dst_block_ids must list {len(missing)} blocks "
                f"(prompt blocks {num_hit_blocks}..{num_blocks - 1})"
            )
        try:
            sender = self._sender(decode_id)
        except UnknownPeer:  # unpaired while it prefilled
            self.loop.run(self.engine.release_held, rid)
            raise
        self.leases.grant(rid, decode_id, self.options.lease_seconds)
        cfg = self.engine.config
        hashes = tuple(
            hash_prompt_blocks(prompt, cfg.block_size, cfg.hash_seed, request.cache_salt)
        )
        sender.put(
            _SendJob(
                rid,
                decode_id,
                missing,
                tuple(reservation.dst_block_ids),
                first_token,
                {"seed": seed, "params": params, **handoff},
                len(prompt),
                hashes,
            )
        )
        return result

    def ack(self, request_id: str) -> bool:
        """The decode side has the KV: release the held blocks (they stay cached)."""
        self.leases.release(request_id)
        since = self.engine.held_since(request_id)  # when its prefill ended
        acked = time.monotonic()  # not after the release, which waits for the step in flight
        released = self.loop.run(self.engine.release_held, request_id)
        if released and since is not None:
            self.transfer_metrics.handed_over(acked - since)
        return released

    def pull_blocks(
        self,
        decode_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        timeout: float = 30.0,
    ) -> PullResult:
        """Obtain from paired decode worker decode_id the KV of the full blocks of token_ids
        this KV cache lacks (from its first miss on) and cache it (PrefillAPI.pull_blocks).

        The pull waits its turn behind the transfers queued to that worker, then each of its
        waits is bounded by the transfer timeout; `timeout` bounds the whole call (past it
        TransferTimeout, and the pull is dropped or, if under way, ends by itself).
        """
        sender = self._sender(decode_id)
        pull_id = f"pull-{uuid.uuid4().hex}"
        tokens = [int(t) for t in token_ids]
        plan = self.loop.run(self.engine.import_blocks, pull_id, tokens, cache_salt)
        if not plan.dst_block_ids:  # all cached here already, or no block free
            return PullResult(plan.num_blocks, plan.start, 0)
        run = tokens[: plan.num_blocks * self.engine.config.block_size]
        ask = PullAsk(
            pull_id, plan.block_hashes, tuple(run), cache_salt, plan.start, plan.dst_block_ids
        )
        job = _PullJob(decode_id, ask)
        sender.put(job)
        try:
            return job.result.result(timeout=timeout)
        except FutureTimeout:
            if job.claim():  # never started (queued, or left behind an unpairing): free it
                self.loop.run(self.engine.release_exchange, pull_id)
            raise TransferTimeout(
                f"pull from decode worker {decode_id!r} did not finish within {timeout}s"
            ) from None

    def abort(self, request_id: str, propagate: bool = True) -> bool:
        """Abort a prefill in progress or release a request's held blocks; with propagate,
        the decode worker it was bound for is told too."""
        lease = self.leases.release(request_id)
        found = self.loop.run(self.engine.abort, request_id)
        if propagate and lease is not None:
            self._notify_peer(
                lease.owner,
                f"abort({request_id})",
                lambda decode: decode.abort(request_id, propagate=False),
            )
        return found

    def _role_stats(self) -> dict:
        return {
            "num_held": len(self.engine.held_requests()),
            "bytes_sent": self.bytes_sent,
            "blocks_sent": self.blocks_sent,
            "blocks_pulled": self.blocks_pulled,
        }

    def shutdown(self) -> None:
        self._stopped.set()
        for decode_id in list(self._senders):
            self._disconnect(decode_id)
        super().shutdown()

    # ---- internals -------------------------------------------------------------------------
    def _renew_loop(self) -> None:
        while not self._stopped.wait(self.options.lease_seconds / 3):
            for rid, decode_id in list(self._computing.items()):
                self._notify_peer(decode_id, f"renew({rid})", operator.methodcaller("renew", rid))

    def _sender(self, decode_id: str) -> queue.Queue:
        """The send queue of a paired decode worker; UnknownPeer when there is no pair group
        with it: never paired, unpaired, or either side restarted and not re-paired yet (the
        router waits for the controller to pair them again)."""
        q = self._senders.get(decode_id)
        if q is None:
            raise UnknownPeer(
                f"prefill worker {self.worker_id!r} is not paired with decode worker "
                f"{decode_id!r} (call connect_decode first)"
            )
        return q

    def _send_loop(self, decode_id: str, jobs: queue.Queue) -> None:
        """Sends to (and pulls from) one decode worker in order (the pair's messages are
        ordered); once unpaired, pulls still queued fail and free their blocks."""
        use_device(self.engine.runner.device)
        while (job := jobs.get()) is not None:
            if isinstance(job, _PullJob):
                self._pull(job)
                continue
            try:
                self._send(job)
            except Exception as exc:  # noqa: BLE001 - the transfer failed; free its blocks
                logger.warning("transfer of %s to %s failed: %s", job.request_id, decode_id, exc)
                self.abort(job.request_id, propagate=False)  # the receiver fails it itself
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, _PullJob) and job.claim():
                self._end_pull(job, UnknownPeer(f"decode worker {decode_id!r} was unpaired"))

    def _pull(self, job: _PullJob) -> None:
        """Run one pull; its blocks are cached (it worked) or free again (it failed)."""
        if not job.claim():
            return  # the caller gave up before its turn and freed its blocks
        try:
            desc, stats = self.transfer.pull(job.decode_id, self.engine.kv_caches, job.ask)
            self.loop.run(
                self.engine.finish_import, job.ask.pull_id, job.ask.start, desc.num_blocks
            )
        except Exception as exc:  # noqa: BLE001 - a failed pull: free its blocks, recompute
            logger.warning("pull %s from %s failed: %s", job.ask.pull_id, job.decode_id, exc)
            self.transfer_metrics.pulls.failures.inc()
            self._end_pull(job, exc)
            return
        self.blocks_pulled += desc.num_blocks
        self.transfer_metrics.pulls.done(desc.num_blocks, stats.payload_bytes, stats.seconds)
        num_blocks = len(job.ask.block_hashes)
        job.result.set_result(
            PullResult(
                num_blocks, job.ask.start, desc.num_blocks, stats.payload_bytes, stats.seconds
            )
        )

    def _end_pull(self, job: _PullJob, error: Exception) -> None:
        """Free a pull's blocks uncached and hand the caller its error (a TransferError)."""
        try:
            self.loop.run(self.engine.release_exchange, job.ask.pull_id)
        except Exception as exc:  # noqa: BLE001 - the loop stopped: its blocks go with it
            logger.warning("pull %s: releasing its blocks failed: %s", job.ask.pull_id, exc)
        if not isinstance(error, TransferError):
            error = TransferError(f"pull from decode worker {job.decode_id!r} failed: {error}")
        job.result.set_exception(error)

    def _send(self, job: _SendJob) -> None:
        try:  # not through the loop: that would wait for the prefill step in flight
            held = self.engine.held_block_ids(job.request_id)
        except KeyError:
            return  # aborted or expired before its turn
        eng = self.engine
        args = eng.runner.model.args
        desc = TransferDescriptor(
            request_id=job.request_id,
            block_hashes=job.block_hashes,
            missing=job.missing,
            src_block_ids=tuple(held[i] for i in job.missing),
            dst_block_ids=job.dst_block_ids,
            layers=(0, args.num_layers),
            dtype=dtype_name(eng.runner.dtype),
            block_shape=(eng.config.block_size, args.num_kv_heads, args.head_dim),
            first_token=job.first_token,
            num_prompt_tokens=job.num_prompt_tokens,
            sampling=job.sampling,
        )
        stats = self.transfer.send(job.decode_id, eng.kv_caches, desc)
        self.bytes_sent += stats.payload_bytes
        self.transfer_metrics.sent(stats.num_blocks, stats.payload_bytes)
        self.blocks_sent += stats.num_blocks

    def _expire_leases(self) -> None:
        for lease in self.leases.expired():
            self.leases.release(lease.request_id)
            if self.engine.release_held(lease.request_id):
                logger.warning(
                    "lease of %s ran out without an ack; blocks released", lease.request_id
                )
