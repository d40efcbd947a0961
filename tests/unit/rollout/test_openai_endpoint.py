"""The OpenAI-compatible endpoint (rollout.agent: external) with the official ``openai`` client as the caller.

Real: the endpoint (FastAPI + uvicorn), the client, the tokenizer and template, the recorder, the
segment builder, and (first test) an embedded sampler with random weights over HTTP. Faked: the
scripted sampler where a test needs a tool call (random weights never write one) and the shell
(tests/unit/rollout/test_tito.py's FakeEnv) where a test runs a whole external-agent episode without a sandbox.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import openai
import pytest

from t1async.actors.rollout import RolloutActor
from t1async.config import EnvConfig, GenerationConfig, ModelConfig, RolloutConfig, TransportConfig
from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout.endpoint import OpenAIEndpoint, SessionLimits, template_message
from t1async.rollout.endpoint.agent import HISTORY_BREAK, HistoryBreak, run_agent_episode, segment_builder
from t1async.sampling.sampler_client import HttpSampler
from t1async.trajectory import TOOL_CALL_ERRORS, decode, encode
from tests.support import REPO
from tests.support.episode_fakes import E, FakeEnv, ScriptedSampler
from tests.support.policies import serve_random_policy
from tests.support.sdk_agent import post

TOK = ChatTokenizer.load()
MODEL = ModelConfig(vocab_size=4100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
PARAMS = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
BASH = {"type": "function", "function": {"name": "bash", "description": "run a command",
                                         "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}
SYSTEM = {"role": "system", "content": "You run commands."}
USER = {"role": "user", "content": "make a file"}


class Recording:
    """Passes every request to the real sampler and keeps what it was sent and answered."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def generate(self, input_ids, sampling_params, *, routed_experts_start_len=0):
        r = self.inner.generate(input_ids, sampling_params, routed_experts_start_len=routed_experts_start_len)
        self.calls.append((list(input_ids), sampling_params, r))
        return r


def _rendered(messages):
    """OpenAI messages as the renderer reads them (the endpoint's own conversion)."""
    return [template_message(m) for m in messages]


@pytest.fixture(scope="module")
def endpoint():
    ep = OpenAIEndpoint(TOK)
    yield ep
    ep.shutdown()


@pytest.fixture(scope="module")
def sampler_url():
    yield from serve_random_policy(MODEL)


def _client(endpoint, session):
    return openai.OpenAI(base_url=f"{endpoint.url}/s/{session.token}/v1", api_key=session.token, max_retries=0)


def _session(endpoint, sampler, max_turns=8, execute=None):
    return endpoint.open(sampler, execute or FakeEnv().step, SessionLimits(dict(PARAMS), max_turns, 4096))


def _as_sent(msg):
    return msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})


def test_real_client_and_sampler_records_exact_ids(endpoint, sampler_url):
    sampler = Recording(HttpSampler(sampler_url, num_layers=2, top_k=2, num_experts=4))
    session = _session(endpoint, sampler)
    client = _client(endpoint, session)
    messages = [SYSTEM, USER]
    for turn in range(3):
        reply = client.chat.completions.create(model="t1async", messages=messages, tools=[BASH], max_tokens=8)
        assert reply.usage.completion_tokens == len(sampler.calls[-1][2].output_ids) <= 8
        messages += [_as_sent(reply.choices[0].message), {"role": "user", "content": f"go on {turn}"}]
    records = session.recorder.records
    assert len(records) == len(sampler.calls) == 3 and session.recorder.history_breaks == 0
    # the first prompt is the chat rendered from scratch; each record is exactly what the sampler was sent/answered
    assert records[0].prompt_ids == TOK.render_chat(_rendered([SYSTEM, USER]), [BASH["function"]])
    for rec, (sent, params, resp) in zip(records, sampler.calls):
        assert rec.prompt_ids == sent and rec.output_ids == resp.output_ids and rec.logprobs == resp.logprobs
        assert rec.weight_version == resp.weight_version == 0 and params["max_new_tokens"] == 8
        assert np.array_equal(rec.routed_experts, resp.routed_experts)
    for prev, rec in zip(records, records[1:]):  # each prompt extends the previous prompt + sampled ids
        assert rec.prompt_ids[:len(prev.prompt_ids) + len(prev.output_ids)] == prev.prompt_ids + prev.output_ids
        assert rec.routed_experts_start_len == len(prev.prompt_ids) + len(prev.output_ids) - 1
    # the returned content is the sampled text (no tool call from random weights)
    assert messages[-2].get("content") == (TOK.decode([i for i in records[-1].output_ids if i not in
                                                       (TOK.im_end_id, TOK.eos_id)]).strip() or None)
    traj = segment_builder(session.recorder.segments()[0], TOK).finish(
        task="t", actor_id=0, num_experts=4, reward=0.0, passed=0, total=1, resolved=False, finish_reason="agent_exit")
    back = decode(encode(traj))
    assert back.drift_tokens == 0 and back.routed_experts.shape == (back.num_tokens - 1, 2, 2)
    for (s, e), rec in zip(back.turn_offsets.tolist(), records):
        assert back.token_ids[s:e].tolist() == rec.output_ids and back.token_ids[:s].tolist() == rec.prompt_ids


