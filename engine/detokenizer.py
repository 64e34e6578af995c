"""Incremental detokenization and stop-string matching for one request."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas; finds stop strings.

    Text is re-decoded from the output ids each step; a trailing U+FFFD (an incomplete
    multi-byte character) is held back until the next token completes it.
    """

    def __init__(
        self, tokenizer, stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.text = ""  # text emitted so far
        self._ids: list[int] = []

    def prime(self, token_ids: list[int]) -> None:
        """Output ids (and their text) emitted before this detokenizer took over: a migrated
        request's earlier tokens. Later deltas continue that text; stop strings may span it."""
        self._ids = list(token_ids)
        if self.tokenizer is not None:
            self.text = self.tokenizer.decode(self._ids, skip_special_tokens=True).rstrip("\ufffd")

    def add(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Append tokens; return (new text, matched stop string or None)."""
        if self.tokenizer is None:
            return "", None
        self._ids.extend(token_ids)
        full = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return "", None
        if not full.startswith(self.text):  # a merge changed earlier text; emit nothing new
            return "", None
        delta = full[len(self.text) :]
        matched = None
        if self.stop:
            # Only text near the new delta can complete a stop string.
            longest = max(len(s) for s in self.stop)
            search_from = max(0, len(self.text) - longest + 1)
            hit = None
            for s in self.stop:
                idx = full.find(s, search_from)
                if idx != -1 and (hit is None or idx < hit[0]):
                    hit = (idx, s)
            if hit is not None:
                idx, matched = hit
                end = idx + len(matched) if self.include_stop else idx
                delta = full[len(self.text) : max(end, len(self.text))]
        self.text += delta
        return delta, matched
