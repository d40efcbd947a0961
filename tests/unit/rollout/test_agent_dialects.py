"""The three dialects (OpenAI Chat Completions, OpenAI Responses, Anthropic Messages), streamed and not,
driven by the official ``openai`` and ``anthropic`` SDKs: no one here wrote the callers.

Real: the SDKs, the endpoint, the recorder, the shipped tokenizer, the rollout actor, the bubblewrap
sandbox, the shipped task and its verifier. Faked: the policy (tests/support/oracle_policy.py: the task's
oracle commands as tool calls in the model's own format; the tiny models on CPU emit noise).
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import anthropic
import numpy as np
import openai
import pytest

from t1async.actors.rollout import RolloutActor
from t1async.config import EnvConfig, GenerationConfig, ModelConfig, RolloutConfig, TransportConfig
from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout.endpoint import AgentEndpoint, SessionLimits
from t1async.rollout.endpoint.agent import segment_builder
from t1async.trajectory import TURN_ABORTED, decode, encode
from tests.support.episode_fakes import E as SCRIPTED_E
from tests.support.episode_fakes import ScriptedSampler
from tests.support.oracle_policy import E, OraclePolicy, oracle_commands

REPO = Path(__file__).resolve().parents[3]
TOK = ChatTokenizer.load()
MODEL = ModelConfig(vocab_size=4100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
TASK = "make-project-skeleton"
PARAMS = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": -1}


SLOW = pytest.mark.slow  # (~10 s each here: the fast suite keeps one episode per dialect)


@pytest.mark.parametrize("dialect,stream", [("chat", False), pytest.param("chat", True, marks=SLOW),
                                            pytest.param("responses", False, marks=SLOW), ("responses", True),
                                            pytest.param("messages", False, marks=SLOW), ("messages", True)])
def test_sdk_episode_on_a_shipped_task_is_resolved_and_exact(tmp_path, monkeypatch, dialect, stream):
    """One episode per dialect: the SDK agent runs the oracle's tool calls through the sandbox route, the
    verifier resolves the task, the one trajectory has drift 0 against the sampled ids, and the calls the
    SDK saw are the policy's, with ids that the results it sent back answered."""
    commands = oracle_commands(REPO / "t1async" / "envs" / "tasks" / TASK)
    log = tmp_path / "agent.jsonl"
    argv = f"python {REPO / 'tests' / 'support' / 'sdk_agent.py'} {dialect}" + (" --stream" if stream else "")
    cfg = RolloutConfig(agent="external", agent_command=argv, agent_cwd=str(REPO))
    actor = RolloutActor(0, EnvConfig(max_turns=8, tasks=[TASK]), GenerationConfig(max_new_tokens=64), MODEL,
                         TransportConfig(curve=False), ["http://127.0.0.1:9"], "tcp://127.0.0.1:9", rollout_cfg=cfg,
                         work_root=str(tmp_path / "work"))
    policy = actor.sampler = OraclePolicy(TOK, commands)
    monkeypatch.setenv("SDK_AGENT_LOG", str(log))
    try:
        [traj] = actor.run_one(TASK)
    finally:
        actor.endpoint.shutdown()
        actor.sender.close()
    traj = decode(encode(traj), num_experts=E, num_layers=2, top_k=2)
    assert traj.resolved and traj.passed == traj.total >= 1 and traj.finish_reason == "end_signal"
    assert traj.drift_tokens == 0 and len(traj.turn_offsets) == len(commands) + 1
    # the trajectory is exactly what the policy was given and sampled: the last prompt + its answer
    assert traj.token_ids.tolist() == policy.calls[-1] + policy.outputs[-1]
    for (s, e), out in zip(traj.turn_offsets.tolist(), policy.outputs):
        assert traj.token_ids[s:e].tolist() == out
    assert np.array_equal(traj.routed_experts[:, 0, 0], np.arange(traj.num_tokens - 1) % E)
    # the round trip as the SDK saw it: each oracle command as a bash call, then the final text
    rounds = [json.loads(line) for line in log.read_text().splitlines()]
    assert [[(name, json.loads(args)) for _, name, args in r["calls"]] for r in rounds] == \
        [[("bash", {"command": c})] for c in commands] + [[]]
    assert rounds[-1]["text"] == "The task is done."
    assert len({i for r in rounds for i, _, _ in r["calls"]}) == len(commands)  # distinct call ids