def test_tool_calls_are_returned_and_their_results_extend_the_stream(endpoint):
    call = TOK.render_tool_call("bash", {"command": "echo hi"}, "Let me look.")
    sampler = ScriptedSampler([[*call, TOK.im_end_id], [*TOK.encode("exit"), TOK.im_end_id]])
    env = FakeEnv()
    session = _session(endpoint, sampler, execute=env.step)
    client = _client(endpoint, session)
    messages = [SYSTEM, USER]
    reply = client.chat.completions.create(model="t1async", messages=messages, tools=[BASH])
    msg = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and msg.content == "Let me look."
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("bash", '{"command": "echo hi"}')]
    # the agent runs it through the sandbox API and sends the result back as a tool message
    out = post(f"{endpoint.url}/s/{session.token}/sandbox/exec", {"command": "echo hi"})
    assert out == {"output": "ran echo hi", "exit_code": 0, "timed_out": False} and env.commands == ["echo hi"]
    messages += [_as_sent(msg), {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": out["output"]}]
    reply = client.chat.completions.create(model="t1async", messages=messages, tools=[BASH])
    assert reply.choices[0].message.content == "exit" and reply.choices[0].finish_reason == "stop"
    first, second = session.recorder.records
    # the second prompt: first prompt + the sampled ids exactly + the tool result as Qwen3's <tool_response> turn
    assert second.prompt_ids == [*first.prompt_ids, *first.output_ids, *TOK.render_tool_response("ran echo hi")]
    # a canonical call re-renders identically from the transcript (template and recorder agree)
    assert second.prompt_ids == TOK.render_chat(_rendered(messages), [BASH["function"]])
    assert session.recorder.history_breaks == 0 and first.status == 0


def test_malformed_call_stays_text_with_a_tool_call_error_code(endpoint):
    bad = [TOK.tool_call_id, *TOK.encode('\n{"name": "bash", "arguments": {"command": }}\n'), TOK.tool_call_end_id]
    session = _session(endpoint, ScriptedSampler([[*bad, TOK.im_end_id]]))
    reply = _client(endpoint, session).chat.completions.create(model="t1async", messages=[USER], tools=[BASH])
    assert reply.choices[0].message.tool_calls is None and "<tool_call>" in reply.choices[0].message.content
    assert TOOL_CALL_ERRORS[session.recorder.records[0].status] == "bad_json"


def test_history_that_is_not_a_prefix_is_detected_counted_and_split(endpoint):
    turns = [[*TOK.encode(f"echo {i}"), TOK.im_end_id] for i in range(5)]
    session = _session(endpoint, ScriptedSampler(turns))
    client = _client(endpoint, session)

    def ask(messages):
        return _as_sent(client.chat.completions.create(model="t1async", messages=messages).choices[0].message)

    a = ask([SYSTEM, USER])
    b = ask([SYSTEM, USER, a, {"role": "user", "content": "next"}])  # appended: continues
    assert session.recorder.history_breaks == 0
    ask([SYSTEM, {"role": "user", "content": "edited"}, a])  # edited message: break
    ask([SYSTEM, USER, a, {"role": "user", "content": "next"}, b, USER])  # the old branch again: break
    ask([SYSTEM, USER])  # truncated / re-sent: break
    rec = session.recorder
    assert rec.history_breaks == 3 and [len(s) for s in rec.segments()] == [2, 1, 1, 1]
    assert [r.segment for r in rec.records] == [0, 0, 1, 2, 3]
    for seg in rec.segments():  # each segment starts over from scratch and is exact
        assert seg[0].routed_experts_start_len == 0
        traj = segment_builder(seg, TOK).finish(task="t", actor_id=0, num_experts=E, reward=0.0, passed=0, total=1,
                                                resolved=False, finish_reason="x")
        assert traj.drift_tokens == 0
        # the position-coded routing rows of the scripted sampler line up with the segment's stream
        assert np.array_equal(traj.routed_experts[:, 0, 0], np.arange(traj.num_tokens - 1) % E)


def test_refusals_are_clear_and_counted(endpoint):
    session = _session(endpoint, ScriptedSampler([]), max_turns=0)
    client = _client(endpoint, session)
    with pytest.raises(openai.BadRequestError, match="n=2: one choice per request") as e:
        client.chat.completions.create(model="t1async", messages=[USER], n=2)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError, match="generation.temperature=1.0"):
        client.chat.completions.create(model="t1async", messages=[USER], temperature=0.2)
    with pytest.raises(openai.ConflictError, match="turns are spent"):
        client.chat.completions.create(model="t1async", messages=[USER])
    assert session.ended == "max_turns"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{endpoint.url}/s/nope/v1", api_key="x", max_retries=0).models.list()
    assert endpoint.rejected["invalid_request_error"] >= 2 and endpoint.rejected["episode_over"] >= 1


AGENT_BREAKS_HISTORY = """
import os, openai
c = openai.OpenAI(max_retries=0)
m = [{"role": "user", "content": os.environ["T1ASYNC_INSTRUCTION"]}]
r = c.chat.completions.create(model="t1async", messages=m).choices[0].message
c.chat.completions.create(model="t1async", messages=[{"role": "user", "content": "something else"}])
"""


@pytest.mark.parametrize("policy", ["split", "drop"])
def test_external_episode_splits_or_drops_on_a_history_break(endpoint, tmp_path, policy):
    sampler = ScriptedSampler([[*TOK.encode("ls"), TOK.im_end_id], [*TOK.encode("pwd"), TOK.im_end_id]])
    task = SimpleNamespace(name="t", agent_timeout_s=60.0)
    cfg = RolloutConfig(agent="external", agent_command=f"{sys.executable} -c '{AGENT_BREAKS_HISTORY}'",
                        history_break=policy)
    args = (task, FakeEnv(), sampler, TOK, endpoint, cfg, EnvConfig(max_turns=4), GenerationConfig(max_new_tokens=8),
            MODEL, 0, tmp_path)
    if policy == "drop":
        with pytest.raises(HistoryBreak, match="broke its history 1 times"):
            run_agent_episode(*args)
        return
    trajs = run_agent_episode(*args)
    assert [t.finish_reason for t in trajs] == [HISTORY_BREAK, "agent_exit"]
    assert all(t.drift_tokens == 0 and t.reward == 1.0 for t in trajs)
    assert [t.token_ids[t.turn_offsets[0][0]:].tolist() for t in trajs] == [sampler_turn for sampler_turn in
                                                                           ([*TOK.encode("ls"), TOK.im_end_id],
                                                                            [*TOK.encode("pwd"), TOK.im_end_id])]
    assert trajs[1].token_ids[:trajs[1].turn_offsets[0][0]].tolist() == TOK.render_chat(
        _rendered([{"role": "user", "content": "something else"}]))


SOLVER = """
import os, openai
from tests.support.sdk_agent import post
m = [{"role": "user", "content": os.environ["T1ASYNC_INSTRUCTION"]}]
openai.OpenAI(max_retries=0).chat.completions.create(model="t1async", messages=m)
out = post(os.environ["T1ASYNC_SANDBOX_URL"] + "/exec", {"command": "echo hello > /app/hello.txt; cat /app/hello.txt"})
assert out["output"].strip() == "hello" and out["exit_code"] == 0, out
post(os.environ["T1ASYNC_DONE_URL"], {})
"""


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["example", "solver"])
def test_rollout_actor_runs_an_external_agent_in_a_real_sandbox(sampler_url, tmp_path, agent):
    """RolloutActor with rollout.agent=external, a bubblewrap sandbox and the real sampler: the shipped
    example agent (append-only history: one exact trajectory of env.max_turns turns), and an agent that
    solves the task through the sandbox API (the verifier sees its file: reward > 0)."""
    repo = REPO
    command = f"python {repo / 'tools' / 'example_agent.py'}" if agent == "example" else f"python -c '{SOLVER}'"
    cfg = RolloutConfig(agent="external", agent_command=command, agent_cwd=str(repo))
    actor = RolloutActor(0, EnvConfig(max_turns=2, tasks=["create-hello-file"]), GenerationConfig(max_new_tokens=8),
                         MODEL, TransportConfig(curve=False), [sampler_url], "tcp://127.0.0.1:9", rollout_cfg=cfg,
                         work_root=str(tmp_path))
    try:
        [traj] = actor.run_one("create-hello-file")
    finally:
        actor.endpoint.shutdown()
        actor.sender.close()
    traj = decode(encode(traj), num_experts=4, num_layers=2, top_k=2)
    assert traj.drift_tokens == 0 and traj.total >= 1
    if agent == "example":
        assert traj.finish_reason == "agent_exit" and len(traj.turn_offsets) == 2
        assert "# Tools" in TOK.decode(traj.token_ids[:traj.turn_offsets[0][0]].tolist())
    else:
        assert traj.finish_reason == "end_signal" and len(traj.turn_offsets) == 1
        assert traj.passed == traj.total and traj.reward == traj.total


