"""Test helper: a Router stand-in whose outputs are given texts, tokenized by the real test
tokenizer and streamed as workers stream them (per choice `index`, finish_reason on a
choice's last output, finished on the request's last; logprobs and prompt_logprobs in the
worker contract's shape), so the doors' shaping is tested exactly."""

from __future__ import annotations

import itertools

from router.metrics import RouterMetrics
from router.readiness import PoolHealth, Readiness, readiness


def logprob_entry(token_id: int, top: int) -> list:
    """A scripted [token_id, logprob, top list]: the token at -0.25, then ids after it."""
    alternatives = [[token_id, -0.25]] + [[(token_id + k) % 512, -1.0 - k] for k in range(1, 9)]
    return [token_id, -0.25, alternatives[:top]]


class ScriptedRouter:
    """generate() streams `texts[i]` as choice i (one per requested choice, cycling), `step`
    tokens per output; every call's (prompt ids, params) is recorded in `calls`."""

    prefill: dict = {}
    decode: dict = {}
    max_model_len = 4096

    def __init__(self, tokenizer, texts: list[str], step: int = 2, finish: str = "stop"):
        self.tokenizer = tokenizer
        self.texts = texts
        self.step = step
        self.finish = finish
        self.calls: list[tuple[list[int], dict]] = []
        self.metrics = RouterMetrics()  # the door counts its error answers there

    def readiness(self) -> Readiness:
        """Always serving: one healthy decode worker, aggregated."""
        return readiness(True, PoolHealth(0, 0), PoolHealth(1, 1))

    def choice_outputs(self, index: int, text: str, params: dict) -> list[dict]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        out, shown = [], ""
        for start in range(0, len(ids), self.step):
            part = ids[: start + self.step]
            decoded = self.tokenizer.decode(part)
            o = {"index": index, "token_ids": ids[start : start + self.step]}
            o["text"], shown = decoded[len(shown) :], decoded
            if params.get("logprobs") is not None:
                o["logprobs"] = [logprob_entry(t, params["logprobs"]) for t in o["token_ids"]]
            out.append(o)
        out[-1]["finish_reason"] = self.finish
        return out

    def generate(self, request_id, prompt_token_ids, params, cache_salt=None):
        self.calls.append((list(prompt_token_ids), dict(params)))
        n = params.get("n", 1)
        texts = list(itertools.islice(itertools.cycle(self.texts), n))
        per_choice = [self.choice_outputs(i, t, params) for i, t in enumerate(texts)]
        # interleaved as an engine steps its choices together
        outputs = [o for step in itertools.zip_longest(*per_choice) for o in step if o]
        if params.get("prompt_logprobs") is not None:
            top = params["prompt_logprobs"]
            outputs[0]["prompt_logprobs"] = [None] + [
                logprob_entry(t, top) for t in prompt_token_ids[1:]
            ]
        for i, o in enumerate(outputs):
            last = i == len(outputs) - 1
            yield {
                "text": "",
                "finish_reason": None,
                **o,
                "finished": last,
                "num_cached_tokens": 4,
                "error": None,
                **({"prefill_worker": "p0", "decode_worker": "d0"} if last else {}),
            }

    def abort(self, request_id: str) -> bool:
        return False