# ---------------------------------------------------------------- one endpoint, direct calls

@pytest.fixture(scope="module")
def endpoint():
    ep = AgentEndpoint(TOK)
    yield ep
    ep.shutdown()


def _session(endpoint, sampler, max_turns=8):
    return endpoint.open(sampler, lambda c: None, SessionLimits(dict(PARAMS), max_turns, 4096))


def _call(text="", command="ls"):
    return [*TOK.render_tool_call("bash", {"command": command}, text), TOK.im_end_id]


BASH_OPENAI = {"type": "function", "name": "bash", "parameters": {"type": "object",
                                                                   "properties": {"command": {"type": "string"}}}}
BASH_ANTHROPIC = {"name": "bash", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}


def test_the_three_dialects_render_the_same_prompt_and_continue_it(endpoint):
    """System/developer instructions, tools and tool results in each API's own shape give the same
    prompt ids as the neutral chat (one renderer), and the second request extends the first exactly."""
    prompts = {}
    for dialect in ("chat", "responses", "messages"):
        sampler = ScriptedSampler([_call("Looking.", "ls /app"), [*TOK.encode("done"), TOK.im_end_id]])
        s = _session(endpoint, sampler)
        base = f"{endpoint.url}/s/{s.token}"
        if dialect == "chat":
            c = openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
            m = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "go"}]
            msg = c.chat.completions.create(model="m", messages=m, tools=[{"type": "function", "function": {
                "name": "bash", "parameters": BASH_OPENAI["parameters"]}}]).choices[0].message
            m += [msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                  {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "a b"}]
            c.chat.completions.create(model="m", messages=m, tools=[{"type": "function", "function": {
                "name": "bash", "parameters": BASH_OPENAI["parameters"]}}])
        elif dialect == "responses":
            c = openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
            items = [{"role": "user", "content": [{"type": "input_text", "text": "go"}]}]
            r = c.responses.create(model="m", instructions="Be brief.", input=items, tools=[BASH_OPENAI])
            assert [o.type for o in r.output] == ["message", "function_call"] and r.output_text == "Looking."
            items += [o.model_dump(exclude_none=True) for o in r.output]
            items.append({"type": "function_call_output", "call_id": r.output[1].call_id, "output": "a b"})
            c.responses.create(model="m", instructions="Be brief.", input=items, tools=[BASH_OPENAI])
        else:
            c = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0)
            h = [{"role": "user", "content": "go"}]
            r = c.messages.create(model="m", system="Be brief.", messages=h, tools=[BASH_ANTHROPIC], max_tokens=64)
            assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["text", "tool_use"]
            assert r.content[1].input == {"command": "ls /app"}
            h += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r.content[1].id,
                                                "content": [{"type": "text", "text": "a b"}]}]}]
            c.messages.create(model="m", system=[{"type": "text", "text": "Be brief."}], messages=h,
                              tools=[BASH_ANTHROPIC], max_tokens=64)
        first, second = s.recorder.records
        assert s.recorder.history_breaks == 0 and s.dialects == {dialect: 2}
        assert second.prompt_ids == [*first.prompt_ids, *first.output_ids, *TOK.render_tool_response("a b")]
        prompts[dialect] = second.prompt_ids
    assert prompts["chat"] == prompts["responses"] == prompts["messages"]