def test_external_agent_config_is_checked():
    from t1async.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.agent_command=''"):
        load_config(None, ["rollout.agent=external"])
    with pytest.raises(ConfigError, match="rollout.history_break='keep'"):
        load_config(None, ["rollout.history_break=keep"])
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(None, ["rollout.agent_command={python} a.py"])
    cfg = load_config(None, ["rollout.agent=external", "rollout.agent_command=python tools/example_agent.py"])
    assert cfg.rollout.agent_command == "python tools/example_agent.py" and cfg.rollout.history_break == "split"


AGENT_HANGS = """
import os, time, openai
openai.OpenAI(max_retries=0).chat.completions.create(model="t1async", messages=[{"role": "user", "content": "hi"}])
time.sleep(600)
"""


@pytest.mark.slow
def test_an_agent_that_overruns_the_time_budget_is_killed_and_its_episode_kept(endpoint, tmp_path):
    """The budget leaves room for `import openai` on a loaded machine (the agent must get its one
    request in before it hangs)."""
    task = SimpleNamespace(name="t", agent_timeout_s=10.0)
    cfg = RolloutConfig(agent="external", agent_command=f"python -c '{AGENT_HANGS}'")
    sampler = ScriptedSampler([[*TOK.encode("ls"), TOK.im_end_id]])
    [traj] = run_agent_episode(task, FakeEnv(), sampler, TOK, endpoint, cfg, EnvConfig(max_turns=4),
                               GenerationConfig(max_new_tokens=8), MODEL, 0, tmp_path)
    assert traj.finish_reason == "timeout" and traj.finished_at - traj.started_at < 40 and traj.drift_tokens == 0


