"""Structured outputs (xgrammar) on a tiny random Llama with a real tokenizer: random weights,
real constraints, so every output must parse and match; the grammar's end stops the request;
a request whose grammar compiles waits while others run; a prefill engine's first token and a
migrated request's earlier tokens are replayed into the matcher of the engine that goes on."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from engine import LLM, InvalidRequestError, LLMEngine, SamplingParams
from engine.request import RequestStatus
from tests.engine.test_remote_kv import disaggregated
from tests.helpers import run_to_completion

EOS = 2
PROMPT = [1, 40, 50, 60, 70, 80]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9 ]{1,8}$"},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "count", "ok", "color"],
}
JSON = {"json": SCHEMA, "disable_any_whitespace": True}
TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<f>",
        "content": {
            "type": "json_schema",
            "json_schema": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"],
            },
        },
        "end": "</f>",
    },
}
OPTS = dict(block_size=4, chunk_size=16)


@pytest.fixture(scope="module")
def llm(tiny_llama_tok):
    return LLM(tiny_llama_tok, num_kv_blocks=256, **OPTS)


def generate(llm, spec, temperature=0.0, seed=None, max_tokens=60, **kw):
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed, structured_output=spec, **kw
    )
    return llm.generate(PROMPT, params)[0]


def stopped_by_the_grammar(out) -> None:
    assert (out.finish_reason, out.token_ids[-1], out.stop_reason) == ("stop", EOS, EOS)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 3), (1.0, 4)])
def test_json_schema_output_is_valid_json_of_the_schema(llm, temperature, seed):
    out = generate(llm, JSON, temperature, seed)
    jsonschema.validate(json.loads(out.text), SCHEMA)
    stopped_by_the_grammar(out)


@pytest.mark.parametrize("seed", [3, 4])
def test_json_object_output_is_a_json_object(llm, seed):
    # Random weights rarely close a string: the quote and brace tokens get a bias.
    quote, brace = llm.tokenizer.convert_tokens_to_ids(['"', "}"])
    out = generate(
        llm,
        {"json_object": True, "disable_any_whitespace": True},
        1.0,
        seed,
        logit_bias={quote: 8.0, brace: 8.0},
    )
    assert isinstance(json.loads(out.text), dict)
    stopped_by_the_grammar(out)


@pytest.mark.parametrize(
    "spec, check",
    [
        ({"regex": r"[a-c]{2,5}-\d{2}"}, lambda t: re.fullmatch(r"[a-c]{2,5}-\d{2}", t)),
        ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
        (
            {"grammar": 'root ::= ("hi" | "hello") " " [a-z] [a-z]? [a-z]?'},
            lambda t: re.fullmatch(r"(hi|hello) [a-z]{1,3}", t),
        ),
        (
            {"structural_tag": TAG},
            lambda t: (
                t.startswith("<f>") and t.endswith("</f>") and 0 <= json.loads(t[3:-4])["x"] <= 9
            ),
        ),
    ],
    ids=["regex", "choice", "grammar", "structural_tag"],
)
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 3), (1.0, 4)])
def test_outputs_match_their_grammar(llm, spec, check, temperature, seed):
    out = generate(llm, spec, temperature, seed)
    assert check(out.text), out.text
    stopped_by_the_grammar(out)


def test_choices_differ_across_seeds(llm):
    texts = {generate(llm, {"choice": ["yes", "no", "maybe so"]}, 1.0, s).text for s in range(8)}
    assert len(texts) > 1  # the constraint does not pin one answer: the tests above can fail


def test_max_tokens_cuts_with_length_and_a_valid_prefix(llm):
    whole = generate(llm, JSON)
    cut = generate(llm, JSON, max_tokens=5)
    assert cut.finish_reason == "length" and cut.token_ids == whole.token_ids[:5]


def test_ignore_eos_still_ends_with_the_grammar(llm):
    out = generate(llm, {"regex": r"[a-c]{2,5}-\d{2}"}, ignore_eos=True)
    assert re.fullmatch(r"[a-c]{2,5}-\d{2}", out.text)
    stopped_by_the_grammar(out)


def test_unconstrained_run_differs(llm):
    free = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert not free.text.startswith("{")  # so the constraint is what shaped the JSON above


def test_structured_output_needs_a_tokenizer(tiny_llama):
    engine = LLMEngine(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=32, **OPTS)
    with pytest.raises(InvalidRequestError, match="structured_output needs the model's tokenizer"):
        engine.add_request("r", PROMPT, SamplingParams(structured_output={"regex": "a+"}))
    engine.check_integrity()


def blocked_compiles(engine: LLMEngine) -> threading.Event:
    """Make engine's grammar compiles wait for the returned event (to order the test)."""
    gate = threading.Event()
    compile_spec = engine.grammar._compile
    engine.grammar._compile = lambda spec: (gate.wait(30), compile_spec(spec))[1]
    return gate