def _sse_events(raw: bytes) -> list[tuple[str | None, str]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        event = [ln[7:] for ln in block.splitlines() if ln.startswith("event: ")]
        data = "".join(ln[6:] for ln in block.splitlines() if ln.startswith("data: "))
        out.append((event[0] if event else None, data))
    return out


def _post(endpoint, path, body):
    host, port = endpoint.url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read()


def test_streamed_events_are_each_apis_own(endpoint):
    """The event names and order each API defines (raw bytes, no SDK in between)."""
    s = _session(endpoint, ScriptedSampler([_call("Hi.")] * 3))
    status, raw = _post(endpoint, f"/s/{s.token}/v1/chat/completions",
                        {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
                         "tools": [{"type": "function", "function": {"name": "bash"}}]})
    ev = _sse_events(raw)
    assert status == 200 and ev[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in ev[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[-1]["choices"][0]["finish_reason"] == \
        "tool_calls"
    s = _session(endpoint, ScriptedSampler([_call("Hi.")]))
    _, raw = _post(endpoint, f"/s/{s.token}/v1/responses", {"model": "m", "input": "x", "stream": True,
                                                             "tools": [BASH_OPENAI]})
    names = [e for e, _ in _sse_events(raw)]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    assert "response.output_text.delta" in names and "response.function_call_arguments.delta" in names
    assert [json.loads(d)["sequence_number"] for _, d in _sse_events(raw)] == list(range(len(names)))
    s = _session(endpoint, ScriptedSampler([_call("Hi.")]))
    _, raw = _post(endpoint, f"/s/{s.token}/v1/messages", {"model": "m", "max_tokens": 9, "stream": True,
                                                            "messages": [{"role": "user", "content": "x"}],
                                                            "tools": [BASH_ANTHROPIC]})
    names = [e for e, _ in _sse_events(raw)]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 2
    start = json.loads(_sse_events(raw)[0][1])["message"]
    assert start["usage"]["input_tokens"] == len(s.recorder.records[0].prompt_ids)


class SlowSampler(ScriptedSampler):
    """Answers after ``delay_s`` (the client can leave while the turn is sampled)."""

    def __init__(self, turns, delay_s):
        super().__init__(turns)
        self.delay_s, self.started = delay_s, threading.Event()

    def generate(self, *a, **k):
        self.started.set()
        time.sleep(self.delay_s)
        return super().generate(*a, **k)


@pytest.mark.parametrize("route,body", [
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("responses", {"input": "x"}),
    ("messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9})])
def test_a_client_that_leaves_mid_stream_leaves_the_turn_recorded_and_marked(endpoint, route, body):
    s = _session(endpoint, SlowSampler([_call(), _call()], 1.0))
    host, port = endpoint.url.split("//")[1].split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps({"model": "m", "stream": True, **body}).encode()
    sock.sendall(f"POST /s/{s.token}/v1/{route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    assert b"200 OK" in sock.recv(4096)  # the stream opened (its first events)
    assert s.sampler.started.wait(10)  # the sampler is working
    sock.close()
    deadline = time.time() + 10
    while not (s.recorder.records and s.recorder.records[0].client_disconnected) and time.time() < deadline:
        time.sleep(0.05)
    [rec] = s.recorder.records
    assert rec.client_disconnected and s.disconnects == 1 and rec.output_ids == _call()
    traj = segment_builder(s.recorder.segments()[0], TOK).finish(
        task="t", actor_id=0, num_experts=SCRIPTED_E, reward=0.0, passed=0, total=1, resolved=False, finish_reason="x")
    assert traj.turn_status.tolist() == [TURN_ABORTED] and traj.drift_tokens == 0


@pytest.mark.parametrize("route,body,field", [
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": ["\n"]}, "stop"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "messages[0].content[0]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0.5}, "top_p"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0]"),
    ("responses", {"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("responses", {"input": "x", "temperature": 0.3}, "temperature"),
    ("responses", {"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ("messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "stop_sequences": ["a"]},
     "stop_sequences"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 9},
     "messages[0].content[0]"),
    ("messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "top_k": 5}, "top_k"),
    ("messages", {"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
])
def test_unsupported_fields_are_refused_in_each_apis_error_shape(endpoint, route, body, field):
    s = _session(endpoint, ScriptedSampler([]))
    status, raw = _post(endpoint, f"/s/{s.token}/v1/{route}", {"model": "m", **body})
    err = json.loads(raw)
    assert status == 400 and not s.recorder.records
    if route == "messages":
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert field in err["error"]["message"]
    else:
        assert err["error"]["param"] == field and field in err["error"]["message"]


def test_sdks_raise_their_own_errors(endpoint):
    s = _session(endpoint, ScriptedSampler([]))
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
        anthropic.Anthropic(base_url=f"{endpoint.url}/s/{s.token}", api_key="k", max_retries=0).messages.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=5, stop_sequences=["x"])
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        openai.OpenAI(base_url=f"{endpoint.url}/s/{s.token}/v1", api_key="k", max_retries=0).responses.create(
            model="m", input="x", previous_response_id="resp_x")


# ---------------------------------------------------------------- real harnesses on the endpoint

CODEX_INSTALL = "npm install -g @openai/codex@0.169.0"


@pytest.mark.slow
def test_codex_exec_runs_its_own_tool_call_and_continues_the_exact_stream(endpoint, tmp_path):
    """`codex exec` (the real CLI, Responses API only, streamed) against a session: the policy calls
    Codex's own `exec_command` tool, Codex runs it in its own process (the file appears), sends the
    result back as a function_call_output, and its next request extends the sampled ids exactly (no
    history break; the hosted tools it declares are left out and counted)."""
    if shutil.which("codex") is None:
        pytest.skip(f"codex is not installed: {CODEX_INSTALL}")
    policy = OraclePolicy(TOK, ["echo hello > hello.txt"], tool="exec_command", argument="cmd")
    s = endpoint.open(policy, lambda c: None, SessionLimits(dict(PARAMS), 8, 1 << 20))
    provider = f'{{name="t1async",base_url="{endpoint.url}/s/{s.token}/v1",wire_api="responses",env_key="OPENAI_API_KEY"}}'
    (tmp_path / "home").mkdir()
    out = subprocess.run(["codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                          "-c", "model_provider=t1async", "-c", f"model_providers.t1async={provider}", "-m", "t1async",
                          "Write hello to hello.txt"], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "OPENAI_API_KEY": s.token, "CODEX_HOME": str(tmp_path / "home")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "hello.txt").read_text() == "hello\n" and "The task is done." in out.stdout
    first, second = s.recorder.records
    assert s.recorder.history_breaks == 0 and s.dialects == {"responses": 2}
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids
    assert s.hosted_tools_left_out.get("web_search") == 2
    traj = segment_builder(s.recorder.segments()[0], TOK).finish(
        task="t", actor_id=0, num_experts=E, reward=0.0, passed=0, total=1, resolved=False, finish_reason="agent_exit")
    assert traj.drift_tokens == 0 and traj.token_ids.tolist() == policy.calls[-1] + policy.outputs[-1]


CLAUDE_INSTALL = "npm install -g @anthropic-ai/claude-code@2.1"


@pytest.mark.slow
def test_claude_code_runs_its_own_tool_call_and_continues_the_exact_stream(endpoint, tmp_path):
    """`claude -p` (the real CLI, streamed Anthropic Messages) against a session: the policy calls Claude
    Code's own `Bash` tool, Claude Code runs it (the file appears), sends the tool_result back, and its
    next request extends the sampled ids exactly (no history break)."""
    if shutil.which("claude") is None:
        pytest.skip(f"claude is not installed: {CLAUDE_INSTALL}")
    policy = OraclePolicy(TOK, ["echo hello > hello.txt"], tool="Bash", argument="command")
    s = endpoint.open(policy, lambda c: None, SessionLimits(dict(PARAMS), 8, 1 << 20))
    (tmp_path / "home").mkdir()
    env = {**os.environ, "ANTHROPIC_BASE_URL": f"{endpoint.url}/s/{s.token}", "ANTHROPIC_API_KEY": s.token,
           "HOME": str(tmp_path / "home"), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_AUTOUPDATER": "1", "IS_SANDBOX": "1"}  # (IS_SANDBOX: it refuses to skip permissions as root)
    out = subprocess.run(["claude", "-p", "--model", "t1async", "--dangerously-skip-permissions",
                          "Write hello to hello.txt"], cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert (tmp_path / "hello.txt").read_text() == "hello\n" and "The task is done." in out.stdout
    first, second = s.recorder.records
    assert s.recorder.history_breaks == 0 and s.dialects == {"messages": 2}
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids
    traj = segment_builder(s.recorder.segments()[0], TOK).finish(
        task="t", actor_id=0, num_experts=E, reward=0.0, passed=0, total=1, resolved=False, finish_reason="agent_exit")
    assert traj.drift_tokens == 0 and traj.token_ids.tolist() == policy.calls[-1] + policy.outputs[-1]


@pytest.mark.slow
def test_mini_swe_agent_ends_on_its_own_when_the_policy_never_calls_its_tool(endpoint, tmp_path):
    """The real `mini` against a session whose policy only writes text (what a tiny model on CPU does): it
    answers each with its own format-error message, gives up after three in a row (RepeatedFormatError)
    and exits 0, so the episode ends without waiting for its budget. mini-swe-agent leaves an answer without
    a valid tool call out of its history (the next request carries only its format-error message), so each
    such answer is a history break: three exact one-turn segments, never re-tokenized."""
    import json as _json

    from t1async.rollout import mini_swe_agent

    if shutil.which(mini_swe_agent.BINARY) is None:
        pytest.skip(f"mini-swe-agent is not installed: {mini_swe_agent.INSTALL}")
    text = [*TOK.encode("I am thinking."), TOK.im_end_id]
    s = _session(endpoint, ScriptedSampler([text] * 5))
    line = mini_swe_agent.command(f"{endpoint.url}/s/{s.token}", s.token, "Write hello to hello.txt",
                                  home=str(tmp_path / "home"), model="t1async")
    out = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    saved = _json.loads((tmp_path / "home" / "mini-swe-agent.traj.json").read_text())
    assert saved["info"]["exit_status"] == "RepeatedFormatError"
    assert len(s.recorder.records) == 3 and s.recorder.history_breaks == 2 and s.dialects == {"chat": 3}
    segments = s.recorder.segments()
    assert [len(seg) for seg in segments] == [1, 1, 1]
    for k, seg in enumerate(segments):
        traj = segment_builder(seg, TOK).finish(task="t", actor_id=0, num_experts=SCRIPTED_E, reward=0.0, passed=0,
                                                total=1, resolved=False, finish_reason="agent_exit")
        assert traj.drift_tokens == 0 and [traj.token_ids[a:b].tolist() for a, b in traj.turn_offsets.tolist()] == [text]
        prompt = TOK.decode(seg[0].prompt_ids)  # the task, then (after the first) its format error, not the answer
        assert "Write hello to hello.txt" in prompt and ("No tool calls found" in prompt) == (k > 0)
        assert "I am thinking." not in prompt


def test_a_compacted_history_is_a_break_and_both_segments_are_trained_exactly(endpoint):
    """A harness that compacts its context (Claude Code and Codex both do) asks the model for a summary,
    then goes on from a history made of that summary: the summary is sampled ids of the first segment
    (trained), and the new history starts a second exact segment whose prompt holds the summary."""
    summary = "Summary: made the file; next, check it."
    sampler = ScriptedSampler([_call(), [*TOK.encode(summary), TOK.im_end_id], _call(command="cat f")])
    s = _session(endpoint, sampler)
    c = anthropic.Anthropic(base_url=f"{endpoint.url}/s/{s.token}", api_key="k", max_retries=0)
    h = [{"role": "user", "content": "make f"}]
    r = c.messages.create(model="m", messages=h, tools=[BASH_ANTHROPIC], max_tokens=64)
    h += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r.content[0].id, "content": "ok"},
                                       {"type": "text", "text": "Summarize the conversation so far."}]}]
    with c.messages.stream(model="m", messages=h, tools=[BASH_ANTHROPIC], max_tokens=64) as st:
        got = st.get_final_message().content[0].text
    assert got == summary and s.recorder.history_breaks == 0  # the summary request continued the stream
    c.messages.create(model="m", messages=[{"role": "user", "content": got}], tools=[BASH_ANTHROPIC], max_tokens=64)
    assert s.recorder.history_breaks == 1
    first, second = s.recorder.segments()
    trajs = [segment_builder(seg, TOK).finish(task="t", actor_id=0, num_experts=SCRIPTED_E, reward=0.0, passed=0, total=1,
                                              resolved=False, finish_reason="x") for seg in (first, second)]
    assert all(t.drift_tokens == 0 for t in trajs)
    s0, e0 = trajs[0].turn_offsets[-1].tolist()  # the summary turn is a sampled (trained) turn of segment 0
    assert trajs[0].token_ids[s0:e0].tolist() == [*TOK.encode(summary), TOK.im_end_id]
    p1 = int(trajs[1].turn_offsets[0][0])  # segment 1's prompt renders the summary as the user's message
    assert summary in TOK.decode(trajs[1].token_ids[:p1].tolist())
    assert trajs[1].token_ids[p1:].tolist() == _call(command="cat f")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["codex", "claude-code", "mini-swe-agent"])
def test_a_named_harness_resolves_a_shipped_task_inside_the_sandbox(tmp_path, name):
    """rollout.agent=codex / claude-code / mini-swe-agent: the real agent runs inside the episode's
    bubblewrap sandbox (env.network=on: the loopback of the host), calls its own shell tool with the
    task's oracle commands (the scripted policy; mini-swe-agent then its own submit command, as its config
    tells the model), its commands change the task's files, and the verifier resolves it; the trajectory
    is exact and records its agent."""
    from t1async.rollout import mini_swe_agent
    from t1async.rollout.harnesses import HARNESSES

    h = HARNESSES[name]
    if shutil.which(h.binary) is None:
        pytest.skip(f"{h.binary} is not installed: {h.install}")
    commands = oracle_commands(REPO / "t1async" / "envs" / "tasks" / TASK)
    cfg = RolloutConfig(agent=name)
    model = ModelConfig(**{**MODEL.__dict__, "max_position_embeddings": 65536})  # (their prompts: ~10k tokens)
    env_cfg = EnvConfig(max_turns=8, tasks=[TASK], network="on", episode_timeout_s=300)  # (importing litellm: ~1 min here)
    actor = RolloutActor(0, env_cfg, GenerationConfig(max_new_tokens=64), model, TransportConfig(curve=False),
                         ["http://127.0.0.1:9"], "tcp://127.0.0.1:9", rollout_cfg=cfg, work_root=str(tmp_path / "work"))
    final_call = mini_swe_agent.SUBMIT if name == "mini-swe-agent" else None
    policy = actor.sampler = OraclePolicy(TOK, commands, tool=h.tool[0], argument=h.tool[1], final_call=final_call)
    try:
        [traj] = actor.run_one(TASK)
    finally:
        actor.endpoint.shutdown()
        actor.sender.close()
    traj = decode(encode(traj), num_experts=E, num_layers=2, top_k=2)
    assert traj.resolved and traj.passed == traj.total >= 1 and traj.finish_reason == "agent_exit"
    assert traj.drift_tokens == 0 and len(traj.turn_offsets) == len(commands) + 1 and traj.agent == name
    assert traj.token_ids.tolist() == policy.calls[-1] + policy.outputs[-1]


def test_an_unknown_or_missing_harness_is_one_line(monkeypatch):
    from t1async.config import ConfigError, load_config
    from t1async.rollout import harnesses

    with pytest.raises(ConfigError, match="'codex', 'claude-code', 'mini-swe-agent' or 'terminus'"):
        load_config(None, ["rollout.agent=aider"])
    assert load_config(None, ["rollout.agent=claude-code"]).rollout.agent == "claude-code"
    with pytest.raises(ValueError, match="the harnesses are codex, claude-code, mini-swe-agent, terminus"):
        harnesses.harness("aider")
    monkeypatch.setattr(harnesses.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match=r"codex is not installed; install it with: npm install -g @openai/codex@0\.169\.0"):
        harnesses.harness("codex")
    line = harnesses.HARNESSES["claude-code"].command("http://127.0.0.1:1/s/tok", "tok", "it's done")
    assert "ANTHROPIC_BASE_URL=http://127.0.0.1:1/s/tok" in line and "'it'\"'\"'s done'" in line
    with pytest.raises(ValueError, match=r"mini-swe-agent/bin/mini is not installed; install it with: python3 -m venv "
                                         r"\S+ && \S+/bin/pip install mini-swe-agent==2\.4\.6$"):
        harnesses.harness("mini-swe-agent")


def test_mini_swe_agent_is_pointed_at_the_session_without_prompts_or_price_table():
    """The shell line that runs mini-swe-agent: litellm's OpenAI provider at the session's /v1 with the session
    token as its key, its non-interactive agent, cost tracking off and no price-table download, the task as
    one argument (checked by splitting the line as the sandbox's bash does)."""
    from t1async.rollout import harnesses

    line = harnesses.HARNESSES["mini-swe-agent"].command("http://127.0.0.1:1/s/tok", "tok", "it's $HOME; done")
    words = shlex.split(line.split(" && ", 1)[1].removesuffix(" < /dev/null"))
    env = dict(w.split("=", 1) for w in words[:words.index(harnesses.mini_swe_agent.BINARY)])
    argv = words[len(env):]
    assert env["OPENAI_API_KEY"] == "tok" and env["MSWEA_CONFIGURED"] == "true" and env["HOME"] == harnesses.HOME
    assert env["MSWEA_COST_TRACKING"] == "ignore_errors" and env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert argv[argv.index("-t") + 1] == "it's $HOME; done" and argv[argv.index("-m") + 1] == "openai/t1async"
    assert argv[argv.index("--agent-class") + 1] == "default"
    specs = [argv[i + 1] for i, w in enumerate(argv) if w == "-c"]
    assert specs[0] == "mini.yaml" and "model.model_kwargs.api_base=http://127.0.0.1:1/s/tok/v1" in specs
    assert "agent.cost_limit=0" in specs