def test_two_calls_in_one_turn_and_their_grouped_results(endpoint):
    """Two calls (one of an undeclared tool: returned, coded unknown_tool); both results sent back
    become one user turn of two <tool_response> blocks (Qwen3), appended after the exact sampled ids."""
    two = [*TOK.render_tool_call("bash", {"command": "ls"}), *TOK.encode("\n"),
           *TOK.render_tool_call("python", {"code": "1"}), TOK.im_end_id]
    session = _session(endpoint, ScriptedSampler([two, [*TOK.encode("exit"), TOK.im_end_id]]))
    client = _client(endpoint, session)
    messages = [USER]
    msg = client.chat.completions.create(model="t1async", messages=messages, tools=[BASH]).choices[0].message
    assert [c.function.name for c in msg.tool_calls] == ["bash", "python"] and msg.content is None
    assert TOOL_CALL_ERRORS[session.recorder.records[0].status] == "unknown_tool"
    messages += [_as_sent(msg), *({"role": "tool", "tool_call_id": c.id, "content": f"out {c.function.name}"}
                                  for c in msg.tool_calls)]
    client.chat.completions.create(model="t1async", messages=messages, tools=[BASH])
    first, second = session.recorder.records
    results = [TOK.im_start_id, *TOK.encode("user\n"), TOK.tool_response_id, *TOK.encode("\nout bash\n"),
               TOK.tool_response_end_id, *TOK.encode("\n"), TOK.tool_response_id, *TOK.encode("\nout python\n"),
               TOK.tool_response_end_id, TOK.im_end_id]
    nl, head = TOK.encode("\n"), [TOK.im_start_id, *TOK.encode("assistant\n")]
    assert second.prompt_ids == [*first.prompt_ids, *two, *nl, *results, *nl, *head]
    assert second.prompt_ids == TOK.render_chat(_rendered(messages), [BASH["function"]])
    assert session.recorder.history_breaks == 0
