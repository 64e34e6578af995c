"""SamplingParams: the new fields' normal forms, and errors that name the field."""

from __future__ import annotations

import msgpack
import pytest

from engine import InvalidRequestError, SamplingParams
from engine.sampler import TokenLogprobs
from engine.structured_output import StructuredOutput
from kvtransfer.worker_api import TokenOutput, from_wire, to_wire


def test_logit_bias_dict_becomes_sorted_pairs():
    p = SamplingParams(logit_bias={"7": 1, 3: -2.5})
    assert p.logit_bias == ((3, -2.5), (7, 1.0))
    assert SamplingParams(logit_bias=[[7, 1], [3, -2.5]]).logit_bias == p.logit_bias
    assert SamplingParams(logit_bias=p.logit_bias) == p


def test_structured_output_from_dict_is_hashable_and_round_trips():
    spec = {
        "json": {"type": "object", "properties": {"b": {}, "a": {}}},
        "disable_any_whitespace": True,
    }
    p = SamplingParams(structured_output=spec)
    so = p.structured_output
    assert isinstance(so, StructuredOutput) and so.kind == "json"
    assert so.json == '{"type": "object", "properties": {"b": {}, "a": {}}}'  # key order kept
    assert StructuredOutput.of(so.to_dict()) == so and hash(so) == hash(StructuredOutput.of(spec))
    assert SamplingParams(structured_output={"choice": ["a", "b"]}).structured_output.choice == (
        "a",
        "b",
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(presence_penalty=2.5), "sampling.presence_penalty=2.5"),
        (dict(frequency_penalty=-3), "sampling.frequency_penalty=-3"),
        (dict(repetition_penalty=0.0), "sampling.repetition_penalty=0.0"),
        (dict(logit_bias={"x": 1}), "sampling.logit_bias key 'x'"),
        (dict(logit_bias={5: 101}), r"sampling.logit_bias\[5\]=101"),
        (dict(logit_bias={-1: 1}), "sampling.logit_bias key -1"),
        (dict(logit_bias="5:1"), "sampling.logit_bias must map"),
        (dict(min_tokens=17), "sampling.min_tokens=17"),
        (dict(min_tokens=-1), "sampling.min_tokens=-1"),
        (dict(logprobs=21), "sampling.logprobs=21"),
        (dict(prompt_logprobs=-1), "sampling.prompt_logprobs=-1"),
        (dict(n=0), "sampling.n=0"),
        (dict(n=2, max_tokens=4, num_prior_output_tokens=1), "sampling.n=2"),
        (dict(structured_output={"regex": "[a-"}), "structured_output.regex: invalid regex: "),
        (
            dict(structured_output={"json": {"type": "bogus"}}),
            "structured_output.json: invalid JSON schema: Unsupported type",
        ),
        (dict(structured_output={"json": "{not json"}), "structured_output.json: is not valid"),
        (
            dict(structured_output={"grammar": "root ::= missing"}),
            "structured_output.grammar: invalid grammar: .*missing",
        ),
        (
            dict(structured_output={"structural_tag": {"type": "nope"}}),
            "structured_output.structural_tag: invalid structural tag",
        ),
        (dict(structured_output={"choice": []}), "structured_output.choice: must be"),
        (dict(structured_output={"regex": "a", "choice": ["a"]}), "exactly one of"),
        (dict(structured_output={}), "exactly one of"),
        (dict(structured_output={"regexp": "a"}), r"unknown field\(s\) \['regexp'\]"),
        (dict(structured_output="a+"), "structured_output must be an object"),
    ],
)
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_token_output_dict_carries_logprobs_index_and_prompt_logprobs():
    lp = TokenLogprobs(5, -0.25, ((5, -0.25), (9, -1.5)))
    assert lp.to_wire() == [5, -0.25, [[5, -0.25], [9, -1.5]]]
    assert TokenLogprobs.from_wire(lp.to_wire()) == lp
    out = TokenOutput(
        "r", (5,), "", False, "stop", 0, index=2, logprobs=[lp.to_wire()],
        prompt_logprobs=[None, [3, -2.0, []]],
    )  # fmt: skip
    d = out.to_dict()
    assert (d["index"], d["logprobs"], d["prompt_logprobs"]) == (
        2,
        [[5, -0.25, [[5, -0.25], [9, -1.5]]]],
        [None, [3, -2.0, []]],
    )
    wire = msgpack.unpackb(msgpack.packb(to_wire(out)), raw=False)
    assert from_wire(TokenOutput, wire) == out
