"""The OpenAI-compatible endpoint on a model folder's own chat template (issue 28), with the official ``openai``
client as the caller and real Qwen3 / Qwen3-Coder tokenizer folders (t1async/models/hf_tokenizers.py).

Real: the endpoint, the client, the tokenizers and templates (transformers' ``apply_chat_template`` is the
reference), the recorder. Faked: the sampler (tests/unit/rollout/test_tito.py's ScriptedSampler answers scripted ids: random
weights never write a tool call) and the shell.
"""

from __future__ import annotations

import json

import openai
import pytest

from t1async.models import hf_tokenizers
from t1async.models.chat_template import ChatTemplateRenderer
from t1async.rollout.endpoint import OpenAIEndpoint, SessionLimits
from t1async.rollout.endpoint.agent import segment_builder
from tests.support.episode_fakes import FakeEnv, ScriptedSampler

BASH = {"type": "function", "function": {"name": "bash", "description": "run a command",
                                         "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                        "required": ["command"]}}}
SYSTEM = {"role": "system", "content": "You run commands."}
USER = {"role": "user", "content": "make a file"}
PARAMS = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": -1}


@pytest.fixture(scope="module", params=["qwen3", "qwen3-coder"])
def renderer(request):
    try:
        folder = hf_tokenizers.build_folders([request.param])[request.param]
    except hf_tokenizers.Unavailable as e:
        pytest.skip(f"real tokenizer folders unavailable: {e}")
    return ChatTemplateRenderer.load(folder)


def _call_ids(r: ChatTemplateRenderer, command: str) -> list[int]:
    """A sampled turn holding one bash call in the template's own format (its tags as ids), then the stop id."""
    from t1async.rollout.tool_formats import detect

    fmt = detect(r.tokenizer.chat_template)
    return [*r._encode_rendered("Running it.\n" + fmt.example("bash", {"command": command})), r.eos_ids[0]]


@pytest.mark.slow
def test_template_prompt_continuation_and_tool_calls(renderer):
    r = renderer
    turns = [_call_ids(r, "touch a"), [*r.encode("Done."), r.eos_ids[0]]]
    sampler = ScriptedSampler([list(t) for t in turns])
    ep = OpenAIEndpoint(r)
    try:
        session = ep.open(sampler, FakeEnv().step, SessionLimits(dict(PARAMS), 8, 8192))
        client = openai.OpenAI(base_url=f"{ep.url}/s/{session.token}/v1", api_key=session.token, max_retries=0)
        messages = [SYSTEM, USER]
        first = client.chat.completions.create(model="t1async", messages=messages, tools=[BASH])
        # the prompt is the template's own rendering, tools declared its way
        want = r.tokenizer.apply_chat_template(messages, tools=[BASH], add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else list(want)
        assert sampler.calls[0] == list(want)
        # the call in the model's format comes back as OpenAI tool_calls
        msg = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("bash", {"command": "touch a"})]
        assert msg.content == "Running it."
        sent = msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
        new = [{"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "ok"}]
        second = client.chat.completions.create(model="t1async", messages=[*messages, sent, *new], tools=[BASH])
        assert second.choices[0].message.content == "Done."
        rec = session.recorder.records
        assert session.recorder.history_breaks == 0
        # continuation: previous prompt + exact sampled ids + only the rendering of the new turn
        stream = [*rec[0].prompt_ids, *turns[0]]
        assert rec[1].prompt_ids[:len(stream)] == stream
        hist = [SYSTEM, USER, {"role": "assistant", "content": r.decode(turns[0][:-1])}]
        assert rec[1].prompt_ids[len(stream):] == r.render_continuation(hist, [{"role": "tool", "content": "ok"}], [BASH])
        tail = r.decode(rec[1].prompt_ids[len(stream):])
        assert "ok" in tail and tail.rstrip().endswith("assistant")
        assert rec[1].routed_experts_start_len == len(stream) - 1
        # template_mismatches: 1 exactly when transformers' re-render of the conversation is not the stream
        whole = r.tokenizer.apply_chat_template([*hist, {"role": "tool", "content": "ok"}], tools=[BASH],
                                                add_generation_prompt=True, tokenize=True)
        whole = whole["input_ids"] if hasattr(whole, "keys") else list(whole)
        assert rec[0].template_mismatches == 0 and rec[1].template_mismatches == int(list(whole) != rec[1].prompt_ids)
        assert segment_builder(rec, r).template_mismatches == rec[1].template_mismatches
    finally:
        ep.shutdown()


def test_template_mismatch_counted_in_the_trajectory():
    """Qwen3's template drops an earlier turn's <think> block once a new user turn follows: the endpoint's
    stream keeps the sampled ids (drift 0) and the record, then the trajectory, count the turn."""
    try:
        r = ChatTemplateRenderer.load(hf_tokenizers.build_folders(["qwen3"])["qwen3"])
    except hf_tokenizers.Unavailable as e:
        pytest.skip(f"real tokenizer folders unavailable: {e}")
    turns = [[*r._encode_rendered("<think>\nplan\n</think>\n\nHello."), r.eos_ids[0]], [*r.encode("Bye."), r.eos_ids[0]]]
    ep = OpenAIEndpoint(r)
    try:
        session = ep.open(ScriptedSampler([list(t) for t in turns]), FakeEnv().step, SessionLimits(dict(PARAMS), 8, 8192))
        client = openai.OpenAI(base_url=f"{ep.url}/s/{session.token}/v1", api_key=session.token, max_retries=0)
        first = client.chat.completions.create(model="t1async", messages=[USER])
        sent = first.choices[0].message.model_dump(exclude_none=True, include={"role", "content"})
        client.chat.completions.create(model="t1async", messages=[USER, sent, {"role": "user", "content": "again"}])
        rec = session.recorder.records
        assert session.recorder.history_breaks == 0
        assert rec[1].prompt_ids[:len(rec[0].prompt_ids) + len(turns[0])] == [*rec[0].prompt_ids, *turns[0]]
        whole = r.tokenizer.apply_chat_template(
            [USER, {"role": "assistant", "content": r.decode(turns[0][:-1])}, {"role": "user", "content": "again"}],
            add_generation_prompt=True, tokenize=True)
        whole = whole["input_ids"] if hasattr(whole, "keys") else list(whole)
        assert list(whole) != rec[1].prompt_ids  # the re-render dropped the think block
        assert [x.template_mismatches for x in rec] == [0, 1]
        assert segment_builder(rec, r).template_mismatches == 1
    finally:
        ep.shutdown()


def test_template_bad_call_stays_text(renderer):
    r = renderer
    from t1async.rollout.tool_formats import detect

    fmt = detect(r.tokenizer.chat_template)
    bad = [*r._encode_rendered(fmt.example("nosuch", {"command": "ls"})), r.eos_ids[0]]
    ep = OpenAIEndpoint(r)
    try:
        session = ep.open(ScriptedSampler([bad]), FakeEnv().step, SessionLimits(dict(PARAMS), 8, 8192))
        client = openai.OpenAI(base_url=f"{ep.url}/s/{session.token}/v1", api_key=session.token, max_retries=0)
        out = client.chat.completions.create(model="t1async", messages=[SYSTEM, USER], tools=[BASH])
        assert not out.choices[0].message.tool_calls and "nosuch" in out.choices[0].message.content
        assert session.recorder.records[0].status == 9  # unknown_tool (t1async/trajectory.py)
    finally:
        ep.shutdown()
