"""What each OpenAI-compatible server needs to answer a benchmark request with exactly
max_tokens greedy tokens, and how to tell the servers apart.

A server's kind comes from its /v1/models card (`owned_by`): "baton", "vllm", "llamacpp";
anything else is "openai" (only standard fields plus vLLM's widely copied `ignore_eos` and
`min_tokens`). Every request is greedy (temperature 0) with max_tokens; the kind adds the
fields that keep it from stopping early:
- baton: `ignore_eos`, `return_token_ids` (its extra fields are refused unless named here);
- vllm: `ignore_eos`, `min_tokens` = max_tokens, `return_token_ids`;
- llamacpp (llama-server): `ignore_eos`, `n_predict` = max_tokens, `cache_prompt` (its prompt
  cache, on by default; said so the runs cannot differ);
- openai: `ignore_eos`, `min_tokens`.
"""

from __future__ import annotations

KINDS = ("baton", "vllm", "llamacpp", "openai")
OWNERS = {"baton": "baton", "vllm": "vllm", "llamacpp": "llamacpp"}


def server_kind(models_reply: dict) -> str:
    """The kind of server whose GET /v1/models answered `models_reply`."""
    data = models_reply.get("data") or [{}]
    return OWNERS.get(str(data[0].get("owned_by", "")).lower(), "openai")


def request_fields(kind: str, max_tokens: int) -> dict:
    """The body fields beyond model, prompt, max_tokens, temperature and stream."""
    if kind == "baton":
        return {"ignore_eos": True, "return_token_ids": True}
    if kind == "vllm":
        return {"ignore_eos": True, "min_tokens": max_tokens, "return_token_ids": True}
    if kind == "llamacpp":
        return {"ignore_eos": True, "n_predict": max_tokens, "cache_prompt": True}
    if kind == "openai":
        return {"ignore_eos": True, "min_tokens": max_tokens}
    raise ValueError(f"unknown server kind {kind!r}; one of {', '.join(KINDS)}")


def chunk_tokens(choice: dict) -> list[int] | int:
    """The tokens one streamed completion choice carries: their ids where the server sends
    them (`token_ids`), else a count: 1 for a chunk that is not only the finish (servers
    without ids stream one token a chunk; its text may be empty while a character is
    incomplete), 0 for a finish-only chunk."""
    if "token_ids" in choice:
        return list(choice.get("token_ids") or ())
    if choice.get("text") or choice.get("finish_reason") is None:
        return 1
    return 0


def reconcile(chunks: list[tuple[float, int]], completion_tokens: int | None) -> None:
    """Make the chunks' token counts add up to the usage's completion_tokens where the
    server reported it: the difference goes to the last chunk (in place; a chunk left with
    no token is dropped)."""
    if completion_tokens is None or not chunks:
        return
    missing = completion_tokens - sum(n for _, n in chunks)
    if missing:
        at, n = chunks[-1]
        if n + missing > 0:
            chunks[-1] = (at, n + missing)
        else:
            chunks.pop()
