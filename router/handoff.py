"""One attempt's calls to its workers: the hand-over from a prefill worker to a decode worker,

    decode.reserve -> prefill.prefill (sends the missing blocks) -> decode streams tokens

or a local prefill on the decode worker (no KV moves). Workers are
kvtransfer.worker_api.PrefillAPI / DecodeAPI: in-process instances or the typed clients of
kvtransfer.worker_client (over RPC or Ray). What it yields are the router's output dicts
(TokenOutput.to_dict()); an output that blames a worker for a failure carries its id in
"failed_worker". It calls only the two workers: the router's request loop
(router/request_life.py) runs it as one step, and tests and benchmarks run it on its own.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from kvtransfer.errors import UnknownPeer
from kvtransfer.worker_api import (
    DecodeAPI,
    PrefillAPI,
    PrefillResult,
    PromptRequest,
    PullResult,
    Reservation,
)
from router.sessions import SessionHint
from router.worker_failures import PairNotReady, is_worker_failure, kv_never_arrived

logger = logging.getLogger(__name__)

# How often a request waiting for its prefill checks that the decode worker still holds its
# reservation; the calls themselves run on this pool (a frozen worker's call may outlive it).
LEASE_CHECK_S = 1.0
_PREFILL_CALLS = ThreadPoolExecutor(max_workers=256, thread_name_prefix="prefill-call")


def error_output(request_id: str, message: str, reason: str = "error") -> dict:
    """The last output of a request that failed (same keys as TokenOutput.to_dict())."""
    return {
        "request_id": request_id,
        "token_ids": [],
        "text": "",
        "finished": True,
        "finish_reason": reason,
        "num_cached_tokens": 0,
        "error": message,
        "stop_reason": None,
    }


def generate_disaggregated(
    prefill: PrefillAPI,
    decode: DecodeAPI,
    request_id: str,
    prompt_token_ids: list[int],
    params: dict,
    *,
    prefill_id: str,
    decode_id: str,
    cache_salt: str | None = None,
    timeout: float = 600.0,
    poll_s: float = 0.5,
    session: SessionHint | None = None,
) -> Iterator[dict]:
    """Yield the decode worker's output dicts for one request; the last has finished=True.

    The seed is fixed here so that both workers draw the same random stream.
    """
    params = dict(params)
    if params.get("seed") is None:
        params["seed"] = random.getrandbits(63)
    request = prompt_request(request_id, prompt_token_ids, params, cache_salt, session)
    reservation = decode.reserve(request, prefill_id)
    early: list[dict] = []  # decode outputs that came while the prefill call ran
    try:
        first = _prefill_while_leased(
            prefill, decode, request, prefill_id, decode_id, reservation, early
        )
    except _DecodeFailed as failed:  # the router blames the decode worker (request_life.watch)
        _PREFILL_CALLS.submit(prefill.abort, request_id, False)
        raise failed.error from None
    except UnknownPeer as exc:  # not paired (yet): the router waits for the controller
        decode.abort(request_id, propagate=False)
        raise PairNotReady(prefill_id, decode_id, str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - reported to the client as this request's error
        decode.abort(request_id, propagate=False)
        out = error_output(request_id, f"prefill worker {prefill_id} failed: {exc}")
        if is_worker_failure(exc):
            out["failed_worker"] = prefill_id  # the router moves the request
        yield out
        return
    if first is None:  # the reservation lapsed: the prefill worker is frozen or dead
        _PREFILL_CALLS.submit(prefill.abort, request_id, False)  # if it still answers
        out = early[-1]
        out["failed_worker"] = prefill_id
        yield out
        return
    if not first.prefilled:
        decode.abort(request_id, propagate=False)
        yield error_output(
            request_id,
            first.error or f"prefill {first.finish_reason}",
            first.finish_reason or "error",
        )
        return
    for out in early:
        out["num_cached_tokens"] = first.num_cached_tokens
    streamed = stream_outputs(decode, request_id, timeout, poll_s, first.num_cached_tokens)
    finished = bool(early) and early[-1]["finished"]
    for out in early if finished else itertools.chain(early, streamed):
        if kv_never_arrived(out, prefill_id):
            out["failed_worker"] = prefill_id
        yield out


class _DecodeFailed(Exception):
    """The decode worker's poll failed while the prefill ran (`error` says how)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


