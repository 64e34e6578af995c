"""Workloads are deterministic from the seed and have the structure they promise: agentic turns
extend the previous prompt exactly, prefix-repetition shares exactly K prefixes, trace replay
maps equal hash ids to equal token blocks; arrivals follow vLLM's gamma semantics."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

from perf.bench.arrivals import arrival_times
from perf.bench.oracle import OracleCache
from perf.bench.workloads import (
    AgenticWorkload,
    AgentWorkload,
    LongPromptWorkload,
    PrefixRepetitionWorkload,
    RandomWorkload,
    TokenSpace,
    TraceWorkload,
    make_workload,
    replay,
    stand_in_answer,
)

TOKENS = TokenSpace(low=3, high=512, exclude=frozenset({7}))
SMALL = [
    AgenticWorkload(num_tenants=3, system_len=20, tools_len=12, user_len=6, output_len=4),
    PrefixRepetitionWorkload(num_prefixes=3, prefix_len=16, suffix_len=5, output_len=3),
    RandomWorkload(input_len=20, output_len=3, range_ratio=0.5),
    LongPromptWorkload(chat_len=10, long_min=60, long_max=80, long_every=5),
]


@pytest.mark.parametrize("workload", SMALL, ids=lambda w: type(w).__name__)
def test_deterministic_from_seed(workload):
    a, b = replay(workload, TOKENS, 1, 15), replay(workload, TOKENS, 1, 15)
    assert len(a) == 15 and a == b
    assert [s.prompt_token_ids for s in replay(workload, TOKENS, 2, 15)] != [
        s.prompt_token_ids for s in a
    ]
    assert len({s.request_id for s in a}) == 15
    ids = [t for s in a for t in s.prompt_token_ids]
    assert min(ids) >= 3 and max(ids) < 512 and 7 not in ids


def test_agentic_turn_extends_previous_prompt_and_answer_exactly():
    w = SMALL[0]
    specs = replay(w, TOKENS, 0, 40)
    by_session = itertools.groupby(specs, key=lambda s: s.session)
    multi = 0
    for _, turns in by_session:
        turns = list(turns)
        assert [t.turn for t in turns] == list(range(len(turns)))
        assert 2 <= len(turns) <= 6 or turns[-1] is specs[-1]
        for prev, cur in itertools.pairwise(turns):
            multi += 1
            head = prev.prompt_token_ids + tuple(stand_in_answer(prev, TOKENS, 0))
            assert cur.prompt_token_ids[: len(head)] == head
            assert 3 <= len(cur.prompt_token_ids) - len(head) <= 9  # a user turn of ~6
    assert multi > 5
    # sessions of one tenant share system prompt + tools (32 tokens), other tenants do not
    firsts = [s for s in specs if s.turn == 0]
    for x, y in itertools.combinations(firsts, 2):
        same = x.prompt_token_ids[:32] == y.prompt_token_ids[:32]
        assert same == (x.tenant == y.tenant)
    # the next turn needs the real answer
    session = next(iter(w.sessions(TOKENS, 0)))
    session.next_turn(None)
    with pytest.raises(ValueError, match="needs the answer"):
        session.next_turn(None)


def test_prefix_repetition_shares_exactly_k_prefixes():
    w = SMALL[1]
    specs = replay(w, TOKENS, 0, 12)
    prefixes = [s.prompt_token_ids[:16] for s in specs]
    assert len(set(prefixes)) == 3
    for rnd in range(4):  # every round of K uses each prefix once
        assert len(set(prefixes[rnd * 3 : rnd * 3 + 3])) == 3
    assert len({s.prompt_token_ids[16:] for s in specs}) == 12
    assert all(len(s.prompt_token_ids) == 21 for s in specs)
    # an infinite cache hits the 16-token prefix (4 blocks of 4) of all but the first K
    oracle = OracleCache(4)
    hits = [oracle.lookup_and_insert(s.prompt_token_ids) for s in specs]
    assert hits == [0, 0, 0] + [16] * 9


def test_random_shares_nothing_and_long_prompts_arrive_mid_stream():
    oracle = OracleCache(4)
    assert (
        sum(oracle.lookup_and_insert(s.prompt_token_ids) for s in replay(SMALL[2], TOKENS, 0, 30))
        == 0
    )
    specs = replay(SMALL[3], TOKENS, 0, 15)
    assert [i for i, s in enumerate(specs) if s.kind == "long"] == [2, 7, 12]
    for s in specs:
        n = len(s.prompt_token_ids)
        assert 60 <= n <= 80 if s.kind == "long" else 5 <= n <= 15


def test_trace_replay_maps_equal_hash_ids_to_equal_blocks(tmp_path):
    rows = [
        dict(timestamp=1000, input_length=8, output_length=2, hash_ids=[0, 1]),
        dict(timestamp=1500, input_length=10, output_length=3, hash_ids=[0, 1, 2]),
        dict(timestamp=3000, input_length=6, output_length=1, hash_ids=[3]),
        dict(timestamp=3100, input_length=7, output_length=1, hash_ids=[2, 1]),
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    w = TraceWorkload(path=str(path), block_len=4, time_scale=2.0)
    specs = replay(w, TOKENS, 0, 100)
    assert [s.arrival_s for s in specs] == [0.0, 1.0, 4.0, 4.2]
    assert [len(s.prompt_token_ids) for s in specs] == [8, 10, 6, 7]
    assert [s.max_tokens for s in specs] == [2, 3, 1, 1]
    p = [s.prompt_token_ids for s in specs]
    assert p[1][:8] == p[0]  # hash ids 0, 1 again
    assert p[3][:2] == p[1][8:10]  # hash id 2 (cut to 2 tokens in line 2) opens line 4
    assert p[3][4:7] == p[0][4:7]  # then hash id 1
    assert p[2][:4] not in (p[0][:4], p[0][4:8], p[3][:4])  # hash id 3 is new
    assert replay(w, TOKENS, 0, 100) == specs
    oracle = OracleCache(4)
    assert [oracle.lookup_and_insert(x) for x in p] == [0, 8, 0, 0]


def test_trace_conversations_replay_aiperf_multi_turn_rows(tmp_path):
    """aiperf's multi-turn rows (`aiperf synthesize agentic-code`): a session's first line has
    the timestamp, the others a delay after the previous answer and only their new tokens."""
    rows = [
        dict(session_id="s-b", input_length=8, output_length=2, hash_ids=[0, 1], timestamp=400),
        dict(timestamp=100, input_length=4, output_length=1, hash_ids=[5]),
        dict(session_id="s-a", input_length=6, output_length=3, hash_ids=[0, 2], timestamp=0),
        dict(session_id="s-b", input_length=3, output_length=2, hash_ids=[3], delay=1500),
        dict(session_id="s-a", input_length=4, output_length=1, hash_ids=[4], delay=250),
        dict(session_id="s-b", input_length=5, output_length=2, hash_ids=[6, 7], delay=10),
    ]
    path = tmp_path / "agentic.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    w = TraceWorkload(path=str(path), block_len=4, time_scale=2.0, retention_seconds=30.0)
    assert w.has_conversations()
    specs = replay(w, TOKENS, 0, 100)
    # in arrival order: s-a (t=0), the one-shot line (t=100 ms), s-b (t=400 ms)
    assert [(s.session, s.turn) for s in specs] == [
        ("t2", 0),
        ("t2", 1),
        ("t1", 0),
        ("t0", 0),
        ("t0", 1),
        ("t0", 2),
    ]
    assert [s.arrival_s for s in specs] == [0.0, None, 0.2, 0.8, None, None]
    assert [s.think_s for s in specs] == [0.0, 0.5, 0.0, 0.0, 3.0, 0.02]
    assert [s.session_id for s in specs] == ["s-a", "s-a", None, "s-b", "s-b", "s-b"]
    assert [s.retention_seconds for s in specs] == [30.0, 30.0, None, 30.0, 30.0, 30.0]
    a0, a1, one, b0, b1, b2 = (s.prompt_token_ids for s in specs)
    answer = {i: tuple(stand_in_answer(specs[i], TOKENS, 0)) for i in range(6)}
    # turn k = turn k-1's prompt + its answer + the line's own input_length tokens
    assert a1 == a0 + answer[0] + a1[-4:] and len(a1) == 6 + 3 + 4
    assert b1 == b0 + answer[3] + b1[-3:] and b2 == b1 + answer[4] + b2[-5:]
    assert a0[:4] == b0[:4]  # hash id 0 opens both conversations
    assert len(one) == 4 and one[:4] != a0[:4]
    oracle = OracleCache(4)
    hits = [oracle.lookup_and_insert(p) for p in (a0, a1, one, b0, b1, b2)]
    assert hits == [0, 4, 0, 4, 8, 12]  # each turn hits its history's full blocks


def test_trace_conversation_ends_before_passing_max_context(tmp_path):
    rows = [dict(session_id="s", input_length=6, output_length=2, hash_ids=[k]) for k in range(4)]
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    specs = replay(TraceWorkload(path=str(path), block_len=8, max_context=20), TOKENS, 0, 100)
    # 6 + 2 = 8 positions, then 8 + 6 + 2 = 16; a third turn would need 24 > 20
    assert [len(s.prompt_token_ids) for s in specs] == [6, 14]


def test_make_workload_options():
    w = make_workload("long-prompt", {"long_min": "100", "long_every": "6"})
    assert (w.long_min, w.long_every, w.long_max) == (100, 6, 8000)
    assert make_workload("trace", {"path": "x.jsonl", "time_scale": "0.5"}).time_scale == 0.5
    with pytest.raises(ValueError, match="no option 'nope'"):
        make_workload("random", {"nope": "1"})
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("chatty")


def test_arrivals_follow_vllm_gamma_semantics():
    assert list(itertools.islice(arrival_times(math.inf), 5)) == [0.0] * 5
    a = list(itertools.islice(arrival_times(4.0, 1.0, seed=3), 20001))
    assert a == list(itertools.islice(arrival_times(4.0, 1.0, seed=3), 20001))
    assert a[0] == 0.0
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)  # mean gap 1 / rate
    assert gaps.var() == pytest.approx(0.25**2, rel=0.06)  # Poisson: var = mean^2
    bursty = np.diff(list(itertools.islice(arrival_times(4.0, 0.25, seed=3), 20001)))
    assert bursty.mean() == pytest.approx(0.25, rel=0.06)
    assert bursty.var() == pytest.approx(0.25**2 / 0.25, rel=0.12)  # var = mean^2 / shape
    with pytest.raises(ValueError, match="rate"):
        next(arrival_times(0.0))


# ---- the multi-turn agent workload -----------------------------------------------------------
AGENT = AgentWorkload(
    system_len=24,
    tools_len=16,
    task_len=8,
    tool_output_len=20,
    tool_output_range=0.5,
    output_len=4,
    min_turns=3,
    max_turns=5,
    think_s=0.5,
    retention_seconds=30.0,
    max_context=120,
)


def test_agent_turns_grow_by_the_answer_and_a_tool_output_over_one_shared_prefix():
    specs = replay(AGENT, TOKENS, 0, 60)
    assert specs == replay(AGENT, TOKENS, 0, 60)
    sessions = [list(t) for _, t in itertools.groupby(specs, key=lambda s: s.session)]
    grown = 0
    for turns in sessions[:-1]:  # the last one may be cut by the 60 requests
        assert [t.turn for t in turns] == list(range(len(turns)))
        assert 1 <= len(turns) <= 5
        assert turns[0].think_s == 0.0 and len(turns[0].prompt_token_ids) == 24 + 16 + 8
        for prev, cur in itertools.pairwise(turns):
            head = prev.prompt_token_ids + tuple(stand_in_answer(prev, TOKENS, 0))
            assert cur.prompt_token_ids[: len(head)] == head
            assert 10 <= len(cur.prompt_token_ids) - len(head) <= 30  # a tool output of ~20
            assert 0.0 <= cur.think_s <= 1.0
            grown += 1
        # the next prompt and its answer would pass max_context: the session ended there
        assert len(turns[-1].prompt_token_ids) + 4 <= 120
        for t in turns:
            assert (t.session_id, t.retention_seconds, t.kind) == (t.session, 30.0, "agent")
    assert grown > 10
    firsts = [s.prompt_token_ids for s in specs if s.turn == 0]
    assert len({p[:40] for p in firsts}) == 1  # one system prompt + tool schemas for all
    assert len({p[40:] for p in firsts}) == len(firsts)  # each its own task


def test_agent_sessions_claim_only_the_turns_their_context_fits():
    """num_turns (what the driver claims of --num-requests) is what the session sends: its
    tool outputs are drawn up front, so max_context cuts the turns before the first one."""
    claimed = []
    for session in itertools.islice(AGENT.sessions(TOKENS, 0), 30):
        claimed.append(session.num_turns)
        answer, sent = None, 0
        while (spec := session.next_turn(answer)) is not None:
            sent, answer = sent + 1, stand_in_answer(spec, TOKENS, 0)
        assert sent == claimed[-1]
    # 48 + 4 positions, then ~24 a turn: max_context 120 fits 3 turns, never max_turns 5
    assert set(claimed) <= {2, 3, 4} and max(claimed) < 5


def test_agent_workload_sizes_its_sessions_from_the_kv_capacity():
    # own context at the mid-point: task 8 + (4 + 20) x (4 turns - 1) / 2 + answer 4 = 48
    roomy = dataclasses.replace(AGENT, max_context=1000)
    assert roomy.mean_own_context() == 48.0
    # max_context 120 leaves room for 2 turns after the first: 3 turns on average, not 4
    assert AGENT.mean_own_context() == 8 + 24 * 2 / 2 + 4 == 36.0
    assert AGENT.live_sessions() is None
    sized = dataclasses.replace(AGENT, live_context_x=5.0, kv_tokens=256)
    assert sized.live_sessions() == math.ceil((5 * 256 - 40) / 36) == 35
    assert make_workload("agent", {"live_context_x": "3", "kv_tokens": "512"}).live_sessions()
    with pytest.raises(ValueError, match="needs kv_tokens"):
        AgentWorkload(live_context_x=2.0).live_sessions()  # `baton bench` fills it in first
    with pytest.raises(ValueError, match="first turn alone passes max_context"):
        AgentWorkload(max_context=2300)
