"""GrammarManager: structured outputs with xgrammar, for one engine.

One TokenizerInfo and one GrammarCompiler (with its cache) per engine. A request's spec is
compiled off the engine step, on a small thread pool (requests with the same spec share one
compile); until it is ready the request is not schedulable. Then a GrammarMatcher per
request whose state is exactly the request's generated tokens: sync() accepts the ones it
has not seen (a decode engine replays the prefill engine's first token, a migrated request
its earlier output) and rolls back any it saw that are no longer there, so nothing but
token ids ever has to travel. Each sampling row of a constrained request gets the bitmask of
the tokens its grammar allows next; the sampler applies the rows batched.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.errors import GrammarRejected
from engine.structured_output import StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

COMPILE_THREADS = 2  # compiles in flight at once (each may use xgrammar's own threads too)
SPEC_FUTURES = 128  # most recent specs whose compile future is shared by later requests


@dataclass(slots=True)
class _Entry:
    """One request's grammar: its compile, then its matcher and the tokens it accepted."""

    spec: StructuredOutput
    future: cf.Future
    matcher: xgr.GrammarMatcher | None = None  # once the compile is done
    accepted: list[int] = field(default_factory=list)


class GrammarManager:
    """Compiles specs, owns the matchers, fills bitmasks; called on the engine thread."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS)
        self._pool = cf.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._by_spec: OrderedDict[StructuredOutput, cf.Future] = OrderedDict()
        self._entries: dict[str, _Entry] = {}

    # ---- compiling -----------------------------------------------------------------------
    def submit(self, request_id: str, spec: StructuredOutput) -> None:
        """Start compiling request_id's spec (or share the compile of an equal spec)."""
        future = self._by_spec.get(spec)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._compile, spec)
            self._by_spec[spec] = future
            while len(self._by_spec) > SPEC_FUTURES:
                self._by_spec.popitem(last=False)
        self._by_spec.move_to_end(spec)
        self._entries[request_id] = _Entry(spec, future)

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        c = self._compiler
        match spec.kind:
            case "json":
                return c.compile_json_schema(spec.text(), **spec.json_options())
            case "json_object":
                return c.compile_json_schema(
                    '{"type": "object"}', strict_mode=False, **spec.json_options()
                )
            case "regex":
                return c.compile_regex(spec.text())
            case "choice":
                return c.compile_grammar(spec.choice_ebnf())
            case "grammar":
                return c.compile_grammar(spec.text())
            case "structural_tag":
                return c.compile_structural_tag(spec.text())
        raise ValueError(f"unknown structured_output kind {spec.kind!r}")

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._entries

    def is_ready(self, request_id: str) -> bool:
        """Whether request_id has its matcher (its compile is done and started)."""
        entry = self._entries.get(request_id)
        return entry is not None and entry.matcher is not None

    def has_compiling(self) -> bool:
        return any(e.matcher is None for e in self._entries.values())

    def take_compiled(self) -> list[tuple[str, str | None]]:
        """Requests whose compile finished since the last call: (id, None) with their matcher
        made, or (id, error message) when the compile failed (the entry is dropped)."""
        done: list[tuple[str, str | None]] = []
        for rid, entry in list(self._entries.items()):
            if entry.matcher is not None or not entry.future.done():
                continue
            exc = entry.future.exception()
            if exc is not None:
                del self._entries[rid]
                done.append((rid, f"structured_output.{entry.spec.kind}: {exc}"))
                continue
            entry.matcher = self._xgr.GrammarMatcher(entry.future.result())
            done.append((rid, None))
        return done

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds until some compile in flight finishes."""
        pending = [e.future for e in self._entries.values() if e.matcher is None]
        if pending:
            cf.wait(pending, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def fork(self, parent_id: str, child_id: str) -> None:
        """child_id gets parent_id's grammar: a fresh matcher (sync() replays its tokens),
        or, while the compile is still running, the same wait for it."""
        parent = self._entries[parent_id]
        matcher = None
        if parent.matcher is not None:
            matcher = self._xgr.GrammarMatcher(parent.future.result())
        self._entries[child_id] = _Entry(parent.spec, parent.future, matcher)

    def remove(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    # ---- matching ------------------------------------------------------------------------
    def sync(self, request_id: str, generated: Sequence[int]) -> bool:
        """Bring the matcher to exactly the `generated` tokens; True if it has terminated
        (a stop token ended the grammar). Raises GrammarRejected on a token it forbids."""
        entry = self._entries[request_id]
        matcher = _matcher(request_id, entry)
        accepted = entry.accepted
        keep = len(accepted)
        if keep > len(generated) or accepted != list(generated[:keep]):
            keep = 0
            while keep < min(len(accepted), len(generated)) and accepted[keep] == generated[keep]:
                keep += 1
            matcher.rollback(len(accepted) - keep)
            del accepted[keep:]
        for token in generated[keep:]:
            if matcher.is_terminated() or not matcher.accept_token(int(token)):
                raise GrammarRejected(
                    f"structured_output.{entry.spec.kind}: token {token} (output position "
                    f"{len(accepted)}) is not allowed by the grammar"
                )
            accepted.append(int(token))
        return matcher.is_terminated()

    def bitmask(self, request_id: str, generated: Sequence[int]) -> torch.Tensor:
        """[ceil(V / 32)] int32: the tokens the grammar allows after `generated`."""
        self.sync(request_id, generated)
        mask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        _matcher(request_id, self._entries[request_id]).fill_next_token_bitmask(mask, 0)
        return mask[0]


def _matcher(request_id: str, entry: _Entry) -> xgr.GrammarMatcher:
    """entry's matcher; matching runs only once is_ready(request_id)."""
    if entry.matcher is None:
        raise RuntimeError(f"request {request_id!r}: its grammar is still compiling")
    return entry.matcher
