"""One request's hand-over from a prefill worker to a decode worker (the router's core step).

    decode.reserve -> prefill.prefill (sends the missing blocks) -> decode streams tokens

Workers are any objects with the PrefillWorker / DecodeWorker control methods: in-process
instances, kvtransfer.control.RpcClient proxies, or Ray actor wrappers.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any


def error_output(request_id: str, message: str, reason: str = "error") -> dict:
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
    prefill: Any,
    decode: Any,
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
    reservation = decode.reserve(
        request_id, prompt_token_ids, params, params["seed"], cache_salt, prefill_id
    )
    try:
        first = prefill.prefill(
            request_id,
            prompt_token_ids,
            params,
            cache_salt,
            decode_id,
            reservation["num_hit_blocks"],
            reservation["dst_block_ids"],
        )
    except Exception as exc:  # noqa: BLE001 - reported to the client as this request's error
        decode.abort(request_id, propagate=False)
        yield error_output(request_id, f"prefill worker {prefill_id} failed: {exc}")
        return
    if first["finish_reason"] != "prefilled":
        decode.abort(request_id, propagate=False)
        yield error_output(
            request_id,
            first["error"] or f"prefill {first['finish_reason']}",
            first["finish_reason"],
        )
        return
    yield from stream_outputs(decode, request_id, timeout, poll_s, first["num_cached_tokens"])


def generate_local(
    decode: Any,
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
    decode.local_generate(request_id, prompt_token_ids, params, cache_salt, params.get("seed"))
    yield from stream_outputs(decode, request_id, timeout, poll_s)


def stream_outputs(
    decode: Any,
    request_id: str,
    timeout: float,
    poll_s: float,
    num_cached_tokens: int | None = None,
) -> Iterator[dict]:
    """Poll the decode worker until the request finishes or the deadline passes (abort)."""
    deadline = time.monotonic() + timeout
    while True:
        for out in decode.poll(request_id, poll_s):
            if num_cached_tokens is not None:
                out["num_cached_tokens"] = num_cached_tokens
            yield out
            if out["finished"]:
                return
        if time.monotonic() > deadline:
            decode.abort(request_id)
            yield error_output(request_id, f"no completion within {timeout:.0f}s", "abort")
            return
