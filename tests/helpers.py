"""Helpers that several test modules use: prompts, HF greedy reference, engine runs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from engine import LLMEngine


def random_prompts(lengths: list[int], seed: int = 1, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt)),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def run_to_completion(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for rid, out in engine.step().outputs.items():
            tokens.setdefault(rid, []).extend(out.new_token_ids)
    return tokens


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to HF q/k rows (written out independently)."""
    d = w.shape[0] // n_heads
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]  # first half of each head -> even rows
            out[h * d + 2 * i + 1] = w[h * d + d // 2 + i]  # second half -> odd rows
    return out


def generate_in_thread(
    router, request_id: str, prompt: list[int], params: dict, out: dict
) -> threading.Thread:
    """Run router.generate on a thread; out[request_id] gets its outputs or its exception."""

    def body() -> None:
        try:
            out[request_id] = list(router.generate(request_id, prompt, params))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out[request_id] = exc

    t = threading.Thread(target=body)
    t.start()
    return t


def wait_until(cond, timeout: float = 10.0) -> None:
    """Poll cond() until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def baton_deploy(address: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `baton deploy ARGS --address ADDRESS` in a new process, as a user does."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run(
        [sys.executable, "-m", "baton", "deploy", *args, "--address", address],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