def _prefill_while_leased(
    prefill: PrefillAPI,
    decode: DecodeAPI,
    request: PromptRequest,
    prefill_id: str,
    decode_id: str,
    reservation: Reservation,
    early: list[dict],
) -> PrefillResult | None:
    """prefill.prefill(...), or None once the decode worker's reservation lapsed (its last
    output, in `early`, says so). A live prefill worker renews the reservation while it
    computes (prefill_worker: lease renewal), so a long or queued prompt may take minutes;
    a frozen or dead one stops renewing, and the request moves within about a lease instead
    of waiting out the call. Outputs the decode worker streams before the call returns (the
    KV went over first) are kept in `early`, in order."""
    call = _PREFILL_CALLS.submit(prefill.prefill, request, decode_id, reservation)
    while True:
        try:
            return call.result(timeout=LEASE_CHECK_S)
        except FutureTimeout:
            pass
        if early and early[-1]["finished"]:
            continue  # finished already (e.g. one token): only the call's result is missing
        try:
            polled = decode.poll(request.request_id, 0.0)
        except Exception as exc:
            raise _DecodeFailed(exc) from exc
        early.extend(o.to_dict() for o in polled)
        if early and kv_never_arrived(early[-1], prefill_id):
            return None


def generate_local(
    decode: DecodeAPI,
    request_id: str,
    prompt_token_ids: list[int],
    params: dict,
    *,
    cache_salt: str | None = None,
    timeout: float = 600.0,
    poll_s: float = 0.5,
    session: SessionHint | None = None,
) -> Iterator[dict]:
    """Conditional disaggregation: the decode worker prefills the prompt itself (its uncached
    tail is short), so no KV moves. Yields output dicts like generate_disaggregated."""
    decode.local_generate(prompt_request(request_id, prompt_token_ids, params, cache_salt, session))
    yield from stream_outputs(decode, request_id, timeout, poll_s)


def prompt_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: dict,
    cache_salt: str | None,
    session: SessionHint | None,
) -> PromptRequest:
    """The request as the workers see it, with its session's fields when it has one."""
    return PromptRequest(
        request_id,
        tuple(prompt_token_ids),
        params,
        cache_salt,
        session.session_id if session is not None else None,
        session.retention_seconds if session is not None else None,
    )


def pull_prefix(
    prefill: PrefillAPI,
    source_id: str,
    token_ids: list[int],
    cache_salt: str | None,
    timeout: float,
) -> PullResult | None:
    """prefill.pull_blocks(source_id, token_ids): the blocks of token_ids it lacks come from
    decode worker source_id; None when the pull failed (nothing was cached: the prefill
    computes those tokens, as without a pull). A dead prefill worker is found by the prefill
    call that follows."""
    try:
        return prefill.pull_blocks(source_id, token_ids, cache_salt, timeout)
    except Exception as exc:  # noqa: BLE001 - a failed pull only costs the recompute
        logger.warning("pull of %d tokens from %s failed: %s", len(token_ids), source_id, exc)
        return None


def stream_outputs(
    decode: DecodeAPI,
    request_id: str,
    timeout: float,
    poll_s: float,
    num_cached_tokens: int | None = None,
) -> Iterator[dict]:
    """Poll the decode worker until the request finishes or the deadline passes (abort)."""
    deadline = time.monotonic() + timeout
    while True:
        for token_output in decode.poll(request_id, poll_s):
            out = token_output.to_dict()
            if num_cached_tokens is not None:
                out["num_cached_tokens"] = num_cached_tokens
            yield out
            if out["finished"]:
                return
        if time.monotonic() > deadline:
            decode.abort(request_id)
            yield error_output(request_id, f"no completion within {timeout:.0f}s", "abort")
            return