def test_a_compiling_request_waits_while_others_run(tiny_llama_tok):
    engine = LLMEngine(tiny_llama_tok, num_kv_blocks=64, **OPTS)
    gate = blocked_compiles(engine)
    constrained = SamplingParams(max_tokens=60, temperature=0.0, structured_output=JSON)
    engine.add_request("json", PROMPT, constrained)
    engine.add_request("free", PROMPT, SamplingParams(max_tokens=4, temperature=0.0))
    free_tokens = []
    while "free" in engine.scheduler.requests:
        result = engine.step()
        assert "json" not in result.scheduled
        free_tokens += result.outputs["free"].new_token_ids if "free" in result.outputs else []
    assert len(free_tokens) == 4
    assert engine.scheduler.requests["json"].status == RequestStatus.WAITING_FOR_GRAMMAR
    gate.set()
    tokens = run_to_completion(engine)["json"]
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert (
        tokens
        == LLM(tiny_llama_tok, num_kv_blocks=64, **OPTS).generate(PROMPT, constrained)[0].token_ids
    )
    engine.check_integrity()


def test_abort_while_compiling_frees_everything(tiny_llama_tok):
    engine = LLMEngine(tiny_llama_tok, num_kv_blocks=64, **OPTS)
    gate = blocked_compiles(engine)
    engine.add_request("json", PROMPT, SamplingParams(structured_output=JSON))
    assert engine.abort("json")
    assert engine.step().outputs["json"].finish_reason == "abort"
    gate.set()
    while engine.has_unfinished():
        assert engine.step().outputs == {}
    engine.check_integrity()
    assert engine.pool.num_free_blocks == 64


def test_preemption_keeps_the_matcher_in_step(tiny_llama_tok, llm):
    # 14 blocks of 4 tokens cannot hold three ~45-token JSON runs: requests are preempted.
    engine = LLMEngine(tiny_llama_tok, num_kv_blocks=14, enable_prefix_caching=False, **OPTS)
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_output=JSON)
        for s in (3, 4, 5)
    ]
    for i, p in enumerate(params):
        engine.add_request(str(i), PROMPT, p)
    tokens, preempted = {}, []
    while engine.has_unfinished():
        result = engine.step()
        preempted += result.preempted
        for rid, out in result.outputs.items():
            tokens.setdefault(rid, []).extend(out.new_token_ids)
    assert preempted
    for i, p in enumerate(params):
        assert tokens[str(i)] == llm.generate(PROMPT, p)[0].token_ids
    engine.check_integrity()


@pytest.mark.parametrize("cut", [1, 12])
def test_migrated_request_replays_its_earlier_tokens(llm, cut):
    whole = generate(llm, JSON, 1.0, 3)
    rest = llm.generate(
        PROMPT + whole.token_ids[:cut],
        SamplingParams(
            max_tokens=60,
            temperature=1.0,
            seed=3,
            structured_output=JSON,
            num_prior_output_tokens=cut,
        ),
    )[0]
    assert rest.token_ids == whole.token_ids[cut:]
    stopped_by_the_grammar(rest)


@pytest.mark.parametrize("decode_compiles_late", [False, True])
def test_prefill_engine_then_decode_engine_equals_one_engine(
    tiny_llama_tok, llm, decode_compiles_late
):
    specs = [JSON, {"regex": r"[a-c]{2,5}-\d{2}"}, {"structural_tag": TAG}]
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=7 + i, structured_output=s)
        for i, s in enumerate(specs)
    ]
    prompts = [PROMPT, PROMPT[:3], PROMPT + [90, 91, 92]]
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    prefill = LLMEngine(tiny_llama_tok, num_kv_blocks=128, **OPTS)
    decode = LLMEngine(tiny_llama_tok, num_kv_blocks=128, **OPTS)
    if decode_compiles_late:  # the first token arrives before the decode side's matcher
        gate = blocked_compiles(decode)
        threading.Timer(1.0, gate.set).start()
    got, _ = disaggregated(prefill, decode, prompts, params)
    assert [got[str(i)] for i in range(3)] == expected
    decode.check_integrity()
    assert decode.pool.num_free_blocks == 128


def test_decode_engine_holds_the_first_token_until_its_grammar_compiles(tiny_llama_tok, llm):
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=9, structured_output=JSON)
    expected = llm.generate(PROMPT, params)[0].token_ids
    prefill = LLMEngine(tiny_llama_tok, num_kv_blocks=64, **OPTS)
    decode = LLMEngine(tiny_llama_tok, num_kv_blocks=64, **OPTS)
    prefill.add_request("r", PROMPT, params, prefill_only=True)
    seed = prefill.seed_of("r")
    first = run_to_completion(prefill)["r"]
    assert first == expected[:1]
    gate = blocked_compiles(decode)
    dst, hits = decode.reserve_remote("r", PROMPT, params, seed)
    for s_layer, d_layer in zip(prefill.kv_caches, decode.kv_caches, strict=True):
        d_layer[:, dst] = s_layer[:, prefill.held_block_ids("r")]
    decode.complete_remote("r", first[0])
    assert decode.scheduler.requests["r"].status == RequestStatus.WAITING_FOR_GRAMMAR
    assert decode.step().scheduled == {}  # the first token's output, nothing runs
    gate.set()
    rest = run_to_completion(decode)["r"]
    assert first + rest == expected
    assert prefill.release_held("r")
    decode.check_integrity()
