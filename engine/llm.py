"""LLM: the offline API — generate for a list of prompts, or chat with a template."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import cast

from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.options import EngineOptions
from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Runs an LLMEngine to completion over a batch of prompts."""

    def __init__(self, model: str | None = None, **engine_options) -> None:
        # Offline, the whole batch's time counts, not each prompt's first token: prompts batch
        # up to the step's token budget unless prefill_batch_tokens is given (on CPU a served
        # engine prefills them one after another; engine/scheduler.py)
        defaults = {f.name: f.default for f in dataclasses.fields(EngineOptions)}
        budget = engine_options.get("max_num_batched_tokens") or defaults["max_num_batched_tokens"]
        engine_options.setdefault("prefill_batch_tokens", budget)
        engine_options.setdefault("decode_steps_between_prompts", 0)
        self.engine = LLMEngine(model, **engine_options)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (strings need the tokenizer)."""
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise InvalidRequestError(
                    "string prompts need a tokenizer; this engine was "
                    "started with skip_tokenizer_init=True"
                )
            return self.engine.tokenizer.encode(prompt, add_special_tokens=True)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[CompletionOutput]:
        """Outputs in the order of the prompts, n per prompt (its choices in index order).
        A single prompt may be passed bare."""
        # A bare prompt (a string, or token ids) or a sequence of them: told apart at run time
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            batch = [cast(Prompt, prompts)]
        else:
            batch = list(cast("Sequence[Prompt]", prompts))
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(batch)
        if len(params) != len(batch):
            raise InvalidRequestError(f"{len(params)} SamplingParams for {len(batch)} prompts")
        engine = self.engine
        order: list[tuple[str, int]] = []  # (request id, choice index)
        state: dict[tuple[str, int], dict] = {}
        for prompt, p in zip(batch, params, strict=True):
            rid = f"llm-{next(self._ids)}"
            ids = self.encode(prompt)
            req = engine.add_request(rid, ids, p, cache_salt=cache_salt)
            for index in range(p.n):
                order.append((rid, index))
                state[rid, index] = {
                    "prompt": ids,
                    "tokens": [],
                    "text": "",
                    "lp": [],
                    "prompt_lp": None,
                    "arrival": req.arrival_time,
                    "first": None,
                    "out": None,
                }
        while engine.has_unfinished() and any(s["out"] is None for s in state.values()):
            result = engine.step()
            now = time.monotonic()
            for o in result.outputs.values():
                s = state.get((o.request_id, o.index))
                if s is None:
                    continue
                if o.new_token_ids and s["first"] is None:
                    s["first"] = now
                s["tokens"].extend(o.new_token_ids)
                s["text"] += o.new_text
                if o.logprobs:
                    s["lp"].extend(o.logprobs)
                if o.prompt_logprobs is not None:
                    s["prompt_lp"] = o.prompt_logprobs
                if o.finish_reason is not None:  # this choice ended
                    s["out"] = CompletionOutput(
                        o.request_id,
                        s["prompt"],
                        s["tokens"],
                        s["text"],
                        o.finish_reason,
                        o.num_cached_tokens,
                        (s["first"] or now) - s["arrival"],
                        now - s["arrival"],
                        o.stop_reason,
                        s["lp"] or None,
                        o.error,
                        o.index,
                        s["prompt_lp"],
                    )
        return [state[key]["out"] for key in order]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[CompletionOutput]:
        """Apply the model's chat template to one conversation (or a list) and generate."""
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise InvalidRequestError("this model has no tokenizer chat template")
        # One conversation (a list of messages) or a list of them: told apart by the first item
        if messages and isinstance(messages[0], dict):
            convs = [messages]
        else:
            convs = cast("list[list[dict]]", messages)
        prompts = [self.chat_token_ids(c, add_generation_prompt) for c in convs]
        return self.generate(prompts, params)

    def chat_token_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered through the chat template."""
        tok = self.engine.tokenizer
        if tok is None:
            raise InvalidRequestError("this model has no tokenizer chat template")
        ids = tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
