"""EngineOptions: the one definition of every engine option (name, type, default, description,
bounds), torch-free so that the manifest schema and `baton serve` can derive their fields from it.

`option()` declares a dataclass field with its description and rules in `metadata`;
`check_options()` enforces those rules. EngineConfig (engine/config.py) adds the torch side;
deploy/manifest.py builds its pydantic fields from `dataclasses.fields(EngineOptions)`.
No `from __future__ import annotations` here: a field's `type` must be the type itself.
"""

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # engine/config.py maps them to torch dtypes
# gguf_isa values; engine/model/gguf_kernel.py maps each but auto to its kernels
GGUF_ISA_NAMES = ("auto", "avx2", "avxvnni", "avx512", "avx512vnni", "amx")
KV_TIER_NAMES = ("none", "host", "disk")  # "none" and engine/kv_tier's TIERS
RULES = ("ge", "gt", "le", "min_length", "choices")  # metadata keys that validate a value
_COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le}


def option(
    default: Any,
    description: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    min_length: int | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A dataclass field whose metadata holds its description and validation rules (None
    always passes the rules: it means "derive the value")."""
    rules = {"ge": ge, "gt": gt, "le": le, "min_length": min_length, "choices": choices}
    metadata = {"description": description} | {k: v for k, v in rules.items() if v is not None}
    return dataclasses.field(default=default, metadata=metadata)


def _problem(field: dataclasses.Field, value: Any) -> str | None:
    """What is wrong with `value` for this field, by its metadata rules; None if nothing."""
    meta = field.metadata
    if value is None:
        return None
    if "choices" in meta:
        return None if value in meta["choices"] else f"choose {', '.join(meta['choices'])}"
    if "min_length" in meta:
        n = meta["min_length"]
        ok = isinstance(value, str) and len(value) >= n
        return None if ok else f"must be a string of at least {n} character(s)"
    limits = [
        (op, meta[key]) for key, op in (("ge", ">="), ("gt", ">"), ("le", "<=")) if key in meta
    ]
    if not limits:
        return None
    integer = field.type in (int, int | None)
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    ok = ok and not isinstance(value, bool) and all(_COMPARE[op](value, x) for op, x in limits)
    kind = "an integer" if integer else "a number"
    return None if ok else f"must be {kind} " + " and ".join(f"{op} {x}" for op, x in limits)


def check_options(options: Any, error: type[Exception]) -> None:
    """Raise `error` naming the first field of a dataclass instance that breaks its rules."""
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        problem = _problem(field, value)
        if problem is not None:
            raise error(f"{field.name}={value!r} is invalid: {problem}")


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Options of one engine. Unset capacity values are derived from the model at start-up."""

    model: str = option(
        "smollm2-135m-instruct",
        "model alias, Hugging Face directory (config.json + *.safetensors) or .gguf file",
    )
    dtype: str = option(
        "auto",
        "weights and KV dtype (auto: float32 on CPU, bfloat16 on CUDA)",
        choices=("auto", *DTYPE_NAMES),
    )
    device: str = option("auto", "torch device (auto: cuda if available, else cpu)")
    block_size: int = option(16, "tokens per KV block", ge=1, le=256)
    num_kv_blocks: int | None = option(
        None, "KV capacity in blocks (default: from kv_cache_memory_gb)", ge=1
    )
    kv_cache_memory_gb: float = option(2.0, "KV budget in GiB when num_kv_blocks is not set", gt=0)
    chunk_size: int = option(1024, "most prefill tokens one request gets in a step", ge=1)
    max_num_batched_tokens: int = option(2048, "all tokens (prefill + decode) in one step", ge=1)
    prefill_batch_tokens: int | None = option(
        None,
        "once a step carries this many prompt tokens no other prompt joins it (one prompt's "
        "chunk still takes up to chunk_size; the next prompt gets at most what is left): "
        "batching prompts past a compute-bound step only holds back the earlier prompts' first "
        "tokens. Default: 32 on CPU, no limit on CUDA; the offline LLM: max_num_batched_tokens "
        "(the batch's throughput, not each prompt's first token)",
        ge=1,
    )
    decode_steps_between_prompts: int | None = option(
        None,
        "while requests decode, a waiting prompt starts only after this many decode-only "
        "steps since the last step with prompt tokens: prompt steps alternate with decode "
        "steps, so running streams never wait out two prompts in a row, and a closed-loop "
        "client's streams, which finish on consecutive steps, do not queue their next prompts "
        "behind each other every round. Default: 1 on CPU, 0 on CUDA; the offline LLM: 0",
        ge=0,
    )
    max_num_seqs: int = option(128, "most running requests per engine", ge=1)
    max_n: int = option(8, "most choices (sampling n) one request may ask for", ge=1)
    max_model_len: int | None = option(
        None, "longest prompt + output (default: the model's max_position_embeddings)", ge=2
    )
    enable_prefix_caching: bool = option(True, "reuse cached full blocks by chained hash")
    hash_seed: str = option(
        "baton",
        "seed of the block hash chain (router and workers must agree)",
        min_length=1,
    )
    kv_tier: str = option(
        "none",
        "a KV tier below the KV cache: blocks evicted from it are kept in host memory (host) "
        "or in kv_tier_path (disk), and a prefix hit loads them back instead of recomputing "
        "them",
        choices=KV_TIER_NAMES,
    )
    kv_tier_bytes: int = option(
        4 * 2**30, "capacity of the KV tier in bytes (disk: block files, headers included)", ge=1
    )
    kv_tier_write_queue_bytes: int = option(
        512 * 2**20,
        "host memory for blocks waiting to be written to the KV tier (an eviction burst past "
        "it drops blocks, counted in kv_tier_dropped_writes)",
        ge=1,
    )
    kv_tier_path: str | None = option(
        None,
        "directory of the disk KV tier, one per engine (locked while open; kept across "
        "restarts, re-indexed on start-up); in a cluster the parent directory: each worker "
        "uses <kv_tier_path>/<worker id>",
        min_length=1,
    )
    max_retention_seconds: float = option(
        600.0,
        "most retention_seconds a request may ask for: the blocks of its session (prompt and "
        "output) are evicted only when no other cached block is left, until that long after "
        "the session's last request finished (0: no retention)",
        ge=0,
    )
    skip_tokenizer_init: bool = option(
        False, "load no tokenizer: clients send prompt_token_ids and get token ids back"
    )
    seed: int = option(0, "seeds the per-request seeds of requests that do not set one")
    attention_backend: str = option(
        "auto", "torch, cpu or triton (auto: triton on CUDA; on CPU cpu where its C kernel builds)"
    )
    num_threads: int | None = option(
        None, "torch intra-op threads on CPU (default: leave as is)", ge=1
    )
    use_gguf_blocks: bool = option(
        True,
        "CPU float32 with a model converted from a GGUF: batches of up to 8 rows multiply "
        "from its Q4_1 / Q8_0 blocks (the same weights, a fraction of the bytes to read)",
    )
    int8_activations: bool = option(
        False,
        "opt-in, changes the arithmetic (not bit-exact with the float32 model): products of up "
        "to 8 rows from GGUF blocks (decode) quantize the activations to int8 per 32 values, "
        "like llama.cpp's Q8_1, and sum integer dot products (faster batch-1 decode). Only CPU "
        "float32 with a model converted from a GGUF (use_gguf_blocks on); elsewhere an error. "
        "Batches above 8 rows (prefill) stay float32, so tokens can depend on how a prompt "
        "is split into steps (prefix cache hits, chunking); decode-only steps that run fused "
        "(fused_decode) quantize at any row count",
    )
    fused_decode: bool = option(
        True,
        "CPU float32 with GGUF blocks: a step of up to 1,024 tokens (decode rows and prompt "
        "chunks; with int8_activations decode rows only) runs the whole decoder stack and "
        "the logits in one C call, each weight read once per step (a row's numbers do not "
        "depend on the other rows of its step); off: the per-operation path for every step "
        "(A/B runs)",
    )
    gguf_isa: str = option(
        "auto",
        "instruction set of the GGUF block kernels (A/B runs): auto picks by cpuid (AVX-512 "
        "for float32 Q4_1 rows of one-row products and of fused decode steps, Q8_0 rows too "
        "where AMX is on, AMX tiles for every product of a fused step of 9 rows or more, the "
        "fastest int8 kernel); avx2 forces "
        "AVX2 everywhere; avx512 and avx512vnni force AVX-512 (float32, no AMX) and AVX-512 "
        "VNNI (int8); amx forces AVX-512 with AMX; avxvnni forces AVX-VNNI (int8) and AVX2 "
        "(float32); one this CPU lacks is an error at start",
        choices=GGUF_ISA_NAMES,
    )
    itl_target_ms: float | None = option(
        None,
        "dynamic chunking: each step's prefill tokens are chosen so that the predicted step "
        "time, plus the recent gaps between steps, stays within this many ms (chunk_size then "
        "does not apply; a waiting prompt still gets one block per step, with a warning when "
        "even that is predicted over the target); unset: decode_stretch, else fixed chunk_size",
        gt=0,
    )
    decode_stretch: float = option(
        0.0,
        "a step-time budget relative to the decode step: a step that carries prefill "
        "chunks beside running decodes is planned (from the step-time profile, corrected "
        "online) to take at most this many times the same step without them, so an arriving "
        "prompt stretches the running streams' inter-token time by at most this factor (a "
        "waiting prompt still gets one block per step); chunks stay within chunk_size, and a "
        "step without decodes takes chunk_size tokens. 0 (default): off, fixed chunk_size (on "
        "CPU a prompt's tokens cost about the same however they are split into steps, so a "
        "low factor lowers ITL p99 but raises ITL p50 and costs throughput); itl_target_ms, "
        "when set, replaces it",
        ge=0,
    )
    step_profile: str | None = option(
        None,
        "step-time profile JSON for itl_target_ms and decode_stretch (`baton profile` "
        "writes one to $BATON_PROFILE_DIR; default: the shipped profile of this model, dtype, "
        "device and threads, else a built-in guess; either is corrected online from measured "
        "steps)",
        min_length=1,
    )

    def __post_init__(self) -> None:
        check_options(self, InvalidRequestError)
        if self.int8_activations:
            problem = (
                "use_gguf_blocks is off"
                if not self.use_gguf_blocks
                else f"dtype is {self.dtype}"
                if self.dtype not in ("auto", "float32")
                else f"device is {self.device}"
                if self.device.startswith("cuda")
                else None
            )
            if problem:
                raise InvalidRequestError(
                    f"int8_activations needs CPU float32 with GGUF blocks, but {problem}"
                )
        if self.kv_tier == "disk" and self.kv_tier_path is None:
            raise InvalidRequestError("kv_tier_path is required when kv_tier is disk")
        if self.kv_tier != "none" and not self.enable_prefix_caching:
            raise InvalidRequestError(
                f"kv_tier={self.kv_tier!r} needs enable_prefix_caching (tiers key blocks by hash)"
            )
        if 0 < self.decode_stretch <= 1:
            raise InvalidRequestError(
                f"decode_stretch {self.decode_stretch} must be 0 (off) or above 1 (a step "
                "with prefill may take that many times the decode-only step)"
            )
        if self.chunk_size > self.max_num_batched_tokens:
            raise InvalidRequestError(
                f"chunk_size {self.chunk_size} exceeds max_num_batched_tokens "
                f"{self.max_num_batched_tokens}"
            )
