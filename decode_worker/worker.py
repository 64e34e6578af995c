"""DecodeWorker: an engine in the decode role.

For each request it reserves blocks for the whole prompt (reusing its own cached prefix),
waits ("waiting for remote KV") while a prefill worker sends the missing blocks, then joins
the running batch and streams tokens. A reservation whose KV does not arrive within the
lease, or whose transfer fails, is freed and the request fails with a clear error. While it
waits for transfers it answers a prefill worker's pulls (kvtransfer.pull) from its cached
blocks: the next turn of a conversation starts with the prompt and output it decoded. Its
public methods are kvtransfer.worker_api.DecodeAPI.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine import InvalidRequestError, SamplingParams
from engine.config import use_device
from engine.engine_loop import RequestStream
from engine.sampler import TokenLogprobs
from kvtransfer import (
    PeerLost,
    PullAsk,
    TransferDescriptor,
    TransferError,
    TransferRejected,
    TransferStats,
    TransferTimeout,
    dtype_name,
)
from kvtransfer.endpoint import TransferEndpoint
from kvtransfer.lease import LeaseError
from kvtransfer.worker_api import PromptRequest, Reservation, Role, TokenOutput

logger = logging.getLogger(__name__)

# A request's outputs wait this long after it finished for a reader: a router polls every live
# request within a second or so, so a stream still unread after this lost its router (killed,
# or restarted without the request) and is dropped with its outputs.
ORPHAN_STREAM_TTL_S = 300.0


@dataclass(frozen=True, slots=True)
class _Expected:
    """A reservation waiting for its KV."""

    prefill_id: str | None
    dst_block_ids: tuple[int, ...]  # the blocks the prefill worker must fill


def token_output(out) -> TokenOutput:
    """An engine RequestOutput as the contract's TokenOutput."""
    return TokenOutput(
        request_id=out.request_id,
        token_ids=tuple(out.new_token_ids),
        text=out.new_text,
        finished=out.finished,
        finish_reason=out.finish_reason,
        num_cached_tokens=out.num_cached_tokens,
        error=out.error,
        stop_reason=out.stop_reason,
        index=out.index,
        logprobs=None if out.logprobs is None else [lp.to_wire() for lp in out.logprobs],
        prompt_logprobs=None
        if out.prompt_logprobs is None
        else [None if lp is None else lp.to_wire() for lp in out.prompt_logprobs],
    )


