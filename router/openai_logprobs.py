"""Worker logprobs in OpenAI's shapes.

A worker's output carries `logprobs`: per new token `[token_id, logprob, [[id, logprob], ...]]`
(the top list has the request's `logprobs` entries, best first); its first output may carry
`prompt_logprobs`, one such entry per prompt position (None at position 0, which has no
context). The values are the model's raw log-softmax, before temperature, penalties or any
other sampling transform. Chat gets `{"content": [{token, logprob, bytes, top_logprobs}]}`,
/v1/completions the legacy `{tokens, token_logprobs, top_logprobs, text_offset}`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece byte fallback


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE map from the printable stand-in character to the byte."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    visible += range(ord("®"), ord("ÿ") + 1)
    chars = list(visible)
    n = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


_BYTE_LEVEL = _byte_level_alphabet()


class TokenText:
    """Each token id's text and exact bytes, cached. Without a tokenizer a token's text is
    `token_id:<id>` (vLLM's spelling)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            text = f"token_id:{token_id}"
            return text, list(text.encode())
        text = self.tokenizer.decode([token_id])
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            byte = _BYTE_TOKEN.match(piece)
            if byte:
                return text, [int(byte.group(1), 16)]
            if self._byte_level and piece and all(c in _BYTE_LEVEL for c in piece):
                return text, [_BYTE_LEVEL[c] for c in piece]
        return text, list(text.encode())


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


def chat_entries(entries: list, text: TokenText) -> list[dict]:
    """Chat's `logprobs.content` items for worker entries."""
    out = []
    for token_id, logprob, top in entries:
        token, raw = text(token_id)
        out.append(
            {
                "token": token,
                "logprob": logprob,
                "bytes": raw,
                "top_logprobs": [
                    {"token": text(i)[0], "logprob": lp, "bytes": text(i)[1]} for i, lp in top
                ],
            }
        )
    return out


@dataclass(slots=True)
class LegacyLogprobs:
    """/v1/completions' logprobs of one choice, built as its tokens arrive; `offset` is the
    text position of the next token (text_offset counts the echoed prompt too)."""

    text: TokenText
    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, entries: list, prompt_ids: list[int] | None = None) -> dict:
        """Append worker entries (or, for an echoed prompt, its prompt_logprobs list beside the
        prompt's ids); returns the legacy dict of just these tokens (a stream chunk's)."""
        start = len(self.tokens)
        if prompt_ids is not None:
            for token_id, entry in zip(prompt_ids, entries, strict=False):
                if entry is None:
                    self._token(token_id, None, None)
                else:
                    self._token(token_id, entry[1], entry[2])
        else:
            for token_id, logprob, top in entries:
                self._token(token_id, logprob, top)
        return self._slice(start)

    def _token(self, token_id: int, logprob: float | None, top: list | None) -> None:
        token = self.text(token_id)[0]
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        if top is None:
            self.top_logprobs.append(None)
        else:
            # vLLM's shape: the top entries, plus the token itself when it is not among them
            ranked = {self.text(i)[0]: lp for i, lp in top}
            ranked.setdefault(token, logprob)
            self.top_logprobs.append(ranked)
        self.text_offset.append(self.offset)
        self.offset += len(token)

    def _slice(self, start: int) -> dict:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }

    def as_dict(self) -> dict:
        """All the choice's logprobs (the non-streamed reply's)."""
        return self._slice(0)
