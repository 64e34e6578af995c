"""One request's hand-over from a prefill worker to a decode worker (the router's core step).

    decode.reserve -> prefill.prefill (sends the missing blocks) -> decode streams tokens

Workers are kvtransfer.worker_api.PrefillAPI / DecodeAPI: in-process instances or the typed
clients of kvtransfer.worker_client (over RPC or Ray). What it yields are the router's output
dicts (TokenOutput.to_dict()).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

from kvtransfer.errors import UnknownPeer
from kvtransfer.worker_api import DecodeAPI, PrefillAPI, PromptRequest
from router.migration import PairNotReady, is_worker_failure


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
) -> Iterator[dict]:
    """Yield the decode worker's output dicts for one request; the last has finished=True.

    The seed is fixed here so that both workers draw the same random stream.
    """
    params = dict(params)
    if params.get("seed") is None:
        params["seed"] = random.getrandbits(63)
    request = PromptRequest(request_id, tuple(prompt_token_ids), params, cache_salt)
    reservation = decode.reserve(request, prefill_id)
    try:
        first = prefill.prefill(request, decode_id, reservation)
    except UnknownPeer as exc:  # not paired (yet): the router waits for the controller
        decode.abort(request_id, propagate=False)
        raise PairNotReady(prefill_id, decode_id, str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - reported to the client as this request's error
        decode.abort(request_id, propagate=False)
        out = error_output(request_id, f"prefill worker {prefill_id} failed: {exc}")
        if is_worker_failure(exc):
            out["failed_worker"] = prefill_id  # the router moves the request (router/migration)
        yield out
        return
    if not first.prefilled:
        decode.abort(request_id, propagate=False)
        yield error_output(
            request_id, first.error or f"prefill {first.finish_reason}", first.finish_reason
        )
        return
    for out in stream_outputs(decode, request_id, timeout, poll_s, first.num_cached_tokens):
        if kv_never_arrived(out, prefill_id):
            out["failed_worker"] = prefill_id
        yield out


def kv_never_arrived(out: dict, prefill_id: str) -> bool:
    """Whether the decode worker failed the request before its first token because the KV
    from prefill_id broke or did not come within the lease (its error names that worker)."""
    return (
        out["finish_reason"] == "error"
        and not out["token_ids"]
        and f"prefill worker {prefill_id}" in (out["error"] or "")
    )


def generate_local(
    decode: DecodeAPI,
    request_id: str,
    prompt_token_ids: list[int],
    params: dict,
    *,
    cache_salt: str | None = None,
    timeout: float = 600.0,
    poll_s: float = 0.5,
) -> Iterator[dict]:
    """Conditional disaggregation: the decode worker prefills the prompt itself (its uncached
    tail is short), so no KV moves. Yields output dicts like generate_disaggregated."""
    decode.local_generate(PromptRequest(request_id, tuple(prompt_token_ids), params, cache_salt))
    yield from stream_outputs(decode, request_id, timeout, poll_s)


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