class DecodeWorker(TransferEndpoint):
    """Decode role: reserve, receive KV, decode with continuous batching, stream tokens."""

    role = Role.DECODE
    peer_role = Role.PREFILL

    def __init__(
        self, worker_id: str, engine_options: dict | None = None, transfer: dict | None = None
    ) -> None:
        super().__init__(worker_id, engine_options, transfer)
        self._expect: dict[str, _Expected] = {}
        self._receiving: set[str] = set()  # requests whose blocks a transfer is writing
        self._aborted: set[str] = set()  # aborted while receiving: failed once it ends
        self._streams: dict[str, RequestStream] = {}
        self._closing = threading.Event()
        self.bytes_received = 0
        self.blocks_received = 0
        self.blocks_served = 0

    # ---- control API -----------------------------------------------------------------------
    def connect_prefill(self, prefill_id: str, address: dict, peer: Any = None) -> None:
        """Join the pair group a prefill worker hosts; `peer` is that worker (PrefillAPI, a
        transport or an RPC address): acks and aborts reach it."""
        with self._lock:
            if prefill_id in self.registry:
                return
            self.registry.join(prefill_id, address)
            self._attach_peer(prefill_id, peer)
        threading.Thread(
            target=self._receive_loop, args=(prefill_id,), daemon=True, name=f"kv-recv-{prefill_id}"
        ).start()

    def disconnect_prefill(self, prefill_id: str) -> None:
        """Tear down the pair group (the prefill worker left)."""
        self._disconnect(prefill_id)

    def reserve(self, request: PromptRequest, prefill_id: str | None = None) -> Reservation:
        """Reserve blocks for the prompt (request.seed must be set); returns the blocks the
        prefill side must fill."""
        rid = request.request_id
        self._drop_orphan_streams()
        stream = self.loop.open_stream(rid)

        def reserve() -> tuple[list[int], int, int]:
            ids, hits = self.engine.reserve_remote(
                rid,
                list(request.prompt_token_ids),
                SamplingParams(**request.params),
                request.seed,
                request.cache_salt,
                retention=request.retention(),
            )
            return ids, hits, self.engine.num_tier_blocks(rid)

        try:
            ids, hits, tier_blocks = self.loop.run(reserve)
        except Exception:
            self.loop.close_stream(rid)
            raise
        with self._lock:
            self._streams[rid] = stream
            self._expect[rid] = _Expected(prefill_id, tuple(ids[hits:]))
        self.leases.grant(rid, prefill_id or "", self.options.lease_seconds)
        return Reservation(
            num_hit_blocks=hits,
            dst_block_ids=tuple(ids[hits:]),
            num_blocks=len(ids),
            num_tier_blocks=tier_blocks,
        )

    def renew(self, request_id: str) -> bool:
        """The prefill worker is still computing the request's KV (a slow prefill is not a
        dead one): its reservation's lease starts again. False without a live lease."""
        try:
            self.leases.renew(request_id, self.options.lease_seconds)
        except LeaseError:
            return False
        return True

    def local_generate(self, request: PromptRequest) -> None:
        """Prefill locally (a short uncached tail: no transfer) and decode."""
        self._drop_orphan_streams()
        stream = self.loop.submit(
            request.request_id,
            list(request.prompt_token_ids),
            SamplingParams(**request.params),
            cache_salt=request.cache_salt,
            seed=request.seed,
            retention=request.retention(),
        )
        with self._lock:
            self._streams[request.request_id] = stream

    def poll(self, request_id: str, timeout: float = 1.0) -> list[TokenOutput]:
        """Outputs of a request since the last poll; waits up to timeout for the first one."""
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(f"unknown request {request_id!r}")
        outs = []
        try:
            outs.append(stream.get(timeout=timeout))
        except queue.Empty:
            return []
        outs += stream.drain()
        if stream.finished:
            with self._lock:
                self._streams.pop(request_id, None)
        return [token_output(o) for o in outs]

    def poll_many(
        self, request_ids: Sequence[str], timeout: float = 1.0
    ) -> tuple[list[TokenOutput], list[str]]:
        """poll() of many requests at once (DecodeAPI.poll_many): waits on the engine loop's
        outputs_ready, so one call serves every request a router streams from here."""
        ready = self.loop.outputs_ready
        deadline = time.monotonic() + timeout
        with ready:
            seen = self.loop.output_batches
            while True:
                outs, unknown = self._take_outputs(request_ids)
                left = deadline - time.monotonic()
                if outs or unknown or left <= 0 or self.loop.output_batches != seen:
                    return [token_output(o) for o in outs], unknown
                ready.wait(left)

    def wake_polls(self) -> None:
        """End the poll_many calls waiting now (DecodeAPI.wake_polls)."""
        self.loop.wake_readers()

    def _take_outputs(self, request_ids: Sequence[str]) -> tuple[list, list[str]]:
        """Every output available now of these requests, and the ids not known here."""
        outs: list = []
        unknown: list[str] = []
        finished = []
        with self._lock:
            streams = [(rid, self._streams.get(rid)) for rid in request_ids]
        for rid, stream in streams:
            if stream is None:
                unknown.append(rid)
                continue
            outs += stream.drain()
            if stream.finished:
                finished.append(rid)
        if finished:
            with self._lock:
                for rid in finished:
                    self._streams.pop(rid, None)
        return outs, unknown

    def _drop_orphan_streams(self) -> None:
        """Forget finished streams nobody read for ORPHAN_STREAM_TTL_S (checked as new
        requests come, so an idle worker keeps at most what its last requests left)."""
        horizon = time.monotonic() - ORPHAN_STREAM_TTL_S
        with self._lock:
            orphans = [
                rid
                for rid, stream in self._streams.items()
                if stream.completed_at is not None and stream.completed_at < horizon
            ]
            for rid in orphans:
                del self._streams[rid]
        if orphans:
            logger.info(
                "dropped %d finished streams nobody read (their router is gone)", len(orphans)
            )

    def abort(self, request_id: str, propagate: bool = True) -> bool:
        """Abort everywhere: free this side's blocks and tell the prefill worker."""
        with self._lock:
            reservation = self._expect.pop(request_id, None)
            if request_id in self._receiving:
                self._aborted.add(request_id)
        self.leases.release(request_id)
        found = self.loop.run(self.engine.abort, request_id)
        if propagate and reservation is not None and reservation.prefill_id is not None:
            self._notify_peer(
                reservation.prefill_id,
                f"abort({request_id})",
                lambda prefill: prefill.abort(request_id, propagate=False),
            )
        return found or reservation is not None

    def _role_stats(self) -> dict:
        return {
            "num_waiting_for_kv": len(self._expect),
            "bytes_received": self.bytes_received,
            "blocks_received": self.blocks_received,
            "blocks_served": self.blocks_served,
        }

    def shutdown(self) -> None:
        self._closing.set()
        super().shutdown()

    # ---- receiving -----------------------------------------------------------------------
    def _accept(self, desc: TransferDescriptor) -> bool:
        """Only write into blocks still reserved for exactly this transfer."""
        with self._lock:
            reservation = self._expect.get(desc.request_id)
            if reservation is None or reservation.dst_block_ids != tuple(desc.dst_block_ids):
                return False
            self._receiving.add(desc.request_id)
            return True

    def _receive_loop(self, prefill_id: str) -> None:
        use_device(self.engine.runner.device)
        while not self._closing.is_set():
            try:
                desc, stats = self.transfer.recv(
                    prefill_id, self.engine.kv_caches, wait=0.5, accept=self._accept, serve=self
                )
            except TransferTimeout as exc:
                self._fail_receiving(prefill_id, exc)  # no-op when nothing was announced yet
                continue
            except TransferRejected:
                continue
            except PeerLost:
                self._fail_receiving(prefill_id, "prefill worker left")
                return
            except (TransferError, KeyError) as exc:
                if prefill_id not in self.registry:
                    return
                self._fail_receiving(prefill_id, exc)
                continue
            self.bytes_received += stats.payload_bytes
            self.blocks_received += stats.num_blocks
            self._finish_receive(prefill_id, desc)

    def _finish_receive(self, prefill_id: str, desc: TransferDescriptor) -> None:
        rid = desc.request_id
        with self._lock:
            self._receiving.discard(rid)
            aborted = rid in self._aborted
            self._aborted.discard(rid)
            self._expect.pop(rid, None)
        self.leases.release(rid)
        if aborted:
            return  # abort() already freed it; the blocks were ours until now
        sampling = desc.sampling
        first_tokens = sampling.get("first_tokens") or [desc.first_token]
        logprobs = [
            None if lp is None else TokenLogprobs.from_wire(lp)
            for lp in sampling.get("logprobs") or []
        ]
        prompt = sampling.get("prompt_logprobs")
        prompt_logprobs = (
            None
            if prompt is None
            else [None if lp is None else TokenLogprobs.from_wire(lp) for lp in prompt]
        )
        try:
            self.loop.run(
                self.engine.complete_remote, rid, first_tokens, logprobs or None, prompt_logprobs
            )
        except KeyError:
            return
        except InvalidRequestError as exc:  # the prefill's tokens do not fit the request
            self.loop.call(self._fail_remote, rid, f"prefill worker {prefill_id}: {exc}")
            return
        self._notify_peer(prefill_id, f"ack({rid})", lambda prefill: prefill.ack(rid))

    # ---- answering pulls (kvtransfer.pull.PullServer) ------------------------------------
    def export(self, ask: PullAsk) -> TransferDescriptor:
        """Pin the cached blocks a prefill worker asks for (the leading ones held from
        ask.start on) and describe them; they stay pinned until exported()."""
        eng = self.engine
        ids = self.loop.run(
            eng.export_blocks,
            ask.pull_id,
            list(ask.token_ids),
            ask.cache_salt,
            ask.start,
            len(ask.dst_block_ids),
        )
        args = eng.runner.model.args
        try:
            return ask.describe(
                ids,
                (0, args.num_layers),
                dtype_name(eng.runner.dtype),
                (eng.config.block_size, args.num_kv_heads, args.head_dim),
            )
        except Exception:
            self.loop.run(eng.release_exchange, ask.pull_id)
            raise

    def exported(self, desc: TransferDescriptor, stats: TransferStats | None) -> None:
        """The answer to a pull ended: unpin its blocks, count it."""
        self.loop.run(self.engine.release_exchange, desc.request_id)
        if stats is None:
            self.transfer_metrics.served.failures.inc()
            return
        self.blocks_served += stats.num_blocks
        self.transfer_metrics.served.done(stats.num_blocks, stats.payload_bytes, stats.seconds)

    def _fail_receiving(self, prefill_id: str, error: object) -> bool:
        """Fail the request whose transfer from prefill_id broke; True if there was one."""
        with self._lock:
            broken = [
                rid
                for rid in self._receiving
                if self._expect.get(rid, _Expected(None, ())).prefill_id == prefill_id
                or rid in self._aborted
            ]
            for rid in broken:
                self._receiving.discard(rid)
                self._aborted.discard(rid)
                self._expect.pop(rid, None)
        self.transfer_metrics.failed(len(broken))
        for rid in broken:
            self.leases.release(rid)
            self.loop.call(
                self._fail_remote,
                rid,
                f"KV transfer from prefill worker {prefill_id} failed: {error}",
            )
        return bool(broken)

    def _fail_remote(self, request_id: str, error: str) -> None:
        try:
            self.engine.fail_remote(request_id, error)
        except KeyError:
            pass  # aborted meanwhile

    def _expire_leases(self) -> None:
        """Runs on the loop thread: free reservations whose KV never came."""
        for lease in self.leases.expired():
            with self._lock:
                if lease.request_id in self._receiving:
                    continue  # the transfer's own timeout bounds it
                self._expect.pop(lease.request_id, None)
            self.leases.release(lease.request_id)
            self.transfer_metrics.failed()
            self._fail_remote(
                lease.request_id,
                f"KV from prefill worker {lease.owner} did not "
                f"arrive within the {self.options.lease_seconds:.0f}s lease",
            )
